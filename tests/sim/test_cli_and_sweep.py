"""``halfmoon simulate`` and ``halfmoon demo`` through the real CLI, and the rate sweep."""

import json
from pathlib import Path

import pytest

from halfmoon.cli import main
from halfmoon.sim import max_rate_within_slo

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "synthetic_trace.jsonl"
DATASET = ["--dataset", "leval", "--rate", "3", "--num-requests", "40"]
REQUIRED_KEYS = {
    "num_requests",
    "num_completed",
    "num_rejected",
    "num_wasted_prefill",
    "ttft_s",
    "tbt_s",
    "slo_attainment",
    "goodput_rps",
    "cache_hit_ratio",
    "duration_s",
    "policy",
    "cluster",
}


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_dataset_writes_json_and_plot(capsys, tmp_path: Path) -> None:
    out_json, out_png, out_records = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "rec"
    code, out, _ = _run(
        capsys,
        *DATASET,
        "--cluster",
        "2P1D",
        "--policy",
        "cache-aware",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
        "--records",
        str(out_records),
    )
    assert code == 0
    report = json.loads(out_json.read_text())
    # every request's record, in halfmoon bench's format: the report comes from them
    from halfmoon.core.config import SLOConfig
    from halfmoon.metrics.records import records_from_json
    from halfmoon.metrics.report import summarize

    records = records_from_json(json.loads(out_records.read_text()))
    assert len(records) == 40
    slo = SLOConfig(report["slo"]["ttft_s"], report["slo"]["tbt_s"], report["slo"]["tbt_metric"])
    assert summarize(records, slo)["ttft_s"] == report["ttft_s"]
    assert REQUIRED_KEYS <= set(report)
    for key in ("ttft_s", "tbt_s"):
        assert set(report[key]) == {"mean", "p50", "p90", "p99"}
    assert report["policy"] == "cache-aware" and report["cluster"] == "2P1D"
    assert report["num_requests"] == 40
    assert out_png.stat().st_size > 0
    assert "SLO attainment" in out and "TTFT mean" in out


def test_simulate_coupled_with_options(capsys, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    code, _, _ = _run(
        capsys,
        *DATASET,
        "--cluster",
        "2M",
        "--coupled-router",
        "least-load",
        "--coupled-chunked-prefill",
        "--tbt-metric",
        "p90",
        "--json",
        str(out_json),
    )
    assert code == 0
    report = json.loads(out_json.read_text())
    assert report["cluster"] == "2M" and report["policy"] == "least-load"
    assert report["slo"]["tbt_metric"] == "p90"


@pytest.mark.skipif(not TRACE.exists(), reason="shared trace not present")
def test_simulate_trace_with_time_scale(capsys, tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    code, _, _ = _run(
        capsys,
        "--trace",
        str(TRACE),
        "--max-requests",
        "60",
        "--time-scale",
        "2",
        "--cluster",
        "2P2D",
        "--early-reject",
        "predict",
        "--cache-capacity-tokens",
        "inf",
        "--json",
        str(out_json),
    )
    assert code == 0
    report = json.loads(out_json.read_text())
    assert report["num_requests"] == 60 and report["time_scale"] == 2.0
    assert report["early_reject"] == "predict"
    assert report["balancing"]["mode"] == "fixed" and report["balancing"]["threshold"] == 0.1
    assert "max_link_backlog_s" not in report["balancing"]  # idle-link pricing


@pytest.mark.skipif(not TRACE.exists(), reason="shared trace not present")
def test_simulate_prices_fetches_by_link_backlog_on_request(tmp_path, capsys):
    out_json = tmp_path / "report.json"
    args = ["--trace", str(TRACE), "--max-requests", "60", "--cluster", "2P2D"]
    code, _, _ = _run(capsys, *args, "--nic-gbps", "5", "--link-backlog", "--json", str(out_json))
    assert code == 0
    balancing = json.loads(out_json.read_text())["balancing"]
    assert balancing["mode"] == "fixed" and balancing["max_link_backlog_s"] >= 0.0


@pytest.mark.parametrize(
    ("flags", "estimate", "instances"),
    [([], "queued", "queued"), (["--prefix-fetch", "overlap"], "overlap", "overlap"),
     (["--instance-prefix-fetch", "overlap"], "queued", "overlap")],
)  # fmt: skip
def test_simulate_runs_prefix_fetches_as_asked(tmp_path, capsys, flags, estimate, instances):
    out_json = tmp_path / "report.json"
    args = ["--trace", str(TRACE), "--max-requests", "60", "--cluster", "2P2D"]
    code, _, _ = _run(capsys, *args, "--nic-gbps", "5", *flags, "--json", str(out_json))
    assert code == 0
    report = json.loads(out_json.read_text())
    assert report["prefix_fetch"] == instances
    assert report["prefix_fetch_estimate"] == estimate


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cluster", "8X"], "cluster"),
        (["--prefix-fetch", "early"], "--prefix-fetch"),
        (["--cluster", "0P1D"], "cluster"),
        (["--cluster", ""], "cluster"),
        (["--policy", "fastest"], "policy"),
        (["--early-reject", "maybe"], "early-reject"),
        (["--balancing", "magic"], "balancing mode"),
        (["--kvcache-balancing-threshold", "1.5"], "--kvcache-balancing-threshold"),
        (["--nic-gbps", "0"], "--nic-gbps"),
        (["--cache-policy", "fifo"], "cache policy"),
        (["--tbt-metric", "p50"], "tbt metric"),
        (["--ttft-slo", "-1"], "ttft"),
        (["--time-scale", "0"], "time-scale"),
        (["--cache-capacity-tokens", "-5"], "capacit"),
        (["--model", "gpt-9"], "model"),
        (["--gpus-per-instance", "0"], "gpus"),
    ],
)
def test_bad_arguments_are_one_line_errors(capsys, args: list[str], message: str) -> None:
    code, _, err = _run(capsys, *DATASET, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("halfmoon: error:")
    assert message in lines[0].lower()


def test_bad_workload_arguments(capsys, tmp_path: Path) -> None:
    for argv in (
        ["--dataset", "leval", "--rate", "-1", "--num-requests", "5"],
        ["--dataset", "leval", "--rate", "1"],
        ["--dataset", "nope", "--rate", "1", "--num-requests", "5"],
        ["--trace", str(tmp_path / "missing.jsonl")],
    ):
        code, _, err = _run(capsys, *argv)
        assert code == 2, argv
        assert len(err.strip().splitlines()) == 1, err


def test_demo_simulates_both_clusters(capsys, tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    code = main(["demo", "--num-requests", "60", "--clusters", "2P1D,3M", "--plot", str(plot)])
    out = capsys.readouterr().out
    assert code == 0
    assert "2P1D" in out and "3M" in out and "SLO attainment" in out
    assert plot.stat().st_size > 0


def test_max_rate_within_slo_finds_the_threshold() -> None:
    calls: list[float] = []

    def ok(rate: float) -> bool:
        calls.append(rate)
        return rate <= 3.7

    found = max_rate_within_slo(ok, start_rate=1.0, rel_tol=0.01)
    assert 3.7 / 1.01 <= found <= 3.7
    assert max_rate_within_slo(lambda r: r <= 0.2, start_rate=1.0) == pytest.approx(0.2, rel=0.03)
    assert max_rate_within_slo(lambda r: False, start_rate=1.0, max_doublings=5) == 0.0
    with pytest.raises(ValueError, match="never saturates"):
        max_rate_within_slo(lambda r: True, start_rate=1.0, max_doublings=3)
    with pytest.raises(ValueError):
        max_rate_within_slo(ok, start_rate=0.0)


def test_simulate_with_measured_profile(capsys, tmp_path: Path) -> None:
    from halfmoon.costmodel import fit_profile

    # a profile of an engine twice as slow as 2,000 tok/s, with 20 ms decode steps
    prefill = [(n, 0, n / 1000.0 + 0.01) for n in (1000, 4000, 16000, 32000)]
    decode = [(b, ctx, 0.02 + 1e-8 * ctx) for b, ctx in ((1, 1000), (8, 64000), (32, 500000))]
    profile = tmp_path / "profile.json"
    fit_profile(prefill, decode, "llama2-70b", "test", created="2026-01-01").save(profile)
    out_json = tmp_path / "r.json"
    code, _, _ = _run(
        capsys,
        "--dataset",
        "arxiv",
        "--rate",
        "0.05",
        "--num-requests",
        "5",
        "--cluster",
        "1P1D",
        "--profile",
        str(profile),
        "--json",
        str(out_json),
    )
    assert code == 0
    report = json.loads(out_json.read_text())
    assert report["tbt_s"]["mean"] > 0.02  # the profile's decode steps, not the roofline's
    code, _, err = _run(capsys, *DATASET, "--profile", str(tmp_path / "missing.json"))
    assert code == 2 and len(err.strip().splitlines()) == 1
