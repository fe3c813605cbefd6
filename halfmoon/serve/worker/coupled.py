"""The coupled role: prefill and decode on one engine (the vLLM-like baseline)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from halfmoon.core.events import BlockStored, CacheEvent
from halfmoon.serve.control.messages import Generate, HeldBlocks
from halfmoon.serve.control.protocol import hashes_to_wire
from halfmoon.serve.worker.process import Handler, Worker
from halfmoon.serve.worker.tokens import StreamClient, TokenStreaming

if TYPE_CHECKING:
    from halfmoon.engine.connector import RequestFailure


class CoupledRole(TokenStreaming):
    """Prefill and decode on the same engine (the vLLM-like baseline).

    Its prefix cache is the engine's own pool: the pool's cache events go to the
    Conductor as they happen, so cache-aware routing sees evictions too.
    """

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        self.cached: set[int] = set()
        self.num_stored = self.num_evicted = 0
        worker.engine.set_cache_listener(self._on_cache_event)

    def _on_cache_event(self, event: CacheEvent) -> None:
        if isinstance(event, BlockStored):
            self.cached.add(event.block_hash)
            self.num_stored += 1
        else:
            self.cached.discard(event.block_hash)
            self.num_evicted += 1
        self.worker.conductor.cache_event(event)

    def handlers(self) -> dict[str, Handler]:
        return {"generate": self._on_generate}

    def _on_generate(self, identity: bytes, msg: Generate) -> None:
        rid = msg.request_id
        params = msg.params.to_params()
        self.worker.engine.add_request(rid, msg.token_ids, params, cache_salt=msg.cache_salt)
        self.worker.metrics.request_queued(rid, len(msg.token_ids))
        self.clients[rid] = StreamClient(identity, msg.token_ids)
        self.worker.conductor.event("prefill_started", request_id=rid)

    def on_outputs(self, outputs: list[Any]) -> None:
        events = self.worker.conductor
        for out in outputs:
            client = self.clients.get(out.request_id)
            if client is None:
                continue
            if client.index == 0:
                # An engine that learns its cached prompt tokens only at the end says 0 now.
                cached = (
                    None if self.worker.engine.cached_tokens_at_finish else out.num_cached_tokens
                )
                events.event("prefill_finished", request_id=out.request_id, cached_tokens=cached)
                events.event("decode_started", request_id=out.request_id)
            # An engine that learns the cached prompt tokens only at a request's end (a
            # vLLM server's usage) sends them with the last tokens.
            self.send_tokens(out.request_id, client, out, out.finish_reason, batch=True,
                             cached_at_finish=self.worker.engine.cached_tokens_at_finish)  # fmt: skip
            if out.finished:
                del self.clients[out.request_id]
                self.worker.metrics.request_finished(out.request_id, len(out.token_ids))
                events.event("request_finished", request_id=out.request_id,
                             num_output_tokens=len(out.token_ids))  # fmt: skip
        self.flush_tokens()

    def on_abort(self, request_id: str) -> None:
        self.worker.metrics.request_dropped(request_id)
        self.clients.pop(request_id, None)
        if self.worker.engine.abort_request(request_id):
            self.worker.conductor.event("request_finished", request_id=request_id)

    def on_failure(self, failure: RequestFailure) -> None:
        """Tell the gateway: a retryable request goes to another instance (naming this one
        when its engine is what failed, e.g. a vLLM server that went away)."""
        client = self.clients.pop(failure.request_id, None)
        self.worker.metrics.request_dropped(failure.request_id)
        if client is None:
            return
        suspect = failure.retryable and failure.instance_failed
        self.end_failed(client.identity, failure.request_id, failure.error,
                        retryable=failure.retryable,
                        suspect=self.worker.me.instance_id if suspect else "")  # fmt: skip

    def tick(self) -> None:
        """All its work is in the engine: nothing waits outside it."""

    def has_work(self) -> bool:
        """All its work is in the engine."""
        return False

    def num_pending(self) -> int:
        """Its requests all live in the engine."""
        return 0

    def stats(self) -> dict[str, Any]:
        """How many blocks its cache events said the engine holds (the Conductor's index
        of this instance should hold as many), and how many events said so."""
        return {"held_blocks": len(self.cached), "stored_events": self.num_stored,
                "evicted_events": self.num_evicted}  # fmt: skip

    def snapshot(self) -> list[HeldBlocks]:
        """Every block in the engine's prefix cache, for a restarted Conductor's index."""
        return [HeldBlocks(tier="dram", hashes=hashes_to_wire(sorted(self.cached)))]

    def close(self) -> None:
        """Nothing to release."""
