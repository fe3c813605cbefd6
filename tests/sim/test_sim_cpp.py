"""CPP groups of simulated prefill instances (chunked pipeline parallelism)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from halfmoon.cli import main
from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel import cpp_prefill_estimate

HIDDEN = 16384
CPP = {"cpp_stages": 2, "cpp_chunk_tokens": 1024, "cpp_hidden_bytes_per_token": HIDDEN}


def test_one_long_request_runs_on_the_pipeline(run_sim, make_request, cost_model) -> None:
    request = make_request("r", 0.0, 16_384, 4)
    result, sim = run_sim("2P1D", [request], **CPP)
    est = cpp_prefill_estimate(cost_model, 2, 16_384, 0, 1024, HIDDEN)
    record = result.records[0]
    assert result.report["num_cpp_prefills"] == 1
    assert record.prefill_done_s == pytest.approx(est.ttft_s)
    # The KV streams out of both stages while they compute: only a small tail is left.
    assert est.ttft_s < record.ttft_s < est.ttft_s + 0.05
    assert record.ttft_s < 0.6 * 16_384 / 2000.0  # 8.2 s on one instance
    assert sim.prefill["P1"].busy_s == pytest.approx(est.stage_busy_s[0])
    assert sim.prefill["P2"].busy_s == pytest.approx(est.stage_busy_s[1])
    assert len(sim.prefill["P1"].cache) == 0  # stages hold layer slices, not full blocks


def test_groups_and_single_placements_interleave(run_sim, make_request) -> None:
    requests = [
        make_request("a", 0.0, 20_000, 4),
        make_request("b", 0.1, 1_000, 4),  # short: one instance
        make_request("c", 0.2, 20_000, 4),
        make_request("d", 0.3, 30_000, 4),
    ]
    result, sim = run_sim("3P1D", requests, **CPP)
    assert all(r.completed for r in result.records)
    assert result.report["num_cpp_prefills"] >= 2
    # Every member's compute is accounted for: the pipeline splits the work, not adds.
    total_busy = sum(p.busy_s for p in sim.prefill.values())
    assert total_busy == pytest.approx(71_000 / 2000.0, rel=1e-9)


def test_group_fetches_a_remote_prefix(run_sim, make_request) -> None:
    shared = list(range(1, 4))  # 3 blocks = 1,536 tokens, cached on P1 by "warm"
    requests = [
        make_request("warm", 0.0, 1_536, 2, prefix=shared),
        make_request("long", 5.0, 16_384, 2, prefix=shared),
    ]
    result, sim = run_sim("2P1D", requests, kvcache_balancing_threshold=0.0, **CPP)
    long = result.records[1]
    assert result.report["num_cpp_prefills"] == 1
    assert long.cached_tokens == 1_536
    assert result.report["num_remote_fetches"] == 1


def test_too_few_prefill_instances_is_an_error(run_sim, make_request) -> None:
    with pytest.raises(HalfmoonError, match="4 CPP stages"):
        run_sim("2P1D", [make_request("r", 0.0, 100, 1)], cpp_stages=4)


def test_cli_cpp_flags(capsys, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = [
        "simulate",
        "--dataset",
        "longctx-16k",
        "--rate",
        "0.2",
        "--num-requests",
        "6",
        "--cluster",
        "4P1D",
        "--cpp-stages",
        "2",
        "--cpp-chunk-tokens",
        "2048",
        "--cpp-min-tokens",
        "4096",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    assert json.loads(out.read_text())["num_cpp_prefills"] == 6
    assert main([*argv[:9], "--cpp-stages", "8"]) == 2
    assert "8 CPP stages" in capsys.readouterr().err
