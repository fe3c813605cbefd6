"""CDF plots of latencies, written as PNG files.

matplotlib is imported inside the functions, so ``import halfmoon.metrics`` stays fast.
Figures are drawn on an explicit Agg canvas rather than through ``pyplot``: no display is
needed and the process-wide pyplot backend and figure registry are left untouched.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from halfmoon.core.config import SLOConfig
from halfmoon.metrics.latency import request_tbt_s
from halfmoon.metrics.records import RequestRecord

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_DPI = 120


def plot_cdfs(
    series: Mapping[str, Sequence[float]],
    path: str | Path,
    xlabel: str,
    title: str,
    limit_s: float | None = None,
) -> Path:
    """Draw one empirical CDF per entry of ``series`` (label -> values) on one axis and
    write it to ``path`` as PNG; ``limit_s`` adds a dashed vertical line (an SLO).

    Returns the path written. Raises ValueError for no series, a value that is not
    finite, or a folder that does not exist.
    """
    out = _checked_path(path)
    figure = _new_figure(1)
    _draw_cdf(figure.axes[0], series, xlabel, title, limit_s)
    return _save(figure, out)


def plot_report(
    records_by_label: Mapping[str, Sequence[RequestRecord]],
    slo: SLOConfig,
    path: str | Path,
) -> Path:
    """A 1x2 figure for one or several runs: TTFT CDF and per-request TBT CDF (by
    ``slo.tbt_metric``) over completed requests, each with its SLO line. Returns the path.
    """
    out = _checked_path(path)
    if not records_by_label:
        raise ValueError("nothing to plot: no runs given")
    ttft_series: dict[str, list[float]] = {}
    tbt_series: dict[str, list[float]] = {}
    for label, records in records_by_label.items():
        completed = [record for record in records if record.completed]
        ttft_series[label] = [record.ttft_s for record in completed if record.ttft_s is not None]
        tbt_series[label] = [request_tbt_s(record, slo.tbt_metric) for record in completed]
    figure = _new_figure(2)
    ttft_axes, tbt_axes = figure.axes
    _draw_cdf(ttft_axes, ttft_series, "TTFT (s)", "Time to first token", slo.ttft_s)
    _draw_cdf(tbt_axes, tbt_series, f"TBT, {slo.tbt_metric} (s)", "Time between tokens", slo.tbt_s)
    return _save(figure, out)


def _checked_path(path: str | Path) -> Path:
    out = Path(path)
    if not out.parent.is_dir():
        raise ValueError(f"cannot write plot {out}: folder {out.parent} does not exist")
    return out


def _check_series(series: Mapping[str, Sequence[float]]) -> None:
    if not series:
        raise ValueError("nothing to plot: no series given")
    for label, values in series.items():
        for value in values:
            if not math.isfinite(value):
                raise ValueError(f"series {label!r} holds a value that is not finite ({value})")


def _new_figure(num_panels: int) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.0 * num_panels, 4.5), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    figure.subplots(1, num_panels, squeeze=False)
    return figure


def _draw_cdf(
    axes: Axes,
    series: Mapping[str, Sequence[float]],
    xlabel: str,
    title: str,
    limit_s: float | None,
) -> None:
    """Step-wise empirical CDF: after the i-th smallest value, a share (i+1)/n is covered."""
    _check_series(series)
    for label, values in series.items():
        ordered = sorted(values)
        if not ordered:
            # Keep the run in the legend so a missing curve is explained, not silent.
            axes.plot([], [], label=f"{label} (no data)")
            continue
        shares = [(index + 1) / len(ordered) for index in range(len(ordered))]
        axes.step([ordered[0], *ordered], [0.0, *shares], where="post", label=label)
    if limit_s is not None:
        axes.axvline(
            limit_s, color="black", linestyle="--", linewidth=1, label=f"SLO {limit_s:g} s"
        )
    axes.set_xlabel(xlabel)
    axes.set_ylabel("share of requests")
    axes.set_ylim(0.0, 1.02)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="lower right")


def _save(figure: Figure, out: Path) -> Path:
    figure.savefig(out, format="png")
    return out
