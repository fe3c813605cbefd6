"""The vectorised prediction (``loads.DecodeForecast``) equals the scalar reference
(``admission.predicted_decode_candidate`` on every instance, then ``min``): same decode
instance, same estimate, same rejection, on random clusters and DecodeTimes."""

import random

import numpy as np
import pytest

from halfmoon.conductor import (
    Conductor,
    ConductorConfig,
    DecodeStarted,
    LoadReport,
    PrefillFinished,
    RequestFinished,
)
from halfmoon.conductor.admission import DecodeTimes, predicted_decode_candidate, rejection_reason
from halfmoon.conductor.loads import KEEP_DECODE_CANDIDATES, DecodeForecast
from halfmoon.conductor.messages import PrefillCandidate
from halfmoon.conductor.state import DecodeState
from halfmoon.core.clock import ManualClock
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request
from halfmoon.costmodel import ProfileCostModel, ThroughputCostModel, build_cost_model, fit_profile
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates

#: Decode instances' speculation: none, and rows / tokens per sequence-step as measured.
RATES = (NO_SPECULATION, SpeculationRates(2.5, 1.8), SpeculationRates(1.3, 1.1),
         SpeculationRates(5.0, 5.0), SpeculationRates(3.0, 1.0))  # fmt: skip

BLOCK = 16
GRID_S = 0.25  # times on a grid of exact floats, so that ages hit the samples exactly


class ScalarOnly:
    """A cost model without the vector method (the forecast falls back to scalar calls)."""

    kv_bytes_per_token = 1024

    def decode_step_time_s(self, batch_size: int, total_context_tokens: int) -> float:
        return 0.02 + 1e-6 * total_context_tokens + 1e-4 * batch_size


def _profile_model():
    profile = fit_profile(
        [(100, 0, 0.1), (200, 50, 0.2), (400, 0, 0.45), (50, 10, 0.05)],
        [(1, 100, 0.01), (8, 5000, 0.013), (32, 100_000, 0.02), (4, 1000, 0.0105)],
        created="2026-12-02T00:00:00+00:00",
    )
    return ProfileCostModel(profile, 1024, 1e9, 1_000_000)


def _cost_models():
    """Round numbers (ties), a roofline, a fitted profile and a scalar-only model."""
    return [
        ThroughputCostModel(1000.0, 1024, 1e9, 0.01, 1e-6),
        ThroughputCostModel(500.0, 2048, 1e9, 0.02, 2e-6),
        build_cost_model("llama3-8b", "a800", 1),
        _profile_model(),
        ScalarOnly(),
    ]


def _times(rng):
    """Configured t_d, learned with no sample yet (fallback), or learned from a few."""
    kind = rng.randrange(3)
    if kind == 0:
        return DecodeTimes(rng.choice([0.5, 2.0, 5.0]))
    times = DecodeTimes(window=rng.choice([3, 8, 64]))
    for _ in range(0 if kind == 1 else rng.randint(1, 20)):
        times.observe(GRID_S * rng.randint(1, 40))
    return times


def _entry(rng, now_s):
    return (now_s - GRID_S * rng.randint(-4, 40), rng.choice([16, 100, rng.randint(1, 5000)]))


def _fill(rng, state, now_s, num):
    for _ in range(rng.randint(0, 6)):
        num[0] += 1
        target = state.running if rng.random() < 0.5 else state.incoming
        target[f"r{num[0]}"] = _entry(rng, now_s)
    if rng.random() < 0.15:
        state.reported_running = rng.randint(0, 5)
        state.reported_context_tokens = rng.randint(0, 8000)
    state.kv_capacity_tokens = rng.choice([3000, 20_000, 1_000_000])


def _request(rng, num):
    length = rng.randint(1, 2000)
    return Request(f"q{num}", 0.0, length, rng.randint(1, 400), (), BLOCK)


def _reference(request, states, now_s, ready_s, times):
    scalar = [predicted_decode_candidate(request, s, now_s, ready_s, times) for s in states]
    return min(scalar, key=lambda d: d.est_tbt_s), scalar


def _check(config, request, states, forecast, now_s, ready_s, times):
    want, scalar = _reference(request, states, now_s, ready_s, times)
    got, kept = forecast.choose(request, now_s, ready_s, times)
    assert got.instance_id == want.instance_id
    assert (got.num_running, got.context_tokens) == (want.num_running, want.context_tokens)
    assert got.est_tbt_s == pytest.approx(want.est_tbt_s, rel=1e-9, abs=0.0)
    by_id = {d.instance_id: d for d in scalar}
    assert got in kept and len(kept) == min(KEEP_DECODE_CANDIDATES, len(states))
    for d in kept:
        ref = by_id[d.instance_id]
        assert (d.num_running, d.context_tokens) == (ref.num_running, ref.context_tokens)
        assert d.est_tbt_s == pytest.approx(ref.est_tbt_s, rel=1e-9, abs=0.0)
    ttft_s = ready_s - now_s
    chosen = PrefillCandidate("P1", 0, "P1", 0.0, ttft_s, 0.0)
    dstate = {s.instance_id: s for s in states}[want.instance_id]
    assert rejection_reason(config, request, chosen, got, dstate, now_s) == rejection_reason(
        config, request, chosen, want, dstate, now_s
    )


@pytest.mark.parametrize("seed", range(80))
def test_forecast_equals_scalar_on_random_clusters(seed):
    rng = random.Random(seed)
    models = _cost_models()
    config = ConductorConfig(
        early_reject="predict", slo=SLOConfig(ttft_s=30.0, tbt_s=rng.choice([0.015, 0.05, 1.0]))
    )
    now_s, num = 100.0, [0]
    states = [
        DecodeState(f"D{i}", rng.choice(models), 1_000_000) for i in range(rng.randint(1, 12))
    ]
    for state in states:
        if rng.random() < 0.7:  # others stay empty: they tie
            _fill(rng, state, now_s, num)
        if seed % 2:  # odd seeds: some instances speculate (their rates change below)
            state.speculation = rng.choice(RATES)
    times = _times(rng)
    forecast = DecodeForecast(states)
    for _ in range(30):
        request = _request(rng, num[0])
        ready_s = now_s + rng.choice([0.0, GRID_S * rng.randint(0, 40), rng.uniform(0, 10)])
        _check(config, request, states, forecast, now_s, ready_s, times)
        for i in rng.sample(range(len(states)), rng.randint(0, len(states))):
            state = states[i]
            if state.incoming and rng.random() < 0.5:
                state.start(rng.choice(list(state.incoming)), now_s)
            elif state.running and rng.random() < 0.5:
                state.finish(rng.choice(list(state.running)))
            else:
                _fill(rng, state, now_s, num)
            if seed % 2 and rng.random() < 0.3:
                state.speculation = rng.choice(RATES)
            forecast.touch(i)
        if not times.configured_s and rng.random() < 0.5:
            times.observe(GRID_S * rng.randint(1, 40))
        now_s += GRID_S * rng.randint(0, 8)


def test_stay_probabilities_equal_the_scalar():
    rng = random.Random(1)
    for _ in range(200):
        times = _times(rng)
        ages = np.array([GRID_S * rng.randint(0, 44) for _ in range(30)] + [0.3, 1e9])
        fallback = np.array([GRID_S * rng.randint(0, 44) for _ in range(len(ages))])
        horizon = GRID_S * rng.randint(0, 20)
        got = times.stay_probabilities(ages, horizon, fallback)
        want = [times.stay_probability(a, horizon, f) for a, f in zip(ages, fallback, strict=True)]
        assert got.tolist() == want
        spans = ages / 4
        got = times.stay_probabilities(0.0, spans, fallback)
        want = [times.stay_probability(0.0, h, f) for h, f in zip(spans, fallback, strict=True)]
        assert got.tolist() == want


@pytest.mark.parametrize("model", _cost_models()[:4], ids=lambda m: type(m).__name__)
def test_vector_step_times_equal_the_scalar(model):
    rng = np.random.default_rng(0)
    batches = np.concatenate(([0, 0, 1], rng.integers(0, 600, 2000)))
    contexts = np.concatenate(([0, 5, 0], rng.integers(0, 4_000_000, 2000)))
    got = model.decode_step_times_s(batches, contexts)
    want = [model.decode_step_time_s(b, c) for b, c in zip(batches, contexts, strict=True)]
    assert got.tolist() == want
    with pytest.raises(ValueError, match="batch_sizes"):
        model.decode_step_times_s(np.array([1, -1]), np.array([0, 0]))
    with pytest.raises(ValueError, match="total_context_tokens"):
        model.decode_step_times_s(np.array([1, 1]), np.array([0.5, 0]))


@pytest.mark.parametrize("model", _cost_models()[:4], ids=lambda m: type(m).__name__)
def test_speculating_step_times_equal_the_scalar(model):
    rng = np.random.default_rng(1)
    batches = np.concatenate(([0, 1, 2], rng.integers(0, 300, 500)))
    contexts = np.concatenate(([0, 5, 0], rng.integers(0, 2_000_000, 500)))
    for rates in RATES:
        got = rates.steps_s(model.decode_step_times_s, batches, contexts)
        want = [rates.step_s(model.decode_step_time_s, b, c)
                for b, c in zip(batches.tolist(), contexts.tolist(), strict=True)]  # fmt: skip
        assert got.tolist() == want


@pytest.mark.parametrize("seed", range(12))
def test_predict_schedule_equals_exhaustive(seed):
    """Whole decisions (configured and learned t_d, load reports, KV-full instances): the
    Conductor's forecast choice against ``schedule(exhaustive=True)`` on a twin."""
    rng = random.Random(seed)
    clock = ManualClock()
    config = ConductorConfig(
        block_size_tokens=BLOCK,
        early_reject="predict",
        slo=SLOConfig(ttft_s=60.0, tbt_s=rng.choice([0.0126, 0.05])),
        decode_time_estimate_s=rng.choice([None, 1.0]),
    )
    model = ThroughputCostModel(1000.0, 1024, 1e9, 0.0125, 2.7e-8)
    fast, full = (Conductor(config, model, clock, random.Random(seed)) for _ in range(2))
    decode = {f"D{i}": rng.choice([4000, 1_000_000]) for i in range(rng.randint(2, 16))}
    for c in (fast, full):
        for p in range(3):
            c.add_prefill_instance(f"P{p}")
        for d, capacity in decode.items():
            c.add_decode_instance(d, kv_capacity_tokens=capacity)
    live, num = [], 0
    for _ in range(200):
        roll = rng.random()
        if roll < 0.4:
            num += 1
            request = Request(f"r{num}", 0.0, rng.randint(1, 3000), rng.randint(1, 60), (), BLOCK)
            got, want = fast.schedule(request), full.schedule(request, exhaustive=True)
            assert (got.accepted, got.reject_reason, got.decode) == (
                want.accepted,
                want.reject_reason,
                want.decode,
            )
            assert set(got.decode_candidates) <= set(want.decode_candidates)
            if got.accepted:
                live.append((request.request_id, got.prefill.instance_id, got.decode.instance_id))
        elif roll < 0.7 and live:
            rid, p, d = entry = live[rng.randrange(len(live))]
            events = [PrefillFinished(p, rid), DecodeStarted(d, rid)]
            if rng.random() < 0.4:
                events = [RequestFinished(d, rid)]
                live.remove(entry)
            for event in events:
                fast.handle(event)
                full.handle(event)
        elif roll < 0.75:
            report = LoadReport(rng.choice(list(decode)), rng.randint(0, 4), rng.randint(0, 9000))
            fast.handle(report)
            full.handle(report)
        else:
            clock.advance(rng.choice([0.05, 0.25, 1.0]))
    fast.check_integrity()
