"""The simulated prefill queue under the priority scheduling policy, the report's
per-priority figures, and ``halfmoon simulate --priority-mix``."""

import dataclasses
import json
from pathlib import Path

import pytest

from halfmoon.cli import main
from halfmoon.core.errors import HalfmoonError
from halfmoon.sim import ClusterSpec, SimConfig

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "synthetic_trace.jsonl"


def _queue(run_sim, make_request, policy):
    """A long request in service, then three queued: 0, then 5, then -1."""
    requests = [
        make_request("first", 0.0, 8000, 2),
        make_request("normal", 0.1, 2000, 2),
        dataclasses.replace(make_request("late", 0.2, 2000, 2), priority=5),
        dataclasses.replace(make_request("urgent", 0.3, 2000, 2), priority=-1),
    ]
    result, _ = run_sim("1P1D", requests, scheduling_policy=policy)
    return result, {r.request_id: r.prefill_done_s for r in result.records}


def test_prefill_instances_serve_their_queue_by_priority(run_sim, make_request) -> None:
    result, done = _queue(run_sim, make_request, "priority")
    # 4 s for the first; then 1 s each: urgent, normal, late (the first is not interrupted)
    assert [done[r] for r in ("first", "urgent", "normal", "late")] == pytest.approx(
        [4.0, 5.0, 6.0, 7.0]
    )
    by = result.report["by_priority"]
    assert list(by) == ["-1", "0", "5"]
    assert [by[p]["num_requests"] for p in by] == [1, 2, 1]
    assert by["-1"]["ttft_s"]["p50"] < by["5"]["ttft_s"]["p50"]


def test_fcfs_instances_keep_arrival_order(run_sim, make_request) -> None:
    result, done = _queue(run_sim, make_request, "fcfs")
    assert [done[r] for r in ("first", "normal", "late", "urgent")] == pytest.approx(
        [4.0, 5.0, 6.0, 7.0]
    )
    assert "by_priority" in result.report  # the requests had priorities


def test_a_run_without_priorities_reports_none(run_sim, make_request) -> None:
    result, _ = run_sim("1P1D", [make_request("r", 0.0, 1000, 2)])
    assert "by_priority" not in result.report


def test_unknown_scheduling_policy_is_refused() -> None:
    with pytest.raises(HalfmoonError, match="scheduling_policy"):
        SimConfig(ClusterSpec.parse("1P1D"), scheduling_policy="sjf")


def test_simulate_with_a_priority_mix(capsys, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(TRACE), "--max-requests", "300", "--cluster", "2P2D",
            "--time-scale", "3", "--scheduling-policy", "priority", "--priority-mix=-1:0.2",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "priority  requests" in text and "\n-1 " in text
    by = json.loads(out.read_text())["by_priority"]
    assert set(by) == {"-1", "0"} and sum(c["num_requests"] for c in by.values()) == 300
    assert 30 <= by["-1"]["num_requests"] <= 90  # 20% drawn, seeded
    assert by["-1"]["ttft_s"]["p50"] < by["0"]["ttft_s"]["p50"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--priority-mix=-1:0.1"], "--priority-estimates off"),
        (["--scheduling-policy", "priority", "--priority-mix", "urgent"], "value:fraction"),
        (["--scheduling-policy", "priority", "--priority-mix=-1:1.5"], "fraction"),
        (["--scheduling-policy", "priority", "--priority-mix=-1:0.6,2:0.6"], "sum"),
        (["--scheduling-policy", "sjf"], "--scheduling-policy"),
    ],
)
def test_bad_priority_flags_are_one_line_errors(capsys, flags, message) -> None:
    code = main(["simulate", "--dataset", "leval", "--rate", "3", "--num-requests", "5", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0].lower()


def test_plan_refuses_a_priority_mix(capsys) -> None:
    code = main(["plan", "--dataset", "leval", "--rate", "3", "--num-requests", "5",
                 "--instances", "2", "--priority-mix=-1:0.1"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--priority-mix" in err[0]


def test_coupled_instances_admit_by_priority(run_sim, make_request) -> None:
    """One coupled instance whose batch holds one request, so prompts are prefilled one
    at a time (a prefill step used to admit every waiting prompt that fit, past
    ``max_batch_size``)."""
    requests = [
        make_request("first", 0.0, 8000, 2),
        make_request("normal", 0.1, 2000, 2),
        dataclasses.replace(make_request("urgent", 0.2, 2000, 2), priority=-1),
    ]
    done = {}
    for policy in ("fcfs", "priority"):
        result, _ = run_sim("1M", requests, scheduling_policy=policy, max_batch_size=1)
        done[policy] = {r.request_id: r.token_times_s[0] for r in result.records}
    assert done["fcfs"]["normal"] < done["fcfs"]["urgent"]
    assert done["priority"]["urgent"] < done["priority"]["normal"]
    assert done["priority"]["first"] == done["fcfs"]["first"]  # not interrupted
