"""The evaluation results per point (cluster shape, workload, replay speed): live medians
over the repeats, the simulator's values, and each trace's offered rate. Shared by
``report.py`` (tables) and ``plots.py``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

from halfmoon.workload.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ("2M", "1P1D")

#: Metric name -> how to read it from a report (``loose`` reads the loose-SLO summary).
METRICS: dict[str, Callable[[dict], float | None]] = {
    "TTFT p50 (s)": lambda run: run["report"]["ttft_s"]["p50"],
    "TTFT p90 (s)": lambda run: run["report"]["ttft_s"]["p90"],
    "TBT p50 (ms)": lambda run: ms(run["report"]["tbt_s"]["p50"]),
    "TBT p90 (ms)": lambda run: ms(run["report"]["tbt_s"]["p90"]),
    "SLO att.": lambda run: run["report"]["slo_attainment"],
    "SLO att., TBT 300 ms": lambda run: run["loose"]["slo_attainment"],
    "goodput (req/s)": lambda run: run["report"]["goodput_rps"],
    "goodput, TBT 300 ms": lambda run: run["loose"]["goodput_rps"],
    "cache hit": lambda run: run["report"]["cache_hit_ratio"],
}


def ms(value: float | None) -> float | None:
    """Seconds -> milliseconds (None stays None)."""
    return None if value is None else value * 1e3


def live_medians(results: dict) -> dict[tuple[str, str, float], dict[str, float | None]]:
    """(shape, workload, speed) -> metric -> median over repeats."""
    groups: dict[tuple[str, str, float], list[dict]] = {}
    for run in results["runs"]:
        groups.setdefault((run["shape"], run["workload"], run["speed"]), []).append(run)
    out = {}
    for key, runs in groups.items():
        values = {}
        for name, read in METRICS.items():
            got = [v for v in (read(run) for run in runs) if v is not None]
            values[name] = statistics.median(got) if got else None
        values["num_repeats"] = len(runs)
        out[key] = values
    return out


def sim_values(
    results: dict, key: str = "sims"
) -> dict[tuple[str, str, float], dict[str, float | None]]:
    """(shape, workload, speed) -> metric -> the simulator's value (``key``: ``sims``,
    or ``ablation/<variant>`` for one subset of the serving terms; no loose SLO there)."""
    out = {}
    if key.startswith("ablation/"):
        entries = results.get("ablation", {}).get(key.split("/", 1)[1], ())
    else:
        entries = results.get(key, ())
    for s in entries:
        values = {}
        for name, read in METRICS.items():
            try:
                values[name] = read(s)
            except KeyError:
                values[name] = None
        out[(s["shape"], s["workload"], s["speed"])] = values
    return out


def offered_rates(results: dict) -> dict[str, float]:
    """Requests/s of each trace at speed x1 (n - 1 gaps over first-to-last arrival)."""
    rates = {}
    for name, path in results["traces"].items():
        requests = read_trace(ROOT / path if not Path(path).is_absolute() else path)
        span_s = requests[-1].arrival_time_s - requests[0].arrival_time_s
        rates[name] = (len(requests) - 1) / span_s
    return rates
