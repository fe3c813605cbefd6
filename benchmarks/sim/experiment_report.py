"""Plots and markdown tables for benchmarks.sim.experiments (one per experiment)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

POLICY_ORDER = ("random", "load-balance", "cache-aware", "kvcache-centric")
MODES = ("none", "snapshot", "predict")


def _figure(num_panels: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.0 * num_panels, 4.3), dpi=110, layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(1, num_panels, squeeze=False)[0]


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:+.0f}%"


# -- 1: policies ----------------------------------------------------------------------------
def plot_policies(result: Mapping[str, Any], img_dir: Path) -> Path:
    """Mean TTFT per policy against replay speed (log scale)."""
    rows = result["rows"].values()
    figure, (axes,) = _figure(1)
    for policy in POLICY_ORDER:
        points = sorted((r["time_scale"], r["ttft_mean_s"]) for r in rows if r["policy"] == policy)
        axes.plot(*zip(*points, strict=True), marker="o", label=policy)
    axes.set_yscale("log")
    axes.set_xlabel("replay speed (--time-scale)")
    axes.set_ylabel("mean TTFT (s)")
    axes.set_title("8P8D, synthetic trace: mean TTFT by policy")
    axes.grid(True, alpha=0.3, which="both")
    axes.legend()
    path = img_dir / "sim_policies.png"
    figure.savefig(path)
    return path


def table_policies(result: Mapping[str, Any], paper: Mapping[str, float]) -> str:
    """TTFT by policy per replay speed, with the paper's column."""
    rows = result["rows"].values()
    scales = sorted({r["time_scale"] for r in rows})
    head = (
        "| policy | "
        + " | ".join(f"x{s:g} mean TTFT s" for s in scales)
        + " | hit ratio | paper s |"
    )
    lines = [head, "|---|" + "---:|" * (len(scales) + 2)]
    for policy in POLICY_ORDER:
        by_scale = {r["time_scale"]: r for r in rows if r["policy"] == policy}
        cells = [_fmt(by_scale[s]["ttft_mean_s"]) for s in scales]
        hit = by_scale[result["headline_time_scale"]]["cache_hit_ratio"]
        lines.append(f"| {policy} | " + " | ".join(cells) + f" | {hit:.2f} | {paper[policy]} |")
    return "### 1. Scheduling policies (8P8D)\n\n" + "\n".join(lines)


# -- 2: coupled vs disaggregated ---------------------------------------------------------------
def plot_capacity(result: Mapping[str, Any], img_dir: Path) -> Path:
    """Effective request capacity at each load and TBT limit, per cluster."""
    rows = list(result["at_load"].values())
    tbts = sorted({r["tbt_s"] for r in rows})
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    figure, panels = _figure(len(tbts))
    for axes, tbt in zip(panels, tbts, strict=True):
        for cluster in clusters:
            points = sorted(
                (r["time_scale"], r["capacity"])
                for r in rows
                if r["tbt_s"] == tbt and r["cluster"] == cluster
            )
            axes.plot(*zip(*points, strict=True), marker="o", label=cluster)
        axes.set_title(f"TBT <= {tbt * 1e3:g} ms (top10mean), TTFT <= 30 s")
        axes.set_xlabel("replay speed (--time-scale)")
        axes.set_ylabel("effective request capacity")
        axes.set_ylim(0, 1.02)
        axes.grid(True, alpha=0.3)
        axes.legend()
    path = img_dir / "sim_coupled_vs_disaggregated.png"
    figure.savefig(path)
    return path


def table_capacity(result: Mapping[str, Any], paper: Mapping[float, float]) -> str:
    """Capacity at each load, and the fastest sustainable replay, per TBT limit."""
    rows = list(result["at_load"].values())
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    loads = sorted({r["time_scale"] for r in rows})
    lines = [
        "| TBT limit | load | "
        + " | ".join(f"{c} capacity (goodput)" for c in clusters)
        + " | 8P8D vs 16M | paper |",
        "|---|---|" + "---:|" * (len(clusters) + 2),
    ]
    for tbt in sorted({r["tbt_s"] for r in rows}):
        for load in loads:
            cell = {r["cluster"]: r for r in rows if r["tbt_s"] == tbt and r["time_scale"] == load}
            gain = cell["8P8D"]["capacity"] / cell["16M"]["capacity"] - 1
            cells = [
                f"{_fmt(cell[c]['capacity'], 3)} ({_fmt(cell[c]['goodput_rps'])})" for c in clusters
            ]
            lines.append(
                f"| {tbt * 1e3:g} ms | x{load:g} | "
                + " | ".join(cells)
                + f" | {_pct(gain)} | {_pct(paper[tbt])} |"
            )
    sustained = result["max_time_scale"]
    lines += [
        "",
        "| TBT limit | "
        + " | ".join(f"{c} max replay speed" for c in clusters)
        + " | 8P8D vs 16M |",
        "|---|" + "---:|" * (len(clusters) + 1),
    ]
    for tbt in sorted({r["tbt_s"] for r in rows}):
        speeds = [sustained[f"{tbt:g}/{c}"] for c in clusters]
        gain = sustained[f"{tbt:g}/8P8D"] / sustained[f"{tbt:g}/16M"] - 1
        lines.append(
            f"| {tbt * 1e3:g} ms | "
            + " | ".join(f"x{s:.2f}" for s in speeds)
            + f" | {_pct(gain)} |"
        )
    return "### 2. Coupled vs disaggregated (synthetic trace)\n\n" + "\n".join(lines)


# -- 3: long context -------------------------------------------------------------------------
def plot_long_context(result: Mapping[str, Any], img_dir: Path) -> Path:
    """Max rate within SLO per context length, per TBT metric."""
    rows = list(result.values())
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    figure, panels = _figure(len(metrics))
    for axes, metric in zip(panels, metrics, strict=True):
        mine = sorted((r for r in rows if r["metric"] == metric), key=lambda r: r["context_k"])
        ks = [r["context_k"] for r in mine]
        axes.plot(ks, [r["rate_3P1D"] for r in mine], marker="o", label="3P1D")
        axes.plot(ks, [r["rate_4M"] for r in mine], marker="s", label="4M")
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xticks(ks, [f"{k}k" for k in ks])
        axes.set_xlabel("prompt length")
        axes.set_ylabel("max rate with >= 90% in SLO (req/s)")
        axes.set_title(f"long-context datasets, per-request TBT = {metric}")
        axes.grid(True, alpha=0.3, which="both")
        axes.legend()
    path = img_dir / "sim_long_context.png"
    figure.savefig(path)
    return path


def table_long_context(result: Mapping[str, Any], paper: Mapping[int, float]) -> str:
    """Max rates and the disaggregated advantage per dataset and TBT metric."""
    lines = [
        "| TBT metric | dataset | TTFT SLO s | TBT SLO ms | 3P1D req/s | 4M req/s | advantage | paper |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result.values():
        lines.append(
            f"| {r['metric']} | longctx-{r['context_k']}k | {r['ttft_slo_s']:.1f} | "
            f"{r['tbt_slo_s'] * 1e3:.1f} | {r['rate_3P1D']:.3f} | {r['rate_4M']:.3f} | "
            f"{_pct(r['advantage'])} | {_pct(paper.get(r['context_k']))} |"
        )
    return "### 3. Long context, [3P1D] vs [4M]\n\n" + "\n".join(lines)


# -- 4: early rejection ----------------------------------------------------------------------
def plot_wasted(result: Mapping[str, Any], img_dir: Path) -> Path:
    """Wasted prefills per early-rejection mode, one group per (workload, speed); and the
    decode-bound run's decode load over time (``sim_decode_load.png``)."""
    rows = list(result["rows"].values())
    groups = list(dict.fromkeys((r["workload"], r["cluster"], r["time_scale"]) for r in rows))
    figure, (axes,) = _figure(1)
    figure.set_figwidth(9.0)
    width = 0.8 / len(MODES)
    for m, mode in enumerate(MODES):
        heights = [
            next(r["wasted"] for r in rows if (r["workload"], r["cluster"], r["time_scale"]) == g
                 and r["mode"] == mode)
            for g in groups
        ]  # fmt: skip
        bars = axes.bar([i + m * width for i in range(len(groups))], heights, width, label=mode)
        axes.bar_label(bars, fontsize=7)
    labels = [f"{c} x{s:g}\n{w}" for w, c, s in groups]
    axes.set_xticks([i + width for i in range(len(groups))], labels, fontsize=8)
    axes.set_yscale("symlog", linthresh=10)
    axes.set_ylabel("requests with wasted prefill")
    axes.set_title("overload: prefill done, then SLO missed")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend(title="early reject", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    path = img_dir / "sim_early_rejection.png"
    figure.savefig(path)
    plot_decode_load(result.get("decode_load_series", {}), img_dir)
    return path


def plot_decode_load(series: Mapping[str, Any], img_dir: Path) -> Path | None:
    """Each decode instance's estimated step over time, one panel per mode (the paper's
    decode-load figure)."""
    if not series:
        return None
    figure, panels = _figure(len(series))
    for axes, (mode, s) in zip(panels, series.items(), strict=True):
        for iid in (k for k in s if k.startswith("D")):
            axes.plot(s["t_s"], s[iid], lw=0.9, label=iid)
        axes.axhline(s["slo_ms"], color="k", ls="--", lw=0.8, label="TBT SLO")
        axes.set_title(f"early reject: {mode} (x{s['scale']:g})")
        axes.set_xlabel("time (s)")
        axes.set_ylabel("decode step, 10 s mean (ms)")
        axes.grid(True, alpha=0.3)
    panels[0].legend(fontsize=7)
    path = img_dir / "sim_decode_load.png"
    figure.savefig(path)
    return path


def table_wasted(result: Mapping[str, Any], paper: Mapping[str, int]) -> str:
    """Wasted prefills, early rejections, goodput and decode-load fluctuation per mode."""
    lines = [
        "| workload | cluster, TBT SLO | speed | early reject | wasted prefill | rejected early "
        "| refused after prefill | goodput req/s | decode batch mean (CV) | decode step ms "
        "mean (CV, CV within 30 s) | paper wasted |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"].values():
        paper_cell = paper[r["mode"]] if r["workload"] == "trace" and r["time_scale"] == 2 else ""
        lines.append(
            f"| {r['workload']} | {r['cluster']}, {r['tbt_ms']:g} ms | x{r['time_scale']:g} | "
            f"{r['mode']} | {r['wasted']} | {r['rejected_early']} | "
            f"{r['refused_after_prefill']} | {_fmt(r['goodput_rps'])} | "
            f"{_fmt(r['decode_batch_mean'], 1)} ({_fmt(r['decode_batch_cv'])}) | "
            f"{_fmt(r['decode_step_ms_mean'], 1)} ({_fmt(r['decode_step_cv'])}, "
            f"{_fmt(r['decode_step_cv_window'])}) | {paper_cell} |"
        )
    return "### 4. Early rejection under overload\n\n" + "\n".join(lines)
