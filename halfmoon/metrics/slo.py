"""SLO verdicts over request records: attainment, effective request capacity, goodput.

Denominators are chosen so that a system cannot look better by refusing work:

- :func:`slo_attainment` is the share of ALL submitted requests that completed and met
  both limits. Rejected, errored and unfinished requests count as misses.
- :func:`effective_request_capacity` is the same number under the name the FAST'25 paper
  uses ("share of requests meeting both limits"); it exists so comparisons between two
  clusters read like the paper's (a ratio of this value on one workload).
- :func:`goodput_rps` counts the same requests per second of the *offered* window
  (:func:`offered_window_s`): the time over which the requests arrived, not the drain
  after the last arrival. A cluster that meets the SLO for every request has goodput
  equal to the offered rate however long its queue takes to empty; a slow drain costs
  goodput only through the requests that miss their SLO. (Dividing by first arrival to
  last finish made a short run's goodput depend on its tail: two clusters with the same
  attainment differed by their drain time, and live and simulated runs by theirs.)

An undefined quantity (no records, a window of zero length) is None, never NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

from halfmoon.core.config import SLOConfig
from halfmoon.metrics.latency import request_tbt_s
from halfmoon.metrics.records import RequestRecord


def meets_slo(record: RequestRecord, slo: SLOConfig) -> bool:
    """True when the request completed (not rejected, no error) with TTFT <= ``slo.ttft_s``
    and its TBT, by ``slo.tbt_metric``, <= ``slo.tbt_s``. Limits are inclusive."""
    ttft_s = record.ttft_s
    if not record.completed or ttft_s is None:
        return False
    return within_slo(ttft_s, request_tbt_s(record, slo.tbt_metric), slo)


def within_slo(ttft_s: float, tbt_s: float, slo: SLOConfig) -> bool:
    """Both latencies of a completed request within their (inclusive) limits."""
    return ttft_s <= slo.ttft_s and tbt_s <= slo.tbt_s


def num_meeting_slo(records: Sequence[RequestRecord], slo: SLOConfig) -> int:
    """How many records meet both SLOs."""
    return sum(1 for record in records if meets_slo(record, slo))


def slo_attainment(records: Sequence[RequestRecord], slo: SLOConfig) -> float | None:
    """Share of all submitted requests (rejected ones included, as misses) that completed
    within both SLOs; None for no records."""
    return share_meeting(num_meeting_slo(records, slo), len(records))


def share_meeting(num_meeting: int, num_requests: int) -> float | None:
    """``num_meeting / num_requests``; None for no requests. The arithmetic behind
    :func:`slo_attainment`, for callers that already counted (the report)."""
    if num_requests == 0:
        return None
    return num_meeting / num_requests


def effective_request_capacity(records: Sequence[RequestRecord], slo: SLOConfig) -> float | None:
    """FAST'25's effective request capacity: the share of requests meeting both limits.

    Identical to :func:`slo_attainment` by definition; the paper's "+62% effective
    request capacity" is the ratio of this value between two systems on one workload.
    """
    return slo_attainment(records, slo)


def observation_window_s(records: Sequence[RequestRecord]) -> float | None:
    """Seconds from the first arrival to the last thing observed (a finish, a token, a
    prefill completion or an arrival); None for no records.

    When the run ends with a finished request, as runs normally do, this is the last
    finish minus the first arrival. Using the latest observation rather than the latest
    finish keeps the window defined when nothing finished (e.g. all rejected).
    """
    if not records:
        return None
    start_s = min(record.arrival_s for record in records)
    end_s = max(_last_observed_s(record) for record in records)
    return end_s - start_s


def _last_observed_s(record: RequestRecord) -> float:
    candidates = [record.arrival_s]
    candidates += [t for t in (record.finish_s, record.prefill_done_s) if t is not None]
    if record.token_times_s:
        candidates.append(record.token_times_s[-1])
    return max(candidates)


def offered_window_s(records: Sequence[RequestRecord]) -> float | None:
    """The arrivals' span as ``N`` mean inter-arrival times: (last - first arrival) *
    N / (N - 1), so ``N / window`` is the offered rate. None for fewer than two records
    or when all arrive at once."""
    if len(records) < 2:
        return None
    arrivals = [record.arrival_s for record in records]
    span_s = max(arrivals) - min(arrivals)
    if span_s <= 0:
        return None
    return span_s * len(records) / (len(records) - 1)


def goodput_window_s(records: Sequence[RequestRecord]) -> float | None:
    """The window goodput divides by: :func:`offered_window_s`, or for a run without an
    arrival span (one request, a burst) :func:`observation_window_s`."""
    return offered_window_s(records) or observation_window_s(records)


def offered_rps(records: Sequence[RequestRecord]) -> float | None:
    """Requests per second offered (see :func:`offered_window_s`); None if undefined."""
    window_s = offered_window_s(records)
    return len(records) / window_s if window_s else None


def goodput_rps(
    records: Sequence[RequestRecord], slo: SLOConfig, duration_s: float | None = None
) -> float | None:
    """Requests that completed within both SLOs, per second of ``duration_s``.

    ``duration_s`` defaults to :func:`goodput_window_s` (the offered window). Returns
    None when the window is undefined or zero (no records, or one instant); raises
    ValueError for a given duration that is not positive.
    """
    window_s = goodput_window_s(records) if duration_s is None else duration_s
    return rate_meeting(num_meeting_slo(records, slo), window_s, given=duration_s is not None)


def rate_meeting(num_meeting: int, duration_s: float | None, given: bool = True) -> float | None:
    """``num_meeting / duration_s``, the arithmetic behind :func:`goodput_rps`.

    A ``given`` duration must be positive (ValueError otherwise); a measured window that
    is None or zero makes the rate undefined: None.
    """
    if given and not (duration_s is not None and duration_s > 0):
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if not duration_s:
        return None
    return num_meeting / duration_s
