"""What the gateway needs from whatever generates tokens: the :class:`Backend` protocol.

The disaggregated cluster (Conductor + prefill + decode workers) and the coupled cluster
both implement it, so the HTTP layer is written once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams, TokenLogprob

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class GenerationChunk:
    """New output token ids of one request; the last chunk carries ``finish_reason``.

    ``cached_tokens`` (prompt tokens served from a prefix cache), ``est_ttft_s`` (the
    Conductor's estimate), ``kv_transfer_bytes`` (KV moved between workers for it) and
    the Conductor's decision time and round trip come with the first chunk when known.
    """

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    cached_tokens: int | None = None
    est_ttft_s: float | None = None
    kv_transfer_bytes: int = 0
    conductor_decision_s: float | None = None
    conductor_rtt_s: float | None = None
    #: Log-probabilities of ``token_ids`` when the request asked for them.
    logprobs: tuple[TokenLogprob, ...] = ()
    #: With the first chunk of a request that asked for them (``prompt_logprobs``): the
    #: log-probabilities of its prompt tokens after the first.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    #: An embedding request's answer (``params.embed``: one chunk, no tokens, finished
    #: ``stop``): the last token's final hidden state, not normalized.
    embedding: tuple[float, ...] | None = None


class Rejected(HalfmoonError):
    """The cluster declined the request up front (early rejection, overload)."""

    def __init__(self, reason: str, retry_after_s: float = 1.0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = retry_after_s


class BackendError(HalfmoonError):
    """The request failed inside the cluster (a worker died, a transfer timed out)."""


class BackendRefused(BackendError):
    """The cluster's engines cannot do what the request asks (e.g. embeddings from a vLLM
    server started to generate): the request is at fault, answered with a 400."""


class Backend(Protocol):
    """Generates tokens for the gateway. A backend may also offer ``async
    metrics_texts(timeout_s)``: the metrics of every process of its cluster, which
    ``/metrics`` merges with the gateway's own (:mod:`halfmoon.serve.gateway.scrape`)."""

    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """Stream the request's output; raises :class:`Rejected` before the first chunk
        when the request is declined, :class:`BackendError` when it fails.

        ``cache_salt`` (a non-empty string): the request may reuse cached KV only of
        requests with the same salt (see :func:`halfmoon.core.hashing.chain_root`). The
        gateway passes it only when a request has one, so a backend without prefix
        caching may leave it out.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free what it holds (idempotent); a stream still being read
        ends with a chunk finished ``abort``."""
        ...

    async def health(self) -> dict[str, Any]:
        """A small status map; raises when the cluster is not serving."""
        ...
