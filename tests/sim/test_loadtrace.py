"""Decode-load samples: run-wide and windowed coefficient of variation."""

import pytest

from halfmoon.sim.loadtrace import DecodeLoadSampler


class _Decode:
    def __init__(self) -> None:
        self.num_running = 0

    def step_now_s(self) -> float:
        return self.num_running / 1000


def test_swing_and_trend_are_told_apart() -> None:
    swing, trend = _Decode(), _Decode()
    sampler = DecodeLoadSampler({"D1": swing, "D2": trend})
    for t in range(120):  # one sample per second, 30 s windows
        swing.num_running = 20 if (t // 5) % 2 == 0 else 10  # 10 <-> 20 every 5 s
        trend.num_running = t  # 0, 1, ..., 119
        sampler.sample(float(t))
    load = sampler.summary()
    assert load["num_samples"] == 120
    assert load["batch_mean"] == pytest.approx((15 + 59.5) / 2)
    swing_cv, trend_cv = 5 / 15, (119 * 121 / 12) ** 0.5 / 59.5
    assert load["batch_cv"] == pytest.approx((swing_cv + trend_cv) / 2)
    # within 30 s the trend spreads only over 30 values: std sqrt((30^2 - 1) / 12)
    assert load["batch_cv_window"] == pytest.approx((swing_cv + (899 / 12) ** 0.5 / 59.5) / 2)
    assert load["step_cv"] == pytest.approx(load["batch_cv"])


def test_no_decode_instances_no_summary() -> None:
    sampler = DecodeLoadSampler({})
    sampler.sample(1.0)
    assert sampler.summary() is None
