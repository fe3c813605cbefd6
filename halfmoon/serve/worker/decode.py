"""The decode role: receives a request's KV streams (one per prefill worker, or one per
stage of a CPP group), imports the KV on the handoff and decodes in the continuous batch.
See :mod:`halfmoon.serve.worker.prefill` for the whole handoff."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.engine.connector import HandoffState, LayerSlice
from halfmoon.serve.control.messages import Error, Expect, Handoff, HeldBlocks
from halfmoon.serve.worker.kvstream import num_blocks
from halfmoon.serve.worker.pipeline_job import kv_session
from halfmoon.serve.worker.process import Handler, Worker
from halfmoon.serve.worker.tokens import (
    HANDOFF_TIMEOUT_S,
    HANDOFF_TTFT_FACTOR,
    StreamClient,
    TokenStreaming,
)
from halfmoon.transfer import StreamLayout, StreamReceiver, TransferEngine, TransferError


@dataclass
class _Expected:
    identity: bytes
    params: SamplingParams
    num_prompt_tokens: int
    region: str
    receivers: list[Any]
    #: Where compressed stream layers land before they are decoded into ``region``.
    wire_region: str | None = None
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
        layout = worker.engine.layout
        self.bytes_per_block = layout.bytes_per_block
        self.num_layers = layout.num_layers
        codec = worker.kv_codec
        self.codec = None if codec is None or codec.name == "none" else codec
        #: Seconds the transfer threads spent decompressing KV (--kv-compression).
        self.kv_decode_s = 0.0

    def handlers(self) -> dict[str, Handler]:
        return {"expect": self._on_expect, "handoff": self._on_handoff}

    def _on_expect(self, identity: bytes, msg: Expect) -> None:
        rid, num_prompt, num_stages = msg.request_id, msg.num_prompt_tokens, msg.num_stages
        n = num_blocks(num_prompt, self.worker.engine.config.block_size)
        slices = LayerSlice.split(self.num_layers, num_stages)  # one KV stream per stage
        region = f"kv-{rid}"
        self.transfer.register_region(region, n * self.bytes_per_block)
        half = self.bytes_per_block // (2 * self.num_layers)
        wire_region = None
        receivers = []
        try:
            if self.codec is not None:
                # One payload per stream layer, each in a slot of the largest size it may
                # have, decoded into ``region`` (the export layout) as it lands.
                slot = self.codec.max_encoded_bytes(n * half)
                wire_region = f"kvz-{rid}"
                self.transfer.register_region(wire_region, 2 * self.num_layers * slot)
            for s, layers in enumerate(slices):
                session = kv_session(rid, s, num_stages)
                if self.codec is None:
                    layout = StreamLayout.contiguous(
                        2 * layers.size, n, half, base_offset=2 * layers.first * n * half
                    )
                    receiver = self.transfer.expect_stream(session, region, layout)
                else:
                    layout = StreamLayout.contiguous(
                        2 * layers.size, 1, slot, base_offset=2 * layers.first * slot
                    )
                    decode = functools.partial(
                        self._decode_layer, region, wire_region, 2 * layers.first, n * half
                    )
                    receiver = self.transfer.expect_stream(session, wire_region, layout, decode)
                receivers.append(receiver)
        except Exception:
            for receiver in receivers:
                receiver.cancel()
            self._unregister(region, wire_region)
            raise
        self.expected[rid] = _Expected(
            identity,
            msg.params.to_params(),
            num_prompt,
            region,
            receivers,
            wire_region,
            msg.prefill_instance,
            msg.cache_salt,
            timeout_s=HANDOFF_TIMEOUT_S + HANDOFF_TTFT_FACTOR * msg.est_ttft_s,
        )

    def _decode_layer(
        self, region: str, wire_region: str, first: int, raw_bytes: int,
        receiver: StreamReceiver, layer: int,
    ) -> None:  # fmt: skip
        """Decode stream layer ``first + layer`` (on the transfer thread, as it lands)."""
        assert self.codec is not None
        index = first + layer
        slot = receiver.layout.block_bytes
        start = receiver.layout.offsets[layer]
        try:
            payload = self.transfer.regions.get(wire_region).view
            payload = payload[start : start + receiver.lengths(layer)[0]]
            out = self.transfer.regions.get(region).view
            started = time.perf_counter()
            self.codec.decode(payload, out[index * raw_bytes : (index + 1) * raw_bytes])
            self.kv_decode_s += time.perf_counter() - started
        except HalfmoonError as exc:  # a bad payload, or the request went away (aborted)
            receiver.fail(TransferError(f"stream layer {index} ({slot}-byte slot): {exc}"))

    def _unregister(self, region: str, wire_region: str | None) -> None:
        self.transfer.unregister_region(region)
        if wire_region is not None:
            self.transfer.unregister_region(wire_region)

    def _on_handoff(self, identity: bytes, msg: Handoff) -> None:
        rid = msg.request_id
        e = self.expected.pop(rid, None)
        if e is None:
            return  # aborted meanwhile
        try:
            for receiver in e.receivers:
                receiver.wait(10.0)
            state = HandoffState(
                request_id=rid, token_ids=tuple(msg.token_ids),
                num_prompt_tokens=msg.num_prompt_tokens,
                num_computed_tokens=msg.num_computed_tokens, seed=msg.seed,
                cache_salt=e.cache_salt,
            )  # fmt: skip
            # The region's bytes are copied into the pool before this returns.
            self.worker.engine.import_request(
                state, e.params, self.transfer.regions.get(e.region).view
            )
        except Exception as exc:  # stream failed or no room: the client must hear of it
            self.worker.send(e.identity, Error(request_id=rid, error=str(exc)))
            self.worker.conductor.event("request_finished", request_id=rid)
            return
        finally:
            self._unregister(e.region, e.wire_region)
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
            self._unregister(e.region, e.wire_region)
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
            self.worker.send(e.identity, Error(
                request_id=rid, error=f"no KV handoff within {e.timeout_s:.0f}s",
                retryable=True, suspect=e.prefill_instance,
            ))  # fmt: skip
            self.on_abort(rid)

    def stats(self) -> dict[str, Any]:
        """Requests waiting for their KV; time spent decompressing it."""
        return {"num_expected": len(self.expected), "kv_decode_s": round(self.kv_decode_s, 6)}

    def snapshot(self) -> list[HeldBlocks]:
        """A decode worker caches nothing the Conductor indexes."""
        return []

    def close(self) -> None:
        self.transfer.close()
