"""Re-planning the P:D split during a run (halfmoon.sim.replan)."""

from __future__ import annotations

import pytest

from halfmoon.conductor import ConductorConfig
from halfmoon.core.config import SLOConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import Request
from halfmoon.costmodel import build_cost_model
from halfmoon.metrics.report import summarize
from halfmoon.sim import ClusterSpec, SimConfig, Simulator
from halfmoon.sim.replan import ReplanConfig, Replanner
from halfmoon.workload.datasets import generate_dataset

SLO = SLOConfig(ttft_s=10.0, tbt_s=0.1)
CONDUCTOR = ConductorConfig(slo=SLO, early_reject="snapshot")
FAST = ReplanConfig(interval_s=20.0, window_s=40.0, cooldown_s=20.0, steps=(1, 2))


@pytest.fixture(scope="module")
def roofline():
    return build_cost_model("llama2-70b", "a800", 8)


def _run(cluster: str, requests: list[Request], cost_model, replan=None) -> Simulator:
    """A run on decode instances of 60k KV tokens (memory-poor: decode needs several)."""
    config = SimConfig(ClusterSpec.parse(cluster), slo=SLO, kv_capacity_tokens=60_000)
    sim = Simulator(config, CONDUCTOR, cost_model, replan=replan)
    sim.report = sim.run(requests).report  # type: ignore[attr-defined]
    sim.check_integrity()
    sim.conductor.check_integrity()
    return sim


def test_replanning_moves_instances_when_the_mix_shifts(roofline) -> None:
    """Chat, then summaries: 2P6D (fine for chat) starves the summaries' prefill; the
    re-planner moves decode instances to prefill soon after the shift."""
    requests = generate_dataset("mixshift", 4.0, 800, 0)
    fixed = _run("2P6D", requests, roofline)
    moved = _run("2P6D", requests, roofline, FAST)
    shift_s = requests[400].arrival_time_s
    changes = moved.role_changes
    assert changes and all(c["from"].startswith("D") and c["to"].startswith("P") for c in changes)
    assert all(c["time_s"] > shift_s - FAST.window_s for c in changes)  # not before the shift
    assert len(moved.prefill) == 2 + len(changes) and len(moved.decode) == 6 - len(changes)
    second = {
        name: summarize(sim.records[400:], SLO)["goodput_rps"]
        for name, sim in (("fixed", fixed), ("moved", moved))
    }
    assert second["moved"] > 1.3 * second["fixed"]
    report = moved.report  # type: ignore[attr-defined]
    assert report["role_changes"] == changes and report["replans"]


def test_no_move_while_every_split_keeps_up(roofline) -> None:
    requests = generate_dataset("mixshift", 1.0, 200, 0)[:100]  # chat only, light
    sim = _run("2P2D", requests, roofline, FAST)
    assert sim.role_changes == [] and sim.replanner is not None and sim.replanner.decisions


def test_replanner_steps_at_most_max_moves_towards_the_best_split() -> None:
    goodput = {1: 1.0, 2: 1.2, 3: 1.5, 5: 3.0, 7: 2.0}

    def evaluate(requests, cost_model, configs):
        return [
            {"goodput_rps": goodput.get(sim.cluster.num_prefill, 0.5), "slo_attainment": 1.0}
            for sim, _ in configs
        ]

    config = ReplanConfig(interval_s=10, window_s=100, max_moves=2, cooldown_s=50, min_requests=2)
    sim = SimConfig(ClusterSpec(1, 7))
    planner = Replanner(config, sim, CONDUCTOR, None, 8, evaluate=evaluate)  # type: ignore[arg-type]
    for i in range(5):
        planner.observe(Request(f"r{i}", float(i), 100, 10), float(i))
    assert planner.due(10.0) and not planner.due(9.0)
    assert planner.target(10.0, 1) == 3  # towards 5, two at a time
    assert not planner.due(40.0) and planner.due(60.0)  # cooldown after a move
    assert sorted(planner.decisions[0].goodput_rps) == [1, 2, 3, 5]  # 1 +- 1, 2, 4
    assert planner.target(60.0, 5) is None  # 5 is the best now


def test_bad_replanning_settings(roofline) -> None:
    with pytest.raises(HalfmoonError):
        ReplanConfig(interval_s=0)
    with pytest.raises(HalfmoonError):
        ReplanConfig(max_moves=0)
    coupled = SimConfig(ClusterSpec.parse("4M"))
    with pytest.raises(HalfmoonError, match="disaggregated"):
        Simulator(coupled, CONDUCTOR, roofline, replan=FAST)
