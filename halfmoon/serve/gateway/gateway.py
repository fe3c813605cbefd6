"""The gateway's request handling, without HTTP: :class:`Gateway` prepares requests
(:mod:`~halfmoon.serve.gateway.preparation`: validation, tokenization, sampling
parameters), knows the served models and LoRA adapters
(:mod:`~halfmoon.serve.gateway.served_models`) and turns the backend's token streams into
text deltas with usage and metrics. What it serves and its limits are a
:class:`~halfmoon.serve.gateway.config.GatewayConfig`; the routes that call it are
:func:`halfmoon.serve.gateway.app.create_app`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import Any, TypeVar

from halfmoon.core.request import SamplingParams, TokenLogprob
from halfmoon.engine.tokenizer import Tokenizer
from halfmoon.metrics.latency import tbt_gaps_s
from halfmoon.serve.gateway.access_log import note_generation
from halfmoon.serve.gateway.backend import Backend, BackendError, GenerationChunk
from halfmoon.serve.gateway.config import GatewayConfig
from halfmoon.serve.gateway.openai_api import Finish, usage
from halfmoon.serve.gateway.preparation import RequestPreparation
from halfmoon.serve.gateway.prom import GatewayMetrics
from halfmoon.serve.gateway.response_store import ResponseStore
from halfmoon.serve.gateway.responses import Delta, Entry, Prepared
from halfmoon.serve.gateway.text import OutputText
from halfmoon.serve.gateway.timeseries import TimeSeries

T = TypeVar("T")

#: What answers put before a request's public id: ids :meth:`Gateway.abort_requests` reads.
ANSWER_ID_PREFIXES = ("cmpl-", "chatcmpl-", "generate-tokens-", "msg_", "embd-")


class Gateway(RequestPreparation):
    """Turns HTTP requests into backend generations (one instance per app)."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer, config: GatewayConfig) -> None:
        super().__init__(backend, tokenizer, config)
        self.metrics = GatewayMetrics()
        #: Recent history for the live cluster page (halfmoon.serve.gateway.dashboard).
        self.series = TimeSeries()
        #: The re-planner's latest rounds, newest last (``--replan``; empty without it).
        self.replan_rounds: Sequence[dict[str, Any]] = ()
        #: Responses API answers kept for later turns.
        self.responses = ResponseStore(config.responses_store_bytes)
        eos = tokenizer.eos_token_id
        #: Where a beam ends (see halfmoon.serve.gateway.beam_search).
        self.end_token_ids = tuple(
            sorted({*config.end_token_ids, *([eos] if eos is not None else [])})
        )
        self.metrics.stored_responses.set_function(lambda: len(self.responses))
        self.metrics.stored_response_bytes.set_function(lambda: self.responses.bytes)
        self.in_flight = 0
        #: Requests being tokenized, counted against the limit too: before, a burst all
        #: passed the check (nothing in flight yet) and every request of it was tokenized
        #: before the excess was refused, behind the others on the tokenizer threads.
        self.preparing = 0
        self._cpu = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="gateway-cpu")
        #: The backend ids of the generations running under each public id (a client's
        #: request id, else the gateway's): what :meth:`abort_requests` finds them by.
        self._running: dict[str, set[str]] = {}
        #: Clear while generation is paused (:meth:`pause`): new generations wait for it.
        self._resumed = asyncio.Event()
        self._resumed.set()
        #: Generations past that gate (sent to the backend), and a wake-up when they end.
        self._generating = 0
        self._idle = asyncio.Event()
        self._idle.set()
        #: The memory asleep in the cluster (vLLM's tags, :mod:`~.sleep_mode`): while any
        #: is, generation stays paused.
        self.memory_asleep: set[str] = set()
        #: One weight update at a time.
        self._weights_lock = asyncio.Lock()
        #: The served weights' version label as this gateway last learned it (SGLang's
        #: answers carry it; :meth:`served_weights` asks the cluster).
        self.weight_version = "default"

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the gateway's CPU threads, so the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(self._cpu, fn, *args)

    # -- generation --------------------------------------------------------------------------
    async def chunks(self, p: Prepared) -> AsyncIterator[GenerationChunk]:
        """The backend's chunks of ``p`` (one choice), counted as running meanwhile."""
        lora = p.params.lora
        self.metrics.running.inc()
        if lora is not None:
            self.metrics.lora_running.labels(lora_name=lora).inc()
        self.in_flight += 1
        try:
            await self._resumed.wait()  # (held here while generation is paused)
            self._running.setdefault(p.public_id, set()).add(p.request_id)
            self._generating += 1
            self._idle.clear()
            try:
                # Only a salted request needs a backend that takes a salt.
                salt = {"cache_salt": p.cache_salt} if p.cache_salt is not None else {}
                async for chunk in self.backend.generate(
                    p.request_id, p.prompt_ids, p.params, **salt
                ):
                    yield chunk
            finally:
                running = self._running.get(p.public_id, set())
                running.discard(p.request_id)
                if not running:
                    self._running.pop(p.public_id, None)
                self._generating -= 1
                if not self._generating:
                    self._idle.set()
        finally:
            self.in_flight -= 1
            self.metrics.running.dec()
            if lora is not None:
                self.metrics.lora_running.labels(lora_name=lora).dec()

    async def embed(
        self, prompt_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
        client_id: str | None = None,
    ) -> tuple[float, ...]:  # fmt: skip
        """The embedding of ``prompt_ids`` (``params.embed``), run as any request (counted,
        held while paused, ended by :meth:`abort_requests` under ``client_id``): its
        vector, not normalized (the prompt tokens a prefix cache served count in the
        metrics). Raises :class:`Rejected` or :class:`BackendError` as generation does."""
        p = Prepared(self.new_id(), prompt_ids, params, (), False, False,
                     cache_salt=cache_salt, client_id=client_id)  # fmt: skip
        arrival = time.monotonic()
        vector: tuple[float, ...] | None = None
        cached = est = None
        finish = "abort"
        try:
            async with aclosing(self.chunks(p)) as chunks:
                async for chunk in chunks:
                    if chunk.cached_tokens is not None:
                        cached, est = chunk.cached_tokens, chunk.est_ttft_s
                    vector = chunk.embedding if chunk.embedding is not None else vector
                    if chunk.finish_reason is not None:
                        finish = chunk.finish_reason
                        break
        except BaseException:
            await self.backend.abort(p.request_id)
            raise
        if vector is None:
            raise BackendError(f"embedding request {p.request_id} ended without a vector "
                               f"({finish})")  # fmt: skip
        no_output = OutputText(self.tokenizer, prompt_ids, (), False, True)
        self._observe_end(p, arrival, [time.monotonic()], no_output, finish, cached, est)
        return vector

    async def abort_requests(self, ids: Iterable[str] | None) -> int:
        """End the generations running under these ids (None: every one): a request id a
        client chose, or an answer's id (that id after ``cmpl-``, ``chatcmpl-``,
        ``generate-tokens-`` or ``msg_``). Each stream ends as finished ``abort``; the
        number ended."""
        found: set[str] = set()
        for given in list(self._running) if ids is None else ids:
            names = {given} | {given[len(pre) :] for pre in ANSWER_ID_PREFIXES
                               if given.startswith(pre)}  # fmt: skip
            for name in names:
                found.update(self._running.get(name, ()))
        for request_id in sorted(found):
            await self.backend.abort(request_id)
        return len(found)

    @property
    def paused(self) -> bool:
        """Whether generation is paused (:meth:`pause`)."""
        return not self._resumed.is_set()

    async def pause(self, mode: str) -> None:
        """Pause generation, as vLLM's RL server does before a weight or adapter update:
        new generations wait (they are not refused) until :meth:`resume`; those running
        are aborted (``mode`` ``abort``) or, with ``wait``, finish first (this returns
        when they have)."""
        self._resumed.clear()
        if mode == "abort":
            await self.abort_requests(None)
        await self._idle.wait()

    def resume(self) -> None:
        """Let generations run again (those held start now)."""
        self._resumed.set()

    async def served_weights(self) -> tuple[str | None, str]:
        """The checkpoint installed while serving (None: the weights the server started
        with) and the weights' version label (``default`` until one is given)."""
        query = getattr(self.backend, "weights", None)
        record = None if query is None else await query()
        path, self.weight_version = (
            (None, "default") if record is None else (record.path or None, record.version)
        )
        return path, self.weight_version

    async def update_weights(self, path: str, version: str | None, abort: bool) -> int:
        """Install the checkpoint at ``path`` on every worker (SGLang's
        ``/update_weights_from_disk``): generation paused meanwhile (new requests wait),
        running requests aborted (``abort``) or finished first, then the backend's
        all-or-none update (BackendError naming why not); ``version`` labels the new
        weights (None: the label stays). Returns how many requests waited."""
        update = getattr(self.backend, "update_weights", None)
        if update is None:
            raise BackendError("this server cannot update its weights while serving")
        # Shielded: a client that gives up mid-way does not cut an update in two (some
        # workers on the new weights, the Conductor's record on the old); it runs to its
        # end, generation resumed after it.
        task = asyncio.ensure_future(self._update_paused(update, path, version, abort))
        return await asyncio.shield(task)

    async def _update_paused(
        self, update: Callable[[str, str], Any], path: str, version: str | None, abort: bool
    ) -> int:
        started = time.monotonic()
        outcome = "failed"
        async with self._weights_lock:
            was_paused = self.paused
            self._resumed.clear()
            try:
                if version is None:
                    version = (await self.served_weights())[1]
                if abort:
                    await self.abort_requests(None)
                await self._idle.wait()
                waiting = self.in_flight - self._generating
                await update(path, version)
                self.weight_version = version
                outcome = "ok"
            finally:
                if not was_paused:
                    self.resume()
                self.metrics.weight_update.labels(outcome).observe(time.monotonic() - started)
        return waiting

    async def label_weights(self, version: str, abort: bool) -> None:
        """Give the served weights the version label ``version`` (vLLM's and SGLang's
        ``/update_weight_version``; ``abort``: running requests end first)."""
        record = getattr(self.backend, "record_weights_version", None)
        if record is None:
            raise BackendError("this server keeps no weight version")
        if abort:
            await self.abort_requests(None)
        await record(version)
        self.weight_version = version

    def _observe_end(
        self,
        p: Prepared,
        arrival: float,
        times: list[float],
        out: OutputText,
        finish: str,
        cached: int | None,
        est_ttft: float | None,
    ) -> None:
        m = self.metrics
        if times:
            m.ttft.observe(times[0] - arrival)
            m.e2e.observe(times[-1] - arrival)
            if est_ttft is not None:
                m.ttft_estimate_error.observe(times[0] - arrival - est_ttft)
            for gap_s in tbt_gaps_s(times):
                m.itl.observe(gap_s)
        m.prompt_tokens.inc(len(p.prompt_ids))
        m.generation_tokens.inc(out.num_tokens)
        m.prefix_cache_queries.inc(len(p.prompt_ids))
        m.prefix_cache_hits.inc(cached or 0)
        m.requests.labels(finished_reason=finish).inc()
        if p.params.lora is not None:
            m.lora_requests.labels(lora_name=p.params.lora).inc()
        gaps_s = tbt_gaps_s(times)
        self.series.finished(times[0] - arrival if times else None, gaps_s, len(p.prompt_ids),
                             cached or 0, out.num_tokens)  # fmt: skip
        note_generation(len(p.prompt_ids), out.num_tokens, times[0] - arrival if times else None)

    def token_text(self, token_id: int) -> str:
        """One token's text (for log-probabilities)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def run(self, p: Prepared) -> AsyncIterator[Delta]:
        """Yield (text delta, None, None, logprobs, prompt) as text arrives, then (tail,
        finish, usage, logprobs, prompt); ``logprobs`` are the entries of the tokens since
        the last yield, ``prompt`` the prompt's entries (with the first yield, when the
        request asked for them; else None)."""
        arrival = time.monotonic()
        thinking = p.reasoning.splitter() if p.reasoning is not None else None
        out = OutputText(self.tokenizer, p.prompt_ids, p.stop, p.include_stop,
                         p.skip_special_tokens, thinking, p.stop_regex,
                         hold_all=bool(p.stop_regex) and not p.stream)  # fmt: skip
        entries: list[Entry] = []
        prompt: list[Entry] | None = None
        times: list[float] = []
        finish: str | None = None
        cached = est = None
        pending = ""
        stopped_by: int | None = None  # the token that ended the request by itself
        try:
            async with aclosing(self.chunks(p)) as chunks:
                async for chunk in chunks:
                    if chunk.cached_tokens is not None:
                        cached, est = chunk.cached_tokens, chunk.est_ttft_s
                    if chunk.prompt_logprobs is not None:
                        prompt = self._prompt_entries(p.prompt_ids, chunk.prompt_logprobs)
                    self.metrics.kv_transfer_bytes.inc(chunk.kv_transfer_bytes)
                    self.series.kv_moved(chunk.kv_transfer_bytes)
                    if chunk.conductor_decision_s is not None:
                        self.metrics.conductor_decision.observe(chunk.conductor_decision_s)
                    if chunk.conductor_rtt_s is not None:
                        self.metrics.conductor_rtt.observe(chunk.conductor_rtt_s)
                    times += [time.monotonic()] * len(chunk.token_ids)
                    counted = out.num_tokens
                    if chunk.finish_reason == "stop" and chunk.token_ids:
                        if self._stop_token(p, chunk.token_ids[-1]):
                            stopped_by = chunk.token_ids[-1]
                    delta = out.add(chunk.token_ids, stopped_by is not None)
                    if p.echo_only:  # max_tokens 0: the prompt alone is the answer
                        delta = ""
                    elif chunk.logprobs or p.return_token_ids:  # only when they are shown:
                        kept = out.num_tokens - counted  # the tokens the text kept (none past
                        values = chunk.logprobs or (None,) * len(chunk.token_ids)  # a stop)
                        entries += zip(chunk.token_ids[:kept], values[:kept], strict=True)
                    finish = "stop" if out.stopped else chunk.finish_reason
                    if finish is not None:
                        pending = delta
                        if chunk.finish_reason is None:  # our stop string: end it upstream
                            await self.backend.abort(p.request_id)
                        break
                    if p.continuous_usage:  # every token batch, text or not
                        use = usage(len(p.prompt_ids), out.num_tokens, cached)
                        yield delta, None, use, entries, prompt
                        entries, prompt = [], None
                    elif delta:
                        yield delta, None, None, entries, prompt
                        entries, prompt = [], None
        except BaseException:
            await self.backend.abort(p.request_id)
            raise
        finish = finish or "abort"
        if finish == "stop":
            finish = Finish(finish, self._stop_reason(p, out, stopped_by))
        self._observe_end(p, arrival, times, out, finish, cached, est)
        if p.echo_only:
            use = usage(len(p.prompt_ids), 0, cached)
            yield "", finish, use, [], prompt
            return
        tail = out.flush()
        use = usage(len(p.prompt_ids), out.num_tokens, cached)
        if thinking is not None:  # (vLLM's usage under a reasoning parser)
            use["completion_tokens_details"] = {"reasoning_tokens": out.reasoning_tokens}
        yield pending + tail, finish, use, entries, prompt

    def _stop_token(self, p: Prepared, token: int) -> bool:
        """Whether ``token`` ends ``p`` by itself: one of its ``stop_token_ids``, or an
        end-of-sequence token unless it ignores them (a backend that also ends requests
        at stop strings, as vLLM's do, says ``stop`` for those too)."""
        eos = token in self.end_token_ids and not p.params.ignore_eos
        return eos or token in p.params.stop_token_ids

    def _stop_reason(self, p: Prepared, out: OutputText, token: int | None) -> int | str | None:
        """What stopped a request that ended with ``stop`` (vLLM's ``stop_reason``): its
        stop string, or the ``token`` that ended it when that is one of its
        ``stop_token_ids`` and not an end-of-sequence token (vLLM answers None for those)."""
        if out.stop_string is not None:
            return out.stop_string
        if token in p.params.stop_token_ids and token not in self.end_token_ids:
            return token
        return None

    @staticmethod
    def _prompt_entries(prompt_ids: list[int], values: tuple[TokenLogprob, ...]) -> list[Entry]:
        """The prompt's ``(token id, log-probability)`` entries (None for the first
        token); a backend that sent the wrong number fails the request."""
        if len(values) != len(prompt_ids) - 1:
            raise BackendError(
                f"{len(values)} prompt log-probabilities for a prompt of {len(prompt_ids)} tokens"
            )
        return [(prompt_ids[0], None), *zip(prompt_ids[1:], values, strict=True)]
