"""Human-readable tables of simulation reports (one run, or several side by side)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from halfmoon.metrics.format import fmt_ms, fmt_num
from halfmoon.workload.report import format_table

Report = Mapping[str, Any]


#: Rows of the comparison table: label and how to read it from a report.
_ROWS: tuple[tuple[str, Callable[[Report], str]], ...] = (
    ("requests", lambda r: fmt_num(r["num_requests"])),
    ("completed", lambda r: fmt_num(r["num_completed"])),
    ("rejected early", lambda r: fmt_num(r.get("num_rejected_early", r["num_rejected"]))),
    ("refused after prefill", lambda r: fmt_num(r.get("num_refused_after_prefill", 0))),
    ("wasted prefill", lambda r: fmt_num(r["num_wasted_prefill"])),
    ("TTFT mean (s)", lambda r: fmt_num(r["ttft_s"]["mean"], 2)),
    ("TTFT p90 (s)", lambda r: fmt_num(r["ttft_s"]["p90"], 2)),
    ("TTFT p99 (s)", lambda r: fmt_num(r["ttft_s"]["p99"], 2)),
    ("TBT mean (ms)", lambda r: fmt_ms(r["tbt_s"]["mean"])),
    ("TBT p90 (ms)", lambda r: fmt_ms(r["tbt_s"]["p90"])),
    ("TBT p99 (ms)", lambda r: fmt_ms(r["tbt_s"]["p99"])),
    ("SLO attainment", lambda r: fmt_num(r["slo_attainment"])),
    ("goodput (req/s)", lambda r: fmt_num(r["goodput_rps"], 2)),
    ("cache hit ratio", lambda r: fmt_num(r["cache_hit_ratio"])),
    ("decode batch mean (CV)", lambda r: _decode_load(r, "batch_mean", "batch_cv", 1)),
    ("decode step ms mean (CV)", lambda r: _decode_load(r, "step_ms_mean", "step_cv", 1)),
    ("duration (s)", lambda r: fmt_num(r["duration_s"], 1)),
)


def _decode_load(report: Report, mean_key: str, cv_key: str, digits: int) -> str:
    """A decode-load sample's mean and coefficient of variation (see sim/loadtrace.py)."""
    load = report.get("decode_load")
    if not load:
        return "-"
    return f"{fmt_num(load[mean_key], digits)} ({fmt_num(load[cv_key], 2)})"


def _slo_line(report: Report) -> str:
    slo = report["slo"]
    return (
        f"SLO: TTFT <= {slo['ttft_s']:g} s, TBT ({slo['tbt_metric']}) <= {slo['tbt_s'] * 1e3:g} ms"
    )


def format_priorities(report: Report) -> str | None:
    """Each priority's figures (``by_priority``: a run whose requests had priorities;
    simulated or measured), else None."""
    classes = report.get("by_priority")
    if not classes:
        return None
    rows = [
        [
            priority,
            fmt_num(c["num_requests"]),
            fmt_num(c["num_rejected"]),
            fmt_num(c["ttft_s"]["p50"], 2),
            fmt_num(c["ttft_s"]["p90"], 2),
            fmt_num(c["slo_attainment"]),
        ]
        for priority, c in classes.items()
    ]
    header = ["priority", "requests", "rejected", "TTFT p50 (s)", "TTFT p90 (s)", "SLO attainment"]
    return format_table(header, rows)


def format_report(report: Report) -> str:
    """One run: a title line, the metrics table, each priority's figures when the
    requests had priorities, and the SLO it was judged against."""
    title = (
        f"cluster {report.get('cluster', '?')}  policy {report.get('policy', '?')}  "
        f"early-reject {report.get('early_reject', 'none')}  "
        f"time-scale {report.get('time_scale', 1):g}"
    )
    rows = [[label, read(report)] for label, read in _ROWS]
    parts = [title, format_table(["metric", "value"], rows), format_priorities(report)]
    return "\n".join(part for part in (*parts, _slo_line(report)) if part is not None)


def format_comparison(reports: Mapping[str, Report]) -> str:
    """Several runs side by side, one column per label (same SLO assumed, printed once)."""
    if not reports:
        raise ValueError("nothing to compare: no reports given")
    labels = list(reports)
    rows = [[label, *(read(reports[k]) for k in labels)] for label, read in _ROWS]
    table = format_table(["metric", *labels], rows)
    return "\n".join((table, _slo_line(reports[labels[0]])))
