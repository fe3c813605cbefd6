"""The Conductor: places each request on a (prefill, decode) pair by estimated TTFT, or
rejects it before any prefill work when the SLOs cannot be met.

Per request (the paper's algorithm, see docs/conductor.md)::

    for each prefill instance p:
        local   = longest prefix of the request's blocks cached on p          (PrefixIndex)
        TTFT(p) = T_queue(p) + T_prefill(uncached tokens | cached prefix)
        if a remote instance holds a longer prefix, by more than
           kvcache_balancing_threshold x prompt, also consider
        TTFT(p <- remote) = T_queue(p) + T_transfer(missing blocks) + T_prefill(rest)
    pick a candidate by the policy (kvcache-centric: minimum TTFT)
    with CPP groups (cpp_stages > 1, long prompts): take the best group candidate
        instead when its TTFT is lower (see halfmoon.conductor.cpp)
    pick the decode instance with the lowest estimated TBT after admission
    early rejection: TTFT > SLO, or TBT (now, or predicted at prefill end) > SLO -> reject
    plan replication of remote prefixes and of hot prefixes

No torch, no sockets: it is driven by events and returns :class:`Decision` records.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from halfmoon.conductor.admission import decode_candidate, rejection_reason, uniform_decode_time_s
from halfmoon.conductor.candidates import Memo, local_candidates, remote_candidates
from halfmoon.conductor.config import ConductorConfig
from halfmoon.conductor.cpp import PipelineEstimator, cpp_groups, group_candidates
from halfmoon.conductor.index import PrefixIndex
from halfmoon.conductor.messages import (
    BlockEvicted,
    BlockStored,
    Decision,
    DecodeCandidate,
    DecodeStarted,
    LoadReport,
    PrefillCandidate,
    PrefillFinished,
    PrefillStarted,
    RejectCode,
    ReplicationPlan,
    RequestFinished,
)
from halfmoon.conductor.policies import COUPLED_ROUTERS, get_policy
from halfmoon.conductor.replication import HotSpotPlanner
from halfmoon.conductor.state import DecodeState, PrefillState, check_bookings
from halfmoon.core.clock import Clock
from halfmoon.core.request import Request
from halfmoon.costmodel.base import CostModel

Event = (
    BlockStored
    | BlockEvicted
    | PrefillStarted
    | PrefillFinished
    | DecodeStarted
    | RequestFinished
    | LoadReport
)
_TD_SMOOTHING = 0.05  # weight of a new observation in the moving average of t_d


class Conductor:
    """Global scheduler shared by the live system and the simulator."""

    def __init__(
        self,
        config: ConductorConfig,
        cost_model: CostModel,
        clock: Clock,
        rng: random.Random | None = None,
    ) -> None:
        if config.coupled_router not in COUPLED_ROUTERS:
            raise ValueError(
                f"unknown coupled router {config.coupled_router!r}; "
                f"choose from {', '.join(COUPLED_ROUTERS)}"
            )
        self.config = config
        self.policy = get_policy(config.policy)
        self.cost_model = cost_model
        self.clock = clock
        self.rng = rng if rng is not None else random.Random(0)
        self.index = PrefixIndex()
        self._prefill: dict[str, PrefillState] = {}
        self._decode: dict[str, DecodeState] = {}
        self._coupled: set[str] = set()
        self._placements: dict[str, tuple[str, str]] = {}
        self._group_of: dict[str, tuple[str, ...]] = {}
        self._cpp = PipelineEstimator(config)
        self._decode_time_s = config.decode_time_estimate_s
        self._round_robin = 0
        self._hot = HotSpotPlanner(
            config.hot_min_requests, config.hot_window_s, config.hot_max_replicas
        )

    # -- membership ----------------------------------------------------------------------
    def add_prefill_instance(self, instance_id: str, cost_model: CostModel | None = None) -> None:
        """Register a prefill instance (its own cost model, or the Conductor's)."""
        self._prefill[instance_id] = PrefillState(instance_id, cost_model or self.cost_model)
        self.index.add_instance(instance_id)

    def add_decode_instance(
        self,
        instance_id: str,
        cost_model: CostModel | None = None,
        kv_capacity_tokens: int | None = None,
    ) -> None:
        """Register a decode instance and its KV capacity in tokens."""
        cm = cost_model or self.cost_model
        capacity = cm.kv_capacity_tokens() if kv_capacity_tokens is None else kv_capacity_tokens
        self._decode[instance_id] = DecodeState(instance_id, cm, capacity)

    def add_coupled_instance(
        self,
        instance_id: str,
        cost_model: CostModel | None = None,
        kv_capacity_tokens: int | None = None,
    ) -> None:
        """Register an instance that does both prefill and decode (vLLM-like)."""
        self.add_prefill_instance(instance_id, cost_model)
        self.add_decode_instance(instance_id, cost_model, kv_capacity_tokens)
        self._coupled.add(instance_id)

    def remove_instance(self, instance_id: str) -> None:
        """Stop placing on ``instance_id``, forget its blocks, and drop what its requests
        had booked on other instances (they will be placed again, or fail)."""
        for rid, (prefill_id, decode_id) in list(self._placements.items()):
            members = self._group_of.get(rid, (prefill_id,))  # a CPP group: every stage
            if instance_id in (*members, decode_id):
                del self._placements[rid]
                self._group_of.pop(rid, None)
                for member in members:
                    if (state := self._prefill.get(member)) is not None:
                        state.finish(rid)
                if (dstate := self._decode.get(decode_id)) is not None:
                    dstate.finish(rid)  # no decode-time sample: it did not finish
        self._prefill.pop(instance_id, None)
        self._decode.pop(instance_id, None)
        self._coupled.discard(instance_id)
        self.index.remove_instance(instance_id)

    @property
    def num_placements(self) -> int:
        """Requests placed and not yet finished or released."""
        return len(self._placements)

    @property
    def prefill_instances(self) -> tuple[str, ...]:
        """Instances that accept prefill work (disaggregated ones only)."""
        return tuple(i for i in self._prefill if i not in self._coupled)

    @property
    def decode_instances(self) -> tuple[str, ...]:
        """Disaggregated decode instances."""
        return tuple(i for i in self._decode if i not in self._coupled)

    @property
    def coupled_instances(self) -> tuple[str, ...]:
        """Coupled instances."""
        return tuple(i for i in self._prefill if i in self._coupled)

    def queue_s(self, instance_id: str) -> float:
        """Estimated prefill queue time on an instance now."""
        return self._prefill[instance_id].queue_s(self.clock.now())

    @property
    def decode_time_estimate_s(self) -> float | None:
        """The uniform decode duration t_d used by prediction (configured or learned)."""
        return self._decode_time_s

    # -- events ----------------------------------------------------------------------------
    def handle(self, event: Event) -> None:
        """Apply one event from an instance."""
        now = self.clock.now()
        if isinstance(event, BlockStored):
            if event.instance_id in self._prefill:
                self.index.stored(event.instance_id, event.block_hash, event.tier)
        elif isinstance(event, BlockEvicted):
            self.index.evicted(event.instance_id, event.block_hash, event.tier)
        elif isinstance(event, PrefillStarted):
            if (state := self._prefill.get(event.instance_id)) is not None:
                state.start(event.request_id, now)
        elif isinstance(event, PrefillFinished):
            if (state := self._prefill.get(event.instance_id)) is not None:
                state.finish(event.request_id)
        elif isinstance(event, DecodeStarted):
            if (dstate := self._decode.get(event.instance_id)) is not None:
                dstate.start(event.request_id, now)
        elif isinstance(event, RequestFinished):
            self._finish(event.request_id, now)
        elif isinstance(event, LoadReport):
            self._apply_report(event)
        else:
            raise TypeError(f"unknown event {event!r}")

    def release(self, request_id: str) -> bool:
        """Drop whatever ``request_id`` still has booked (its gateway saw it end without a
        worker's RequestFinished: a failure before dispatch, a refusal, a hang-up).
        Idempotent; True when something was booked. No decode-time sample is taken."""
        booked = request_id in self._placements
        self._finish(request_id, self.clock.now(), sample=False)
        return booked

    def check_integrity(self) -> None:
        """Assert that placements and per-instance bookings agree both ways, and that each
        instance's totals equal the sum of its parts (tests and the service's ping)."""
        check_bookings(self._placements, self._group_of, self._prefill, self._decode)

    def _finish(self, request_id: str, now_s: float, sample: bool = True) -> None:
        prefill_id, decode_id = self._placements.pop(request_id, ("", ""))
        for member in self._group_of.pop(request_id, (prefill_id,)):
            if (state := self._prefill.get(member)) is not None:
                state.finish(request_id)
        if (dstate := self._decode.get(decode_id)) is not None:
            started = dstate.finish(request_id)
            if sample and started is not None and self.config.decode_time_estimate_s is None:
                sample = now_s - started
                old = self._decode_time_s
                self._decode_time_s = (
                    sample if old is None else old + _TD_SMOOTHING * (sample - old)
                )

    def _apply_report(self, report: LoadReport) -> None:
        if (state := self._prefill.get(report.instance_id)) is not None:
            state.report(report.queued_prefill_tokens, self.clock.now())
        dstate = self._decode.get(report.instance_id)
        if dstate is None:
            return
        dstate.reported_running = report.num_running
        dstate.reported_context_tokens = report.context_tokens
        if report.kv_capacity_tokens:
            dstate.kv_capacity_tokens = report.kv_capacity_tokens

    # -- placement -------------------------------------------------------------------------
    def prefill_candidates(self, request: Request) -> list[PrefillCandidate]:
        """Every placement considered for ``request``: single instances (the policy's
        choice), then CPP groups (``group`` set) for long prompts when configured."""
        ids = self.prefill_instances
        matched = self.index.match(request.block_hashes[: request.num_full_blocks], ids)
        memo: Memo = {}
        now = self.clock.now()
        local = local_candidates(request, self._prefill, ids, matched, now, memo)
        out = local
        if self.policy.uses_remote_prefixes and local:
            threshold = self.config.kvcache_balancing_threshold
            out = local + remote_candidates(request, self._prefill, local, matched, threshold, memo)
        cfg = self.config
        groups = cpp_groups(ids, cfg.cpp_stages)
        if groups and request.input_length >= cfg.cpp_min_tokens:
            now = self.clock.now()
            remote = self.policy.uses_remote_prefixes
            out += group_candidates(request, groups, self._prefill, matched, now, self._cpp, remote)
        return out

    def _choose(self, candidates: Sequence[PrefillCandidate]) -> PrefillCandidate:
        """The policy's single-instance choice, or a CPP group when it lowers TTFT."""
        chosen = self.policy.choose([c for c in candidates if not c.group], self.rng)
        groups = [c for c in candidates if c.group]
        if groups:
            best = min(groups, key=lambda c: c.ttft_s)
            if best.ttft_s < chosen.ttft_s:
                return best
        return chosen

    def _decode_candidate(
        self, request: Request, dstate: DecodeState, ready_s: float
    ) -> DecodeCandidate:
        predict = self.config.early_reject == "predict"
        t_d = uniform_decode_time_s(request, dstate, self._decode_time_s) if predict else 0.0
        return decode_candidate(request, dstate, ready_s, predict, t_d)

    def _rejection(
        self, request: Request, chosen: PrefillCandidate, decode: DecodeCandidate
    ) -> tuple[str, str]:
        dstate = self._decode[decode.instance_id]
        return rejection_reason(self.config, request, chosen, decode, dstate)

    def schedule(self, request: Request) -> Decision:
        """Place ``request`` on a prefill and a decode instance, or reject it."""
        policy = self.policy.name
        candidates = self.prefill_candidates(request)
        if not candidates or not self.decode_instances:
            return Decision(
                request_id=request.request_id,
                policy=policy,
                accepted=False,
                prefill=None,
                decode=None,
                reject_reason="no prefill or decode instance available",
                candidates=tuple(candidates),
                why="cluster has no capacity",
                reject_code=RejectCode.NO_INSTANCE,
            )
        chosen = self._choose(candidates)
        ready_s = self.clock.now() + chosen.ttft_s
        decodes = [
            self._decode_candidate(request, self._decode[d], ready_s) for d in self.decode_instances
        ]
        decode = min(decodes, key=lambda d: d.est_tbt_s)
        why = (
            f"{policy}: {chosen.label} (prefix from {chosen.cache_source}, "
            f"est TTFT {chosen.ttft_s:.3f}s); decode {decode.instance_id} "
            f"(est TBT {decode.est_tbt_s * 1e3:.1f}ms)"
        )
        code, reason = self._rejection(request, chosen, decode)
        if code:
            return Decision(
                request_id=request.request_id,
                policy=policy,
                accepted=False,
                prefill=chosen,
                decode=decode,
                reject_reason=reason,
                candidates=tuple(candidates),
                decode_candidates=tuple(decodes),
                why=why,
                reject_code=code,
            )
        replications = self._commit(request, chosen, decode.instance_id, ready_s)
        return Decision(
            request_id=request.request_id,
            policy=policy,
            accepted=True,
            prefill=chosen,
            decode=decode,
            candidates=tuple(candidates),
            decode_candidates=tuple(decodes),
            replications=replications,
            why=why,
        )

    def route_coupled(self, request: Request) -> Decision:
        """Pick a coupled instance by the configured router, or reject the request early
        when the chosen instance would miss its SLOs (``early_reject``, as for
        disaggregated placement)."""
        ids = self.coupled_instances
        router = self.config.coupled_router
        if not ids:
            return Decision(
                request_id=request.request_id,
                policy=router,
                accepted=False,
                prefill=None,
                decode=None,
                reject_reason="no coupled instance available",
                why="cluster has no capacity",
                reject_code=RejectCode.NO_INSTANCE,
            )
        matched = self.index.match(request.block_hashes[: request.num_full_blocks], ids)
        cands = local_candidates(request, self._prefill, ids, matched, self.clock.now(), {})

        def load(c: PrefillCandidate) -> tuple[float, int]:
            return (c.queue_s, self._decode[c.instance_id].num_running)

        # Ties (idle instances, no hit anywhere) go round the instances, not to the first:
        # candidates are tried in an order that starts one further each time.
        turn = self._round_robin % len(cands)
        self._round_robin += 1
        rotated = cands[turn:] + cands[:turn]
        if router == "round-robin":
            chosen = rotated[0]
        elif router == "least-load":
            chosen = min(rotated, key=load)
        elif router == "kvcache-centric":
            chosen = min(rotated, key=lambda c: (c.ttft_s, *load(c)))
        else:
            chosen = min(rotated, key=lambda c: (-c.cached_tokens, *load(c)))
        ready_s = self.clock.now() + chosen.ttft_s
        decode = self._decode_candidate(request, self._decode[chosen.instance_id], ready_s)
        code, reason = self._rejection(request, chosen, decode)
        if code:
            return Decision(
                request_id=request.request_id, policy=router, accepted=False, prefill=chosen,
                decode=decode, reject_reason=reason, candidates=tuple(cands),
                why=f"{router}: {chosen.instance_id} (est TTFT {chosen.ttft_s:.3f}s)",
                reject_code=code,
            )  # fmt: skip
        self._commit(request, chosen, chosen.instance_id, ready_s)
        return Decision(
            request_id=request.request_id,
            policy=router,
            accepted=True,
            prefill=chosen,
            decode=decode,
            candidates=tuple(cands),
            decode_candidates=(decode,),
            why=f"{router}: {chosen.instance_id} (cached {chosen.cached_tokens} tokens)",
        )

    def _commit(
        self, request: Request, chosen: PrefillCandidate, decode_id: str, ready_s: float
    ) -> tuple[ReplicationPlan, ...]:
        """Book the placement and plan any replication it calls for."""
        rid = request.request_id
        if rid in self._placements:  # placed again under the same id: drop the old booking
            self._finish(rid, self.clock.now(), sample=False)
        new_tokens = request.input_length - chosen.cached_tokens
        if chosen.group:
            # Member s is held from the pipeline's start until its last chunk is done.
            cm = self._prefill[chosen.instance_id].cost_model
            est = self._cpp.estimate(cm, new_tokens, chosen.cached_tokens)
            for member, held_s in zip(chosen.group, est.stage_end_s, strict=True):
                self._prefill[member].add(rid, held_s, new_tokens)
            self._group_of[rid] = chosen.group
        else:
            self._prefill[chosen.instance_id].add(rid, chosen.prefill_s, new_tokens)
        self._decode[decode_id].incoming[rid] = (ready_s, request.input_length)
        self._placements[rid] = (chosen.instance_id, decode_id)
        block = request.block_size_tokens
        num_cached_blocks = chosen.cached_tokens // block
        prefix = request.block_hashes[:num_cached_blocks]
        plans = []
        # A group's members fetch only their layers' share: no full copy to plan.
        if chosen.is_remote and self.config.replicate_remote_prefixes and not chosen.group:
            missing = [h for h in prefix if not self.index.holds(chosen.instance_id, h)]
            plans.append(
                ReplicationPlan(
                    chosen.cache_source, chosen.instance_id, tuple(missing), "remote prefix"
                )
            )
        if chosen.instance_id not in self._coupled:
            hot = self._hot.observe(
                self.clock.now(), prefix, self.index, self.prefill_instances, self.queue_s
            )
            if hot is not None:
                plans.append(hot)
        return tuple(plans)
