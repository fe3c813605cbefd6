"""``halfmoon bench`` against a real ``halfmoon serve`` tiny cluster (1 prefill + 1 decode)."""

from __future__ import annotations

import json

import pytest
from e2e.conftest import Cluster

from halfmoon.cli import main
from halfmoon.core.request import Request
from halfmoon.metrics.records import records_from_json
from halfmoon.workload.trace import write_trace

pytestmark = pytest.mark.e2e  # a real cluster (so also slow: tests/conftest.py)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, shared_cache):
    traces = tmp_path_factory.mktemp("traces")
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": str(traces),
                           "torch_profiler_with_stack": False})  # fmt: skip
    started = Cluster(tmp_path_factory.mktemp("serve"), "--kv-cache-mb", "64",
                      "--profiler-config", profiler, shared=shared_cache)  # fmt: skip
    started.traces = traces
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


def test_bench_against_a_live_cluster(cluster, tmp_path):
    trace, out, records = tmp_path / "t.jsonl", tmp_path / "r.json", tmp_path / "rec.json"
    write_trace([
        Request("a", 0.0, 1100, 8, (1, 2, 3), 512),
        Request("b", 1.5, 1200, 6, (1, 2, 4), 512),  # shares two full blocks with "a"
        Request("c", 1.6, 300, 5, (5,), 512),
    ], trace)  # fmt: skip
    code = main(["bench", "--url", cluster.base_url, "--trace", str(trace), "--json", str(out),
                 "--records", str(records), "--ttft-slo", "30", "--tbt-slo", "5"])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    by_id = {r.request_id: r for r in records_from_json(json.loads(records.read_text()))}
    errors = {rid: r.error or r.reject_reason for rid, r in by_id.items() if not r.completed}
    assert not errors and report["num_completed"] == 3
    assert report["model"] == "tiny"
    # ignore_eos + min_tokens: exactly the trace's output lengths, whatever the model says.
    assert report["num_output_tokens"] == 8 + 6 + 5 and report["num_short_outputs"] == 0
    assert by_id["req-2"].cached_tokens >= 1024 - 16  # the shared prefix was really shared
    assert by_id["req-1"].cached_tokens < 16
    for record in by_id.values():
        assert 1 <= len(record.token_times_s) <= record.output_length
        assert record.ttft_s > 0 and record.e2e_s >= record.ttft_s
    assert report["slo_attainment"] == 1.0 and report["cache_hit_ratio"] > 0.3


def test_bench_profiles_the_run(cluster, tmp_path, capsys):
    """``--profile``: the server profiles the run (vLLM's ``/start_profile`` before it,
    ``/stop_profile`` after) and the bench prints where each worker's trace went."""
    trace = tmp_path / "t.jsonl"
    write_trace([Request("a", 0.0, 200, 4, (7,), 512)], trace)
    assert main(["bench", "--url", cluster.base_url, "--trace", str(trace), "--profile",
                 "--ttft-slo", "30", "--tbt-slo", "5"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    for worker in ("prefill-0", "decode-0"):
        (line,) = [ln for ln in out.splitlines() if ln.startswith(f"profiler trace of {worker}:")]
        paths = line.split(": ", 1)[1].split(", ")
        assert paths and all(p.startswith(str(cluster.traces)) for p in paths), line
