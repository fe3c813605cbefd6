"""Replaying a plan: send times, concurrency limit, the report."""

from __future__ import annotations

import pytest

from halfmoon.bench.client import ClientConfig
from halfmoon.bench.report import bench_report, format_bench
from halfmoon.bench.runner import run_benchmark
from halfmoon.bench.workload import PromptMaker, PromptSpec, plan_requests
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request
from halfmoon.metrics.report import REPORT_KEYS, summarize

from .fake_openai import FakeOpenAI, Reply


def _plan(arrivals_s, n_out=3, time_scale=1.0):
    requests = [Request(f"q{i}", t, 40, n_out, (i,), 512) for i, t in enumerate(arrivals_s)]
    return plan_requests(requests, time_scale=time_scale)


def _run(server, planned, **kwargs):
    config = ClientConfig(server.url, "fake-model")
    return run_benchmark(planned, config, PromptMaker(PromptSpec(), 512), **kwargs)


def test_requests_leave_at_their_time_scaled_times():
    planned = _plan([100.0, 100.2, 100.6, 101.0], time_scale=2.0)  # sends at 0, .1, .3, .5 s
    with FakeOpenAI(lambda body: Reply(gaps_s=[0.01, 0.01])) as server:
        run = _run(server, planned)
    received = sorted(e.received_s - run.start_monotonic_s for e in server.exchanges)
    for got, want in zip(received, [0.0, 0.1, 0.3, 0.5], strict=True):
        assert want <= got <= want + 0.1  # (a new connection may take a few tens of ms)
    for record, p in zip(run.records, planned, strict=True):
        assert record.request_id == p.request_id
        assert record.arrival_s == pytest.approx(p.send_at_s, abs=0.05)
        assert record.completed and len(record.token_times_s) == 3
    assert run.wall_s >= 0.5 and max(run.send_lag_s) < 0.05


def test_prompts_are_the_planned_tokens():
    planned = _plan([0.0, 0.0])
    with FakeOpenAI(lambda body: Reply()) as server:
        _run(server, planned)
    maker = PromptMaker(PromptSpec(), 512)
    sent = sorted(tuple(e.body["prompt"]) for e in server.exchanges)
    assert sent == sorted(tuple(maker.prompt_ids(p.request)) for p in planned)


def test_max_concurrency_is_respected():
    planned = _plan([0.0] * 6)
    with FakeOpenAI(lambda body: Reply(ttft_s=0.1)) as server:
        run = _run(server, planned, max_concurrency=2)
    assert server.max_in_flight == 2
    assert all(record.completed for record in run.records)
    # The later ones waited for a slot: sent late against their plan, and arrival is
    # when they were really sent.
    assert sorted(run.send_lag_s)[-1] >= 0.2
    with pytest.raises(ValueError, match="max-concurrency"):
        _run(server, planned, max_concurrency=0)


def test_report_has_the_simulator_keys_then_live_entries():
    planned = _plan([0.0, 0.05, 0.1, 0.15], n_out=4)

    def reply(body):  # the second request is rejected, the third gets one token short
        prompt = tuple(body["prompt"])
        index = [tuple(maker.prompt_ids(p.request)) for p in planned].index(prompt)
        if index == 1:
            return Reply(status=429, message="busy")
        return Reply(gaps_s=[0.01] * (2 if index == 2 else 3))

    maker = PromptMaker(PromptSpec(), 512)
    with FakeOpenAI(reply) as server:
        run = _run(server, planned)
    slo = SLOConfig(ttft_s=5.0, tbt_s=1.0, tbt_metric="p90")
    report = bench_report(run, slo, {"url": server.url, "workload": "test"})
    assert list(report)[: len(REPORT_KEYS)] == list(REPORT_KEYS)
    base = summarize(run.records, slo)
    assert {k: report[k] for k in REPORT_KEYS} == base
    assert (report["num_completed"], report["num_rejected"], report["num_errors"]) == (3, 1, 0)
    assert report["num_output_tokens"] == 4 + 3 + 4
    assert report["num_short_outputs"] == 1
    assert report["num_token_events"] == 11
    assert report["url"] == server.url
    table = format_bench(report)
    assert "rejected (429)" in table and "goodput" in table
