"""Prefill calibration: the scale learned from busy time, and what it changes in the
Conductor's estimates and early rejections."""

from __future__ import annotations

import pytest

from halfmoon.conductor import (
    Conductor,
    ConductorConfig,
    FirstToken,
    LoadReport,
    PrefillFinished,
    PrefillStarted,
    RequestFinished,
)
from halfmoon.conductor.calibration import LatenessCalibration, PrefillCalibration
from halfmoon.conductor.state import PrefillState
from halfmoon.core.clock import ManualClock
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request
from halfmoon.costmodel.throughput import ThroughputCostModel

BLOCK = 16
#: 1,000 prompt tokens a second: a 480-token prompt is estimated at 0.48 s.
MODEL = ThroughputCostModel(1000.0, 1024, 1e9, 0.01, 1e-6)


def test_scale_moves_after_min_samples_and_stays_in_bounds() -> None:
    cal = PrefillCalibration(decay=1.0, min_samples=3)
    assert cal.observe(2.0, 1.0) == 1.0 and cal.observe(2.0, 1.0) == 1.0
    assert cal.observe(2.0, 1.0) == pytest.approx(2.0)
    assert cal.observe(5.0, 1.0) == pytest.approx(11 / 4)  # sums, not a mean of ratios
    assert cal.observe(-1.0, 1.0) == pytest.approx(11 / 4)  # nonsense samples are ignored
    assert cal.observe(1.0, 0.0) == pytest.approx(11 / 4) and cal.samples == 4
    fast = PrefillCalibration(min_samples=1, low=0.5)
    assert fast.observe(0.001, 1.0) == 0.5
    slow = PrefillCalibration(min_samples=1, high=4.0)
    assert slow.observe(100.0, 1.0) == 4.0


def test_decay_forgets_old_speed() -> None:
    cal = PrefillCalibration(decay=0.5, min_samples=1)
    for _ in range(3):
        cal.observe(3.0, 1.0)
    for _ in range(12):
        cal.observe(1.0, 1.0)
    assert cal.scale == pytest.approx(1.0, abs=1e-3)


@pytest.mark.parametrize("bad", [{"decay": 0.0}, {"min_samples": 0}, {"low": 2.0}])
def test_bad_settings_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        PrefillCalibration(**bad)


def test_busy_time_is_split_between_queued_prefills() -> None:
    """Three prefills announced together (a worker's engine queue), run one after the
    other: each sample is the time since the previous finish, not since its start."""
    seen: list[tuple[float, float]] = []

    class Recording(PrefillCalibration):
        def observe(self, busy_s: float, estimated_s: float, now_s: float = 0.0) -> float:
            seen.append((busy_s, estimated_s))
            return super().observe(busy_s, estimated_s, now_s)

    state = PrefillState("P1", MODEL, calibration=Recording(decay=1.0))
    for rid in ("a", "b", "c"):
        state.add(rid, 0.5, 500, estimated_s=0.5)
        state.start(rid, 10.0)
    state.finish("a", 11.0)
    state.finish("b", 12.5)
    state.finish("c", 13.0)
    assert seen == [(1.0, 0.5), (1.5, 0.5), (0.5, 0.5)]
    assert state.prefill_scale == pytest.approx(3.0 / 1.5)
    assert state.busy_mark_s is None
    # Idle time between prefills is not busy time.
    state.add("d", 0.5, 500, estimated_s=0.5)
    state.start("d", 20.0)
    state.finish("d", 21.0)
    assert seen[-1] == (1.0, 0.5)


def test_a_dropped_prefill_is_no_sample_and_bookings_without_estimate_are_none() -> None:
    state = PrefillState("P1", MODEL, calibration=PrefillCalibration(min_samples=1))
    state.add("a", 0.5, 500, estimated_s=0.5)
    state.add("g", 0.9, 500)  # e.g. a CPP stage: no plain estimate
    state.start("a", 0.0)
    state.start("g", 0.0)
    state.finish("a", 4.0, sample=False)
    state.finish("g", 5.0)
    assert state.calibration is not None and state.calibration.samples == 0
    assert state.prefill_scale == 1.0


def test_reported_queue_is_scaled() -> None:
    state = PrefillState("P1", MODEL, calibration=PrefillCalibration(min_samples=1))
    state.add("a", 0.5, 500, estimated_s=0.5)
    state.start("a", 0.0)
    state.finish("a", 1.5)
    assert state.prefill_scale == pytest.approx(3.0)
    state.report(1000, now_s=2.0)
    assert state.queue_s(2.0) == pytest.approx(3.0)


def _conductor(calibrate: bool, clock: ManualClock, stddevs: float = 0.0) -> Conductor:
    config = ConductorConfig(
        block_size_tokens=BLOCK,
        early_reject="snapshot",
        slo=SLOConfig(ttft_s=1.0, tbt_s=1.0),
        prefill_calibration=calibrate,
        lateness_stddevs=stddevs,
    )
    c = Conductor(config, MODEL, clock)
    c.add_prefill_instance("P1")
    c.add_decode_instance("D1")
    return c


def _request(n: int, tokens: int = 30 * BLOCK) -> Request:
    hashes = tuple(range(10**6 * n, 10**6 * n + tokens // BLOCK))
    return Request(f"r{n}", 0.0, tokens, 4, hashes, BLOCK)


@pytest.mark.parametrize("calibrate", [True, False])
def test_a_slow_instance_teaches_the_conductor_to_reject_early(calibrate: bool) -> None:
    """Prefills take 3x the cost model's 0.48 s: a calibrated Conductor learns it and
    rejects a prompt its estimate said would make the 1 s TTFT SLO; an uncalibrated one
    keeps admitting it (and it misses the SLO)."""
    clock = ManualClock()
    c = _conductor(calibrate, clock)
    for n in range(3):  # the calibration's min_samples
        d = c.schedule(_request(n))
        assert d.accepted, d.reject_reason
        c.handle(PrefillStarted("P1", d.request_id))
        clock.advance(3 * 0.48)
        c.handle(PrefillFinished("P1", d.request_id))
        c.handle(RequestFinished("D1", d.request_id))
        c.check_integrity()
    d = c.schedule(_request(99))
    if calibrate:
        assert c.prefill_calibration["P1"]["scale"] == pytest.approx(3.0)
        assert c.prefill_calibration["P1"]["samples"] == 3
        assert not d.accepted and "TTFT" in d.reject_reason
        assert d.prefill is not None and d.prefill.prefill_s == pytest.approx(1.44)
    else:
        assert c.prefill_calibration == {}
        assert d.accepted and d.prefill is not None
        assert d.prefill.prefill_s == pytest.approx(0.48)


def test_calibrated_queue_books_scaled_prefills() -> None:
    clock = ManualClock()
    c = _conductor(True, clock)
    for n in range(3):  # teach 2x
        d = c.schedule(_request(n, 10 * BLOCK))
        c.handle(PrefillStarted("P1", d.request_id))
        clock.advance(2 * 0.16)
        c.handle(PrefillFinished("P1", d.request_id))
        c.handle(RequestFinished("D1", d.request_id))
    assert c.prefill_calibration["P1"]["scale"] == pytest.approx(2.0)
    d = c.schedule(_request(50, 10 * BLOCK))
    assert d.accepted and d.prefill.prefill_s == pytest.approx(0.32)
    assert c.queue_s("P1") == pytest.approx(0.32)  # booked at the scaled estimate
    c.handle(LoadReport("P1", queued_prefill_tokens=400))
    assert c.queue_s("P1") == pytest.approx(0.8)  # a report's tokens are scaled too


def test_a_longer_cached_prefix_than_planned_is_not_a_faster_instance() -> None:
    """Placed with nothing cached (0.48 s for 480 tokens), the instance then found 320
    tokens cached (a prefill queued ahead stored them) and computed 160 in 0.16 s: the
    sample pairs 0.16 s with the estimate for what it computed, so the scale stays 1."""
    state = PrefillState("P1", MODEL, calibration=PrefillCalibration(min_samples=1))
    state.add("a", 0.48, 480, estimated_s=0.48, prompt_tokens=480)
    state.start("a", 0.0)
    state.finish("a", 0.16, cached_tokens=320)
    assert state.prefill_scale == pytest.approx(1.0)
    # Without the report the same run would have looked 3x faster than the model.
    blind = PrefillState("P1", MODEL, calibration=PrefillCalibration(min_samples=1))
    blind.add("a", 0.48, 480, estimated_s=0.48, prompt_tokens=480)
    blind.start("a", 0.0)
    blind.finish("a", 0.16)
    assert blind.prefill_scale == pytest.approx(1 / 3)


def test_the_service_passes_a_workers_cached_tokens_on() -> None:
    from halfmoon.serve.control.conductor_service import conductor_events
    from halfmoon.serve.control.messages import event_entry

    entries = [
        event_entry("prefill_finished", request_id="r", cached_tokens=32),
        event_entry("prefill_started", request_id="r"),
    ]
    assert conductor_events("P1", entries) == [
        PrefillFinished("P1", "r", 32),
        PrefillStarted("P1", "r"),
    ]


def test_prefills_announced_together_are_worked_through_one_at_a_time() -> None:
    """A live worker announces each prefill on arrival, so three can be "started" at
    once: after 0.5 s the instance has done 0.5 s of their 1.5 s, not 0.5 s of each."""
    state = PrefillState("P1", MODEL)
    for rid in ("a", "b", "c"):
        state.add(rid, 0.5, 500)
        state.start(rid, 10.0)
    assert state.queue_s(10.5) == pytest.approx(1.0)
    state.finish("a", 10.6)  # the busy time since this finish counts for the rest
    assert state.queue_s(10.6) == pytest.approx(1.0)
    assert state.queue_s(11.1) == pytest.approx(0.5)
    state.finish("b", 11.1)
    state.finish("c", 11.5)
    assert state.queue_s(11.5) == 0.0 and state.busy_mark_s is None
    assert state.started_pending_s == 0.0


def test_lateness_is_a_decayed_mean_never_below_zero() -> None:
    late = LatenessCalibration(decay=1.0, min_samples=2)
    assert late.observe(0.4) == 0.0  # not enough samples yet
    assert late.observe(0.2) == pytest.approx(0.3)
    assert late.observe(-2.0) == 0.0  # early on average: nothing added
    with pytest.raises(ValueError):
        LatenessCalibration(decay=1.5)


def test_lateness_adds_its_spread_when_asked() -> None:
    """Samples 0.1 and 0.5 (decay 1): mean 0.3, standard deviation 0.2; with 1.5
    standard deviations the held lateness is 0.6, and it still never goes below 0."""
    plain, wide = LatenessCalibration(decay=1.0), LatenessCalibration(decay=1.0, stddevs=1.5)
    for late in (0.1, 0.5, 0.1, 0.5):
        plain.observe(late)
        wide.observe(late)
    assert plain.learned_s == pytest.approx(0.3) and plain.std_s == pytest.approx(0.2)
    assert wide.learned_s == pytest.approx(0.6) and wide.mean_s == pytest.approx(0.3)
    steady = LatenessCalibration(decay=1.0, min_samples=1, stddevs=3.0)
    for _ in range(5):
        steady.observe(0.25)
    assert steady.std_s == pytest.approx(0.0, abs=1e-6)
    assert steady.learned_s == pytest.approx(0.25)  # no spread, no margin
    early = LatenessCalibration(decay=1.0, min_samples=1, stddevs=1.0)
    early.observe(-1.0)
    early.observe(-0.8)
    assert early.learned_s == 0.0  # -0.9 + 0.1: still early
    decayed = LatenessCalibration(decay=0.5, min_samples=1, stddevs=1.0)
    for late in (5.0, 5.0, 5.0):  # an old wide spell...
        decayed.observe(late)
    for _ in range(20):  # ...forgotten by steady samples
        decayed.observe(0.2)
    assert decayed.learned_s == pytest.approx(0.2, abs=0.01)
    for bad in (-0.1, 5.5, float("nan")):
        with pytest.raises(ValueError):
            LatenessCalibration(stddevs=bad)
        with pytest.raises(ValueError):
            ConductorConfig(lateness_stddevs=bad)


def test_the_conductor_holds_the_lateness_spread_against_the_slo() -> None:
    """First tokens come 0.1, 0.5 and 0.1 s after their estimates: held at its mean
    (~0.23 s) the lateness lets a 0.48 s prefill fit a 1 s SLO; with two standard
    deviations on top (~0.61 s) it does not, and the refusal names the learned lateness."""
    lates = (0.1, 0.5, 0.1)
    for stddevs, accepted in ((0.0, True), (2.0, False)):
        clock = ManualClock()
        c = _conductor(True, clock, stddevs)
        expected = LatenessCalibration(stddevs=stddevs)
        for n, late in enumerate(lates):
            d = c.schedule(_request(n))
            assert d.accepted, d.reject_reason
            c.handle(PrefillStarted("P1", d.request_id))
            clock.advance(0.48)
            c.handle(PrefillFinished("P1", d.request_id))
            clock.advance(late)
            c.handle(FirstToken("", d.request_id))
            c.handle(RequestFinished("D1", d.request_id))
            expected.observe(late)
        d = c.schedule(_request(99))
        assert d.accepted == accepted, (stddevs, d.reject_reason)
        assert c.ttft_lateness_s == pytest.approx(expected.learned_s, abs=1e-6)
        assert expected.learned_s == pytest.approx(0.233 + stddevs * 0.189, abs=0.005)
        if not accepted:
            assert "learned lateness" in d.why


def test_the_lateness_margin_flag_is_checked_and_preset() -> None:
    import argparse

    from halfmoon.conductor.options import add_conductor_options, conductor_config_from_args
    from halfmoon.core.errors import HalfmoonError

    for preset, default in (("paper", 0.0), ("live", 0.0)):
        parser = argparse.ArgumentParser()
        add_conductor_options(parser, preset)
        config = conductor_config_from_args(parser.parse_args([]), BLOCK)
        assert config.lateness_stddevs == default
        config = conductor_config_from_args(parser.parse_args(["--lateness-stddevs", "2"]), BLOCK)
        assert config.lateness_stddevs == 2.0
        with pytest.raises(HalfmoonError, match="--lateness-stddevs must be in"):
            conductor_config_from_args(parser.parse_args(["--lateness-stddevs", "-1"]), BLOCK)


def test_learned_values_relax_back_without_samples() -> None:
    """A bad spell learned, then no sample (everything rejected): the scale and the
    lateness come back halfway per half-life, so admissions resume and correct them."""
    cal = PrefillCalibration(min_samples=1, half_life_s=30.0)
    cal.observe(5.0, 1.0, now_s=100.0)
    assert cal.relax(100.0) == pytest.approx(5.0)
    assert cal.relax(130.0) == pytest.approx(3.0)
    assert cal.relax(400.0) == pytest.approx(1.0, abs=0.01)
    cal.observe(2.0, 1.0, now_s=401.0)  # a new sample: the decayed sums' ratio again
    assert cal.scale == pytest.approx((0.9 * 5.0 + 2.0) / (0.9 * 1.0 + 1.0))
    late = LatenessCalibration(min_samples=1, half_life_s=10.0)
    late.observe(40.0, now_s=0.0)
    assert late.at(0.0) == pytest.approx(40.0) and late.at(20.0) == pytest.approx(10.0)


@pytest.mark.parametrize("calibrate", [True, False])
def test_first_tokens_later_than_estimated_make_the_conductor_reject_earlier(
    calibrate: bool,
) -> None:
    """First tokens reach clients 0.6 s after the estimated TTFT (a hand-off no cost
    model prices): calibrated, the Conductor adds that to its estimates and refuses a
    0.48 s prefill under a 1 s SLO; uncalibrated, it admits it."""
    clock = ManualClock()
    c = _conductor(calibrate, clock)
    for n in range(3):
        d = c.schedule(_request(n))
        assert d.accepted, d.reject_reason
        c.handle(PrefillStarted("P1", d.request_id))
        clock.advance(0.48)
        c.handle(PrefillFinished("P1", d.request_id))
        clock.advance(0.6)
        c.handle(FirstToken("", d.request_id))
        c.handle(RequestFinished("D1", d.request_id))
        c.check_integrity()
    c.handle(FirstToken("", "never-placed"))  # ignored
    d = c.schedule(_request(99))
    if calibrate:
        assert c.ttft_lateness_s == pytest.approx(0.6) and c.lateness_samples == 3
        assert not d.accepted and "1.08s" in d.reject_reason
        assert "0.600s of it learned lateness" in d.why
    else:
        assert c.ttft_lateness_s == 0.0 and c.lateness_samples == 0
        assert d.accepted
