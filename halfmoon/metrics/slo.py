"""SLO verdicts over request records: attainment, effective request capacity, goodput.

Denominators are chosen so that a system cannot look better by refusing work:

- :func:`slo_attainment` is the share of ALL submitted requests that completed and met
  both limits. Rejected, errored and unfinished requests count as misses.
- :func:`effective_request_capacity` is the same number under the name the FAST'25 paper
  uses ("share of requests meeting both limits"); it exists so comparisons between two
  clusters read like the paper's (a ratio of this value on one workload).
- :func:`goodput_rps` counts the same requests per second of the observation window.

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


def goodput_rps(
    records: Sequence[RequestRecord], slo: SLOConfig, duration_s: float | None = None
) -> float | None:
    """Requests that completed within both SLOs, per second of ``duration_s``.

    ``duration_s`` defaults to :func:`observation_window_s`. Returns None when the window
    is undefined or zero (no records, or one instant); raises ValueError for a given
    duration that is not positive.
    """
    window_s = observation_window_s(records) if duration_s is None else duration_s
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
