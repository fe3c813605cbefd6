"""The prefill role, and the disaggregated handoff it starts.

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
streamer thread (:mod:`halfmoon.serve.worker.kvstream`), and a request whose first token is out
waits in ``handing`` (its blocks held) until its stream finished or failed; ``tick``
then hands it over. A frozen decode worker fails only its own streams, within
``PEER_TIMEOUT_S`` per step; the request goes back to the gateway as retryable, naming
the suspect.

An embedding (``params.embed``, ``/v1/embeddings``) ends here: no ``expect`` went to a
decode worker, no stream is opened, and the engine's vector goes back to the gateway in
the ``tokens`` message that ends it (its blocks saved in the store as any prompt's).

Nor does it wait on a prefix pull: a request whose prefix comes from a peer's store
waits in ``loading`` while a pull thread fetches it, and joins the engine once that ended
(:meth:`~halfmoon.serve.worker.prefix_cache.ClusterPrefixCache.begin_load`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from halfmoon.core.request import SamplingParams
from halfmoon.serve.control.messages import (
    Endpoints,
    Handoff,
    HeldBlocks,
    Prefill,
    Replicate,
)
from halfmoon.serve.worker.kvstream import (
    OutStream,
    StreamerPool,
    finish_all,
    kv_stream_layout,
    num_blocks,
)
from halfmoon.serve.worker.pipeline import PipelineStage
from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache, Holdings, PrefixFetch, PrefixLoad
from halfmoon.serve.worker.process import IDLE_WAIT_S, Handler, Worker
from halfmoon.serve.worker.tokens import HANDOFF_TIMEOUT_S, StreamClient, TokenStreaming
from halfmoon.transfer import TransferEngine

if TYPE_CHECKING:
    from halfmoon.engine.connector import RequestFailure

log = logging.getLogger(__name__)


@dataclass
class _Prefill:
    identity: bytes
    prompt_token_ids: list[int]
    params: SamplingParams
    #: Where its KV streams (None: an embedding).
    decode: Endpoints | None
    num_blocks: int
    #: Its KV stream to the decode worker (None: an embedding, which ends here).
    stream: OutStream | None
    cache_salt: str | None = None
    error: str = ""
    pulled_bytes: int = 0
    started_s: float = field(default_factory=time.monotonic)
    #: After the first token: the engine's output, waiting for the stream to end.
    out: Any = None
    handing_s: float = 0.0
    streamed: threading.Event = field(default_factory=threading.Event)
    #: The next prompt-KV layer to stream (a step computed again after a failed one
    #: hands over the layers it had already handed over again).
    next_layer: int = 0


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
        worker.metrics.add_store(cache.store.stats, cache.store.config.block_bytes)
        self.streamers = StreamerPool()
        self.prefills: dict[str, _Prefill] = {}
        #: First token out, stream still finishing (blocks held until it has).
        self.handing: dict[str, _Prefill] = {}
        #: Not in the engine yet: their prefix is being pulled from a peer.
        self.loading: dict[str, tuple[bytes, Prefill, PrefixLoad]] = {}
        #: Pulls whose blocks only go to the store or the pool's cache (replication; an
        #: aborted request's prefix, whose load ends once its pull has), each with what
        #: it is, for the log line once it ended.
        self.side_fetches: list[tuple[PrefixFetch, str, PrefixLoad | None]] = []
        layout = worker.engine.layout
        self.num_layers = layout.num_layers
        self.bytes_per_block = layout.bytes_per_block
        self.half_block_bytes = layout.bytes_per_block // (2 * layout.num_layers)
        #: KV streamed to decode workers: bytes on the wire, the raw KV they carried (more
        #: with --kv-compression) and the seconds spent compressing it.
        self.kv_bytes_sent = 0
        self.kv_raw_bytes_sent = 0
        self.kv_encode_s = 0.0
        #: Its stage of chunked-pipeline (CPP) group requests.
        self.stage = PipelineStage(worker, transfer, cache, self.streamers)
        worker.engine.set_prompt_kv_hook(self.on_prompt_kv)

    def handlers(self) -> dict[str, Handler]:
        return {
            "prefill": self._on_prefill,
            "replicate": self._on_replicate,
            **self.stage.handlers(),
        }

    def has_work(self) -> bool:
        """Whether handoffs, prefix pulls or pipeline-stage work wait outside the engine."""
        return bool(self.handing or self.loading or self.side_fetches) or self.stage.has_work()

    def num_pending(self) -> int:
        """Requests held outside the engine: handoffs, prefix pulls and pipeline stages."""
        return len(self.handing) + len(self.loading) + len(self.stage.jobs)

    def _on_replicate(self, identity: bytes, msg: Replicate) -> None:
        fetch = self.cache.begin_replicate(self.transfer, msg.source, msg.block_hashes)
        what = f"replication of {len(msg.block_hashes)} blocks from {msg.source}"
        self.side_fetches.append((fetch, what, None))

    def _on_prefill(self, identity: bytes, msg: Prefill) -> None:
        source = msg.cache_source
        remote = ""
        if source is not None and source.instance_id != self.worker.me.instance_id:
            remote = source.transfer
        if msg.params.prompt_logprobs is not None:  # computed, never taken from a cache
            load = PrefixLoad(list(msg.token_ids), msg.cache_salt)
        else:
            load = self.cache.begin_load(msg.token_ids, self.transfer, remote, msg.cache_salt)
        if load.fetch.done():
            self._start(identity, msg, load)
        else:  # tick() starts it once its pull ended; the loop goes on meanwhile
            self.loading[msg.request_id] = (identity, msg, load)

    def _start(self, identity: bytes, msg: Prefill, load: PrefixLoad) -> None:
        """Seed the request's prefix (its pull, if any, ended) and add it to the engine."""
        rid, tokens, salt = msg.request_id, msg.token_ids, msg.cache_salt
        params = msg.params.to_params()
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(1, params.min_tokens))
        n = num_blocks(len(tokens), self.worker.engine.config.block_size)
        self.cache.end_load(load)
        decode = msg.decode
        codec = self.worker.kv_codec
        stream = None
        if not params.embed:
            assert decode is not None  # (checked on arrival)
            layout = kv_stream_layout(self.num_layers, n, self.half_block_bytes, codec)
            stream = OutStream(
                self.transfer, decode.transfer, rid, layout, f"decode {decode.instance_id}",
                self.streamers, codec=codec,
            )  # fmt: skip
        p = _Prefill(identity, tokens, params, decode, n, stream, salt)
        p.pulled_bytes = load.fetch.num_pulled * self.bytes_per_block
        if p.pulled_bytes:
            self.worker.metrics.observe_kv_received(p.pulled_bytes)
        self.prefills[rid] = p
        self.worker.engine.add_request(rid, tokens, first_only, keep_kv=True, cache_salt=salt)
        self.worker.metrics.request_queued(rid, len(tokens))
        self.worker.conductor.event("prefill_started", request_id=rid)

    # -- the prompt-KV hook (engine thread) -------------------------------------------------------
    def on_prompt_kv(
        self, rid: str, layer: int, keys: list[memoryview], values: list[memoryview]
    ) -> None:
        """Queue layer ``layer`` of ``rid``'s prompt KV on its stream (a pipeline stage's
        requests go to the stage). The views stay valid while the request holds its
        blocks: until the handoff below, which waits for the stream first."""
        p = self.prefills.get(rid)
        if p is None:
            self.stage.on_prompt_kv(rid, layer, keys, values)
        elif not p.error and layer >= p.next_layer and p.stream is not None:
            p.next_layer = layer + 1
            p.stream.submit_kv(layer, keys, values)

    # -- first token: hand over ----------------------------------------------------------------------
    def on_outputs(self, outputs: list[Any]) -> None:
        for out in outputs:
            p = self.prefills.pop(out.request_id, None)
            if p is not None:
                self._first_token(out.request_id, p, out)

    def _first_token(self, rid: str, p: _Prefill, out: Any) -> None:
        self.worker.conductor.event(
            "prefill_finished", request_id=rid, cached_tokens=out.num_cached_tokens
        )
        self.cache.save(rid, p.prompt_token_ids, p.cache_salt)  # the store reports events
        p.out = out
        if out.finish_reason == "stop" or p.params.max_tokens == 1 or p.stream is None:
            self._hand_over(rid, p, out.finish_reason)
            return
        # Every layer must be on the wire before the blocks go back to the pool: the
        # stream ends on its own thread, and tick() hands the request over after that.
        p.handing_s = time.monotonic()
        self.handing[rid] = p
        assert p.stream is not None
        finish_all([p.stream], p.streamed.set)

    def _hand_over(self, rid: str, p: _Prefill, finish: str | None) -> None:
        """Release the request's blocks, then hand it to decode (``finish`` None) or end
        it, and send the first token."""
        # The KV went by the stream: only the request's state is needed here (no copy of
        # its KV, off a GPU or not). Its cached blocks stay cached.
        handoff = self.worker.engine.take_handoff(rid)
        if finish is None or p.error:  # its decode worker counts its tokens
            self.worker.metrics.request_dropped(rid)
        else:
            self.worker.metrics.request_finished(rid, len(p.out.token_ids))
        if p.error:  # aborted while its stream ended
            self.worker.conductor.event("request_finished", request_id=rid)
            return
        streamed = 0
        if finish is None and p.stream is not None:
            if p.stream.error:
                self._fail(rid, p, p.stream.error)
                return
            assert p.decode is not None
            try:
                self.worker.send_to(p.decode.command, Handoff(
                    request_id=rid, token_ids=list(handoff.token_ids),
                    num_prompt_tokens=handoff.num_prompt_tokens,
                    num_computed_tokens=handoff.num_computed_tokens, seed=handoff.seed,
                ))  # fmt: skip
            except ConnectionError as exc:
                self._fail(rid, p, str(exc))
                return
            self.kv_bytes_sent += p.stream.bytes_sent
            self.kv_raw_bytes_sent += p.stream.raw_bytes_sent
            self.kv_encode_s += p.stream.encode_s
            self.worker.metrics.observe_kv_sent(p.stream.bytes_sent, p.stream.send_s)
            streamed = p.stream.bytes_sent
        else:
            self.worker.conductor.event("request_finished", request_id=rid)
        client = StreamClient(p.identity, p.prompt_token_ids)
        self.send_tokens(rid, client, p.out, finish, streamed + p.pulled_bytes)

    def _fail(self, rid: str, p: _Prefill, error: str) -> None:
        log.warning("request %s: %s", rid, error)
        if p.stream is not None:
            p.stream.submit_cancel()
        # The decode side failed, not the request: the gateway may place it again.
        suspect = p.decode.instance_id if p.decode is not None else ""
        self.end_failed(p.identity, rid, error, retryable=True, suspect=suspect)

    def on_failure(self, failure: RequestFailure) -> None:
        """A prefill failed in the engine (a step it was part of failed): its stream is
        cancelled, its client hears the error (retryable: the gateway places it again)."""
        rid = failure.request_id
        self.worker.metrics.request_dropped(rid)
        p = self.prefills.pop(rid, None) or self.handing.pop(rid, None)
        if p is None:
            return
        log.warning("request %s: %s", rid, failure.error)
        p.error = failure.error
        if p.stream is not None:
            p.stream.submit_cancel()
        self.end_failed(p.identity, rid, failure.error, retryable=failure.retryable)

    def on_abort(self, request_id: str) -> None:
        self.worker.metrics.request_dropped(request_id)
        waiting = self.loading.pop(request_id, None)
        if waiting is not None:  # its pull goes on: the blocks still go to the store/pool
            load = waiting[2]
            self.side_fetches.append((load.fetch, f"the prefix of aborted {request_id}", load))
            self.worker.conductor.event("request_finished", request_id=request_id)
            return
        p = self.prefills.pop(request_id, None) or self.handing.get(request_id)
        if p is not None:
            p.error = "aborted"
            if p.stream is not None:
                p.stream.submit_cancel()
        if request_id in self.handing:
            return  # its blocks go back once its stream thread is done with them
        staged = self.stage.on_abort(request_id)
        if self.worker.engine.abort_request(request_id) or staged:
            self.worker.conductor.event("request_finished", request_id=request_id)

    def tick(self) -> None:
        """Start the requests whose prefix pulls ended; hand over the requests whose
        streams ended; advance pipeline-stage work."""
        for rid, (identity, msg, load) in list(self.loading.items()):
            if load.fetch.done():
                del self.loading[rid]
                self._start(identity, msg, load)
        if self.side_fetches:
            for side in [f for f in self.side_fetches if f[0].done()]:
                self.side_fetches.remove(side)
                fetch, what, load = side
                if load is None:
                    log.info("%s: %d blocks stored", what, len(self.cache.end_fetch(fetch)))
                else:  # its pool blocks are held until now (and kept cached)
                    log.info("%s: the pool holds %d of its blocks", what, self.cache.end_load(load))
        now = time.monotonic()
        for rid, p in list(self.handing.items()):
            assert p.stream is not None  # (an embedding is never handing)
            if not p.streamed.is_set() and now - p.handing_s > HANDOFF_TIMEOUT_S:
                p.stream.error = p.stream.error or f"KV stream not done in {HANDOFF_TIMEOUT_S:g}s"
            elif not p.streamed.is_set():
                continue
            del self.handing[rid]
            self._hand_over(rid, p, None)
        self.stage.tick()
        if not self.engine_busy():
            # Nothing to compute: wake the moment the oldest stream or pull ends, not a
            # poll later.
            fetches = [load.fetch for _, _, load in self.loading.values()]
            fetches += [fetch for fetch, _, _ in self.side_fetches]
            if self.handing:
                next(iter(self.handing.values())).streamed.wait(IDLE_WAIT_S)
            elif fetches:
                fetches[0].wait(IDLE_WAIT_S)

    def engine_busy(self) -> bool:
        """Whether the engine or a pipeline stage has work to run."""
        return self.worker.engine.has_unfinished_requests() or bool(self.stage.jobs)

    def snapshot(self) -> list[HeldBlocks]:
        """Every block of the store, for a restarted Conductor's index."""
        return self.holdings.snapshot()

    def stats(self) -> dict[str, Any]:
        """Cache traffic of this worker."""
        store = self.cache.store.stats()
        return {
            "blocks_loaded": self.cache.num_blocks_loaded,
            "blocks_pulled": self.cache.num_blocks_pulled,
            "blocks_demoted": self.cache.num_blocks_demoted,
            "blocks_read_for_peers": self.cache.num_blocks_read_for_peers,
            "kv_bytes_streamed": self.kv_bytes_sent,
            "kv_raw_bytes_streamed": self.kv_raw_bytes_sent,
            "kv_encode_s": round(self.kv_encode_s, 6),
            "store_blocks": store.dram.num_blocks + store.ssd.num_blocks,
            "store_corrupt_blocks": store.num_corrupt,
            **self.stage.stats(),
        }

    def close(self) -> None:
        self.streamers.close()
        self.stage.close()
        self.transfer.close()  # running pulls fail at once
        self.cache.close()
        self.cache.store.close()
