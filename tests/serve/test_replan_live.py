"""Live re-planning (halfmoon.serve.launch.replan): the Conductor's workload window, the
controller's rounds and the local mover, each against real parts where they are cheap
(a real Conductor service on 127.0.0.1, real child processes) and a scripted simulator
where a real one would make the test about timing."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from halfmoon.conductor import ConductorConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel.profile import fit_profile
from halfmoon.serve.control.messages import (
    Arrival,
    Register,
    Schedule,
    WorkloadQuery,
    WorkloadWindow,
)
from halfmoon.serve.control.protocol import hashes_to_wire
from halfmoon.serve.control.workload import ArrivalLog
from halfmoon.serve.launch.processes import ProcessGroup
from halfmoon.serve.launch.replan import (
    LiveReplanner,
    LocalMover,
    simulation_inputs,
    window_requests,
)
from halfmoon.sim.config import ClusterSpec, SimConfig
from halfmoon.sim.replan import ReplanConfig

from .test_dashboard import Peer, service  # noqa: F401 - the fixture: a real service

PROFILE = fit_profile(
    [(n, 0, n / 1000.0 + 0.01) for n in (100, 400, 1600)],
    [(b, ctx, 0.02 + 1e-8 * ctx) for b, ctx in ((1, 100), (8, 6400), (32, 50000))],
    "tiny", "test", created="2026-01-01",
)  # fmt: skip


def test_arrival_log_keeps_a_window_oldest_first_and_forgets_old_entries():
    log = ArrivalLog(keep_s=10.0)
    for t in range(20):
        log.record(10 + t, 5, b"", now_s=float(t))
    assert len(log) == 11  # t = 9..19: older than 10 s before the last is gone
    window = log.window(3.0, now_s=19.0)
    assert [a.input_length for a in window] == [26, 27, 28, 29]
    assert [a.age_s for a in window] == [3.0, 2.0, 1.0, 0.0]


def test_arrival_log_replaces_max_tokens_with_what_a_request_generated():
    log = ArrivalLog(keep_s=10.0, max_entries=3)
    for t in range(4):
        log.record(10, 4000, b"", now_s=float(t), request_id=f"r{t}")
    log.finished("r3", 12)
    log.finished("r0", 5)  # dropped already (at most 3 entries): nothing to change
    log.finished("nope", 7)
    # r1, r2 still running: replayed at the finished r3's 12 (see the next test)
    assert [a.output_length for a in log.window(10.0, now_s=3.0)] == [12, 12, 12]
    log.record(10, 8, b"", now_s=20.0, request_id="r4")  # the rest expire
    assert len(log) == 1 and log._by_id.keys() == {"r4"}  # noqa: SLF001 - no leak


def test_arrival_log_replays_running_requests_at_what_finished_ones_generated():
    """A request still running is replayed with the median output of the finished ones
    of its first block, else of all, within its own bound (before: its max_tokens)."""
    log = ArrivalLog(keep_s=100.0)
    doc, other = hashes_to_wire([7, 8]), hashes_to_wire([9])
    log.record(10, 4000, doc, 0.0, "r0")
    assert [a.output_length for a in log.window(10.0, now_s=0.0)] == [4000]  # none finished yet
    for i, (hashes, out) in enumerate([(doc, 30), (doc, 50), (doc, 40), (other, 300)], 1):
        log.record(10, 4000, hashes, float(i), f"r{i}")
        log.finished(f"r{i}", out)
    log.record(10, 4000, doc, 5.0, "same-doc")  # running: its document's median, 40
    log.record(10, 4000, other, 6.0, "other")  # its own block's: 300
    log.record(10, 4000, b"", 7.0, "no-block")  # no full block: all finished ones', 45
    log.record(10, 20, doc, 8.0, "short")  # within its own max_tokens
    outs = [a.output_length for a in log.window(100.0, now_s=8.0)]
    assert outs == [40, 30, 50, 40, 300, 40, 300, 45, 20]


def test_an_embedding_is_replayed_as_one_and_weighs_in_no_output_median():
    """A prefill-only arrival (an embedding) keeps its mark through the window into the
    replay's requests, and its one-token bound is no output other requests are replayed
    with."""
    log = ArrivalLog(keep_s=100.0)
    doc = hashes_to_wire([7])
    log.record(16, 1, doc, 0.0, "embed", prefill_only=True)
    log.record(16, 500, doc, 1.0, "chat")
    log.finished("chat", 60)
    log.record(16, 500, doc, 2.0, "running")  # the chat's median, not the embedding's 1
    window = log.window(10.0, now_s=2.0)
    assert [(a.output_length, a.prefill_only) for a in window] == [
        (1, True), (60, False), (60, False)]  # fmt: skip
    requests = window_requests(WorkloadWindow(window_s=10, arrivals=window), 16)
    assert [r.prefill_only for r in requests] == [True, False, False]


def _register(peer: Peer, iid: str, role: str, profile: dict | None = None) -> None:
    peer.call(Register(instance_id=iid, role=role, command_endpoint=f"tcp://127.0.0.1:1/{iid}",
                       transfer_endpoint=f"127.0.0.1:2/{iid}", kv_capacity_tokens=4096,
                       kv_bytes_per_token=2048, profile=profile))  # fmt: skip


def test_the_conductor_answers_a_workload_query_with_what_a_simulation_needs(service):  # noqa: F811
    peer = Peer(service)
    empty = peer.call(WorkloadQuery(window_s=60))
    assert isinstance(empty, WorkloadWindow) and empty.profile is None and not empty.arrivals
    _register(peer, "prefill-0", "prefill", PROFILE.to_dict())
    _register(peer, "decode-0", "decode", PROFILE.to_dict())
    _register(peer, "decode-1", "decode", PROFILE.to_dict())
    for i, n in enumerate((40, 64, 100)):
        hashes = list(range(1000 * i, 1000 * i + -(-n // 16)))
        peer.call(Schedule(request_id=f"r{i}", input_length=n, output_length=7, block_size=16,
                           hashes=hashes_to_wire(hashes)))  # fmt: skip
    from halfmoon.serve.control.messages import Drain, Events, event_entry

    # r1 finished after 3 tokens (its decode worker says): a replay sees 3, not max_tokens
    done = event_entry("request_finished", request_id="r1", num_output_tokens=3)
    peer.send(Events(instance_id="decode-0", events=[done]))
    peer.call(Drain(instance_id="decode-1"))
    window = peer.call(WorkloadQuery(window_s=60))
    assert isinstance(window, WorkloadWindow)
    assert [a.input_length for a in window.arrivals] == [40, 64, 100]
    # (the two running: the finished one's 3 as well; without it, their max_tokens)
    assert [a.output_length for a in window.arrivals] == [3, 3, 3]
    assert window.arrivals[0].age_s >= window.arrivals[-1].age_s >= 0
    assert window.arrivals[2].block_hashes == list(range(2000, 2007))
    assert (window.prefill, window.decode, window.draining) == (
        ["prefill-0"], ["decode-0"], ["decode-1"])  # fmt: skip
    assert window.profile == PROFILE.to_dict() and window.kv_bytes_per_token == 2048
    assert window.decode_kv_capacity_tokens == 4096
    assert ConductorConfig.from_json(window.conductor).slo.tbt_s == 0.2
    # A bad window is an error answer, not a crash of the service.
    bad = peer.call(WorkloadQuery(window_s=0))
    assert bad.wire_name == "error" and "window_s" in bad.error

    inputs = simulation_inputs(window, SimConfig(cluster=ClusterSpec(1, 1), num_layers=4))
    assert inputs is not None
    assert str(inputs.sim.cluster) == "1P1D" and inputs.sim.kv_capacity_tokens == 4096
    assert inputs.sim.num_layers == 4 and inputs.sim.slo.ttft_s == 5.0
    assert [r.input_length for r in inputs.requests] == [40, 64, 100]
    assert inputs.requests[0].arrival_time_s == 0.0
    assert inputs.cost_model.prefill_time_s(400, 0) == pytest.approx(PROFILE.prefill_s(400))


def test_window_requests_keep_lengths_when_the_hashes_do_not_fit():
    window = WorkloadWindow(window_s=10, arrivals=[
        Arrival(age_s=5.0, input_length=32, output_length=0, hashes=hashes_to_wire([1, 2])),
        Arrival(age_s=1.0, input_length=32, output_length=3, hashes=hashes_to_wire([1])),
    ])  # fmt: skip
    first, second = window_requests(window, 16)
    assert (first.arrival_time_s, first.block_hashes, first.output_length) == (0.0, (1, 2), 1)
    assert (second.arrival_time_s, second.block_hashes) == (4.0, ())


class ScriptedBackend:
    """The Conductor's side of a round: a window whose split follows the moves."""

    def __init__(self, prefill: int, decode: int, num_requests: int = 40) -> None:
        self.expected_instances = prefill + decode
        self.prefill = [f"prefill-{i}" for i in range(prefill)]
        self.decode = [f"decode-{i}" for i in range(decode)]
        self.draining: list[str] = []
        self.num_requests = num_requests
        self.drained: list[str] = []

    async def workload_window(self, window_s: float, timeout_s: float = 5.0) -> WorkloadWindow:
        arrivals = [Arrival(age_s=window_s * (1 - i / self.num_requests), input_length=64,
                            output_length=8) for i in range(self.num_requests)]  # fmt: skip
        return WorkloadWindow(
            window_s=window_s, arrivals=arrivals, prefill=list(self.prefill),
            decode=list(self.decode), draining=list(self.draining), profile=PROFILE.to_dict(),
            kv_bytes_per_token=2048, decode_kv_capacity_tokens=10_000,
            conductor=ConductorConfig(block_size_tokens=16).to_json(),
        )  # fmt: skip

    async def drain(self, instance_id: str, timeout_s: float = 5.0) -> None:
        self.drained.append(instance_id)


class ScriptedMover:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.busy = False

    def moving(self) -> bool:
        return self.busy

    async def move(self, from_role, to_role, count, window):
        placeable = window.prefill if from_role == "prefill" else window.decode
        self.calls.append((from_role, to_role, count, sorted(placeable)))
        return sorted(placeable)[:count]


def _scripted_evaluate(goodput: dict[int, float], seen: list):
    def evaluate(requests, cost_model, configs):
        seen.append([str(sim.cluster) for sim, _ in configs])
        return [{"goodput_rps": goodput[sim.cluster.num_prefill], "slo_attainment": 1.0}
                for sim, _ in configs]  # fmt: skip

    return evaluate


def test_a_round_moves_towards_the_split_that_wins_by_the_margin():
    backend, mover, seen = ScriptedBackend(1, 3), ScriptedMover(), []
    config = ReplanConfig(interval_s=0.01, window_s=30, margin=0.05, max_moves=1,
                          cooldown_s=0, min_requests=10)  # fmt: skip
    goodput = {1: 1.0, 2: 2.0, 3: 2.5}
    from halfmoon.serve.gateway.prom import GatewayMetrics

    metrics = GatewayMetrics()
    planner = LiveReplanner(backend, mover, config, evaluate=_scripted_evaluate(goodput, seen),
                            metrics=metrics)  # fmt: skip
    import time

    time.sleep(0.02)
    record = asyncio.run(planner.round())
    assert seen == [["1P3D", "2P2D", "3P1D"]]  # the current split and its neighbours
    assert record["split"] == "1P3D" and record["target"] == "2P2D"  # one move at most
    assert mover.calls == [("decode", "prefill", 1, ["decode-0", "decode-1", "decode-2"])]
    assert record["goodput_rps"]["3P1D"] == 2.5 and record["requests"] == 40
    text = metrics.render().decode()
    assert 'halfmoon:replan_rounds_total{outcome="move"} 1.0' in text
    assert 'halfmoon:replan_moves_total{to_role="prefill"} 1.0' in text

    # While a move is in progress, or an instance drains, no round runs.
    mover.busy = True
    time.sleep(0.02)
    assert asyncio.run(planner.round()) is None
    mover.busy, backend.draining = False, ["decode-2"]
    assert asyncio.run(planner.round()) is None
    assert len(seen) == 1


def test_a_round_stays_within_the_margin_and_without_enough_requests():
    backend, mover, seen = ScriptedBackend(2, 2), ScriptedMover(), []
    config = ReplanConfig(interval_s=0.01, window_s=30, margin=0.1, cooldown_s=0,
                          min_requests=10)  # fmt: skip
    planner = LiveReplanner(backend, mover, config,
                            evaluate=_scripted_evaluate({1: 1.0, 2: 1.0, 3: 1.05}, seen))  # fmt: skip
    import time

    time.sleep(0.02)
    record = asyncio.run(planner.round())
    assert record["target"] is None and mover.calls == []
    backend.num_requests = 5
    time.sleep(0.02)
    assert asyncio.run(planner.round()) is None and len(seen) == 1


class GroupBackend(ScriptedBackend):
    """Registers a started worker once its process runs (as a real worker would)."""

    def __init__(self, group: ProcessGroup) -> None:
        super().__init__(1, 1)
        self.group = group

    async def workload_window(self, window_s: float, timeout_s: float = 5.0) -> WorkloadWindow:
        running = [c.name for c in self.group.children
                   if c.proc.poll() is None and not c.retiring]  # fmt: skip
        self.prefill = [n for n in running if n.startswith("prefill")]
        self.decode = [n for n in running if n.startswith("decode")]
        return await super().workload_window(window_s, timeout_s)


def test_the_local_mover_drains_waits_for_the_exit_then_starts_the_other_role(monkeypatch):
    group = ProcessGroup("secret")
    # Children that behave like workers: the leaving one exits by itself (its drain).
    monkeypatch.setattr(group, "_popen", lambda argv: subprocess.Popen(
        [sys.executable, "-c", f"import time; time.sleep({argv[0]})"]))  # fmt: skip
    group.spawn("prefill-0", "60")
    group.spawn("decode-0", "0.3")  # "drained": exits soon
    backend = GroupBackend(group)
    backend.expected_instances = 2
    mover = LocalMover(group, backend, lambda role, index: ("60",), start_timeout_s=10)

    async def scenario():
        leaving = await mover.move("decode", "prefill", 1, await backend.workload_window(1))
        assert leaving == ["decode-0"] and backend.drained == ["decode-0"]
        assert mover.moving() and backend.expected_instances == 1
        assert group.supervise() == []  # the drained worker is not restarted
        while mover.moving():
            await asyncio.sleep(0.05)

    try:
        asyncio.run(asyncio.wait_for(scenario(), 20))
        assert sorted(c.name for c in group.children) == ["prefill-0", "prefill-1"]
        assert backend.expected_instances == 2
        assert mover.moves[0]["done"] and mover.moves[0]["started"] == "prefill-1"
        assert group.states()["prefill-1"]["state"] == "running"
    finally:
        group.stop(1.0)


def test_replan_options_are_checked_before_anything_starts():
    from halfmoon.cli import build_parser
    from halfmoon.serve.launch.launcher import check_shape

    parser = build_parser()
    args = parser.parse_args(["serve", "--replan", "--mode", "coupled"])
    with pytest.raises(HalfmoonError, match="--replan .* needs --mode disaggregated"):
        check_shape(args)
    args = parser.parse_args(["serve", "--replan", "--replan-margin", "-1"])
    with pytest.raises(HalfmoonError, match="margin"):
        check_shape(args)
    args = parser.parse_args(["serve", "--replan", "--prefill", "2", "--cpp-stages", "2"])
    with pytest.raises(HalfmoonError, match="--cpp-stages"):
        check_shape(args)


def test_the_ray_pool_mover_resizes_both_pools_and_settles_when_the_conductor_agrees():
    from halfmoon.deploy.replan import PoolMover

    backend = ScriptedBackend(1, 2)
    asked: list[dict] = []

    async def scale(targets):
        asked.append(targets)
        backend.decode, backend.draining = ["decode-0"], ["decode-1"]  # the drain begins
        return {"added": ["prefill-1"], "draining": ["decode-1"], "sizes": targets}

    async def scenario():
        mover = PoolMover(scale, backend, settle_timeout_s=10)
        window = await backend.workload_window(1)
        assert await mover.move("decode", "prefill", 1, window) == ["decode-1"]
        assert asked == [{"decode": 1, "prefill": 2}]
        await asyncio.sleep(0.6)
        assert mover.moving()  # the new worker has not registered, the old one drains
        backend.prefill, backend.draining = ["prefill-0", "prefill-1"], []
        await asyncio.wait_for(mover._task, 5)
        assert not mover.moving() and mover.moves[0]["done"]

    asyncio.run(scenario())


def test_a_refused_drain_leaves_the_worker_as_it_was(monkeypatch):
    group = ProcessGroup("secret")
    monkeypatch.setattr(group, "_popen", lambda argv: subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"]))  # fmt: skip
    group.spawn("decode-0", "x")
    backend = GroupBackend(group)
    backend.expected_instances = 2

    async def refuse(instance_id, timeout_s=5.0):
        raise HalfmoonError(f"the Conductor did not drain {instance_id}: unknown")

    backend.drain = refuse
    mover = LocalMover(group, backend, lambda role, index: ("60",))

    async def scenario():
        with pytest.raises(HalfmoonError, match="did not drain"):
            await mover.move("decode", "prefill", 1, await backend.workload_window(1))

    try:
        asyncio.run(scenario())
        assert not mover.moving() and backend.expected_instances == 2
        assert not group.children[0].retiring  # still supervised (restarted if it crashes)
    finally:
        group.stop(1.0)
