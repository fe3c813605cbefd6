"""What each kind of worker does: coupled, prefill and decode roles.

Disaggregated handoff of one request (P = prefill worker, D = decode worker)::

    gateway -> D  expect(rid, params, num_prompt_tokens)   D announces a KV stream session
    gateway -> P  prefill(rid, tokens, params, D)          P prefills with max_tokens=1
    (``generate``, ``expect``, ``prefill`` and ``cpp_prefill`` carry the request's
    ``cache_salt``, if any: every cache lookup and block it stores hashes under it)
    P: per-layer hook -> LayerStreamer thread -> D          layer l's K and V, while P computes l+1
    P -> D        handoff(token ids, computed, seed)        after every layer is acknowledged
    P -> gateway  tokens(index 0 = first token)             TTFT
    D: import the KV, join the batch -> tokens(index 1..) -> gateway

The KV stream of a request with ``n`` blocks has ``2 * num_layers`` stream layers (K and V
of each model layer) of ``n`` blocks each, laid out exactly as the engine's export layout
(``[L, 2, n, B, H_kv, D]``), so the receiver imports the region as it is.

The engine thread never waits on the wire: layers go out on the destination's own
streamer thread (:mod:`halfmoon.serve.kvstream`), and a request whose first token is out
waits in ``handing`` (its blocks held) until its stream finished or failed; ``tick``
then hands it over. A frozen decode worker fails only its own streams, within
``PEER_TIMEOUT_S`` per step; the request goes back to the gateway as retryable, naming
the suspect.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from halfmoon.serve.cpp import PipelineStage
from halfmoon.serve.kvstream import OutStream, StreamerPool, finish_all, num_blocks
from halfmoon.serve.prefix import ClusterPrefixCache, Holdings
from halfmoon.serve.protocol import hashes_from_wire, hashes_to_wire
from halfmoon.serve.wire import cache_salt_from_wire, logprobs_to_wire, params_from_wire
from halfmoon.serve.worker import Handler, Worker
from halfmoon.transfer import TransferEngine

log = logging.getLogger(__name__)
#: A decode worker drops an expected KV handoff that has not come within this; a prefill
#: worker fails a handoff whose stream has not finished within it (a backstop: every
#: stream step has its own, shorter, deadline).
HANDOFF_TIMEOUT_S = 60.0
#: Longest the worker loop blocks on a stream's end while the engine has nothing to do.
IDLE_WAIT_S = 0.005
#: A decode worker waits for a handoff this many times the Conductor's TTFT estimate on
#: top of HANDOFF_TIMEOUT_S (a long prompt's prefill may take minutes on a CPU).
HANDOFF_TTFT_FACTOR = 4.0


@dataclass
class StreamClient:
    """A gateway waiting for a request's tokens; ``index`` counts tokens already sent."""

    identity: bytes
    prompt_token_ids: list[int]
    index: int = 0


class TokenStreaming:
    """Shared by the roles that stream tokens to the gateway."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.clients: dict[str, StreamClient] = {}
        self._outbox: dict[bytes, list[dict[str, Any]]] = {}

    def send_tokens(
        self,
        rid: str,
        client: StreamClient,
        out: Any,
        finish: str | None,
        kv_bytes: int = 0,
        batch: bool = False,
    ) -> None:
        """Send a request's new tokens; with ``batch`` they wait for :meth:`flush_tokens`,
        which sends a step's tokens for one gateway as one message."""
        msg: dict[str, Any] = {
            "type": "tokens", "request_id": rid, "index": client.index,
            "token_ids": list(out.new_token_ids), "finish_reason": finish,
        }  # fmt: skip
        if out.new_logprobs:
            msg["logprobs"] = logprobs_to_wire(out.new_logprobs)
        if client.index == 0:
            msg["cached_tokens"] = out.num_cached_tokens
            msg["kv_bytes"] = kv_bytes
        client.index += len(out.new_token_ids)
        if batch:
            self._outbox.setdefault(client.identity, []).append(msg)
        else:
            self.worker.send(client.identity, msg)

    def flush_tokens(self) -> None:
        """One message per gateway for the tokens batched since the last flush (one
        signed message per step instead of one per running request)."""
        for identity, msgs in self._outbox.items():
            self.worker.send(
                identity, msgs[0] if len(msgs) == 1 else {"type": "batch", "messages": msgs}
            )
        self._outbox.clear()


class CoupledRole(TokenStreaming):
    """Prefill and decode on the same engine (the vLLM-like baseline).

    Its prefix cache is the engine's own pool: the block manager's cache events go to the
    Conductor as they happen, so cache-aware routing sees evictions too.
    """

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        self.cached: set[int] = set()
        worker.engine.block_manager.listener = self._on_cache_event

    def _on_cache_event(self, kind: str, block_hash: int) -> None:
        if kind == "stored":
            self.cached.add(block_hash)
        else:
            self.cached.discard(block_hash)
        self.worker.conductor.event(kind, hashes=hashes_to_wire([block_hash]), tier="dram")

    def handlers(self) -> dict[str, Handler]:
        return {"generate": self._on_generate}

    def _on_generate(self, identity: bytes, msg: dict[str, Any]) -> None:
        rid = str(msg["request_id"])
        tokens = [int(t) for t in msg["token_ids"]]
        params = params_from_wire(msg["params"])
        self.worker.engine.add_request(rid, tokens, params, cache_salt=cache_salt_from_wire(msg))
        self.clients[rid] = StreamClient(identity, tokens)
        self.worker.conductor.event("prefill_started", request_id=rid)

    def on_outputs(self, outputs: list[Any]) -> None:
        events = self.worker.conductor
        for out in outputs:
            client = self.clients.get(out.request_id)
            if client is None:
                continue
            if client.index == 0:
                events.event("prefill_finished", request_id=out.request_id)
                events.event("decode_started", request_id=out.request_id)
            self.send_tokens(out.request_id, client, out, out.finish_reason, batch=True)
            if out.finished:
                del self.clients[out.request_id]
                events.event("request_finished", request_id=out.request_id)
        self.flush_tokens()

    def on_abort(self, request_id: str) -> None:
        self.clients.pop(request_id, None)
        if self.worker.engine.abort_request(request_id):
            self.worker.conductor.event("request_finished", request_id=request_id)

    def tick(self) -> None:
        """Nothing waits outside the engine."""

    def has_work(self) -> bool:
        """All its work is in the engine."""
        return False

    def num_pending(self) -> int:
        """Its requests all live in the engine."""
        return 0

    def stats(self) -> dict[str, Any]:
        """Nothing beyond the engine's numbers."""
        return {}

    def snapshot(self) -> list[dict[str, Any]]:
        """Every block in the engine's prefix cache, for a restarted Conductor's index."""
        return [{"tier": "dram", "hashes": hashes_to_wire(sorted(self.cached))}]

    def close(self) -> None:
        """Nothing to release."""


@dataclass
class _Prefill:
    identity: bytes
    prompt_token_ids: list[int]
    params: Any
    decode: dict[str, str]
    num_blocks: int
    stream: OutStream
    cache_salt: str | None = None
    error: str = ""
    pulled_bytes: int = 0
    started_s: float = field(default_factory=time.monotonic)
    #: After the first token: the engine's output, waiting for the stream to end.
    out: Any = None
    handing_s: float = 0.0
    streamed: threading.Event = field(default_factory=threading.Event)


class PrefillRole(TokenStreaming):
    """Prefill only: computes the prompt and the first token, streams the KV to decode."""

    def __init__(
        self,
        worker: Worker,
        transfer: TransferEngine,
        cache: ClusterPrefixCache,
        holdings: Holdings,
    ) -> None:
        super().__init__(worker)
        self.transfer = transfer
        self.cache = cache
        self.holdings = holdings
        worker.store = cache.store  # its counters go out with the load reports
        self.streamers = StreamerPool()
        self.prefills: dict[str, _Prefill] = {}
        #: First token out, stream still finishing (blocks held until it has).
        self.handing: dict[str, _Prefill] = {}
        layout = worker.engine.kv_layout
        self.num_layers = layout.num_layers
        self.bytes_per_block = layout.bytes_per_block
        self.half_block_bytes = layout.bytes_per_block // (2 * layout.num_layers)
        self.kv_bytes_sent = 0
        #: Its stage of chunked-pipeline (CPP) group requests.
        self.stage = PipelineStage(worker, transfer, cache, self.streamers)

    def handlers(self) -> dict[str, Handler]:
        return {
            "prefill": self._on_prefill,
            "replicate": self._on_replicate,
            **self.stage.handlers(),
        }

    def has_work(self) -> bool:
        """Whether handoffs or pipeline-stage work wait outside the engine."""
        return bool(self.handing) or self.stage.has_work()

    def num_pending(self) -> int:
        """Requests held outside the engine: handoffs and pipeline stages."""
        return len(self.handing) + len(self.stage.jobs)

    def _on_replicate(self, identity: bytes, msg: dict[str, Any]) -> None:
        hashes = hashes_from_wire(msg["hashes"])
        copied = self.cache.replicate(self.transfer, str(msg["source"]), hashes)
        log.info("replicated %d of %d blocks from %s", copied, len(hashes), msg["source"])

    def _on_prefill(self, identity: bytes, msg: dict[str, Any]) -> None:
        rid = str(msg["request_id"])
        tokens = [int(t) for t in msg["token_ids"]]
        params = params_from_wire(msg["params"])
        salt = cache_salt_from_wire(msg)
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(1, params.min_tokens))
        n = num_blocks(len(tokens), self.worker.engine.config.block_size)
        source = msg.get("cache_source") or {}
        remote = (
            source.get("transfer", "")
            if source.get("instance_id") != self.worker.me.instance_id
            else ""
        )
        pulled_before = self.cache.num_blocks_pulled
        self.cache.load(tokens, self.transfer, remote, salt)
        decode = dict(msg["decode"])
        layout = (2 * self.num_layers, n, self.half_block_bytes)
        stream = OutStream(
            self.transfer, decode["transfer"], rid, layout, f"decode {decode['instance_id']}",
            self.streamers,
        )  # fmt: skip
        p = _Prefill(identity, tokens, params, decode, n, stream, salt)
        p.pulled_bytes = (self.cache.num_blocks_pulled - pulled_before) * self.bytes_per_block
        self.prefills[rid] = p
        self.worker.engine.add_request(rid, tokens, first_only, keep_kv=True, cache_salt=salt)
        self.worker.conductor.event("prefill_started", request_id=rid)

    # -- the per-layer hook (engine thread) -------------------------------------------------------
    def on_layer(self, rid: str, layer: int, block_ids: list[int], kv: Any) -> None:
        """Queue layer ``layer`` of ``rid`` once its last prompt chunk is in the pool."""
        p = self.prefills.get(rid)
        if p is None or p.error or kv.end_token < len(p.prompt_token_ids):
            return
        table = self.worker.engine.block_manager.block_table(rid)[: p.num_blocks]
        # Host byte views (zero copy on a CPU engine), valid while the request holds its
        # blocks: until the handoff below, which waits for the stream first.
        keys, values = self.worker.engine.kv_cache.layer_bytes(layer, table)
        p.stream.submit_kv(layer, keys, values)

    # -- first token: hand over ----------------------------------------------------------------------
    def on_outputs(self, outputs: list[Any]) -> None:
        for out in outputs:
            p = self.prefills.pop(out.request_id, None)
            if p is not None:
                self._first_token(out.request_id, p, out)

    def _first_token(self, rid: str, p: _Prefill, out: Any) -> None:
        self.worker.conductor.event("prefill_finished", request_id=rid)
        self.cache.save(rid, p.prompt_token_ids, p.cache_salt)  # the store reports events
        p.out = out
        if out.finish_reason == "stop" or p.params.max_tokens == 1:
            self._hand_over(rid, p, out.finish_reason)
            return
        # Every layer must be on the wire before the blocks go back to the pool: the
        # stream ends on its own thread, and tick() hands the request over after that.
        p.handing_s = time.monotonic()
        self.handing[rid] = p
        finish_all([p.stream], p.streamed.set)

    def _hand_over(self, rid: str, p: _Prefill, finish: str | None) -> None:
        """Release the request's blocks, then hand it to decode (``finish`` None) or end
        it, and send the first token."""
        # The KV went by the stream: only the request's state is needed here (no copy of
        # its KV, off a GPU or not). Its cached blocks stay cached.
        handoff = self.worker.engine.export_kv(rid, release=True, with_data=False)
        if p.error:  # aborted while its stream ended
            self.worker.conductor.event("request_finished", request_id=rid)
            return
        streamed = 0
        if finish is None:
            if p.stream.error:
                self._fail(rid, p, p.stream.error)
                return
            try:
                self.worker.send_to(p.decode["command"], {
                    "type": "handoff", "request_id": rid, "token_ids": list(handoff.token_ids),
                    "num_prompt_tokens": handoff.num_prompt_tokens,
                    "num_computed_tokens": handoff.num_computed_tokens, "seed": handoff.seed,
                })  # fmt: skip
            except ConnectionError as exc:
                self._fail(rid, p, str(exc))
                return
            self.kv_bytes_sent += p.stream.bytes_sent
            streamed = p.num_blocks * self.bytes_per_block
        else:
            self.worker.conductor.event("request_finished", request_id=rid)
        client = StreamClient(p.identity, p.prompt_token_ids)
        self.send_tokens(rid, client, p.out, finish, streamed + p.pulled_bytes)

    def _fail(self, rid: str, p: _Prefill, error: str) -> None:
        log.warning("request %s: %s", rid, error)
        p.stream.submit_cancel()
        # The decode side failed, not the request: the gateway may place it again.
        self.worker.send(p.identity, {
            "type": "error", "request_id": rid, "error": error, "retryable": True,
            "suspect": p.decode["instance_id"],
        })  # fmt: skip
        self.worker.conductor.event("request_finished", request_id=rid)

    def on_abort(self, request_id: str) -> None:
        p = self.prefills.pop(request_id, None) or self.handing.get(request_id)
        if p is not None:
            p.error = "aborted"
            p.stream.submit_cancel()
        if request_id in self.handing:
            return  # its blocks go back once its stream thread is done with them
        staged = self.stage.on_abort(request_id)
        if self.worker.engine.abort_request(request_id) or staged:
            self.worker.conductor.event("request_finished", request_id=request_id)

    def tick(self) -> None:
        """Hand over the requests whose streams ended; advance pipeline-stage work."""
        now = time.monotonic()
        for rid, p in list(self.handing.items()):
            if not p.streamed.is_set() and now - p.handing_s > HANDOFF_TIMEOUT_S:
                p.stream.error = p.stream.error or f"KV stream not done in {HANDOFF_TIMEOUT_S:g}s"
            elif not p.streamed.is_set():
                continue
            del self.handing[rid]
            self._hand_over(rid, p, None)
        self.stage.tick()
        if self.handing and not self.engine_busy():
            # Nothing to compute: wake the moment the oldest stream ends, not a poll later.
            next(iter(self.handing.values())).streamed.wait(IDLE_WAIT_S)

    def engine_busy(self) -> bool:
        """Whether the engine or a pipeline stage has work to run."""
        return self.worker.engine.has_unfinished_requests() or bool(self.stage.jobs)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every block of the store, for a restarted Conductor's index."""
        return self.holdings.snapshot()

    def stats(self) -> dict[str, Any]:
        """Cache traffic of this worker."""
        store = self.cache.store.stats()
        return {
            "blocks_loaded": self.cache.num_blocks_loaded,
            "blocks_pulled": self.cache.num_blocks_pulled,
            "kv_bytes_streamed": self.kv_bytes_sent,
            "store_blocks": store.dram.num_blocks + store.ssd.num_blocks,
            "store_corrupt_blocks": store.num_corrupt,
            **self.stage.stats(),
        }

    def close(self) -> None:
        self.streamers.close()
        self.stage.close()
        self.transfer.close()
        self.cache.store.close()
