"""The decode role: receives a request's KV streams (one per prefill worker, or one per
stage of a CPP group), imports the KV on the handoff and decodes in the continuous batch.
See :mod:`halfmoon.serve.roles` for the whole handoff."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from halfmoon.engine.stage import LayerSlice
from halfmoon.serve.cpp_job import kv_session
from halfmoon.serve.kvstream import num_blocks
from halfmoon.serve.roles import (
    HANDOFF_TIMEOUT_S,
    HANDOFF_TTFT_FACTOR,
    StreamClient,
    TokenStreaming,
)
from halfmoon.serve.wire import cache_salt_from_wire, params_from_wire
from halfmoon.serve.worker import Handler, Worker
from halfmoon.transfer import StreamLayout, TransferEngine


@dataclass
class _Expected:
    identity: bytes
    params: Any
    num_prompt_tokens: int
    region: str
    receivers: list[Any]
    prefill_instance: str = ""
    cache_salt: str | None = None
    since_s: float = field(default_factory=time.monotonic)
    timeout_s: float = HANDOFF_TIMEOUT_S


class DecodeRole(TokenStreaming):
    """Decode only: receives KV streams, continues requests, streams tokens."""

    def __init__(self, worker: Worker, transfer: TransferEngine) -> None:
        super().__init__(worker)
        self.transfer = transfer
        self.expected: dict[str, _Expected] = {}
        layout = worker.engine.kv_layout
        self.bytes_per_block = layout.bytes_per_block
        self.num_layers = layout.num_layers

    def handlers(self) -> dict[str, Handler]:
        return {"expect": self._on_expect, "handoff": self._on_handoff}

    def _on_expect(self, identity: bytes, msg: dict[str, Any]) -> None:
        rid = str(msg["request_id"])
        salt = cache_salt_from_wire(msg)  # checked before anything is registered
        num_prompt = int(msg["num_prompt_tokens"])
        n = num_blocks(num_prompt, self.worker.engine.config.block_size)
        num_stages = int(msg.get("num_stages", 1))
        slices = LayerSlice.split(self.num_layers, num_stages)  # one KV stream per stage
        region = f"kv-{rid}"
        self.transfer.register_region(region, n * self.bytes_per_block)
        half = self.bytes_per_block // (2 * self.num_layers)
        receivers = []
        try:
            for s, layers in enumerate(slices):
                layout = StreamLayout.contiguous(
                    2 * layers.size, n, half, base_offset=2 * layers.first * n * half
                )
                session = kv_session(rid, s, num_stages)
                receivers.append(self.transfer.expect_stream(session, region, layout))
        except Exception:
            for receiver in receivers:
                receiver.cancel()
            self.transfer.unregister_region(region)
            raise
        self.expected[rid] = _Expected(
            identity,
            params_from_wire(msg["params"]),
            num_prompt,
            region,
            receivers,
            str(msg.get("prefill_instance", "")),
            salt,
            timeout_s=HANDOFF_TIMEOUT_S + HANDOFF_TTFT_FACTOR * float(msg.get("est_ttft_s") or 0),
        )

    def _on_handoff(self, identity: bytes, msg: dict[str, Any]) -> None:
        from halfmoon.engine.engine import KVHandoff

        rid = str(msg["request_id"])
        e = self.expected.pop(rid, None)
        if e is None:
            return  # aborted meanwhile
        try:
            for receiver in e.receivers:
                receiver.wait(10.0)
            engine = self.worker.engine
            handoff = KVHandoff(
                request_id=rid, token_ids=tuple(int(t) for t in msg["token_ids"]),
                num_prompt_tokens=int(msg["num_prompt_tokens"]),
                num_computed_tokens=int(msg["num_computed_tokens"]), seed=int(msg["seed"]),
                layout=engine.kv_layout, data=self.transfer.regions.get(e.region).view,
                cache_salt=e.cache_salt,
            )  # fmt: skip
            engine.import_request(handoff, e.params)
        except Exception as exc:  # stream failed or no room: the client must hear of it
            self.worker.send(e.identity, {"type": "error", "request_id": rid, "error": str(exc)})
            self.worker.conductor.event("request_finished", request_id=rid)
            return
        finally:
            self.transfer.unregister_region(e.region)
        self.clients[rid] = StreamClient(e.identity, [], index=1)
        self.worker.conductor.event("decode_started", request_id=rid)

    def on_outputs(self, outputs: list[Any]) -> None:
        for out in outputs:
            client = self.clients.get(out.request_id)
            if client is None:
                continue
            self.send_tokens(out.request_id, client, out, out.finish_reason, batch=True)
            if out.finished:
                del self.clients[out.request_id]
                self.worker.conductor.event("request_finished", request_id=out.request_id)
        self.flush_tokens()

    def on_abort(self, request_id: str) -> None:
        e = self.expected.pop(request_id, None)
        if e is not None:
            for receiver in e.receivers:
                receiver.cancel()
            self.transfer.unregister_region(e.region)
        self.clients.pop(request_id, None)
        if self.worker.engine.abort_request(request_id) or e is not None:
            self.worker.conductor.event("request_finished", request_id=request_id)

    def has_work(self) -> bool:
        """Waiting KV streams need no loop turns: the handoff message wakes the loop."""
        return False

    def num_pending(self) -> int:
        """Requests whose KV is still on its way."""
        return len(self.expected)

    def tick(self) -> None:
        """Expire expectations whose handoff never came (the prefill side died)."""
        now = time.monotonic()
        for rid in [r for r, e in self.expected.items() if now - e.since_s > e.timeout_s]:
            e = self.expected[rid]
            self.worker.send(e.identity, {
                "type": "error", "request_id": rid,
                "error": f"no KV handoff within {e.timeout_s:.0f}s", "retryable": True,
                "suspect": e.prefill_instance,
            })  # fmt: skip
            self.on_abort(rid)

    def stats(self) -> dict[str, Any]:
        """Requests waiting for their KV."""
        return {"num_expected": len(self.expected)}

    def snapshot(self) -> list[dict[str, Any]]:
        """A decode worker caches nothing the Conductor indexes."""
        return []

    def close(self) -> None:
        self.transfer.close()
