"""Messages into and out of the Conductor: events, load reports and decision records.

The Conductor learns cluster state only from these events, exactly as it would over the
network; the simulator and the live workers both produce them.

Request lifecycle events, in order, for a disaggregated request placed on (P, D)::

    schedule() -> PrefillStarted(P) -> PrefillFinished(P) -> DecodeStarted(D) -> RequestFinished(D)

and, from whoever sees it reach the client, FirstToken (around the hand-over to D).

A coupled instance plays both roles and sends the same events with its own id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The cache events the Conductor consumes are the one vocabulary of halfmoon.core.events.
from halfmoon.core.events import TIERS as TIERS
from halfmoon.core.events import BlockEvicted as BlockEvicted
from halfmoon.core.events import BlockStored as BlockStored


@dataclass(frozen=True)
class PrefillStarted:
    """The instance began computing the request's prefill."""

    instance_id: str
    request_id: str


@dataclass(frozen=True)
class PrefillFinished:
    """The request's prefill is done (its KV is on its way to the decode instance).
    ``cached_tokens``: prompt tokens the instance served from cache, when it says (the
    prefix it found may be longer than the one the Conductor planned with)."""

    instance_id: str
    request_id: str
    cached_tokens: int | None = None


@dataclass(frozen=True)
class FirstToken:
    """The request's first token reached its client: the gateway says so live (with an
    empty ``instance_id``), the simulator when it records it."""

    instance_id: str
    request_id: str


@dataclass(frozen=True)
class DecodeStarted:
    """The decode instance admitted the request into its batch."""

    instance_id: str
    request_id: str


@dataclass(frozen=True)
class RequestFinished:
    """The request left ``instance_id`` (finished, rejected after prefill, or aborted)."""

    instance_id: str
    request_id: str


@dataclass(frozen=True)
class LoadReport:
    """An instance's own view of its load; overrides the Conductor's bookkeeping.

    ``queued_prefill_tokens`` counts uncached prompt tokens waiting or running on a prefill
    instance; ``num_running`` / ``context_tokens`` describe a decode batch; ``kv_*`` its
    KV memory in tokens; ``spec_*``: a speculating decode instance's rows computed and
    tokens gained per sequence and step
    (:class:`~halfmoon.costmodel.speculation.SpeculationRates`; 1 and 1 without).
    """

    instance_id: str
    num_running: int = 0
    context_tokens: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    queued_prefill_tokens: int = 0
    spec_rows_per_seq: float = 1.0
    spec_tokens_per_step: float = 1.0


@dataclass(frozen=True)
class PrefillCandidate:
    """One way to run the prefill: on ``instance_id``, with its prefix from ``cache_source``.

    ``group``: for a chunked-pipeline (CPP) candidate, the stage instances in pipeline
    order (``instance_id`` is the first); empty for a single instance. Then ``queue_s`` is
    the longest member queue, ``prefill_s`` the pipelined prefill and ``transfer_s`` the
    slowest member's fetch of its layers' share of a remote prefix.

    ``overlap``: the fetch runs while the instance's queue does (the Conductor's
    ``prefix_fetch="overlap"``), so the two overlap in :attr:`ttft_s`.
    """

    instance_id: str
    cached_tokens: int
    cache_source: str
    queue_s: float
    prefill_s: float
    transfer_s: float
    group: tuple[str, ...] = ()
    overlap: bool = False

    @property
    def label(self) -> str:
        """``P1`` for one instance, ``P1+P2`` for a CPP group."""
        return "+".join(self.group) if self.group else self.instance_id

    @property
    def ttft_s(self) -> float:
        """Estimated time to first token if this candidate is chosen: queue, fetch and
        prefill one after another, or (``overlap``) the longer of queue and fetch, then
        the prefill."""
        if self.overlap:
            return max(self.queue_s, self.transfer_s) + self.prefill_s
        return self.queue_s + self.transfer_s + self.prefill_s

    @property
    def is_remote(self) -> bool:
        """Whether the prefix is fetched from another instance (for a group: from outside
        it, or by a member that lacks part of it)."""
        if self.group:
            return self.transfer_s > 0 or self.cache_source not in self.group
        return self.cache_source != self.instance_id


@dataclass(frozen=True)
class DecodeCandidate:
    """Estimated decode step time on ``instance_id`` once the request joins."""

    instance_id: str
    num_running: int
    context_tokens: int
    est_tbt_s: float


@dataclass(frozen=True)
class ReplicationPlan:
    """Copy ``block_hashes`` from ``source`` to ``target`` (prefix migration or hot spot)."""

    source: str
    target: str
    block_hashes: tuple[int, ...]
    reason: str


class RejectCode:
    """Why the Conductor refused a request (``Decision.reject_code``): stable codes for
    programs to act on; ``Decision.reject_reason`` is the text for people."""

    #: No prefill, decode or coupled instance registered (a restart in progress?).
    NO_INSTANCE = "no_instance"
    #: The estimated TTFT of the best placement exceeds the SLO.
    TTFT = "ttft"
    #: The estimated decode step time (TBT) exceeds the SLO.
    TBT = "tbt"
    #: The decode instance's KV cache cannot hold the request.
    KV_FULL = "kv_full"


@dataclass(frozen=True, kw_only=True)
class Decision:
    """The Conductor's answer for one request, with everything it considered.

    When ``accepted`` is False, ``reject_code`` (a :class:`RejectCode`) and
    ``reject_reason`` say why, and nothing was placed. Every field is keyword-only.
    ``candidates`` / ``decode_candidates`` may be the best few of those considered (a
    pruned decision); ``num_candidates`` / ``num_decode_candidates`` count them all
    (0: all are listed).
    """

    request_id: str
    policy: str
    accepted: bool
    prefill: PrefillCandidate | None
    decode: DecodeCandidate | None
    reject_reason: str = ""
    candidates: tuple[PrefillCandidate, ...] = ()
    decode_candidates: tuple[DecodeCandidate, ...] = ()
    replications: tuple[ReplicationPlan, ...] = field(default=())
    why: str = ""
    reject_code: str = ""
    num_candidates: int = 0
    num_decode_candidates: int = 0

    @property
    def est_ttft_s(self) -> float | None:
        """Estimated TTFT of the chosen placement."""
        return None if self.prefill is None else self.prefill.ttft_s

    def explain(self) -> str:
        """A human-readable table of the candidates and the choice."""
        lines = [f"request {self.request_id} policy={self.policy}: {self.why}"]
        lines.append(
            f"  {'prefill':<10} {'source':<10} {'cached':>8} {'queue_s':>8} "
            f"{'xfer_s':>8} {'prefill_s':>9} {'ttft_s':>8}"
        )
        for c in self.candidates:
            mark = "*" if c == self.prefill else " "
            lines.append(
                f" {mark}{c.label:<10} {c.cache_source:<10} {c.cached_tokens:>8} "
                f"{c.queue_s:>8.3f} {c.transfer_s:>8.3f} {c.prefill_s:>9.3f} {c.ttft_s:>8.3f}"
            )
        if any(c.overlap for c in self.candidates):
            lines.append(
                "  (fetches run beside the queue: ttft_s = max(queue_s, xfer_s) + prefill_s)"
            )
        if self.num_candidates > len(self.candidates):
            more = self.num_candidates - len(self.candidates)
            lines.append(f"  (+{more} prefill candidate(s) not listed: none beats the choice)")
        for d in self.decode_candidates:
            mark = "*" if d == self.decode else " "
            lines.append(
                f" {mark}{d.instance_id:<10} running={d.num_running} "
                f"context={d.context_tokens} est_tbt_s={d.est_tbt_s:.4f}"
            )
        if self.num_decode_candidates > len(self.decode_candidates):
            more = self.num_decode_candidates - len(self.decode_candidates)
            lines.append(f"  (+{more} decode instance(s) not listed: none beats the choice)")
        if not self.accepted:
            lines.append(f"  REJECTED: {self.reject_reason}")
        for r in self.replications:
            lines.append(
                f"  replicate {len(r.block_hashes)} blocks {r.source} -> {r.target} ({r.reason})"
            )
        return "\n".join(lines)
