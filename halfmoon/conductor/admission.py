"""Decode-side estimates and early rejection (the paper's admission control).

``snapshot`` looks at the decode batch as it is now; ``predict`` forecasts it for the
moment the request's prefill ends (the paper's load prediction)::

    at ready = now + estimated TTFT, on each decode instance:
      running request r (decoding for age_r):  stays with P(D > age_r + h | D > age_r),
                                               h = ready - now, D a decode duration
      placed request whose prefill ends at done <= ready:  joins, and stays with
                                               P(D > ready - done)
      context = what stays and joins, each grown by one token per step since it joined
    reject when the step of that batch plus this request exceeds the TBT SLO

The decode instance chosen is the one with the least predicted step among those whose KV
can hold the request now (the KV check is the snapshot's: running plus placed prompts).

The distribution of D is learned from observed decode durations (:class:`DecodeTimes`,
the last ``DURATION_WINDOW``); with ``decode_time_estimate_s`` configured it is the
paper's uniform t_d (a request leaves exactly t_d after it joined). With
``decode_time_by_prefix``, a request whose duration is predicted from its prompt's
first block (:mod:`halfmoon.conductor.lengths`) is weighed by the learned durations
scaled to that prediction (:meth:`DecodeTimes.own_stay_probability`). Either way a
request older than every duration seen (older than its t_d) is *not* assumed gone: it is
running, so it counts until it leaves.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque

import numpy as np

from halfmoon.conductor.config import ConductorConfig
from halfmoon.conductor.messages import DecodeCandidate, PrefillCandidate, RejectCode
from halfmoon.conductor.state import DecodeState
from halfmoon.core.request import Request

#: Observed decode durations the prediction's distribution is drawn from: recent ones,
#: since durations stretch as batches grow.
DURATION_WINDOW = 64
_TD_SMOOTHING = 0.05  # weight of a new observation in the moving average of t_d


class DecodeTimes:
    """Decode durations (join -> finish) as the Conductor learns them.

    ``mean_s`` is t_d: the configured value, or a moving average of observations (None
    before any). :meth:`stay_probability` draws on the last ``window`` observations.
    """

    def __init__(self, configured_s: float | None = None, window: int = DURATION_WINDOW):
        self.configured_s = configured_s
        self.mean_s = configured_s
        self._window = window
        self._recent: deque[float] = deque()
        self._sorted: list[float] = []
        self._sorted_array: np.ndarray | None = None  # _sorted for the vector form

    def observe(self, duration_s: float) -> None:
        """A request finished decoding after ``duration_s`` (ignored when configured)."""
        if self.configured_s is not None:
            return
        old = self.mean_s
        self.mean_s = duration_s if old is None else old + _TD_SMOOTHING * (duration_s - old)
        self._recent.append(duration_s)
        insort(self._sorted, duration_s)
        if len(self._recent) > self._window:
            del self._sorted[bisect_left(self._sorted, self._recent.popleft())]
        self._sorted_array = None

    def stay_probability(self, age_s: float, horizon_s: float, fallback_s: float) -> float:
        """P(a request decoding for ``age_s`` still decodes ``horizon_s`` later).

        Uniform t_d (configured, or ``fallback_s`` before any observation): 1 or 0.
        Learned: the share of the observed durations beyond ``age_s`` that also exceed
        ``age_s + horizon_s``; 1 when none exceeds ``age_s`` (no evidence it ends soon).
        """
        sample = self._sorted
        if self.configured_s is not None or not sample:
            t_d = self.configured_s if self.configured_s is not None else fallback_s
            return 0.0 if age_s < t_d <= age_s + horizon_s else 1.0
        n = len(sample)
        alive_now = n - bisect_right(sample, age_s)
        if alive_now == 0:
            return 1.0
        return (n - bisect_right(sample, age_s + horizon_s)) / alive_now

    @property
    def median_s(self) -> float | None:
        """The median of the durations drawn on (None: none yet, or t_d configured)."""
        sample = self._sorted
        if self.configured_s is not None or not sample:
            return None
        half = len(sample) // 2
        return sample[half] if len(sample) % 2 else (sample[half - 1] + sample[half]) / 2

    def own_stay_probability(self, age_s: float, horizon_s: float, t_d: float) -> float:
        """:meth:`stay_probability` of a request whose own duration is predicted as
        ``t_d`` (:mod:`halfmoon.conductor.lengths`): the learned durations scaled so that
        their median is ``t_d`` (the spread of all, the size of its own); before any
        observation, or with t_d configured, the uniform rule with its own t_d."""
        median = self.median_s
        if median is None or not t_d > 0:
            return 0.0 if age_s < t_d <= age_s + horizon_s else 1.0
        k = median / t_d
        return self.stay_probability(age_s * k, horizon_s * k, 0.0)

    def own_stay_probabilities(
        self, age_s: np.ndarray, horizon_s: np.ndarray, t_d: np.ndarray
    ) -> np.ndarray:
        """:meth:`own_stay_probability` of many requests at once, the same floats."""
        uniform = np.where((age_s < t_d) & (t_d <= age_s + horizon_s), 0.0, 1.0)
        median = self.median_s
        if median is None:
            return uniform
        positive = t_d > 0
        k = np.where(positive, median / np.where(positive, t_d, 1.0), 1.0)
        scaled = self.stay_probabilities(age_s * k, horizon_s * k, np.zeros_like(t_d))
        return np.where(positive, scaled, uniform)

    def stay_probabilities(
        self, age_s: np.ndarray | float, horizon_s: np.ndarray | float, fallback_s: np.ndarray
    ) -> np.ndarray:
        """:meth:`stay_probability` of many requests at once (arrays, or a value shared
        by all), the same floats element by element."""
        end_s = age_s + horizon_s
        if self.configured_s is not None or not self._sorted:
            t_d = self.configured_s if self.configured_s is not None else fallback_s
            return np.where((age_s < t_d) & (t_d <= end_s), 0.0, 1.0)
        if self._sorted_array is None:
            self._sorted_array = np.array(self._sorted)
        sample = self._sorted_array
        n = len(sample)
        alive_now = n - np.searchsorted(sample, age_s, side="right")
        left = n - np.searchsorted(sample, end_s, side="right")
        return np.where(alive_now > 0, left / np.maximum(alive_now, 1), 1.0)


def kv_need_tokens(request: Request, booking: str = "output") -> int:
    """The KV tokens ``request`` must find free on a decode instance under ``booking``
    (``ConductorConfig.decode_kv_booking``): prompt and output, or prompt and first token."""
    return request.input_length + (request.output_length if booking == "output" else 1)


def decode_candidate(request: Request, dstate: DecodeState) -> DecodeCandidate:
    """Estimated TBT on ``dstate`` once the request joins, counting its running and
    incoming requests as they are now (the snapshot's choice of decode instance)."""
    num = dstate.num_running + len(dstate.incoming) + 1
    ctx = dstate.committed_tokens + request.input_length
    return DecodeCandidate(dstate.instance_id, num, ctx, dstate.step_time_s(num, ctx))


def predicted_decode_candidate(
    request: Request,
    dstate: DecodeState,
    now_s: float,
    ready_s: float,
    times: DecodeTimes,
    booking: str = "output",
) -> DecodeCandidate:
    """Estimated TBT on ``dstate`` at ``ready_s`` (the request's prefill end) once it
    joins: the expected batch of the module docstring's prediction. The reference: a
    decision evaluates it on every instance at once (``loads.DecodeForecast``)."""
    horizon_s = max(0.0, ready_s - now_s)
    # seconds per token of each sequence (a step's, over its tokens when speculating)
    step_s = dstate.token_time_s(dstate.num_running, dstate.context_tokens)
    fallback_s = request.output_length * step_s  # t_d before any observation
    num, ctx = 1.0, float(request.input_length)
    predicted = dstate.predicted_s

    def stay(rid: str, age_s: float, span_s: float) -> float:
        t_d = predicted.get(rid)
        if t_d is None:
            return times.stay_probability(age_s, span_s, fallback_s)
        return times.own_stay_probability(age_s, span_s, t_d)

    for rid, (start_s, tokens) in dstate.running.items():
        p = stay(rid, now_s - start_s, horizon_s)
        if p > 0.0:
            num += p
            ctx += p * (tokens + (ready_s - start_s) / step_s)
    for rid, (done_s, tokens) in dstate.incoming.items():
        if done_s <= ready_s:  # joins by then, and may already have left again
            join_s = max(done_s, now_s)
            p = stay(rid, 0.0, ready_s - join_s)
            if p > 0.0:
                num += p
                ctx += p * (tokens + (ready_s - join_s) / step_s)
    n, c = round(num), round(ctx)
    if dstate.committed_tokens + kv_need_tokens(request, booking) > dstate.kv_capacity_tokens:
        # the KV check (the same as the snapshot's) would reject it here: prefer any
        # instance with room, however loaded it is predicted to be
        return DecodeCandidate(dstate.instance_id, n, c, float("inf"))
    return DecodeCandidate(dstate.instance_id, n, c, dstate.step_time_s(n, c))


def rejection_reason(
    config: ConductorConfig,
    request: Request,
    chosen: PrefillCandidate,
    decode: DecodeCandidate | None,
    dstate: DecodeState | None,
    now_s: float | None = None,
    ttft_s: float | None = None,
) -> tuple[str, str]:
    """Why the request must be rejected before any prefill work: (a
    :class:`RejectCode`, the text), or ("", "") to admit it. ``now_s`` (when given) lets
    the snapshot count the tokens the running requests generated since they joined;
    ``ttft_s``: the TTFT to hold against the SLO (default: the candidate's). A
    prefill-only request has no ``decode`` (None) and is held to its TTFT alone."""
    mode = config.early_reject
    if mode == "none" or request.admitted:  # a failed-over request was admitted once
        return "", ""
    slo = config.slo
    ttft = chosen.ttft_s if ttft_s is None else ttft_s
    if ttft > slo.ttft_s:
        return RejectCode.TTFT, (
            f"estimated TTFT {ttft:.2f}s on {chosen.label} exceeds the {slo.ttft_s:g}s SLO"
        )
    if request.prefill_only or decode is None or dstate is None:  # (never decoded)
        return "", ""
    need = kv_need_tokens(request, config.decode_kv_booking)
    if dstate.committed_tokens + need > dstate.kv_capacity_tokens:
        return RejectCode.KV_FULL, (
            f"decode KV full on {decode.instance_id}: {dstate.committed_tokens}+{need} "
            f"tokens > capacity {dstate.kv_capacity_tokens}"
        )
    if mode == "snapshot":
        num = dstate.num_running + 1
        ctx = dstate.context_tokens if now_s is None else dstate.context_tokens_at(now_s)
        tbt_s = dstate.step_time_s(num, ctx + request.input_length)
    else:
        tbt_s = decode.est_tbt_s
    if tbt_s > slo.tbt_s:
        return RejectCode.TBT, (
            f"estimated TBT {tbt_s * 1e3:.1f}ms on {decode.instance_id} ({mode}) "
            f"exceeds the {slo.tbt_s * 1e3:g}ms SLO"
        )
    return "", ""
