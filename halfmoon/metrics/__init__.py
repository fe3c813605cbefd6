"""Request latency metrics shared by the simulator and the benchmark client.

Per-request records (:class:`RequestRecord`) -> TTFT, TBT by two definitions (``p90`` of
a request's gaps, or FAST'25's ``top10mean``), SLO attainment, effective request capacity,
goodput and the JSON run report (:func:`summarize`). Plots live in
:mod:`halfmoon.metrics.plots`, which imports matplotlib only when a plot is drawn.
"""

from halfmoon.metrics.latency import (
    percentiles,
    request_tbt_s,
    tbt_from_gaps_s,
    tbt_gaps_s,
    tbt_p90,
    tbt_top10mean,
)
from halfmoon.metrics.plots import plot_cdfs, plot_report
from halfmoon.metrics.records import RequestRecord, records_from_json, records_to_json
from halfmoon.metrics.report import REPORT_KEYS, cache_hit_ratio, summarize
from halfmoon.metrics.slo import (
    effective_request_capacity,
    goodput_rps,
    goodput_window_s,
    meets_slo,
    num_meeting_slo,
    observation_window_s,
    offered_rps,
    offered_window_s,
    rate_meeting,
    share_meeting,
    slo_attainment,
)

__all__ = [
    "REPORT_KEYS",
    "RequestRecord",
    "cache_hit_ratio",
    "effective_request_capacity",
    "goodput_rps",
    "goodput_window_s",
    "meets_slo",
    "num_meeting_slo",
    "observation_window_s",
    "offered_rps",
    "offered_window_s",
    "percentiles",
    "plot_cdfs",
    "plot_report",
    "records_from_json",
    "records_to_json",
    "request_tbt_s",
    "rate_meeting",
    "share_meeting",
    "slo_attainment",
    "summarize",
    "tbt_from_gaps_s",
    "tbt_gaps_s",
    "tbt_p90",
    "tbt_top10mean",
]
