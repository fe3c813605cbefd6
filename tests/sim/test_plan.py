"""``halfmoon plan`` and the parallel simulation runner behind it."""

from __future__ import annotations

import itertools
import json
import shlex
from pathlib import Path

import pytest

from halfmoon.cli import build_parser, main
from halfmoon.conductor import ConductorConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel import build_cost_model
from halfmoon.sim import ClusterSpec, SimConfig
from halfmoon.sim.parallel import SimJob, run_jobs
from halfmoon.sim.plan import GOODPUT_TIE, PlanPoint, coarse_splits
from halfmoon.workload.datasets import generate_dataset

DATASET = ["--dataset", "leval", "--rate", "3", "--num-requests", "120"]


def test_coarse_splits_cover_small_clusters_and_eighths_of_large_ones() -> None:
    assert coarse_splits(2) == [1]
    assert coarse_splits(5) == [1, 2, 3, 4]
    assert coarse_splits(16) == [2, 4, 6, 8, 10, 12, 14]
    assert coarse_splits(64)[0] == 8 and coarse_splits(64)[-1] == 56
    with pytest.raises(HalfmoonError, match="instances"):
        coarse_splits(1)


def test_parallel_runs_match_runs_in_turn() -> None:
    requests = generate_dataset("leval", 3.0, 80, 0)
    cost_model = build_cost_model("llama2-70b", "a800", 8)
    jobs = [
        SimJob(SimConfig(ClusterSpec.parse(c)), ConductorConfig(early_reject=m))
        for c, m in (("2P1D", "none"), ("1P2D", "snapshot"), ("3M", "none"))
    ]
    parallel = run_jobs(requests, cost_model, jobs, processes=2)
    in_turn = run_jobs(requests, cost_model, jobs, processes=1)
    assert [r["cluster"] for r in parallel] == ["2P1D", "1P2D", "3M"]
    assert parallel == in_turn


def test_a_point_serves_with_flags_that_serve_accepts() -> None:
    point = PlanPoint(6, 2, early_reject="predict", cpp_stages=2, balancing="adaptive")
    config = ConductorConfig()
    command = point.command(config.slo, 0.1, 2048)
    assert command.startswith("halfmoon serve --prefill 6 --decode 2")
    args = build_parser().parse_args([*shlex.split(command)[1:], "--model", "tiny"])
    assert (args.prefill, args.decode, args.early_reject) == (6, 2, "predict")
    assert (args.cpp_stages, args.cpp_min_tokens, args.balancing) == (2, 2048, "adaptive")
    assert args.tbt_slo == config.slo.tbt_s
    coupled = PlanPoint(8, 0).command(config.slo, 1.0, 2048)
    args = build_parser().parse_args([*shlex.split(coupled)[1:], "--model", "tiny"])
    assert (args.mode, args.instances, args.kvcache_balancing_threshold) == ("coupled", 8, 1.0)


def test_plan_prints_the_best_and_writes_them_best_first(capsys, tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    argv = ["plan", *DATASET, "--instances", "3", "--processes", "2", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "best: " in printed and "serve it: halfmoon serve" in printed
    entries = json.loads(out.read_text())
    clusters = {e["cluster"] for e in entries}
    assert {"1P2D", "2P1D", "3M"} <= clusters  # every split and the coupled reference
    goodputs = [e["goodput_rps"] for e in entries]  # best first, ties within GOODPUT_TIE
    assert all(a >= b / (1 + GOODPUT_TIE) for a, b in itertools.pairwise(goodputs))
    ties = [e["slo_load"] for e in entries if e["goodput_rps"] == goodputs[0]]
    assert ties == sorted(ties)
    for entry in entries:
        assert entry["prefill"] + entry["decode"] == 3 or entry["mode"] == "coupled"
        assert {"goodput_rps", "slo_attainment", "command", "early_reject", "cpp_stages",
                "balancing", "kvcache_balancing_threshold"} <= entry.keys()  # fmt: skip
        assert 0 <= entry["slo_attainment"] <= 1
    # stage 3 tried the knobs on the best split
    best_split = entries[0]["prefill"] if entries[0]["mode"] != "coupled" else None
    tried = {(e["early_reject"], e["balancing"]) for e in entries if e["prefill"] == best_split}
    assert ("predict", "fixed") in tried or best_split is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--instances", "1"], "--instances"),
        (["--instances", "4", "--tbt-slo", "0"], "--tbt-slo"),
        (["--instances", "4", "--processes", "0"], "--processes"),
        (["--instances", "4", "--kvcache-balancing-threshold", "-1"], "threshold"),
        (["--instances", "4", "--gpu", "tpu9"], "gpu"),
    ],
)
def test_bad_plan_arguments_are_one_line_errors(capsys, args: list[str], message: str) -> None:
    assert main(["plan", *DATASET, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("halfmoon: error:")
    assert message in err[0].lower()
