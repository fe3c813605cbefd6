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
    """Each request is sent no earlier than its scaled time, without waiting for the ones
    before it, and how late it went is recorded. Only lower bounds on time: a loaded host
    may delay a send, never bring it forward."""
    planned = _plan([100.0, 100.2, 100.6, 101.0], time_scale=2.0)
    assert [p.send_at_s for p in planned] == pytest.approx([0.0, 0.1, 0.3, 0.5])
    # All four are held until all four are in flight: none waited for an earlier answer.
    with FakeOpenAI(lambda body: Reply(gaps_s=[0.01, 0.01]), hold_first=4) as server:
        run = _run(server, planned)
    assert server.max_in_flight == 4
    maker = PromptMaker(PromptSpec(), 512)
    received = {tuple(e.body["prompt"]): e.received_s - run.start_monotonic_s
                for e in server.exchanges}  # fmt: skip
    for record, p, lag in zip(run.records, planned, run.send_lag_s, strict=True):
        assert record.request_id == p.request_id
        assert record.arrival_s >= p.send_at_s - 1e-6  # never early (asyncio: 1 ns)
        assert record.arrival_s == pytest.approx(p.send_at_s + lag, abs=1e-6)
        assert received[tuple(maker.prompt_ids(p.request))] >= record.arrival_s
        assert record.completed and len(record.token_times_s) == 3
    assert run.wall_s >= 0.5


def test_prompts_are_the_planned_tokens():
    planned = _plan([0.0, 0.0])
    with FakeOpenAI(lambda body: Reply()) as server:
        _run(server, planned)
    maker = PromptMaker(PromptSpec(), 512)
    sent = sorted(tuple(e.body["prompt"]) for e in server.exchanges)
    assert sent == sorted(tuple(maker.prompt_ids(p.request)) for p in planned)


def test_max_concurrency_is_respected():
    planned = _plan([0.0] * 6)
    # The first two are held until both are in flight, so two at once really happened.
    with FakeOpenAI(lambda body: Reply(ttft_s=0.1), hold_first=2) as server:
        run = _run(server, planned, max_concurrency=2)
    assert server.max_in_flight == 2
    assert all(record.completed for record in run.records)
    # The later ones waited for a slot: sent late against their plan, and arrival is
    # when they were really sent. Each answer takes >= 0.1 s, so the last two went after
    # four answers through two slots: a lower bound, which no load can break.
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
