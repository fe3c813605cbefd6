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

from halfmoon.conductor.admission import (
    DecodeTimes,
    decode_candidate,
    predicted_decode_candidate,
    rejection_reason,
)
from halfmoon.conductor.balancing import Balancer
from halfmoon.conductor.calibration import LatenessCalibration
from halfmoon.conductor.candidates import (
    Memo,
    least_ttft_candidates,
    local_candidates,
    remote_candidates,
)
from halfmoon.conductor.cluster import Cluster
from halfmoon.conductor.config import ConductorConfig
from halfmoon.conductor.cpp import (
    PipelineEstimator,
    cpp_groups,
    group_candidates,
    group_fetch_s,
    group_fetches,
    group_scale,
)
from halfmoon.conductor.lengths import PrefixDurations, prefix_root
from halfmoon.conductor.links import LinkBook
from halfmoon.conductor.loads import DecodeLoads, PrefillLoads
from halfmoon.conductor.messages import (
    Decision,
    DecodeCandidate,
    PrefillCandidate,
    RejectCode,
    ReplicationPlan,
)
from halfmoon.conductor.policies import COUPLED_ROUTERS, get_policy
from halfmoon.conductor.priorities import WHOLE_QUEUE, QueueView, UrgentShare
from halfmoon.conductor.replication import HotSpotPlanner
from halfmoon.conductor.state import DecodeState
from halfmoon.core.clock import Clock
from halfmoon.core.request import Request
from halfmoon.costmodel.base import CostModel
from halfmoon.costmodel.pipeline import PipelineEstimate

#: Seconds between two relaxations of the learned prefill scales (see
#: :meth:`Conductor._relax_calibration`).
RELAX_EVERY_S = 1.0


class Conductor(Cluster):
    """Global scheduler shared by the live system and the simulator (its books, events
    and membership: :class:`~halfmoon.conductor.cluster.Cluster`)."""

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
        super().__init__(cost_model, clock)
        self.config = config
        self.calibrate_prefill = config.prefill_calibration
        # How late first tokens reach clients against the decisions' TTFT estimates.
        self._lateness = (
            LatenessCalibration(stddevs=config.lateness_stddevs)
            if config.prefill_calibration
            else None
        )
        self._relaxed_at_s = float("-inf")
        self.policy = get_policy(config.policy)
        self.rng = rng if rng is not None else random.Random(0)
        self._cpp = PipelineEstimator(config)
        self._decode_times = DecodeTimes(config.decode_time_estimate_s)
        # Decode durations by the prompt's first block, and the placed requests' blocks.
        self._by_prefix = PrefixDurations() if config.decode_time_by_prefix else None
        self._root_of: dict[str, int] = {}
        self._round_robin = 0
        self._hot = HotSpotPlanner(
            config.hot_min_requests, config.hot_window_s, config.hot_max_replicas
        )
        self._balancer = Balancer(
            config.kvcache_balancing_threshold, config.balancing == "adaptive"
        )
        # Planned transfers per instance link (config.prices_links; links.py).
        self._links = LinkBook() if config.prices_links else None
        # Summaries for pruned decisions, rebuilt lazily whenever the instances change.
        self._loads: PrefillLoads | None = None
        self._decode_loads: DecodeLoads | None = None
        self._alive = 0  # the index's slot mask of the disaggregated prefill instances
        # Prefill seconds placed per priority, recently (priorities.py; idle under fcfs).
        self._urgent = UrgentShare()

    # -- the books' hooks (halfmoon.conductor.cluster) ------------------------------------
    def _instances_changed(self) -> None:
        super()._instances_changed()
        if self._loads is not None:
            self._loads.detach()
        self._loads = self._decode_loads = None

    def _prefill_finished(self, request_id: str, now_s: float) -> None:
        self._balancer.prefill_finished(request_id, now_s)

    def _decode_started(self, request_id: str, now_s: float) -> None:
        self._balancer.decode_started(request_id, now_s)

    def _first_token(self, request_id: str, now_s: float) -> None:
        if self._lateness is not None:
            self._lateness.first_token(request_id, now_s)

    def _finished(self, request_id: str, decode_s: float | None) -> None:
        self._balancer.forget(request_id)
        root = self._root_of.pop(request_id, None)
        if root is not None and decode_s is not None and self._by_prefix is not None:
            self._by_prefix.observe(root, decode_s)
        if self._lateness is not None:
            self._lateness.forget(request_id)
        if decode_s is not None:
            self._decode_times.observe(decode_s)

    def remove_instance(self, instance_id: str) -> None:
        super().remove_instance(instance_id)
        if self._links is not None:
            self._links.forget(instance_id)
        if self._lateness is not None:
            self._lateness.retain(self._placements)
        for rid in self._root_of.keys() - self._placements.keys():
            del self._root_of[rid]  # dropped with the instance: no duration to learn

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self._root_of.keys() <= self._placements.keys(), "prefix of no placement"
        if self._lateness is not None:
            pending = self._lateness.pending.keys()
            assert pending <= self._placements.keys(), "first token of no placement"

    def _touched(self, instance_id: str) -> None:
        if self._decode_loads is not None:
            self._decode_loads.touch(instance_id)

    @property
    def prefill_calibration(self) -> dict[str, dict[str, float]]:
        """Each prefill instance's learned prefill scale and its evidence (empty when
        ``prefill_calibration`` is off): ``{instance: {scale, samples}}``."""
        return {
            iid: {"scale": state.calibration.scale, "samples": state.calibration.samples}
            for iid, state in self._prefill.items()
            if state.calibration is not None
        }

    def _relax_calibration(self) -> None:
        """At most once a second: let each learned prefill scale drift back toward 1 for
        the time it has had no sample (a Conductor that rejects everything after a bad
        spell would otherwise never learn that it is over)."""
        if not self.calibrate_prefill:
            return
        now = self.clock.now()
        if now - self._relaxed_at_s < RELAX_EVERY_S:
            return
        self._relaxed_at_s = now
        for state in self._prefill.values():
            state.relax(now)

    @property
    def ttft_lateness_s(self) -> float:
        """Seconds added to every TTFT estimate held against the SLO: how much later than
        estimated first tokens have reached clients, their mean plus
        ``config.lateness_stddevs`` standard deviations (0 with calibration off)."""
        return 0.0 if self._lateness is None else self._lateness.at(self.clock.now())

    @property
    def ttft_lateness_spread(self) -> dict[str, float]:
        """The learned lateness's parts, as of its last sample: ``mean_s``, ``std_s``,
        ``stddevs`` (empty with calibration off)."""
        late = self._lateness
        if late is None:
            return {}
        return {"mean_s": late.mean_s, "std_s": late.std_s, "stddevs": late.stddevs}

    @property
    def lateness_samples(self) -> int:
        """First tokens the lateness was learned from."""
        return 0 if self._lateness is None else self._lateness.samples

    @property
    def decode_time_estimate_s(self) -> float | None:
        """The mean decode duration t_d of the prediction (configured or learned)."""
        return self._decode_times.mean_s

    # -- placement -------------------------------------------------------------------------
    def prefill_candidates(self, request: Request) -> list[PrefillCandidate]:
        """Every placement considered for ``request``: single instances (the policy's
        choice), then CPP groups (``group`` set) for long prompts when configured."""
        ids = self.prefill_instances
        matched = self.index.match(request.block_hashes[: request.num_full_blocks], ids)
        memo: Memo = {}
        now = self.clock.now()
        view = self._queue_view(request)
        local = local_candidates(request, self._prefill, ids, matched, now, memo, view)
        out = local
        if self.policy.uses_remote_prefixes and local:
            threshold = self._balancer.decision_threshold()
            out = local + remote_candidates(
                request, self._prefill, local, matched, threshold, memo, self._links, now,
                self.config.overlaps_fetches,
            )  # fmt: skip
        cfg = self.config
        groups = cpp_groups(ids, cfg.cpp_stages)
        if groups and request.input_length >= cfg.cpp_min_tokens:
            now = self.clock.now()
            remote = self.policy.uses_remote_prefixes
            out += group_candidates(
                request, groups, self._prefill, matched, now, self._cpp, remote, self._links,
                view,
            )  # fmt: skip
        return out

    @property
    def priorities(self) -> dict[str, object]:
        """How the queue estimates follow request priorities: on or off, and the work
        placed per priority recently (:meth:`UrgentShare.summary`; empty until a request
        of a priority other than 0 came)."""
        return {
            "estimates": self.config.priority_estimates,
            **self._urgent.summary(self.clock.now(), self._num_queues),
        }

    @property
    def _num_queues(self) -> int:
        """The instances whose time the urgent share is a share of: the prefill ones (the
        coupled ones in a coupled cluster)."""
        return len(self.prefill_instances) or len(self.coupled_instances)

    def _queue_view(self, request: Request) -> QueueView:
        """How ``request`` sees the prefill queues (:mod:`halfmoon.conductor.priorities`;
        with ``priority_estimates`` off, whole, as under ``fcfs``)."""
        if not self.config.priority_estimates:
            return WHOLE_QUEUE
        return self._urgent.view(self.clock.now(), request.priority, self._num_queues)

    def _pruned_candidates(self, request: Request) -> tuple[list[PrefillCandidate], int]:
        """What :meth:`prefill_candidates` lists, pruned to those that can win under
        kvcache-centric and a few runners-up (:func:`least_ttft_candidates`), and the
        number of candidates considered. O(prefix + holders) Python work, not O(instances)."""
        if self._loads is None:
            self._loads = PrefillLoads([self._prefill[i] for i in self.prefill_instances])
            self._alive = self.index.mask(self._loads.ids)
        loads, cfg, now = self._loads, self.config, self.clock.now()
        hashes = request.block_hashes[: request.num_full_blocks]
        held = self.index.match_holders(hashes, self._alive)
        # Per decision (the balancer may change it), asked when prefill_candidates would be.
        threshold = self._balancer.decision_threshold() if loads.ids else 0.0
        memo: Memo = {}
        view = self._queue_view(request)
        out, num = least_ttft_candidates(
            request, loads, held, threshold, now, memo, self._links, cfg.overlaps_fetches, view
        )
        groups = cpp_groups(loads.ids, cfg.cpp_stages)
        if groups and request.input_length >= cfg.cpp_min_tokens:
            matched = dict.fromkeys(loads.ids, 0) | held
            groups_out = group_candidates(
                request, groups, self._prefill, matched, now, self._cpp, True, self._links, view
            )
            out += groups_out
            num += len(groups_out)
        return out, num

    def _decode_choice(
        self, request: Request, ready_s: float, exhaustive: bool
    ) -> tuple[DecodeCandidate, list[DecodeCandidate]]:
        """The decode instance with the least estimated TBT (ties: the earlier instance)
        and the candidates evaluated: every instance; or (snapshot estimates, a shared
        monotone cost model) only those whose lower bound can beat the best so far; or
        (prediction) every instance at once as arrays, keeping the best few."""
        if self._decode_loads is None:
            self._decode_loads = DecodeLoads([self._decode[d] for d in self.decode_instances])
        loads = self._decode_loads
        predict = self.config.early_reject == "predict"
        if predict and not exhaustive:
            now = self.clock.now()
            chosen = loads.forecast.choose(
                request, now, ready_s, self._decode_times, self.config.decode_kv_booking
            )
            if chosen is not None:
                return chosen
        if exhaustive or predict or not loads.usable:
            decodes = [
                self._decode_candidate(request, self._decode[d], ready_s)
                for d in self.decode_instances
            ]
            return min(decodes, key=lambda d: d.est_tbt_s), decodes
        evaluated = loads.best(
            request.input_length, lambda dstate: self._decode_candidate(request, dstate, ready_s)
        )
        rank = loads.rank
        best = min(evaluated, key=lambda d: (d.est_tbt_s, rank[d.instance_id]))
        evaluated.sort(key=lambda d: rank[d.instance_id])
        return best, evaluated

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
        if self.config.early_reject == "predict":
            now = self.clock.now()
            return predicted_decode_candidate(
                request, dstate, now, ready_s, self._decode_times, self.config.decode_kv_booking
            )
        return decode_candidate(request, dstate)

    def _rejection(
        self, request: Request, chosen: PrefillCandidate, decode: DecodeCandidate | None,
        ttft_s: float,
    ) -> tuple[str, str]:  # fmt: skip
        dstate = None if decode is None else self._decode[decode.instance_id]
        now = self.clock.now()
        return rejection_reason(self.config, request, chosen, decode, dstate, now, ttft_s)

    def _held_ttft(self, chosen: PrefillCandidate) -> tuple[float, str]:
        """The TTFT held against the SLO for ``chosen`` (its estimate plus the learned
        lateness) and how the decision's explanation says so."""
        late = self.ttft_lateness_s
        note = f", {late:.3f}s of it learned lateness" if late else ""
        return chosen.ttft_s + late, note

    def schedule(self, request: Request, *, exhaustive: bool = False) -> Decision:
        """Place ``request`` on a prefill and a decode instance, or reject it (a
        prefill-only request: on a prefill instance alone, ``Decision.decode`` None).

        The decision is the same with or without ``exhaustive``; without it, instances
        that cannot win are pruned (kvcache-centric; snapshot decode estimates) and
        ``Decision.candidates`` lists the best few (``num_candidates`` counts them all)."""
        policy = self.policy.name
        self._relax_calibration()
        if exhaustive or policy != "kvcache-centric":
            candidates = self.prefill_candidates(request)
            num_candidates = len(candidates)
        else:
            candidates, num_candidates = self._pruned_candidates(request)
        if request.prefill_only:  # answered by the instance that computes it: no CPP group
            candidates = [c for c in candidates if not c.group]
        if not candidates or not (request.prefill_only or self.decode_instances):
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
        ttft_s, note = self._held_ttft(chosen)
        ready_s = self.clock.now() + ttft_s
        decode: DecodeCandidate | None = None
        decodes: list[DecodeCandidate] = []
        then = "prefill only"
        if not request.prefill_only:
            decode, decodes = self._decode_choice(request, ready_s, exhaustive)
            then = f"decode {decode.instance_id} (est TBT {decode.est_tbt_s * 1e3:.1f}ms)"
        counts = {
            "num_candidates": num_candidates,
            "num_decode_candidates": 0 if decode is None else len(self.decode_instances),
        }
        why = (
            f"{policy}: {chosen.label} (prefix from {chosen.cache_source}, "
            f"est TTFT {ttft_s:.3f}s{note}); {then}"
        )
        code, reason = self._rejection(request, chosen, decode, ttft_s)
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
                **counts,
            )
        replications = self._commit(request, chosen, "" if decode is None else decode.instance_id,
                                    ready_s)  # fmt: skip
        self._observe_placement(request, chosen, candidates)
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
            **counts,
        )

    @property
    def balancing(self) -> dict[str, object]:
        """The cache-balancing threshold in use and how it was learned
        (:class:`~halfmoon.conductor.balancing.Balancer`); with link pricing, also the
        longest backlog booked on an instance's link, in seconds from now."""
        state = self._balancer.state()
        if self._links is not None:
            backlog = self._links.state(self.clock.now()).values()
            state["max_link_backlog_s"] = round(max(backlog, default=0.0), 6)
        return state

    def _observe_placement(
        self, request: Request, chosen: PrefillCandidate, candidates: Sequence[PrefillCandidate]
    ) -> None:
        """Hand the adaptive balancer what this placement assumed (single instances)."""
        if not self._balancer.adaptive or chosen.group:
            return
        local = [c.ttft_s for c in candidates if not c.group and not c.is_remote]
        best_local = min(local, default=chosen.ttft_s)
        fraction = None
        if chosen.is_remote:
            hashes = request.block_hashes[: request.num_full_blocks]
            own = self.index.match(hashes, (chosen.instance_id,))[chosen.instance_id]
            own_tokens = min(own * request.block_size_tokens, chosen.cached_tokens)
            fraction = (chosen.cached_tokens - own_tokens) / request.input_length
        self._balancer.placed(
            request.request_id, self.clock.now(), chosen.ttft_s, fraction, best_local
        )

    def route_coupled(self, request: Request) -> Decision:
        """Pick a coupled instance by the configured router, or reject the request early
        when the chosen instance would miss its SLOs (``early_reject``, as for
        disaggregated placement)."""
        ids = self.coupled_instances
        router = self.config.coupled_router
        self._relax_calibration()
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
        cands = local_candidates(
            request, self._prefill, ids, matched, self.clock.now(), {}, self._queue_view(request)
        )

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
        ttft_s, note = self._held_ttft(chosen)
        ready_s = self.clock.now() + ttft_s
        decode = self._decode_candidate(request, self._decode[chosen.instance_id], ready_s)
        code, reason = self._rejection(request, chosen, decode, ttft_s)
        if code:
            return Decision(
                request_id=request.request_id, policy=router, accepted=False, prefill=chosen,
                decode=decode, reject_reason=reason, candidates=tuple(cands),
                why=f"{router}: {chosen.instance_id} (est TTFT {ttft_s:.3f}s{note})",
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
        """Book the placement and plan any replication it calls for (a prefill-only
        request books no decode instance: it is placed with ``decode_id`` "")."""
        rid = request.request_id
        if request.prefill_only:
            decode_id = ""
        if rid in self._placements:  # placed again under the same id: drop the old booking
            self._finish(rid, self.clock.now(), sample=False)
        if self._lateness is not None:  # the estimate its first token will be held against
            self._lateness.placed(rid, self.clock.now(), chosen.ttft_s)
        new_tokens = request.input_length - chosen.cached_tokens
        if chosen.group:
            # Member s is held from the pipeline's start until its last chunk is done
            # (with link books, from the fetch's start, as a single instance is).
            cm = self._prefill[chosen.instance_id].cost_model
            est = self._cpp.estimate(cm, new_tokens, chosen.cached_tokens)
            fetch_s = 0.0 if self._links is None else chosen.transfer_s
            scale = group_scale(self._prefill, chosen.group)
            for member, held_s in zip(chosen.group, est.stage_end_s, strict=True):
                self._prefill[member].add(
                    rid, fetch_s + held_s * scale, new_tokens, priority=request.priority
                )
            self._group_of[rid] = chosen.group
            if self._links is not None:
                self._book_group_links(request, chosen, decode_id, est)
        else:
            state = self._prefill[chosen.instance_id]
            # Its busy time (announced after any fetch) calibrates the instance against
            # the cost model's own estimate.
            estimated_s = chosen.prefill_s / state.prefill_scale
            booked_s = chosen.prefill_s
            if self._links is not None and not chosen.overlap:  # the fetch holds it too
                booked_s += chosen.transfer_s
            state.add(
                rid, booked_s, new_tokens, estimated_s, request.input_length, request.priority
            )
            if self._links is not None:
                self._book_links(request, chosen, decode_id, ready_s)
        if decode_id:
            dstate = self._decode[decode_id]
            dstate.incoming[rid] = (ready_s, request.input_length)
            if self._by_prefix is not None and (root := prefix_root(request)) is not None:
                self._root_of[rid] = root
                if (predicted_s := self._by_prefix.predict(root)) is not None:
                    dstate.predicted_s[rid] = predicted_s
            if self._decode_loads is not None:
                self._decode_loads.touch(decode_id)
        self._urgent.placed(self.clock.now(), request.priority, chosen.prefill_s)
        self._placements[rid] = (chosen.instance_id, decode_id)
        if chosen.is_remote:
            self._sources[rid] = chosen.cache_source
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
                if self._links is not None:
                    cm = self._prefill[hot.source].cost_model
                    num_bytes = len(hot.block_hashes) * block * cm.kv_bytes_per_token
                    self._links.reserve(
                        self.clock.now(), cm.transfer_time_s(num_bytes), hot.source, hot.target
                    )
        return tuple(plans)

    def _book_group_links(
        self, request: Request, chosen: PrefillCandidate, decode_id: str, est: PipelineEstimate
    ) -> None:
        """Book a CPP group's transfers as :meth:`_book_links` does a single instance's:
        each member's share of a remote prefix (one after another from the source, once
        the group's queue is through), then each stage's hand-off of its layers' KV to
        decode, of which what its compute cannot hide is left at the stage's end."""
        links = self._links
        assert links is not None
        now, group = self.clock.now(), chosen.group
        cm = self._prefill[chosen.instance_id].cost_model
        start_s = now + chosen.queue_s
        if chosen.is_remote:
            block = request.block_size_tokens
            num_blocks = -(-chosen.cached_tokens // block)  # cached is capped at prompt - 1
            hashes = request.block_hashes[: request.num_full_blocks]
            matched = self.index.match(hashes, group)
            fetches = group_fetches(request, group, chosen.cache_source, num_blocks, matched, cm)
            group_fetch_s(fetches, chosen.cache_source, start_s, links, book=True)
            start_s += chosen.transfer_s
        share_s = cm.transfer_time_s(request.input_length * cm.kv_bytes_per_token / len(group))
        for s, member in enumerate(group):
            compute_s = est.stage_end_s[s] - est.stage_start_s[s]
            links.reserve(start_s + est.stage_end_s[s], share_s - compute_s, member, decode_id)

    def _book_links(
        self, request: Request, chosen: PrefillCandidate, decode_id: str, ready_s: float
    ) -> None:
        """Book a single-instance placement's transfers: the prefix fetch (it starts when
        the queue is through, or with ``overlap`` now, and both links are free: the
        candidate's transfer time ends it), and the KV hand-off to decode. The hand-off
        streams layer by layer during the prefill; only what the compute cannot hide,
        ``transfer(prompt) - prefill``, is left on the links at its end (the simulator's
        tail when the link is the bound)."""
        links = self._links
        assert links is not None
        now, p = self.clock.now(), chosen.instance_id
        if chosen.is_remote:
            ready = now if chosen.overlap else now + chosen.queue_s
            fetch_s = chosen.transfer_s - links.wait_s(ready, chosen.cache_source, p)
            links.reserve(ready, fetch_s, chosen.cache_source, p)
        if not decode_id:  # prefill only: no hand-off
            return
        cm = self._prefill[p].cost_model
        stream_s = cm.transfer_time_s(request.input_length * cm.kv_bytes_per_token)
        links.reserve(ready_s, stream_s - chosen.prefill_s, p, decode_id)
