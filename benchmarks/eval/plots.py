"""Plots of the evaluation (``report.py`` calls them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from halfmoon.core.config import SLOConfig
from halfmoon.metrics.plots import plot_report
from halfmoon.metrics.records import records_from_json

from .points import SHAPES, live_medians, offered_rates, sim_values

COLORS = {"2M": "tab:red", "1P1D": "tab:blue"}
PANELS = (("TTFT p90 (s)", "TTFT p90 (s)"), ("TBT p90 (ms)", "per-request TBT p90 (ms)"),
          ("SLO att.", "SLO attainment (TTFT 2 s, TBT 100 ms)"))  # fmt: skip


def plot_rates(results: dict[str, Any], path: Path) -> Path:
    """Rows: docqa, short; columns: TTFT p90, TBT p90, SLO attainment against the offered
    rate, live (solid, medians) and simulated (dashed)."""
    live, sim, rates = live_medians(results), sim_values(results), offered_rates(results)
    workloads = ("docqa", "short")
    figure = Figure(figsize=(15, 8.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(workloads), len(PANELS), squeeze=False)
    for row, workload in enumerate(workloads):
        speeds = results["config"]["points"][workload]
        xs = [rates[workload] * s for s in speeds]
        for col, (name, label) in enumerate(PANELS):
            ax = axes[row][col]
            for shape in SHAPES:
                for source, style, tag in ((live, "-o", "live"), (sim, "--x", "sim")):
                    ys = [source.get((shape, workload, s), {}).get(name) for s in speeds]
                    pts = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
                    if pts:
                        ax.plot(*zip(*pts, strict=True), style, color=COLORS[shape],
                                label=f"{shape} {tag}")  # fmt: skip
            if name.startswith("SLO"):
                ax.set_ylim(0.0, 1.05)
            ax.set_xlabel(f"{workload}: offered requests/s")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            if name.startswith("TTFT") or name.startswith("TBT"):
                ax.set_yscale("log")
    axes[0][0].legend(loc="upper left")
    figure.savefig(path, format="png")
    return path


def plot_cache(results: dict[str, Any], path: Path) -> Path:
    """TTFT p50 / p90 with the shared-prefix workload (cache on) and with nothing shared
    (off), per cluster and speed."""
    live, rates = live_medians(results), offered_rates(results)
    speeds = results["config"]["points"].get("docqa-unshared", ())
    figure = Figure(figsize=(6 * max(1, len(speeds)), 4.5), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, max(1, len(speeds)), squeeze=False)[0]
    labels = [f"{shape}\ncache {state}" for shape in SHAPES for state in ("on", "off")]
    for ax, speed in zip(axes, speeds, strict=False):
        for offset, name in ((-0.2, "TTFT p50 (s)"), (0.2, "TTFT p90 (s)")):
            values = [
                live.get((shape, w, speed), {}).get(name) or 0.0
                for shape in SHAPES for w in ("docqa", "docqa-unshared")
            ]  # fmt: skip
            ax.bar([i + offset for i in range(len(values))], values, width=0.4, label=name)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_title(f"docqa at {rates['docqa'] * speed:.1f} requests/s")
        ax.set_ylabel("seconds")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend()
    figure.savefig(path, format="png")
    return path


def plot_cdfs(results: dict[str, Any], runs_dir: Path, workload: str, speed: float, path: Path):
    """TTFT and TBT CDFs of both clusters at one point (first repeat's records)."""
    slo = SLOConfig(**results["config"]["slo"])
    series = {}
    for shape in SHAPES:
        stem = runs_dir / f"{shape}-{workload}-x{speed:g}-r0.records.json"
        if not stem.exists():
            return None
        series[shape] = records_from_json(json.loads(stem.read_text()))
    return plot_report(series, slo, path)
