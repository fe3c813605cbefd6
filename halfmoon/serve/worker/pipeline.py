"""Chunked pipeline parallelism (CPP) in a prefill worker: one stage of a CPP group.

The gateway sends ``cpp_prefill`` to each of the group's K workers (stage ``s`` of K); the
decode worker was told to expect K KV streams, one per stage. Per chunk ``c``::

    stage 0       embed + layers [0, a)  --hidden c-->  stage 1 (transfer stream "<rid>@h1")
    stage s       layers [.., ..)        --hidden c-->  stage s+1
    last stage    layers [z, L) + norm;  after the last chunk: logits -> first token

On its last chunk every stage streams its layers' K and V, layer by layer as they
complete, into its slice of the decode worker's region (stream "<rid>@kv<s>"); the last
stage then sends the first token to the gateway and the handoff to the decode worker.
Stages overlap: while stage ``s+1`` computes chunk ``c``, stage ``s`` computes ``c+1``.

Prefix reuse per stage: the Conductor picks a group with the prefix its members hold (or
names a source to pull it from); each stage loads those whole-model blocks from its
store or its engine's pool, or pulls them (on a pull thread: the loop goes on), and keeps
its layers' share. A stage that cannot (the blocks went meanwhile), or that loses a
neighbour, fails the request as retryable and the gateway places it again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.hashing import chain_root, hash_blocks
from halfmoon.engine.connector import StageConnector
from halfmoon.serve.control.messages import (
    CppOffer,
    CppPrefill,
    CppStart,
    Error,
    Handoff,
    Tokens,
    logprobs_to_wire,
)
from halfmoon.serve.worker.kvstream import (
    OutStream,
    StreamerPool,
    finish_all,
    kv_stream_layout,
    num_blocks,
)
from halfmoon.serve.worker.pipeline_job import StageJob, hidden_session, kv_session
from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache
from halfmoon.serve.worker.process import IDLE_WAIT_S, Handler, Worker
from halfmoon.transfer import StreamLayout, TransferEngine, TransferError

log = logging.getLogger(__name__)
#: How long a stage waits for its next chunk's hidden states before failing the request.
STAGE_WAIT_S = 60.0


class PipelineStage:
    """The CPP side of a prefill worker: runs its layer slice of group requests, chunk by
    chunk, between the worker's engine steps (see the module docstring)."""

    def __init__(
        self,
        worker: Worker,
        transfer: TransferEngine,
        cache: ClusterPrefixCache,
        streamers: StreamerPool,
    ):
        self.worker = worker
        self.transfer = transfer
        self.cache = cache
        self.engine = worker.engine
        self.streamers = streamers  # the worker's, shared with its whole-prompt prefills
        self.jobs: dict[str, StageJob] = {}
        self._early: dict[str, dict[int, int]] = {}  # offers that beat their cpp_prefill
        layout = self.engine.layout
        self.block_size = layout.block_size
        self.half_block_bytes = layout.bytes_per_block // (2 * layout.num_layers)
        self.num_chunks_run = 0
        self.num_requests = 0
        self.num_prefix_tokens_reused = 0

    def handlers(self) -> dict[str, Handler]:
        return {
            "cpp_prefill": self._on_cpp_prefill,
            "cpp_offer": self._on_cpp_offer,
            "cpp_start": self._on_cpp_start,
        }

    def has_work(self) -> bool:
        """Whether a job can advance right now (compute a chunk, finish or fail)."""
        return any(self._can_advance(job) for job in self.jobs.values())

    @staticmethod
    def _can_advance(job: StageJob) -> bool:
        if job.error:
            return True
        if not job.began:
            return False  # a command (cpp_offer / cpp_start) wakes the loop
        if job.computed:
            return job.sent.is_set()
        if job.prefix_fetch is not None:
            return job.prefix_fetch.done()
        return job.receiver is None or job.receiver.is_layer_done(job.next_chunk)

    # -- a new request: agree on the prefix, then begin ---------------------------------------------
    def _on_cpp_prefill(self, identity: bytes, msg: CppPrefill) -> None:
        rid, tokens, commands = msg.request_id, msg.token_ids, msg.commands
        stage, num_stages, chunk_tokens = msg.stage, msg.num_stages, msg.chunk_tokens
        if not 0 <= stage < num_stages == len(commands) or chunk_tokens < 1 or not tokens:
            raise HalfmoonError(
                f"bad cpp_prefill: stage {stage} of {num_stages} ({len(commands)} commands), "
                f"chunk {chunk_tokens}, {len(tokens)} tokens"
            )
        if len(tokens) >= self.engine.max_model_len:
            raise HalfmoonError(f"prompt of {len(tokens)} tokens exceeds the context")
        executor = self.engine.pipeline_stage(num_stages, stage)
        group, salt = msg.group, msg.cache_salt
        job = StageJob(
            rid=rid, identity=identity, tokens=tokens, params=msg.params.to_params(),
            executor=executor, stage=stage, num_stages=num_stages, chunk_tokens=chunk_tokens,
            next_transfer=msg.next_transfer, decode=msg.decode, commands=commands,
            suspects=(group[stage - 1] if 0 < stage <= len(group) else "",
                      group[stage + 1] if stage + 1 < len(group) else ""),
            offered_blocks=(
                0 if msg.params.prompt_logprobs is not None  # every position is computed
                else self._offer(executor, tokens, msg.cached_tokens, salt)
            ),
            cache_source=msg.cache_source, cache_salt=salt,
        )  # fmt: skip
        self.jobs[rid] = job
        if stage == 0:
            job.matches = {0: job.offered_blocks, **self._early.pop(rid, {})}
            self._maybe_agree(job)
        else:
            self.worker.send_to(
                commands[0], CppOffer(request_id=rid, stage=stage, blocks=job.offered_blocks)
            )

    def _offer(
        self,
        executor: StageConnector,
        tokens: list[int],
        conductor_tokens: int,
        cache_salt: str | None = None,
    ) -> int:
        """Prefix blocks this stage can provide: its own cache's, or the store prefix the
        Conductor counted on (loaded from the store, or pulled, at the start)."""
        if not self.engine.config.enable_prefix_caching:
            return 0
        usable = (len(tokens) - 1) // self.block_size
        mine = executor.match_blocks(tokens, cache_salt)
        return min(max(mine, conductor_tokens // self.block_size), usable)

    def _on_cpp_offer(self, identity: bytes, msg: CppOffer) -> None:
        rid = msg.request_id
        job = self.jobs.get(rid)
        if job is None:
            early = self._early.setdefault(rid, {})
            early[msg.stage] = msg.blocks
            while len(self._early) > 1024:  # offers of requests aborted before they came
                self._early.pop(next(iter(self._early)))
            return
        job.matches[msg.stage] = msg.blocks
        self._maybe_agree(job)

    def _maybe_agree(self, job: StageJob) -> None:
        """Stage 0, once every stage offered: all start after the prefix all can provide."""
        if job.began or len(job.matches) < job.num_stages:
            return
        start_blocks = min(job.matches.values())
        for command in job.commands[1:]:
            self.worker.send_to(command, CppStart(request_id=job.rid, start_blocks=start_blocks))
        self._begin(job, start_blocks)

    def _on_cpp_start(self, identity: bytes, msg: CppStart) -> None:
        job = self.jobs.get(msg.request_id)
        if job is not None and not job.began:  # else aborted meanwhile
            self._begin(job, msg.start_blocks)

    def _begin(self, job: StageJob, start_blocks: int) -> None:
        """Take blocks (reusing the agreed prefix), announce the hidden-state stream."""
        job.began = True
        job.progress_s = job.began_s = time.monotonic()
        start = start_blocks * self.block_size
        try:
            cached = job.executor.start(job.rid, job.tokens, start, job.cache_salt,
                                        job.params.prompt_logprobs, job.params.lora)  # fmt: skip
        except HalfmoonError as exc:
            job.error = str(exc)  # the next tick fails it as retryable
            return
        if cached < start:  # tick() runs its chunks once the blocks are in
            self._begin_prefix_load(job, cached // self.block_size, start_blocks)
            if job.error:  # the next tick fails it as retryable
                return
        job.start = start
        self.num_prefix_tokens_reused += start
        n = num_blocks(len(job.tokens), self.block_size)
        codec = self.worker.kv_codec
        job.kv_out = OutStream(
            self.transfer, job.decode.transfer, kv_session(job.rid, job.stage, job.num_stages),
            kv_stream_layout(job.executor.layers.size, n, self.half_block_bytes, codec),
            f"decode {job.decode.instance_id}", self.streamers, codec=codec,
        )  # fmt: skip
        chunk_bytes = job.chunk_tokens * job.executor.row_bytes
        if job.stage + 1 < job.num_stages:
            job.hidden_out = OutStream(
                self.transfer, job.next_transfer, hidden_session(job.rid, job.stage + 1),
                (job.num_chunks, 1, chunk_bytes), f"stage {job.stage + 1}", self.streamers,
            )  # fmt: skip
        if job.stage > 0:
            job.region = f"cpp-{job.rid}"
            self.transfer.register_region(job.region, job.num_chunks * chunk_bytes)
            job.receiver = self.transfer.expect_stream(
                hidden_session(job.rid, job.stage), job.region,
                StreamLayout.contiguous(job.num_chunks, 1, chunk_bytes),
            )  # fmt: skip
        self.num_requests += 1
        self.worker.conductor.event("prefill_started", request_id=job.rid)

    def _begin_prefix_load(self, job: StageJob, have_blocks: int, want_blocks: int) -> None:
        """Start fetching blocks ``have..want-1`` from the worker's store or its engine's
        pool (where ``demote`` keeps them), or pulling them from the Conductor's source
        on a pull thread (the loop goes on meanwhile)."""
        prefix = job.tokens[: want_blocks * self.block_size]
        hashes = hash_blocks(prefix, self.block_size, chain_root(job.cache_salt)).full
        source = job.cache_source
        endpoint = ""
        if source is not None and source.instance_id != self.worker.me.instance_id:
            endpoint = source.transfer
        job.prefix_fetch = self.cache.begin_fetch(
            hashes[have_blocks:], self.transfer, endpoint, pool=True
        )
        job.prefix_blocks = (have_blocks, want_blocks)
        if job.prefix_fetch.done():
            self._end_prefix_load(job)

    def _end_prefix_load(self, job: StageJob) -> None:
        """Load a fetch that ended into the stage's pool; fails the job when blocks are
        missing (the group agreed on them: the request is placed again)."""
        assert job.prefix_fetch is not None
        payloads = self.cache.end_fetch(job.prefix_fetch)
        job.prefix_fetch = None
        have_blocks, want_blocks = job.prefix_blocks
        if len(payloads) < want_blocks - have_blocks:
            job.error = (
                f"stage {job.stage} found {have_blocks + len(payloads)} of the "
                f"{want_blocks} agreed prefix blocks"
            )
            return
        job.executor.load_prefix(job.rid, payloads, have_blocks, job.tokens)
        job.progress_s = time.monotonic()  # waiting for the blocks was no neighbour's fault

    # -- the prompt-KV hook (engine thread) -------------------------------------------------------
    def on_prompt_kv(
        self, rid: str, layer: int, keys: list[memoryview], values: list[memoryview]
    ) -> None:
        """After the last chunk, queue this (global) layer's K and V of the whole prompt
        for decode; the views stay valid while the job holds its blocks (it waits for its
        streams before it releases them)."""
        job = self.jobs.get(rid)
        if job is None or job.error:
            return
        local = layer - job.executor.layers.first
        out = job.kv_out
        assert out is not None
        out.submit_kv(local, keys, values)

    # -- the worker loop ---------------------------------------------------------------------------
    def tick(self) -> None:
        """Finish jobs whose streams ended; run one chunk of the oldest runnable job."""
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if job.prefix_fetch is not None and not job.error and job.prefix_fetch.done():
                self._end_prefix_load(job)
            self._check_streams(job)
            if not job.began and not job.error and now - job.progress_s > STAGE_WAIT_S:
                job.error = f"the group did not agree on a start within {STAGE_WAIT_S:g}s"
            if job.error:
                self._fail(job)
            elif job.computed and job.sent.is_set():
                self._complete(job)
        for job in list(self.jobs.values()):
            if (
                job.began
                and not job.computed
                and not job.error
                and job.prefix_fetch is None
                and self._input_ready(job)
            ):
                self._run_chunk(job)
                return
        if self.jobs and not self.engine.has_unfinished_requests():
            self._idle_wait(IDLE_WAIT_S)

    def _idle_wait(self, timeout_s: float) -> None:
        """Nothing to compute: block briefly on what the oldest job awaits, so the loop
        wakes the moment it arrives instead of spinning or sleeping a whole poll."""
        job = next(iter(self.jobs.values()))
        if job.error or not job.began:
            return
        if job.computed:
            job.sent.wait(timeout_s)
        elif job.prefix_fetch is not None:
            job.prefix_fetch.wait(timeout_s)
        elif job.receiver is not None:
            with contextlib.suppress(TransferError):  # _input_ready reports it next tick
                job.receiver.wait_layer(job.next_chunk, timeout_s)

    @staticmethod
    def _check_streams(job: StageJob) -> None:
        """A failed outgoing stream fails the job, suspecting its peer."""
        if job.error:
            return
        if job.kv_out is not None and job.kv_out.error:
            job.error, job.suspect = job.kv_out.error, job.decode.instance_id
        elif job.hidden_out is not None and job.hidden_out.error:
            job.error, job.suspect = job.hidden_out.error, job.suspects[1]

    def _input_ready(self, job: StageJob) -> bool:
        if job.receiver is None:
            return True
        if job.receiver.is_layer_done(job.next_chunk):
            return True
        if job.receiver.error is not None:
            job.error = f"hidden states from stage {job.stage - 1}: {job.receiver.error}"
            job.suspect = job.suspects[0]
        elif time.monotonic() - job.progress_s > STAGE_WAIT_S:
            job.error = f"no hidden states from stage {job.stage - 1} for {STAGE_WAIT_S:g}s"
            job.suspect = job.suspects[0]
        return False

    def _run_chunk(self, job: StageJob) -> None:
        c = job.next_chunk
        lo = job.start + c * job.chunk_tokens
        hi = min(lo + job.chunk_tokens, len(job.tokens))
        row_bytes = job.executor.row_bytes
        hidden_in = None
        if job.receiver is not None:  # chunk c's slot of the region: host bytes
            view = self.transfer.regions.get(job.region).view
            offset = c * job.chunk_tokens * row_bytes
            hidden_in = view[offset : offset + (hi - lo) * row_bytes]
        t0 = time.monotonic()
        try:
            # Host bytes of the output, padded to a whole slot of the stream (chunk_tokens
            # rows).
            data = job.executor.run_chunk(job.rid, job.tokens, lo, hi, hidden_in, job.chunk_tokens)
        except Exception as exc:  # the request fails (the next tick), not the worker
            self._compute_failed(job, exc)
            return
        job.compute_s += time.monotonic() - t0
        job.next_chunk += 1
        job.progress_s = time.monotonic()
        self.num_chunks_run += 1
        if job.stage + 1 < job.num_stages:
            stream = job.hidden_out
            assert stream is not None and data is not None
            stream.submit(lambda: stream.send(c, [data]))
        if job.computed:
            job.computed_s = time.monotonic()
            if job.stage + 1 == job.num_stages:
                try:
                    token, entry, job.seed, job.first_finish = job.executor.sample_first(
                        job.rid, job.tokens, job.params
                    )
                except Exception as exc:
                    self._compute_failed(job, exc)
                    return
                job.first_token = token
                job.first_logprob = None if entry is None else logprobs_to_wire((entry,))
                prompt = job.executor.take_prompt_logprobs(job.rid)
                job.prompt_logprobs = None if prompt is None else logprobs_to_wire(prompt)
            outs = [out for out in (job.hidden_out, job.kv_out) if out is not None]
            finish_all(outs, job.sent.set)

    def _compute_failed(self, job: StageJob, exc: Exception) -> None:
        """The stage's computation raised: the next tick fails the request (retryable,
        naming no peer: the fault may have been passing), never the worker; nothing the
        chunk computed was cached."""
        log.error("request %s, stage %d: computing failed", job.rid, job.stage, exc_info=exc)
        job.error, job.suspect = f"engine step failed: {type(exc).__name__}: {exc}", ""
        self.worker.metrics.request_failed(retryable=True)

    # -- endings -----------------------------------------------------------------------------------
    def _release(self, job: StageJob) -> None:
        self.jobs.pop(job.rid, None)
        job.executor.release(job.rid)
        receiver = job.receiver
        if receiver is not None and receiver.num_layers_done < receiver.layout.num_layers:
            receiver.cancel()  # (a complete one may still await its sender's finish)
        if job.region:
            self.transfer.unregister_region(job.region)
            job.region = ""

    def _complete(self, job: StageJob) -> None:
        self._release(job)
        now = time.monotonic()
        log.debug(
            "request %s stage %d/%d: agreed in %.3fs, %d chunks from token %d in %.3fs "
            "(%.3fs computing), streams done %.3fs later",
            job.rid, job.stage, job.num_stages, job.began_s - job.created_s, job.num_chunks,
            job.start, job.computed_s - job.began_s, job.compute_s, now - job.computed_s,
        )  # fmt: skip
        events = self.worker.conductor
        events.event("prefill_finished", request_id=job.rid)
        if job.first_token is None:
            return  # not the last stage: it only computed and streamed
        token, finish = job.first_token, job.first_finish
        if finish is None:
            try:
                self.worker.send_to(job.decode.command, Handoff(
                    request_id=job.rid, token_ids=[*job.tokens, token],
                    num_prompt_tokens=len(job.tokens), num_computed_tokens=len(job.tokens),
                    seed=job.seed,
                ))  # fmt: skip
            except ConnectionError as exc:  # its blocks are released: only tell the gateway
                job.error, job.suspect = str(exc), job.decode.instance_id
                log.warning("request %s: %s", job.rid, job.error)
                self.worker.send(job.identity, Error(
                    request_id=job.rid, error=job.error, retryable=True, suspect=job.suspect,
                ))  # fmt: skip
                events.event("request_finished", request_id=job.rid)
                return
        else:
            events.event("request_finished", request_id=job.rid)
        n = num_blocks(len(job.tokens), self.engine.config.block_size)
        kv_bytes = 0 if finish else n * self.engine.kv_bytes_per_block
        self.worker.send(job.identity, Tokens(
            request_id=job.rid, index=0, token_ids=[token], finish_reason=finish,
            cached_tokens=job.start, kv_bytes=kv_bytes, logprobs=job.first_logprob,
            prompt_logprobs=job.prompt_logprobs,
        ))  # fmt: skip

    def _fail(self, job: StageJob) -> None:
        log.warning("request %s, stage %d: %s", job.rid, job.stage, job.error)
        self._cancel_streams(job)
        self._release(job)
        self.worker.send(job.identity, Error(
            request_id=job.rid, error=job.error, retryable=True, suspect=job.suspect,
        ))  # fmt: skip
        self.worker.conductor.event("request_finished", request_id=job.rid)

    def _cancel_streams(self, job: StageJob) -> None:
        for out in (job.hidden_out, job.kv_out):
            if out is not None:
                out.submit_cancel()

    def on_abort(self, request_id: str) -> bool:
        """Drop the request's job; True if there was one."""
        self._early.pop(request_id, None)
        job = self.jobs.get(request_id)
        if job is None:
            return False
        job.error = job.error or "aborted"
        self._cancel_streams(job)
        self._release(job)
        return True

    def stats(self) -> dict[str, Any]:
        """CPP traffic of this worker."""
        return {"cpp_requests": self.num_requests, "cpp_chunks": self.num_chunks_run,
                "cpp_jobs": len(self.jobs),
                "cpp_prefix_tokens_reused": self.num_prefix_tokens_reused}  # fmt: skip

    def close(self) -> None:
        """Nothing of its own: the stream threads are the role's."""
