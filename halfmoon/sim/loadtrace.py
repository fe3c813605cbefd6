"""The decode instances' load over time, sampled at each arrival (no events of its own).

The paper's overload figure plots the decoding instances' load over time: prefill and
decode load swing in anti-phase, and early rejection based on prediction is meant to
damp the swing. The first arrival at least ``SAMPLE_INTERVAL_S`` after the previous
sample records, per decode instance, the running batch size and the step time of that
batch as the instance runs it (what the TBT SLO binds on; with ``speculation_blind``
more than the guard estimates): samples about evenly spaced in time, so their
mean and spread are the load's over the run. The cost is one step estimate per decode
instance per sample, independent of the arrival rate (a cluster 32 times larger, with 32
times the arrivals, samples as often).

``summary()`` (the report's ``decode_load``): ``batch_mean`` and ``step_ms_mean`` over
every sample of every instance, ``batch_cv`` / ``step_cv`` the coefficient of variation
(std / mean) of each instance's series averaged over the instances (0 for an instance
that never ran), ``batch_cv_window`` / ``step_cv_window`` the same with the std taken
within windows of ``WINDOW_S`` seconds and averaged over them (the swing around the
load's trend, which the run-wide CV mixes with the trace's own ups and downs),
``step_ms_p99`` pooled, ``num_samples`` per instance.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

#: Window of the short-term spread (``*_cv_window``), in simulated seconds.
WINDOW_S = 30.0
#: Least simulated time between two samples.
SAMPLE_INTERVAL_S = 1.0


class _Decoder(Protocol):
    @property
    def num_running(self) -> int: ...

    def step_now_s(self) -> float: ...


class DecodeLoadSampler:
    """Per-instance samples of batch size and estimated step time (``sample`` at each
    arrival, recording at most one per ``SAMPLE_INTERVAL_S``); ``times_s`` and the
    per-instance lists make the figure."""

    def __init__(self, instances: Mapping[str, _Decoder]) -> None:
        self._instances = instances
        self.times_s: list[float] = []
        self.batch: dict[str, list[int]] = {iid: [] for iid in instances}
        self.step_s: dict[str, list[float]] = {iid: [] for iid in instances}

    def sample(self, now_s: float) -> None:
        """Record every decode instance's load now. An instance that joins later (a role
        change) has zeros for the samples before it; one that left has zeros after."""
        if not self._instances and not self.batch:
            return
        if self.times_s and now_s < self.times_s[-1] + SAMPLE_INTERVAL_S:
            return
        before = len(self.times_s)
        self.times_s.append(now_s)
        for iid in self._instances.keys() - self.batch.keys():
            self.batch[iid] = [0] * before
            self.step_s[iid] = [0.0] * before
        for iid in self.batch:
            instance = self._instances.get(iid)
            self.batch[iid].append(0 if instance is None else instance.num_running)
            self.step_s[iid].append(0.0 if instance is None else instance.step_now_s())

    def summary(self) -> dict[str, Any] | None:
        """Mean, spread and tail of the samples (None without decode instances or
        samples)."""
        if not self.batch or not self.times_s:
            return None
        batch = np.array(list(self.batch.values()), dtype=float)
        step_ms = np.array(list(self.step_s.values())) * 1e3
        window = (np.array(self.times_s) // WINDOW_S).astype(np.intp)
        return {
            "batch_mean": float(batch.mean()),
            "batch_cv": _mean_cv(batch),
            "batch_cv_window": _mean_cv(batch, window),
            "step_ms_mean": float(step_ms.mean()),
            "step_cv": _mean_cv(step_ms),
            "step_cv_window": _mean_cv(step_ms, window),
            "step_ms_p99": float(np.percentile(step_ms, 99)),
            "num_samples": len(self.times_s),
        }


def _mean_cv(rows: np.ndarray, window: np.ndarray | None = None) -> float:
    """std / mean of each row (an instance's series), averaged over the rows; with
    ``window`` (each sample's window number) the std is each window's, averaged."""
    mean = rows.mean(axis=1)
    if window is None:
        std = rows.std(axis=1)
    else:
        counts = np.bincount(window)
        sums = np.array([np.bincount(window, row, len(counts)) for row in rows])
        squares = np.array([np.bincount(window, row * row, len(counts)) for row in rows])
        used = counts > 0
        win_mean = sums[:, used] / counts[used]
        win_var = np.maximum(squares[:, used] / counts[used] - win_mean**2, 0.0)
        std = np.sqrt(win_var).mean(axis=1)
    cv = np.divide(std, mean, out=np.zeros_like(std), where=mean > 0)
    return float(cv.mean())
