"""The cluster simulator: simulated instances driven by the real Conductor.

:class:`Simulator` builds the instances of a :class:`~halfmoon.sim.config.ClusterSpec`,
registers them with a :class:`~halfmoon.conductor.Conductor` that reads the simulator's
clock, and replays requests: each arrival asks the Conductor for a placement
(``schedule`` for a disaggregated cluster, ``route_coupled`` for a coupled one) and hands
the request to the chosen instances, which report back to the Conductor with the same
events a live worker would send. Deterministic for a seed (the Conductor's random
policy draws from ``random.Random(seed)``, step jitter from a generator of its own
seeded from it; same-time events fire in scheduling order).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from halfmoon.conductor.conductor import Conductor
from halfmoon.conductor.config import ConductorConfig
from halfmoon.conductor.messages import Decision, ReplicationPlan
from halfmoon.core.clock import ManualClock
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import Request
from halfmoon.costmodel.base import CostModel
from halfmoon.costmodel.pipeline import hidden_bytes_per_token
from halfmoon.costmodel.speculation import NO_SPECULATION
from halfmoon.metrics.records import RequestRecord
from halfmoon.metrics.report import summarize, summarize_by_priority
from halfmoon.sim.cache import InstanceCache
from halfmoon.sim.config import InstanceSpec, SimConfig
from halfmoon.sim.coupled import CoupledInstance
from halfmoon.sim.cpp import CPPRun
from halfmoon.sim.decode import DecodeInstance
from halfmoon.sim.events import NO_EVENTS, Event, EventLoop
from halfmoon.sim.host import Host
from halfmoon.sim.job import Job
from halfmoon.sim.loadtrace import DecodeLoadSampler
from halfmoon.sim.prefill import PrefillInstance
from halfmoon.sim.replan import ReplanConfig, Replanner


@dataclass
class SimResult:
    """Per-request records and the run report (``halfmoon.metrics.summarize`` keys plus
    the simulator's own, see :meth:`Simulator.run`)."""

    records: list[RequestRecord]
    report: dict[str, Any]


def _capacity_blocks(tokens: int | None, block_size_tokens: int) -> int | None:
    return None if tokens is None else tokens // block_size_tokens


class Simulator:
    """One simulated cluster and its Conductor; :meth:`run` replays a workload once.

    Every instance is built from ``instance_spec``
    (:meth:`InstanceSpec.for_config <halfmoon.sim.config.InstanceSpec.for_config>` of
    ``config`` and ``cost_model``); ``seed`` (keyword-only) seeds the Conductor's random
    policy and the step jitter."""

    def __init__(
        self,
        config: SimConfig,
        conductor_config: ConductorConfig,
        cost_model: CostModel,
        *,
        seed: int = 0,
        replan: ReplanConfig | None = None,
    ) -> None:
        self.config = config
        self.cost_model = cost_model
        self.clock = ManualClock()
        self.loop = EventLoop(self.clock)
        self.conductor = Conductor(conductor_config, cost_model, self.clock, random.Random(seed))
        # Step jitter has its own stream: turning it on leaves the Conductor's draws alone.
        self._step_rng = random.Random(f"step-jitter-{seed}")
        self.host = None
        if config.host_cores is not None:
            self.host = Host(config.host_cores, config.serving.background_cpu_s_per_token)
        self.block_size_tokens = conductor_config.block_size_tokens
        self.prefill: dict[str, PrefillInstance] = {}
        self.decode: dict[str, DecodeInstance] = {}
        self.coupled: dict[str, CoupledInstance] = {}
        self.records: list[RequestRecord] = []
        self._priority_of: dict[str, int] = {}  # requests of a priority other than 0
        self.num_rejected_early = 0
        self.num_replications = 0
        self.num_replicated_blocks = 0
        self.num_cpp_prefills = 0
        self._requests: Iterator[Request] = iter(())
        self._on_arrival: Callable[[], None] | None = None
        self._build()
        self.decode_load = DecodeLoadSampler(self.decode)
        self.replanner: Replanner | None = None
        #: Instances draining before a role change -> their new role ("P" or "D").
        self._moving: dict[str, str] = {}
        self.role_changes: list[dict[str, Any]] = []
        if replan is not None:
            self._start_replanning(replan)

    def _build(self) -> None:
        spec = self.config.cluster
        stages = self.conductor.config.cpp_stages
        if stages > 1 and (spec.coupled or spec.num_prefill < stages):
            raise HalfmoonError(
                f"{stages} CPP stages need at least {stages} prefill instances in a "
                f"disaggregated cluster, got {spec}"
            )
        self._cpp_hidden_bytes = 0
        if stages > 1:
            try:
                self._cpp_hidden_bytes = hidden_bytes_per_token(
                    self.cost_model, self.conductor.config.cpp_hidden_bytes_per_token
                )
            except ValueError as exc:
                raise HalfmoonError(str(exc)) from None
        self.instance_spec = InstanceSpec.for_config(self.config, self.cost_model)
        for i in range(1, spec.num_prefill + 1):
            self._add_prefill(f"P{i}")
        for i in range(1, spec.num_decode + 1):
            self._add_decode(f"D{i}")
        for i in range(1, spec.num_coupled + 1):
            self._add_coupled(f"M{i}")

    # -- re-planning: role changes ---------------------------------------------------------
    def _start_replanning(self, replan: ReplanConfig) -> None:
        spec = self.config.cluster
        if spec.coupled or self.conductor.config.cpp_stages > 1:
            raise HalfmoonError("re-planning moves disaggregated instances, without CPP groups")
        self.replanner = Replanner(
            replan, self.config, self.conductor.config, self.cost_model, spec.num_instances
        )
        self._next_index = {"P": spec.num_prefill + 1, "D": spec.num_decode + 1}

    @property
    def planned_prefill(self) -> int:
        """Prefill instances once the moves under way are done."""
        to_decode = sum(1 for role in self._moving.values() if role == "D")
        return len(self.prefill) - to_decode + (len(self._moving) - to_decode)

    def _replan(self, now_s: float) -> None:
        """A re-planning round: drain the instances that change role."""
        assert self.replanner is not None
        target = self.replanner.target(now_s, self.planned_prefill)
        if target is None:
            return
        moves = target - self.planned_prefill
        if moves < 0:  # prefill -> decode: the least queued first
            pool = [i for i in self.conductor.prefill_instances]
            pool.sort(key=self.conductor.queue_s)
            new_role = "D"
        else:
            pool = list(self.conductor.decode_instances)
            pool.sort(key=lambda i: self.decode[i].num_running + self.decode[i].num_waiting)
            new_role = "P"
        for iid in pool[: min(abs(moves), len(pool) - 1)]:  # a role keeps one instance
            self.conductor.drain(iid)
            self._moving[iid] = new_role

    def _change_roles(self, now_s: float) -> None:
        """Instances drained and idle (nothing placed uses them, links free) change role."""
        for iid, role in list(self._moving.items()):
            old = self.prefill.get(iid) or self.decode.get(iid)
            assert old is not None
            if self.conductor.busy(iid) or old.nic.free_at_s > now_s:
                continue
            if isinstance(old, DecodeInstance) and (old.num_running or old.num_waiting):
                continue
            if isinstance(old, PrefillInstance) and (old.queue_length or old.busy):
                continue
            self.conductor.remove_instance(iid)
            self.prefill.pop(iid, None)
            self.decode.pop(iid, None)
            del self._moving[iid]
            new_id = f"{role}{self._next_index[role]}"
            self._next_index[role] += 1
            (self._add_prefill if role == "P" else self._add_decode)(new_id)
            self.role_changes.append({"time_s": round(now_s, 3), "from": iid, "to": new_id})

    def _add_prefill(self, iid: str) -> None:
        cfg = self.config
        notify = self.conductor.handle
        cache = InstanceCache(
            iid,
            capacity_blocks=_capacity_blocks(cfg.cache_capacity_tokens, self.block_size_tokens),
            policy=cfg.cache_policy,
            notify=notify,
        )
        fetch = cfg.instance_prefix_fetch or self.conductor.config.prefix_fetch
        self.prefill[iid] = PrefillInstance(
            iid, self.instance_spec, cache=cache, clock=self.clock, notify=notify,
            host=self.host, overlap=fetch == "overlap",
        )  # fmt: skip
        self.conductor.add_prefill_instance(iid)

    def _add_decode(self, iid: str) -> None:
        self.decode[iid] = DecodeInstance(
            iid,
            self.instance_spec,
            clock=self.clock,
            notify=self.conductor.handle,
            rng=self._step_rng,
            host=self.host,
        )
        self.conductor.add_decode_instance(
            iid, kv_capacity_tokens=self.instance_spec.kv_capacity_tokens,
            speculation=NO_SPECULATION if self.config.speculation_blind
            else self.config.speculation,
        )  # fmt: skip

    def _add_coupled(self, iid: str) -> None:
        cfg = self.config
        kv_capacity = self.instance_spec.kv_capacity_tokens
        notify = self.conductor.handle
        cache = None
        if cfg.coupled_prefix_caching:
            tokens = cfg.coupled_cache_capacity_tokens
            cache = InstanceCache(
                iid,
                capacity_blocks=_capacity_blocks(
                    kv_capacity if tokens is None else tokens, self.block_size_tokens
                ),
                policy=cfg.cache_policy,
                notify=notify,
            )
        self.coupled[iid] = CoupledInstance(
            iid,
            self.instance_spec,
            clock=self.clock,
            notify=notify,
            cache=cache,
            rng=self._step_rng,
            host=self.host,
        )
        self.conductor.add_coupled_instance(iid, kv_capacity_tokens=kv_capacity)

    # -- arrivals and placement -----------------------------------------------------------
    def _next_arrival(self) -> Sequence[Event]:
        request = next(self._requests, None)
        if request is None:
            return NO_EVENTS
        if request.block_size_tokens != self.block_size_tokens:
            raise HalfmoonError(
                f"request {request.request_id} uses {request.block_size_tokens}-token blocks; "
                f"the Conductor is configured for {self.block_size_tokens}"
            )
        arrival_s = request.arrival_time_s / self.config.time_scale
        if arrival_s < self.clock.now():
            raise HalfmoonError(
                f"request {request.request_id} arrives at {request.arrival_time_s}s, before "
                "the previous one: the workload must be sorted by arrival time"
            )
        return (Event(arrival_s, lambda: self._arrive(request)),)

    def _arrive(self, request: Request) -> list[Event]:
        record = RequestRecord(
            request.request_id, self.clock.now(), request.input_length, request.output_length
        )
        self.records.append(record)
        if request.priority:
            self._priority_of[request.request_id] = request.priority
        self.decode_load.sample(record.arrival_s)
        if self.replanner is not None:
            now = record.arrival_s
            if self._moving:
                self._change_roles(now)
            self.replanner.observe(request, now)
            if self.replanner.due(now) and not self._moving:
                self._replan(now)
        if self._on_arrival is not None:
            self._on_arrival()
        job = Job(request, record)
        delay_s = self.config.serving.request_overhead_s
        if delay_s > 0:  # the serving path before placement delays only this request
            events = [Event(self.clock.now() + delay_s, lambda: self._place_any(job))]
        else:
            events = self._place_any(job)
        events.extend(self._next_arrival())
        return events

    def _place_any(self, job: Job) -> list[Event]:
        return list(self._place_coupled(job) if self.coupled else self._place(job))

    def _reject(self, job: Job, decision: Decision) -> None:
        job.record.rejected = True
        job.record.reject_reason = decision.reject_reason
        self.num_rejected_early += 1

    def _place(self, job: Job) -> list[Event]:
        decision = self.conductor.schedule(job.request)
        decode = decision.decode  # (None for a prefill-only request: answered by its prefill)
        if (
            not decision.accepted
            or decision.prefill is None
            or (decode is None and not job.request.prefill_only)
        ):
            self._reject(job, decision)
            return []
        chosen = decision.prefill
        job.prefill = self.prefill[chosen.instance_id]
        job.decode = None if decode is None else self.decode[decode.instance_id]
        job.cache_source = self.prefill[chosen.cache_source]
        job.planned_cached_blocks = -(-chosen.cached_tokens // self.block_size_tokens)
        if chosen.group:
            return self._place_group(job, chosen.group, decision.replications)
        others = []
        for plan in decision.replications:
            if chosen.is_remote and (plan.source, plan.target) == (
                chosen.cache_source,
                chosen.instance_id,
            ):
                job.keep_fetched = True  # the fetch itself makes the copy
            else:
                others.append(plan)
        events = list(job.prefill.submit(job))
        for plan in others:
            events.extend(self._replicate(plan))
        return events

    def _place_group(
        self, job: Job, group: Sequence[str], plans: Sequence[ReplicationPlan]
    ) -> list[Event]:
        """Queue a CPP request on every member of its group (see ``sim/cpp.py``)."""
        members = [self.prefill[m] for m in group]
        self.num_cpp_prefills += 1
        job.cpp = CPPRun(
            job,
            members,
            chunk_tokens=self.conductor.config.cpp_chunk_tokens,
            hidden_bytes_per_token=self._cpp_hidden_bytes,
            num_layers=self.config.num_layers,
        )
        events: list[Event] = []
        for member in members:
            events.extend(member.submit(job))
        for plan in plans:
            events.extend(self._replicate(plan))
        return events

    def _replicate(self, plan: ReplicationPlan) -> Sequence[Event]:
        source = self.prefill.get(plan.source)
        target = self.prefill.get(plan.target)
        if source is None or target is None or source is target:
            return NO_EVENTS

        def done(num_blocks: int) -> None:
            self.num_replications += 1
            self.num_replicated_blocks += num_blocks

        return source.replicate_to(target, plan.block_hashes, self.block_size_tokens, done)

    def _place_coupled(self, job: Job) -> Sequence[Event]:
        decision = self.conductor.route_coupled(job.request)
        if not decision.accepted or decision.prefill is None:
            self._reject(job, decision)
            return NO_EVENTS
        return self.coupled[decision.prefill.instance_id].submit(job)

    # -- running --------------------------------------------------------------------------
    def run(
        self, requests: Iterable[Request], on_arrival: Callable[[], None] | None = None
    ) -> SimResult:
        """Replay ``requests`` (sorted by arrival) to the end; ``on_arrival`` is called once
        per request (progress bars). Returns the records and the report: the
        :func:`~halfmoon.metrics.summarize` keys, then ``policy``, ``cluster``,
        ``early_reject``, ``time_scale``, ``num_rejected_early``,
        ``num_refused_after_prefill``, ``effective_request_capacity``, ``num_remote_fetches``,
        ``num_replications``, ``num_cpp_prefills`` (requests prefilled by a CPP group),
        ``num_events``, ``decode_load`` (the decode instances' load sampled at arrivals,
        :mod:`halfmoon.sim.loadtrace`), ``balancing`` (the cache-balancing threshold at the
        end and how it was learned); and ``by_priority`` when a request had a priority
        other than 0."""
        if self.records:
            raise HalfmoonError("a Simulator runs once; build a new one for another run")
        limit = self.config.max_requests
        self._requests = iter(requests) if limit is None else itertools.islice(requests, limit)
        self._on_arrival = on_arrival
        self.loop.schedule(self._next_arrival())
        self.loop.run()
        unfinished = [r.request_id for r in self.records if not r.rejected and r.finish_s is None]
        if unfinished:
            raise RuntimeError(f"simulation ended with {len(unfinished)} requests unfinished")
        return SimResult(self.records, self._report())

    def check_integrity(self) -> None:
        """Raise AssertionError if any instance's books are inconsistent (tests call it
        after a run, when every instance must also be idle)."""
        for instance in (*self.prefill.values(), *self.decode.values(), *self.coupled.values()):
            instance.check_integrity()
        for coupled in self.coupled.values():
            if coupled.cache is not None:
                coupled.cache.check_integrity()
        if not self.loop:
            assert all(d.num_running == 0 and d.num_waiting == 0 for d in self.decode.values())
            assert all(m.kv_used_tokens == 0 for m in self.coupled.values())

    def _report(self) -> dict[str, Any]:
        cfg = self.config
        conductor_cfg = self.conductor.config
        refused = sum(d.num_refused for d in self.decode.values())
        # A coupled instance refuses only requests that can never fit, before any prefill.
        rejected_early = self.num_rejected_early + sum(m.num_refused for m in self.coupled.values())
        report = summarize(
            self.records,
            cfg.slo,
            extra={
                "policy": conductor_cfg.coupled_router if self.coupled else conductor_cfg.policy,
                "cluster": str(cfg.cluster),
                "early_reject": "none" if self.coupled else conductor_cfg.early_reject,
                "time_scale": cfg.time_scale,
                "num_rejected_early": rejected_early,
                "num_refused_after_prefill": refused,
                "num_remote_fetches": sum(p.num_fetches for p in self.prefill.values()),
                "prefix_fetch": cfg.instance_prefix_fetch or conductor_cfg.prefix_fetch,
                "prefix_fetch_estimate": conductor_cfg.prefix_fetch,
                "num_replications": self.num_replications,
                "num_cpp_prefills": self.num_cpp_prefills,
                "num_events": self.loop.num_fired,
                "decode_load": self.decode_load.summary(),
                "role_changes": self.role_changes,
                "replans": None if self.replanner is None else self.replanner.summary(),
                "balancing": self.conductor.balancing,
                "prefill_calibration": self.conductor.prefill_calibration,
                "ttft_lateness_s": self.conductor.ttft_lateness_s,
            },
        )
        report["effective_request_capacity"] = report["slo_attainment"]
        if self._priority_of:
            report["by_priority"] = summarize_by_priority(
                self.records, self._priority_of, self.config.slo
            )
        return report


def simulate(
    requests: Iterable[Request],
    config: SimConfig,
    conductor_config: ConductorConfig,
    cost_model: CostModel,
    *,
    seed: int = 0,
    replan: ReplanConfig | None = None,
) -> SimResult:
    """Build a :class:`Simulator` and run ``requests`` through it once (``replan``:
    re-plan the P:D split as it runs, :mod:`halfmoon.sim.replan`)."""
    return Simulator(config, conductor_config, cost_model, seed=seed, replan=replan).run(requests)
