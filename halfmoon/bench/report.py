"""The benchmark's JSON report and its summary table.

The report is :func:`halfmoon.metrics.summarize` over the run's records — the keys of a
``halfmoon simulate`` report, so the two compare field by field — followed by what only a
live run knows (see :func:`bench_report`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from halfmoon.bench.runner import BenchRun
from halfmoon.core.config import SLOConfig
from halfmoon.metrics.format import fmt_ms, fmt_num
from halfmoon.metrics.latency import percentiles
from halfmoon.metrics.report import summarize, summarize_by_priority
from halfmoon.sim.report import format_priorities
from halfmoon.workload.report import format_table

Report = Mapping[str, Any]


def bench_report(
    run: BenchRun,
    slo: SLOConfig,
    extra: Mapping[str, Any],
    priority_of: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """``summarize(records)`` plus the live run's own entries:

    - ``num_output_tokens``: tokens the server reported generating (``usage``; token
      events counted where it sent none); ``output_tokens_per_s`` over the wall time;
    - ``num_short_outputs``: completed requests that got fewer tokens than asked for;
    - ``num_token_events`` / ``num_output_tokens``: below 1 when some events carried more
      than one token (their gaps then count once);
    - ``send_lag_s``: how late requests were sent against their plan (client overload);
    - ``wall_s``: the run's wall time; then ``extra`` (url, model, workload...);
    - ``by_priority`` (with ``priority_of``, request id -> priority, when it names any):
      each priority's figures, as ``halfmoon simulate`` reports them.
    """
    num_tokens = 0
    num_short = 0
    for record, stats in zip(run.records, run.stats, strict=True):
        got = stats.num_reported_tokens
        got = len(record.token_times_s) if got is None else got
        num_tokens += got
        if record.completed and got < record.output_length:
            num_short += 1
    live = {
        "num_output_tokens": num_tokens,
        "num_token_events": sum(stats.num_events for stats in run.stats),
        "num_short_outputs": num_short,
        "output_tokens_per_s": num_tokens / run.wall_s if run.wall_s > 0 else None,
        "send_lag_s": percentiles(run.send_lag_s, include_max=True),
        "wall_s": run.wall_s,
    }
    report = summarize(run.records, slo, extra={**live, **extra})
    if priority_of:
        report["by_priority"] = summarize_by_priority(run.records, priority_of, slo)
    return report


_ROWS: tuple[tuple[str, Callable[[Report], str]], ...] = (
    ("requests", lambda r: fmt_num(r["num_requests"])),
    ("completed", lambda r: fmt_num(r["num_completed"])),
    ("rejected (429)", lambda r: fmt_num(r["num_rejected"])),
    ("errors", lambda r: fmt_num(r["num_errors"])),
    ("TTFT p50 / p90 / p99 (s)", lambda r: " / ".join(fmt_num(r["ttft_s"][k]) for k in _P)),
    ("TBT p50 / p90 / p99 (ms)", lambda r: " / ".join(fmt_ms(r["tbt_s"][k]) for k in _P)),
    ("ITL p50 / p90 / p99 (ms)", lambda r: " / ".join(fmt_ms(r["itl_s"][k]) for k in _P)),
    ("E2E p50 / p90 (s)", lambda r: " / ".join(fmt_num(r["e2e_s"][k]) for k in _P[:2])),
    ("SLO attainment", lambda r: fmt_num(r["slo_attainment"])),
    ("goodput (req/s)", lambda r: fmt_num(r["goodput_rps"])),
    ("output tokens/s", lambda r: fmt_num(r.get("output_tokens_per_s"), 1)),
    ("cache hit ratio", lambda r: fmt_num(r["cache_hit_ratio"])),
    ("duration (s)", lambda r: fmt_num(r["duration_s"], 1)),
    ("max send lag (s)", lambda r: fmt_num(r.get("send_lag_s", {}).get("max"))),
)
_P = ("p50", "p90", "p99")


def format_bench(report: Report) -> str:
    """A title line, the metrics table, each priority's figures when the requests had
    priorities, and the SLO the run was judged against."""
    title = (
        f"{report.get('url', '?')}  model {report.get('model', '?')}  "
        f"workload {report.get('workload', '?')}  time-scale {report.get('time_scale', 1):g}"
    )
    rows = [[label, read(report)] for label, read in _ROWS]
    slo = report["slo"]
    slo_line = (
        f"SLO: TTFT <= {slo['ttft_s']:g} s, TBT ({slo['tbt_metric']}) <= {slo['tbt_s'] * 1e3:g} ms"
    )
    table = format_table(["metric", "value"], rows)
    parts = (title, table, format_priorities(report), slo_line)
    return "\n".join(part for part in parts if part is not None)
