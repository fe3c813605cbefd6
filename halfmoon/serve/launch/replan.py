"""Re-planning a live cluster: move workers between the prefill and decode roles as the
workload shifts (``halfmoon serve --replan``).

A :class:`LiveReplanner` runs beside the gateway. Every ``interval_s`` it asks the
Conductor for the requests it placed in the last ``window_s`` (``workload_query``:
arrival times, prompt and output lengths, block hashes) and for what a simulation of
the cluster needs (a worker's measured cost profile, the decode KV pool, the Conductor's
settings), and hands them to the simulator's :class:`~halfmoon.sim.replan.Replanner`:
it replays the window on the current split and its neighbours and says whether one wins
by more than ``margin`` in goodput. A move is carried out by a :class:`RoleMover`:

- :class:`LocalMover` (the local launcher): the worker leaving its role is drained (the
  Conductor places nothing more on it and tells it to exit once idle; its requests
  finish), and once it has exited a new worker of the other role starts in its place;
- :class:`halfmoon.deploy.replan.PoolMover` (the Ray deployment): the deployment's
  controller resizes both pools, which drains the leaving worker the same way.

Hysteresis: no round runs while a move is in progress (a drain, a start) or while any
instance drains, and after a move the Replanner's ``cooldown_s`` holds, so the window
shows the new split at work before the next decision.

The simulations run in a separate process (spawned once), so neither the gateway's
event loop nor its interpreter lock waits on them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from halfmoon.conductor.config import ConductorConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import Request
from halfmoon.costmodel import CostProfile, ProfileCostModel
from halfmoon.costmodel.base import CostModel
from halfmoon.serve.control.messages import WorkloadWindow
from halfmoon.sim.config import ClusterSpec, SimConfig
from halfmoon.sim.replan import ReplanConfig, Replanner

log = logging.getLogger("replan")

#: Bandwidth assumed between workers in the simulated cluster (as the Conductor's).
LINK_BYTES_PER_S = 1e9
#: Rounds kept for the cluster page and the logs' readers.
KEEP_ROUNDS = 100


def window_requests(window: WorkloadWindow, block_size: int) -> list[Request]:
    """The window's arrivals as simulator requests, arrival times from 0."""
    if not window.arrivals:
        return []
    first = window.arrivals[0].age_s
    out = []
    for i, a in enumerate(window.arrivals):
        hashes = tuple(a.block_hashes)
        if len(hashes) != -(-a.input_length // block_size):
            hashes = ()  # (hashed with another block size: lengths only)
        out.append(Request(f"w{i}", max(0.0, first - a.age_s), a.input_length,
                           max(1, a.output_length), hashes, block_size,
                           prefill_only=a.prefill_only))  # fmt: skip
    return out


@dataclass(frozen=True)
class Simulated:
    """What a round simulates: the window's requests, the cost model, the simulated
    cluster and the Conductor's settings."""

    requests: list[Request]
    cost_model: CostModel
    sim: SimConfig
    conductor: ConductorConfig


def simulation_inputs(window: WorkloadWindow, base: SimConfig) -> Simulated | None:
    """The simulation of ``window`` on this cluster's current split (``base`` holds the
    settings the Conductor does not know, e.g. the batch limit); None when the window
    cannot say (no measured profile yet, or a pool is empty)."""
    if not window.profile or window.kv_bytes_per_token <= 0:
        return None
    if not window.prefill or not window.decode:
        return None
    conductor = ConductorConfig.from_json(window.conductor)
    profile = CostProfile.from_dict(window.profile, source="the cluster's measured profile")
    capacity = window.decode_kv_capacity_tokens or 1
    cost_model = ProfileCostModel(
        profile, window.kv_bytes_per_token, LINK_BYTES_PER_S, capacity,
        hidden_bytes_per_token=window.hidden_bytes_per_token or None,
    )  # fmt: skip
    sim = replace(
        base,
        cluster=ClusterSpec(len(window.prefill), len(window.decode)),
        slo=conductor.slo,
        kv_capacity_tokens=window.decode_kv_capacity_tokens or None,
        serving=profile.serving,
    )
    return Simulated(window_requests(window, conductor.block_size_tokens), cost_model, sim,
                     conductor)  # fmt: skip


def _simulate_one(requests: list[Request], cost_model: CostModel, sim: SimConfig,
                  conductor: ConductorConfig) -> dict[str, Any]:  # fmt: skip
    from halfmoon.sim.simulator import Simulator

    return Simulator(sim, conductor, cost_model).run(requests).report


class SpawnedEvaluate:
    """The Replanner's nested simulations in ``processes`` spawned processes (started on
    first use, kept until :meth:`close`): a replay of a minute of traffic takes a second
    or more of pure Python, which must not hold up a serving process."""

    def __init__(self, processes: int = 1) -> None:
        self.processes = max(1, processes)
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, requests: list[Request], cost_model: CostModel,
                 configs: Sequence[tuple[SimConfig, ConductorConfig]]) -> list[dict[str, Any]]:  # fmt: skip
        if self._pool is None:
            import multiprocessing

            from halfmoon.serve.runtime import die_with_parent

            self._pool = ProcessPoolExecutor(  # (gone with this process, even on a SIGKILL)
                self.processes, mp_context=multiprocessing.get_context("spawn"),
                initializer=die_with_parent,
            )  # fmt: skip
        futures = [self._pool.submit(_simulate_one, requests, cost_model, sim, conductor)
                   for sim, conductor in configs]  # fmt: skip
        return [f.result() for f in futures]

    def close(self) -> None:
        """Stop the simulation processes."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class RoleMover(Protocol):
    """Carries out a re-planning move."""

    def moving(self) -> bool:
        """Whether a move is still in progress (draining, or its new worker starting)."""
        ...

    async def move(self, from_role: str, to_role: str, count: int,
                   window: WorkloadWindow) -> list[str]:  # fmt: skip
        """Start moving ``count`` workers of ``from_role`` (among the ``window``'s
        placeable ones) to ``to_role``; returns the workers that leave (as far as known)."""
        ...


class _Backend(Protocol):
    expected_instances: int

    async def workload_window(self, window_s: float, timeout_s: float = 5.0) -> WorkloadWindow: ...

    async def drain(self, instance_id: str, timeout_s: float = 5.0) -> None: ...


def _index(name: str) -> int:
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


class LocalMover:
    """Moves workers of a local cluster (:class:`~halfmoon.serve.launch.processes.ProcessGroup`):
    drain the leaving worker, wait for its exit (at most ``drain_timeout_s``, then stop
    it), start ``to_role-N`` (``argv(role, index)``: its command line) and wait until it
    registers. The gateway's ``/health`` expects one worker fewer during the move."""

    def __init__(self, group: Any, backend: _Backend,
                 argv: Callable[[str, int], tuple[str, ...]],
                 drain_timeout_s: float = 300.0, start_timeout_s: float = 600.0) -> None:  # fmt: skip
        self.group = group
        self.backend = backend
        self.argv = argv
        self.drain_timeout_s = drain_timeout_s
        self.start_timeout_s = start_timeout_s
        self._tasks: list[asyncio.Task] = []
        self.moves: list[dict[str, Any]] = []

    def moving(self) -> bool:
        """Whether a move is still in progress."""
        self._tasks = [t for t in self._tasks if not t.done()]
        return bool(self._tasks)

    def _next_index(self, role: str) -> int:
        used = [_index(c.name) for c in self.group.children if c.name.startswith(role + "-")]
        used += [
            _index(name)
            for m in self.moves
            for name in (m["started"], m["leaving"])
            if name.startswith(role + "-")
        ]  # (a name is never used twice)
        return max(used, default=-1) + 1

    async def move(self, from_role: str, to_role: str, count: int,
                   window: WorkloadWindow) -> list[str]:  # fmt: skip
        """Drain ``count`` placeable workers of ``from_role`` (the newest first) and
        replace each by a worker of ``to_role`` once it has exited."""
        placeable = window.prefill if from_role == "prefill" else window.decode
        leaving = sorted(placeable, key=_index, reverse=True)[:count]
        for name in leaving:
            # Drained first (a refusal leaves the worker as it was), then not restarted
            # when it exits: it stays up at least DRAIN_QUIET_S after the drain, and the
            # supervisor runs on this event loop, so it cannot restart it in between.
            await self.backend.drain(name)
            self.group.retire(name)
            self.backend.expected_instances -= 1
            new = f"{to_role}-{self._next_index(to_role)}"
            record = {"leaving": name, "started": new, "at": time.time(), "done": False}
            self.moves.append(record)
            self._tasks.append(asyncio.get_running_loop().create_task(
                self._replace(name, to_role, new, record)))  # fmt: skip
        return leaving

    async def _replace(self, old: str, role: str, new: str, record: dict[str, Any]) -> None:
        try:
            child = next(c for c in self.group.children if c.name == old)
            deadline = time.monotonic() + self.drain_timeout_s
            while child.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            if child.proc.poll() is None:
                log.warning("%s still busy after %gs of draining: stopping it", old,
                            self.drain_timeout_s)  # fmt: skip
            self.group.forget(old)
            log.info("%s drained; starting %s", old, new)
            self.group.spawn(new, *self.argv(role, _index(new)))
            deadline = time.monotonic() + self.start_timeout_s
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    window = await self.backend.workload_window(1.0)
                    if new in (*window.prefill, *window.decode):
                        log.info("%s serves as %s (was %s)", new, role, old)
                        record["done"] = True
                        return
                await asyncio.sleep(0.5)
            log.error("%s did not register within %gs (it is restarted if it exits)", new,
                      self.start_timeout_s)  # fmt: skip
        finally:
            self.backend.expected_instances += 1


@dataclass
class LiveReplanner:
    """Watches the live cluster and moves workers between roles (module docstring)."""

    backend: _Backend
    mover: RoleMover
    config: ReplanConfig = field(default_factory=ReplanConfig)
    #: Settings of the simulated instances the Conductor does not know (batch limit,
    #: layers, shared host cores); the split, SLOs, KV pool and cost come from the window.
    base: SimConfig = field(default_factory=lambda: SimConfig(cluster=ClusterSpec(1, 1)))
    evaluate: Any = None
    #: The gateway's metrics (``halfmoon:replan_rounds``, ``halfmoon:replan_moves``).
    metrics: Any = None
    #: Every round: when, the split, the goodput of each simulated split, what it chose.
    rounds: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=KEEP_ROUNDS))
    _replanner: Replanner | None = None
    _started_s: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.evaluate is None:
            self.evaluate = SpawnedEvaluate(self.config.processes or 1)

    def _now_s(self) -> float:
        return time.monotonic() - self._started_s

    def close(self) -> None:
        """Stop the simulation processes."""
        close = getattr(self.evaluate, "close", None)
        if close is not None:
            close()

    async def run(self, poll_s: float = 1.0) -> None:
        """Run a round whenever one is due (every ``interval_s``, no move in progress, no
        cooldown) until cancelled."""
        try:
            while True:
                await asyncio.sleep(min(poll_s, self.config.interval_s))
                try:
                    await self.round()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # a failed round must not end re-planning
                    log.warning("re-planning round failed: %s", exc)
        finally:
            self.close()

    async def round(self) -> dict[str, Any] | None:
        """One round: the decision as a map (also kept in ``rounds``), None if skipped."""
        if self.mover.moving():
            return None
        if self._replanner is not None and not self._replanner.due(self._now_s()):
            return None
        window = await self.backend.workload_window(self.config.window_s)
        if window.draining:
            return None
        inputs = simulation_inputs(window, self.base)
        if inputs is None:
            return None
        p, d = len(window.prefill), len(window.decode)
        now_s = self._now_s()
        if self._replanner is None:
            self._replanner = Replanner(self.config, inputs.sim, inputs.conductor,
                                        inputs.cost_model, p + d, self.evaluate)  # fmt: skip
        planner = self._replanner
        if not planner.due(now_s):
            return None
        planner.sim, planner.conductor = inputs.sim, inputs.conductor
        planner.cost_model, planner.instances = inputs.cost_model, p + d
        num_rounds = len(planner.decisions)
        target = await asyncio.to_thread(planner.target, now_s, p, inputs.requests)
        if len(planner.decisions) == num_rounds:
            return None  # too few requests in the window to say
        decision = planner.decisions[-1]
        del planner.decisions[:-KEEP_ROUNDS]  # (a server runs for days: keep the latest)
        record = {
            "time": time.time(), "split": f"{p}P{d}D", "requests": len(inputs.requests),
            "goodput_rps": {f"{q}P{p + d - q}D": round(g, 4)
                            for q, g in sorted(decision.goodput_rps.items())},
            "target": None if target is None else f"{target}P{p + d - target}D",
        }  # fmt: skip
        self.rounds.append(record)
        if self.metrics is not None:
            self.metrics.replan_rounds.labels("stay" if target is None else "move").inc()
        if target is None:
            log.info("re-plan: %s stays (%d requests; goodput %s)", record["split"],
                     record["requests"], json.dumps(record["goodput_rps"]))  # fmt: skip
            return record
        from_role, to_role = ("decode", "prefill") if target > p else ("prefill", "decode")
        log.info("re-plan: %s -> %s (%d requests; goodput %s)", record["split"],
                 record["target"], record["requests"],
                 json.dumps(record["goodput_rps"]))  # fmt: skip
        record["leaving"] = await self.mover.move(from_role, to_role, abs(target - p), window)
        if self.metrics is not None:
            self.metrics.replan_moves.labels(to_role).inc(abs(target - p))
        return record


def replan_base(model_dir: Any, max_num_seqs: int, decode_guard: str,
                host_cores: float | None) -> SimConfig:  # fmt: skip
    """The simulated instances' settings a live cluster's Conductor does not know: the
    model's layers (its config.json; 32 when it does not say), the batch limit, the decode
    guard, and the cores they share (None: each has its own)."""
    from pathlib import Path

    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        num_layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        num_layers = 32
    return SimConfig(cluster=ClusterSpec(1, 1), num_layers=num_layers,
                     max_batch_size=max_num_seqs, decode_tbt_guard=decode_guard,
                     host_cores=host_cores, first_token_at="kv")  # fmt: skip


def check_replan(mode: str, cpp_stages: int) -> None:
    """Refuse ``--replan`` where roles cannot move (coupled workers, CPP groups)."""
    if mode != "disaggregated":
        raise HalfmoonError("--replan moves workers between prefill and decode: it needs "
                            "--mode disaggregated")  # fmt: skip
    if cpp_stages > 1:
        raise HalfmoonError("--replan with --cpp-stages > 1 is not supported (a CPP group's "
                            "size is fixed)")  # fmt: skip


def add_replan_options(p: Any) -> None:
    """Add ``--replan`` and its knobs to a ``serve`` parser."""
    d = ReplanConfig()
    p.add_argument(
        "--replan", action="store_true",
        help="move workers between prefill and decode when a simulation of the recent "
        "requests says another split serves more of them within the SLOs (docs/conductor.md)",
    )  # fmt: skip
    p.add_argument("--replan-interval", type=float, default=d.interval_s, metavar="S",
                   help=f"seconds between re-planning rounds (default {d.interval_s:g})")  # fmt: skip
    p.add_argument("--replan-window", type=float, default=d.window_s, metavar="S",
                   help=f"seconds of recent requests each round replays (default {d.window_s:g})")  # fmt: skip
    p.add_argument("--replan-margin", type=float, default=d.margin, metavar="F",
                   help=f"move only when a split's goodput is this much higher (default {d.margin:g})")  # fmt: skip
    p.add_argument("--replan-max-moves", type=int, default=1, metavar="N",
                   help="workers moved per round, at most (default 1)")  # fmt: skip
    p.add_argument("--replan-min-requests", type=int, default=d.min_requests, metavar="N",
                   help=f"requests a window needs before it decides (default {d.min_requests})")  # fmt: skip


def replan_config_from_args(args: Any) -> ReplanConfig | None:
    """The ReplanConfig of the ``--replan*`` options (None without ``--replan``); a
    HalfmoonError names a bad value."""
    if not getattr(args, "replan", False):
        return None
    check_replan(args.mode, args.cpp_stages)
    return ReplanConfig(
        interval_s=args.replan_interval, window_s=args.replan_window,
        margin=args.replan_margin, max_moves=args.replan_max_moves,
        cooldown_s=args.replan_interval, min_requests=args.replan_min_requests, processes=1,
    )  # fmt: skip
