"""Disaggregated roles over vLLM servers (#19 item 2): the halfmoon worker in front of a
prefill or a decode vLLM whose KV moves through halfmoon's KV connector inside vLLM.

One request, with the gateway playing vLLM's disaggregation proxy (the Conductor chose
the prefill instance P, the decode instance D and a cache source, as for halfmoon's own
workers; see :mod:`halfmoon.serve.vllm.pd` for what the servers do)::

    gateway -> D worker  expect(rid, params)
    gateway -> P worker  prefill(rid, tokens, params, D, cache source, cached tokens)
    P worker -> P vLLM   completion, max_tokens 1, kv_transfer_params: stream to D's
                         connector, pull the cached prefix from the source's store
    P worker -> D worker prefill_done(rid, the answer's kv_transfer_params, cached tokens)
    D worker -> D vLLM   the whole request with those params: the KV is loaded, not computed
    D worker -> gateway  tokens from index 0 (P's one token is not kept: vLLM's D samples
                         it again from the same state, as vLLM's own proxy does)

Failures: a prefill vLLM that refuses or loses a request fails it (retryable when the
server broke, naming P); an expected request whose ``prefill_done`` never comes fails
retryable after the handoff timeout, naming P; a decode server that breaks fails it
retryable naming D. Nothing waits forever.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from halfmoon.core.request import SamplingParams, TokenLogprob
from halfmoon.serve.control.messages import (
    Error,
    Expect,
    Prefill,
    PrefillDone,
    Replicate,
    logprobs_to_wire,
)
from halfmoon.serve.vllm.connector import NO_POOLING, VllmServerConnector, VllmUnsupported
from halfmoon.serve.vllm.pd import PrefillResult, prefill_params
from halfmoon.serve.worker.coupled import CoupledRole
from halfmoon.serve.worker.process import Handler, Worker
from halfmoon.serve.worker.tokens import HANDOFF_TIMEOUT_S, HANDOFF_TTFT_FACTOR, StreamClient

if TYPE_CHECKING:
    from halfmoon.engine.connector import RequestFailure

log = logging.getLogger(__name__)


@dataclass
class _Prefilling:
    decode_command: str
    decode_instance: str
    kv_bytes: int


class VllmPrefillRole(CoupledRole):
    """Prefill through a vLLM server; its KV events feed the Conductor's index (the prefix
    source of later requests), as a coupled vLLM worker's do."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        assert isinstance(worker.engine, VllmServerConnector)
        self.engine: VllmServerConnector = worker.engine
        self.prefilling: dict[str, _Prefilling] = {}
        self.num_prefills = self.num_remote_prefix = self.prefix_tokens_pulled = 0
        self._warned_replicate = False

    def handlers(self) -> dict[str, Handler]:
        return {"prefill": self._on_prefill, "replicate": self._on_replicate}

    def _on_replicate(self, identity: bytes, msg: Replicate) -> None:
        if not self._warned_replicate:
            self._warned_replicate = True
            log.warning("hot-block replication is not done by vLLM prefill workers (ignored)")

    def _on_prefill(self, identity: bytes, msg: Prefill) -> None:
        rid, source = msg.request_id, msg.cache_source
        if msg.decode is None:  # an embedding (the worker answers it as a 400)
            raise VllmUnsupported(NO_POOLING)
        remote = source is not None and source.instance_id != self.worker.me.instance_id
        params = prefill_params(
            rid, msg.decode.transfer, source.transfer if remote and source else None,
            msg.cached_tokens if remote else 0,
        )  # fmt: skip
        self.num_remote_prefix += int(remote and msg.cached_tokens > 0)
        try:
            self.engine.add_prefill(
                rid, msg.token_ids, msg.params.to_params(), cache_salt=msg.cache_salt,
                kv_transfer_params=params,
            )  # fmt: skip
        except Exception as exc:  # e.g. too long for the server: the client must hear of it
            self.worker.send(identity, Error(request_id=rid, error=str(exc)))
            return
        self.clients[rid] = StreamClient(identity, msg.token_ids)
        self.prefilling[rid] = _Prefilling(msg.decode.command, msg.decode.instance_id, 0)
        self.worker.conductor.event("prefill_started", request_id=rid)

    def on_outputs(self, outputs: list[Any]) -> None:
        events = self.worker.conductor
        for out in outputs:
            rid = out.request_id
            if not out.finished or rid not in self.prefilling or rid not in self.clients:
                continue  # a prefill's answer comes whole: tokens and finish together
            p, client = self.prefilling.pop(rid), self.clients.pop(rid)
            self.num_prefills += 1
            events.event("prefill_finished", request_id=rid, cached_tokens=out.num_cached_tokens)
            events.event("request_finished", request_id=rid)
            try:
                result = PrefillResult.from_params(self.engine.take_transfer_params(rid))
            except ValueError as exc:
                self.worker.send(client.identity, Error(request_id=rid, error=str(exc)))
                continue
            self.prefix_tokens_pulled += result.loaded_tokens
            layout = self.engine.layout
            kv_bytes = result.num_tokens * layout.bytes_per_block // layout.block_size
            prompt = out.prompt_logprobs
            try:
                self.worker.send_to(p.decode_command, PrefillDone(
                    request_id=rid, token_ids=client.prompt_token_ids, session=result.session,
                    num_tokens=result.num_tokens, streamed=result.streamed,
                    cached_tokens=out.num_cached_tokens, kv_bytes=kv_bytes if result.streamed else 0,
                    prompt_logprobs=None if prompt is None else logprobs_to_wire(prompt),
                ))  # fmt: skip
            except ConnectionError as exc:
                self.worker.send(client.identity, Error(
                    request_id=rid, error=str(exc), retryable=True, suspect=p.decode_instance,
                ))  # fmt: skip

    def on_abort(self, request_id: str) -> None:
        self.prefilling.pop(request_id, None)
        super().on_abort(request_id)

    def on_failure(self, failure: RequestFailure) -> None:
        """A prefill the server dropped (see :meth:`CoupledRole.on_failure`)."""
        self.prefilling.pop(failure.request_id, None)
        super().on_failure(failure)

    def stats(self) -> dict[str, Any]:
        """Prefills handed to decode, how many named a remote prefix source and how many
        prompt tokens' KV came from one (pulled, not computed), and the coupled role's
        cache-event counts."""
        return {**super().stats(), "prefills": self.num_prefills,
                "remote_prefix_requests": self.num_remote_prefix,
                "prefix_tokens_pulled": self.prefix_tokens_pulled}  # fmt: skip


@dataclass
class _Expected:
    identity: bytes
    params: SamplingParams
    prefill_instance: str
    cache_salt: str | None
    timeout_s: float
    since_s: float = field(default_factory=time.monotonic)


class VllmDecodeRole(CoupledRole):
    """Decode through a vLLM server that loads each request's KV from its inbox. Its cache
    is not indexed (the Conductor places prefills by the prefill instances' caches)."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        worker.engine.set_cache_listener(None)
        assert isinstance(worker.engine, VllmServerConnector)
        self.engine: VllmServerConnector = worker.engine
        self.expected: dict[str, _Expected] = {}
        #: cached tokens, KV bytes and prompt log-probabilities (None: not asked for) of
        #: the prefill, for the first tokens message
        self.firsts: dict[str, tuple[int, int, tuple[TokenLogprob, ...] | None]] = {}

    def handlers(self) -> dict[str, Handler]:
        return {"expect": self._on_expect, "prefill_done": self._on_prefill_done}

    def _on_expect(self, identity: bytes, msg: Expect) -> None:
        self.expected[msg.request_id] = _Expected(
            identity, msg.params.to_params(), msg.prefill_instance, msg.cache_salt,
            HANDOFF_TIMEOUT_S + HANDOFF_TTFT_FACTOR * msg.est_ttft_s,
        )  # fmt: skip

    def _on_prefill_done(self, identity: bytes, msg: PrefillDone) -> None:
        rid = msg.request_id
        e = self.expected.pop(rid, None)
        if e is None:
            return  # aborted meanwhile
        result = PrefillResult(msg.session, msg.num_tokens, msg.streamed)
        # The prefill server computed the prompt's log-probabilities: not again here.
        params = dataclasses.replace(e.params, prompt_logprobs=None)
        try:
            self.engine.add_request(rid, msg.token_ids, params, cache_salt=e.cache_salt,
                                    kv_transfer_params=result.decode_params())  # fmt: skip
        except Exception as exc:
            self.worker.send(e.identity, Error(request_id=rid, error=str(exc)))
            return
        self.clients[rid] = StreamClient(e.identity, msg.token_ids)
        self.firsts[rid] = (msg.cached_tokens, msg.kv_bytes, msg.prompt_token_logprobs)
        self.worker.conductor.event("decode_started", request_id=rid)

    def on_outputs(self, outputs: list[Any]) -> None:
        for out in outputs:
            rid = out.request_id
            client = self.clients.get(rid)
            if client is None:
                continue
            cached, kv_bytes, prompt = self.firsts.pop(rid, (None, 0, None))
            if cached is not None:  # the prefill's count, not the decode's (its whole prompt)
                out = dataclasses.replace(out, num_cached_tokens=cached, prompt_logprobs=prompt)
            self.send_tokens(rid, client, out, out.finish_reason, kv_bytes=kv_bytes, batch=True)
            if out.finished:
                del self.clients[rid]
                self.worker.conductor.event("request_finished", request_id=rid,
                                            num_output_tokens=len(out.token_ids))  # fmt: skip
        self.flush_tokens()

    def on_failure(self, failure: RequestFailure) -> None:
        """A request the server dropped (see :meth:`CoupledRole.on_failure`)."""
        self.firsts.pop(failure.request_id, None)
        super().on_failure(failure)

    def on_abort(self, request_id: str) -> None:
        self.firsts.pop(request_id, None)
        if self.expected.pop(request_id, None) is not None:
            self.worker.conductor.event("request_finished", request_id=request_id)
        super().on_abort(request_id)

    def tick(self) -> None:
        """Fail expectations whose prefill never came (retryable, naming the prefill
        instance)."""
        now = time.monotonic()
        for rid in [r for r, e in self.expected.items() if now - e.since_s > e.timeout_s]:
            e = self.expected.pop(rid)
            self.end_failed(e.identity, rid, f"no prefill handoff within {e.timeout_s:.0f}s",
                            retryable=True, suspect=e.prefill_instance)  # fmt: skip
        super().tick()

    def num_pending(self) -> int:
        """Requests whose prefill has not come yet."""
        return len(self.expected)

    def stats(self) -> dict[str, Any]:
        """Requests waiting for their prefill."""
        return {"num_expected": len(self.expected)}

    def snapshot(self) -> list[Any]:
        """A decode instance's cache is not indexed."""
        return []
