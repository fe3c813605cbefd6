"""``halfmoon bench`` end to end against the fake server, and its one-line errors."""

from __future__ import annotations

import json

import pytest

from halfmoon.cli import main
from halfmoon.core.request import Request
from halfmoon.metrics.records import records_from_json
from halfmoon.metrics.report import REPORT_KEYS
from halfmoon.workload.trace import write_trace

from .fake_openai import FakeOpenAI, Reply


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.jsonl"
    requests = [
        Request("a", 1.000, 600, 3, (1, 2), 512),
        Request("b", 1.100, 700, 2, (1, 3), 512),
        Request("c", 1.300, 100, 4, (4,), 512),
    ]
    write_trace(requests, path)
    return path


def test_bench_trace_writes_report_records_and_plot(tmp_path, trace, capsys):
    out, records, plot = tmp_path / "r.json", tmp_path / "rec.json", tmp_path / "p.png"
    with FakeOpenAI(lambda body: Reply(gaps_s=[0.01] * (body["max_tokens"] - 1))) as server:
        code = main([
            "bench", "--url", server.url + "/v1/", "--trace", str(trace), "--json", str(out),
            "--records", str(records), "--plot", str(plot), "--api-key", "k",
            "--ttft-slo", "2", "--tbt-slo", "0.5", "--tbt-metric", "p90",
        ])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert list(report)[: len(REPORT_KEYS)] == list(REPORT_KEYS)
    assert (report["num_completed"], report["num_output_tokens"]) == (3, 9)
    assert report["slo"] == {"ttft_s": 2.0, "tbt_s": 0.5, "tbt_metric": "p90"}
    assert report["model"] == "fake-model" and report["url"] == server.url
    assert report["slo_attainment"] == 1.0
    bodies = [e.body for e in server.exchanges]
    assert sorted(len(b["prompt"]) for b in bodies) == [100, 600, 700]
    assert all(b["model"] == "fake-model" for b in bodies)
    assert all(e.headers["authorization"] == "Bearer k" for e in server.exchanges)
    assert [r.request_id for r in records_from_json(json.loads(records.read_text()))] == [
        "req-1", "req-2", "req-3",
    ]  # fmt: skip
    assert plot.stat().st_size > 0
    printed = capsys.readouterr().out
    assert "TTFT p50 / p90 / p99 (s)" in printed and "report written" in printed


def test_report_keys_match_the_simulator(tmp_path, trace):
    sim_out, bench_out = tmp_path / "sim.json", tmp_path / "bench.json"
    assert main(["simulate", "--trace", str(trace), "--cluster", "1P1D",
                 "--json", str(sim_out)]) == 0  # fmt: skip
    with FakeOpenAI(lambda body: Reply()) as server:
        assert main(["bench", "--url", server.url, "--trace", str(trace), "--model", "m",
                     "--json", str(bench_out)]) == 0  # fmt: skip
    sim, bench = json.loads(sim_out.read_text()), json.loads(bench_out.read_text())
    for key in REPORT_KEYS:
        value = sim[key]
        assert key in bench
        if isinstance(value, dict):
            assert set(bench[key]) == set(value), key
    assert server.exchanges[0].body["model"] == "m"


def test_bench_dataset_with_length_scale(tmp_path):
    with FakeOpenAI(lambda body: Reply()) as server:
        code = main(["bench", "--url", server.url, "--dataset", "arxiv", "--rate", "100",
                     "--num-requests", "3", "--length-scale", "0.0625", "--max-concurrency",
                     "1", "--no-vllm-extensions"])  # fmt: skip
    assert code == 0
    lengths = [len(e.body["prompt"]) for e in server.exchanges]
    assert len(lengths) == 3 and all(32 <= n <= 32 * 64 for n in lengths)
    assert all("ignore_eos" not in e.body for e in server.exchanges)
    assert server.max_in_flight == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--trace", "T", "--rate", "1"], "--rate and --num-requests go with --dataset"),
        (["--dataset", "arxiv"], "--dataset needs --rate and --num-requests"),
        (["--dataset", "nope", "--rate", "1", "--num-requests", "2"], "unknown dataset"),
        (["--trace", "T", "--length-scale", "0.3"], "whole number"),
        (["--trace", "T", "--time-scale", "0"], "--time-scale"),
        (["--trace", "T", "--tbt-metric", "p50"], "unknown tbt metric"),
        (["--trace", "T", "--ttft-slo", "-1"], "--ttft-slo"),
        (["--trace", "/no/such/file"], "no such trace file"),
        (["--trace", "T", "--max-requests", "0"], "--max-requests"),
    ],
)
def test_bad_arguments_fail_on_one_line(trace, capsys, args, message):
    args = [str(trace) if a == "T" else a for a in args]
    assert main(["bench", "--url", "http://127.0.0.1:9", "--model", "m", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("halfmoon: error:") and message in err and "\n" not in err


def test_bad_url_and_unreachable_server(trace, capsys):
    assert main(["bench", "--url", "localhost:8000", "--trace", str(trace)]) == 2
    assert "--url must look like" in capsys.readouterr().err
    with FakeOpenAI(lambda body: Reply()) as server:
        url = server.url  # closed once the block ends
    assert main(["bench", "--url", url, "--trace", str(trace)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("halfmoon: error: cannot reach") and "\n" not in err


def test_profile_needs_a_server_with_the_profiler(trace, capsys):
    with FakeOpenAI(lambda body: Reply()) as server:
        assert main(["bench", "--url", server.url, "--trace", str(trace), "--profile"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("halfmoon: error:") and "serves no /start_profile" in err
    assert "--profiler-config" in err and "\n" not in err


def test_bench_sends_the_priority_mix_and_reports_each_class(tmp_path, capsys):
    """``--priority-mix`` gives a seeded share of the requests vLLM's ``priority``; the
    server sees it in their bodies (none in the others'), and the report has each
    priority's figures, as the simulator's does."""
    path = tmp_path / "trace.jsonl"
    write_trace([Request(f"r{i}", i * 0.01, 64, 2, (i,), 512) for i in range(40)], path)
    out = tmp_path / "r.json"
    with FakeOpenAI(lambda body: Reply(gaps_s=[0.001])) as server:
        code = main(["bench", "--url", server.url, "--trace", str(path), "--json", str(out),
                     "--priority-mix=-1:0.3,4:0.2", "--seed", "5"])  # fmt: skip
    assert code == 0
    sent = [e.body.get("priority", 0) for e in server.exchanges]
    assert set(sent) == {-1, 0, 4}
    assert all(e.body.get("priority") != 0 for e in server.exchanges)  # 0 is not sent
    by = json.loads(out.read_text())["by_priority"]
    assert list(by) == ["-1", "0", "4"]
    assert [by[p]["num_requests"] for p in by] == [sent.count(-1), sent.count(0), sent.count(4)]
    assert all(c["num_completed"] == c["num_requests"] for c in by.values())
    assert "priority  requests" in capsys.readouterr().out
