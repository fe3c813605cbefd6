"""The JSON run report shared by ``halfmoon simulate`` and ``halfmoon bench``.

Both commands build it with :func:`summarize` from the same :class:`RequestRecord` list
shape, so a simulated run and a measured one can be compared key by key. The keys, in
order, are :data:`REPORT_KEYS`; callers append their own (``policy``, ``cluster``...)
through ``extra``.

Which requests each entry covers:

- ``num_completed``: finished normally (see :attr:`RequestRecord.completed`).
- ``num_rejected``: refused by admission. ``num_errors``: not rejected but ``error`` set.
  Requests still running are counted only in ``num_requests``.
- ``num_wasted_prefill``: prefill finished (``prefill_done_s`` set) but the request then
  did not meet its SLO: rejected after prefill, errored, or too slow.
- ``ttft_s``, ``tbt_s``, ``e2e_s``: over completed requests; ``tbt_s`` is each request's
  TBT by the SLO's metric (0 for single-token requests). ``itl_s`` pools every
  inter-token gap of the completed requests.
- ``slo_attainment`` over all submitted requests; ``goodput_rps`` over the offered
  window (the arrivals' span, :func:`~halfmoon.metrics.slo.goodput_window_s`; the drain
  after the last arrival is not in it) unless ``duration_s`` is given;
  ``offered_rps`` the arrival rate; ``duration_s`` is the observation window (first
  arrival to last finish) unless given; ``cache_hit_ratio`` = cached prompt tokens /
  prompt tokens of the non-rejected requests.

Undefined values are None (JSON ``null``); the report never holds NaN or infinity.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from halfmoon.core.config import SLOConfig
from halfmoon.metrics.latency import percentiles, tbt_from_gaps_s
from halfmoon.metrics.records import RequestRecord
from halfmoon.metrics.slo import (
    goodput_window_s,
    observation_window_s,
    offered_rps,
    rate_meeting,
    share_meeting,
    within_slo,
)

REPORT_KEYS = (
    "num_requests",
    "num_completed",
    "num_rejected",
    "num_errors",
    "num_wasted_prefill",
    "ttft_s",
    "tbt_s",
    "itl_s",
    "e2e_s",
    "slo_attainment",
    "goodput_rps",
    "offered_rps",
    "cache_hit_ratio",
    "duration_s",
    "slo",
)


def summarize(
    records: Sequence[RequestRecord],
    slo: SLOConfig,
    duration_s: float | None = None,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The run report: :data:`REPORT_KEYS` in order, then the entries of ``extra``.

    Raises ValueError when ``duration_s`` is not positive, when ``extra`` reuses a report
    key, or when ``extra`` cannot be written as strict JSON.
    """
    completed = [record for record in records if record.completed]
    # Gaps and TBT once per completed request: the SLO verdicts, the TBT and the pooled
    # ITL distributions all come from them (a report may cover millions of tokens).
    gaps_by_request = [record.tbt_gaps_s for record in completed]
    tbts_s = [tbt_from_gaps_s(gaps, slo.tbt_metric) for gaps in gaps_by_request]
    verdicts = _slo_verdicts(records, tbts_s, slo)
    num_meeting = sum(verdicts)
    window_s = observation_window_s(records) if duration_s is None else float(duration_s)
    goodput_s = goodput_window_s(records) if duration_s is None else float(duration_s)
    report: dict[str, Any] = {
        "num_requests": len(records),
        "num_completed": len(completed),
        "num_rejected": sum(1 for record in records if record.rejected),
        "num_errors": sum(1 for record in records if record.error and not record.rejected),
        "num_wasted_prefill": sum(
            1
            for record, met in zip(records, verdicts, strict=True)
            if record.prefill_done_s is not None and not met
        ),
        "ttft_s": percentiles(record.ttft_s for record in completed),
        "tbt_s": percentiles(tbts_s),
        "itl_s": percentiles(gap for gaps in gaps_by_request for gap in gaps),
        "e2e_s": percentiles(record.e2e_s for record in completed),
        "slo_attainment": share_meeting(num_meeting, len(records)),
        "goodput_rps": rate_meeting(num_meeting, goodput_s, given=duration_s is not None),
        "offered_rps": offered_rps(records),
        "cache_hit_ratio": cache_hit_ratio(records),
        "duration_s": window_s,
        "slo": {
            "ttft_s": float(slo.ttft_s),
            "tbt_s": float(slo.tbt_s),
            "tbt_metric": slo.tbt_metric,
        },
    }
    if extra:
        _merge_extra(report, extra)
    return report


def summarize_by_priority(
    records: Sequence[RequestRecord], priority_of: Mapping[str, int], slo: SLOConfig
) -> dict[str, dict[str, Any]]:
    """Each priority's requests summarized apart (``priority_of``: request id ->
    priority; the others have 0), keyed by the priority as text, lowest first: how many,
    rejected, completed, TTFT, SLO attainment (the :func:`summarize` entries)."""
    classes: dict[int, list[RequestRecord]] = {}
    for record in records:
        classes.setdefault(priority_of.get(record.request_id, 0), []).append(record)
    out = {}
    for priority in sorted(classes):
        part = summarize(classes[priority], slo)
        keys = ("num_requests", "num_rejected", "num_completed", "ttft_s", "slo_attainment")
        out[str(priority)] = {key: part[key] for key in keys}
    return out


def cache_hit_ratio(records: Sequence[RequestRecord]) -> float | None:
    """Cached prompt tokens / prompt tokens over non-rejected requests; None if no tokens."""
    admitted = [record for record in records if not record.rejected]
    num_input_tokens = sum(record.input_length for record in admitted)
    if num_input_tokens == 0:
        return None
    return sum(record.cached_tokens for record in admitted) / num_input_tokens


def _slo_verdicts(
    records: Sequence[RequestRecord], completed_tbts_s: Sequence[float], slo: SLOConfig
) -> list[bool]:
    """:func:`meets_slo` for every record, reusing the TBTs already computed for the
    completed records (given in the order they appear)."""
    tbts_s = iter(completed_tbts_s)
    verdicts = []
    for record in records:
        if not record.completed:
            verdicts.append(False)
            continue
        tbt_s, ttft_s = next(tbts_s), record.ttft_s
        verdicts.append(ttft_s is not None and within_slo(ttft_s, tbt_s, slo))
    return verdicts


def _merge_extra(report: dict[str, Any], extra: Mapping[str, Any]) -> None:
    clashes = sorted(set(extra) & set(report))
    if clashes:
        raise ValueError(f"extra report entries would overwrite {', '.join(clashes)}")
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extra report entries are not valid JSON: {exc}") from exc
    report.update(extra)
