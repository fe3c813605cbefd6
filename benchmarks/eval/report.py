"""Tables (markdown) and plots of the evaluation results (``benchmarks.eval.serving``).

Run: .venv/bin/python -m benchmarks.eval.report [--results benchmarks/results/eval.json]
         [--md benchmarks/results/eval.md] [--img-dir docs/img]

Live figures are medians over the repeats of each (shape, workload, speed); the
simulator is deterministic and runs once per point. Simulator error = sim / live - 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .points import METRICS, SHAPES, live_medians, ms, offered_rates, sim_values

ROOT = Path(__file__).resolve().parents[2]
Report = dict[str, Any]

FIDELITY = (
    "TTFT p50 (s)", "TTFT p90 (s)", "TBT p50 (ms)", "TBT p90 (ms)", "SLO att.", "goodput (req/s)",
)  # fmt: skip


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.{digits}g}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def table_shapes(results: dict, workload: str) -> str:
    """2M vs 1P1D at each speed of ``workload`` (live medians)."""
    live, rates = live_medians(results), offered_rates(results)
    names = [n for n in METRICS if n != "cache hit"]
    rows = []
    for speed in results["config"]["points"][workload]:
        for shape in SHAPES:
            values = live.get((shape, workload, speed))
            if values is None:
                continue
            rate = f"{rates[workload] * speed:.2f}"
            rows.append([rate, shape, *(_fmt(values[n]) for n in names)])
    return _table(["req/s", "cluster", *names], rows)


def table_goodput_ratio(results: dict) -> str:
    """1P1D / 2M, SLO attainment and goodput, per workload and speed, both SLOs."""
    live, rates = live_medians(results), offered_rates(results)
    rows = []
    for workload, speeds in results["config"]["points"].items():
        for speed in speeds:
            pair = [live.get((shape, workload, speed)) for shape in SHAPES]
            if None in pair:
                continue
            cells = []
            for name in RATIO_METRICS:
                coupled, disagg = pair[0][name], pair[1][name]
                cells.append(f"{disagg:.2f} / {coupled:.2f}")
            rows.append([workload, f"{rates[workload] * speed:.2f}", *cells])
    return _table(["workload", "req/s", *(f"{n}: 1P1D / 2M" for n in RATIO_METRICS)], rows)


RATIO_METRICS = ("SLO att.", "SLO att., TBT 300 ms", "goodput (req/s)", "goodput, TBT 300 ms")


def table_cache(results: dict) -> str:
    """The shared-prefix workload against the same lengths with nothing shared."""
    live, rates = live_medians(results), offered_rates(results)
    names = ("cache hit", "TTFT p50 (s)", "TTFT p90 (s)", "TBT p90 (ms)", "goodput (req/s)")
    rows = []
    for speed in results["config"]["points"].get("docqa-unshared", ()):
        for shape in SHAPES:
            for workload, label in (("docqa", "on"), ("docqa-unshared", "off")):
                values = live.get((shape, workload, speed))
                if values is not None:
                    rate = f"{rates[workload] * speed:.2f}"
                    rows.append([rate, shape, label, *(_fmt(values[n]) for n in names)])
    return _table(["req/s", "cluster", "cache", *names], rows)


def fidelity_rows(
    results: dict, key: str = "sims"
) -> list[tuple[str, str, float, str, float, float]]:
    """(shape, workload, speed, metric, live, sim) for every comparable value."""
    live, sim = live_medians(results), sim_values(results, key)
    rows = []
    for key, values in sorted(live.items()):
        if key not in sim:
            continue
        for name in FIDELITY:
            if values[name] is not None and sim[key][name] is not None:
                rows.append((*key, name, values[name], sim[key][name]))
    return rows


def table_fidelity(results: dict, key: str = "sims") -> str:
    """Simulator vs live per point and metric; error = sim / live - 1."""
    by_point: dict[tuple, dict[str, tuple[float, float]]] = {}
    for shape, workload, speed, name, live, sim in fidelity_rows(results, key):
        by_point.setdefault((workload, speed, shape), {})[name] = (live, sim)
    rows = []
    for (workload, speed, shape), metrics in sorted(by_point.items()):
        cells = []
        for name in FIDELITY:
            live, sim = metrics.get(name, (None, None))
            error = f"{sim / live - 1:+.0%}" if live else "-"
            cells.append(f"{_fmt(live)} / {_fmt(sim)} ({error})" if live is not None else "-")
        rows.append([workload, f"x{speed:g}", shape, *cells])
    return _table(["workload", "speed", "cluster", *(f"{n} live / sim" for n in FIDELITY)], rows)


def table_fidelity_summary(results: dict, key: str = "sims") -> str:
    """Per metric: median |error| and the share of points within 25%."""
    errors: dict[tuple[str, str], list[float]] = {}
    for shape, _, _, name, live, sim in fidelity_rows(results, key):
        if live:
            errors.setdefault((name, shape), []).append(abs(sim / live - 1))
    rows = [
        [
            name,
            shape,
            f"{statistics.median(errs):.0%}",
            f"{sum(e <= 0.25 for e in errs)}/{len(errs)}",
        ]
        for (name, shape), errs in sorted(errors.items())
    ]
    return _table(["metric", "cluster", "median abs error", "points within 25%"], rows)


def table_ablation(results: dict) -> str:
    """Median |error| per metric and cluster as the serving terms are added one by one."""
    variants = list(results.get("ablation", {}))
    rows = []
    for name in FIDELITY:
        for shape in SHAPES:
            cells = []
            for variant in variants:
                errs = [abs(sim / live - 1)
                        for s, _, _, metric, live, sim in fidelity_rows(results, f"ablation/{variant}")
                        if s == shape and metric == name and live]  # fmt: skip
                within = sum(e <= 0.25 for e in errs)
                cells.append(
                    f"{statistics.median(errs):.0%} ({within}/{len(errs)})" if errs else "-"
                )
            rows.append([name, shape, *cells])
    return _table(["metric", "cluster", *variants], rows)


def table_serving_terms(results: dict) -> str:
    """The serving terms each cluster's simulation used, and the burst measurements."""
    rows = []
    for shape, terms in results.get("serving_terms", {}).items():
        burst = results.get("bursts", {}).get(shape, {})
        rows.append([
            shape, f"{terms['request_overhead_s'] * 1e3:.2f}",
            f"{terms['prefill_handoff_s_per_token'] * 1e6:.2f}",
            f"{terms.get('decode_step_overhead_s', 0.0) * 1e3:.3f}",
            f"{terms['decode_per_seq_overhead_s'] * 1e3:.3f}",
            f"{terms['kv_import_s_per_token'] * 1e6:.3f}",
            f"{terms.get('step_jitter_sigma', 0.0):.3f}",
            f"{burst.get('batch', 0):g}", str(burst.get("num_gaps", 0)),
            _fmt(ms(burst.get("gap_p50_s"))), _fmt(ms(burst.get("model_p50_s"))),
            f"{terms.get('background_cpu_s_per_token', 0.0) * 1e3:.3f}",
            _fmt(burst.get("foreign_cores")),
        ])  # fmt: skip
    table = _table(["cluster", "request overhead ms", "prefill hand-over us/token",
                   "decode per-step ms", "decode per-seq ms", "KV import us/token", "step jitter sigma", "burst batch/instance",
                   "burst gaps", "burst gap p50 ms", "profile step p50 ms",
                   "path CPU ms/token", "other jobs' cores in burst"], rows)  # fmt: skip
    bursts = results.get("bursts", {})
    lines = [
        f"- {name}: gap p50 / p90 {_fmt(ms(b.get('gap_p50_s')))} / "
        f"{_fmt(ms(b.get('gap_p90_s')))} ms at batch {b.get('batch', 0):g}, jitter sigma "
        f"{b.get('jitter_sigma') or 0:.3f}, per-seq excess "
        f"{(b.get('per_seq_excess_p50_s') or 0) * 1e3:.3f} ms, per-step excess "
        f"{(b.get('per_step_excess_s') or 0) * 1e3:.3f} ms, split: sigma "
        f"{b.get('split_jitter_sigma') or 0:.3f} + wait {(b.get('wait_mean_s') or 0) * 1e3:.2f} ms"
        for name, b in bursts.items()
    ]
    return (
        table
        + "\n\nEvery burst (1P1D-loaded: the prefill worker busy meanwhile):\n\n"
        + "\n".join(lines)
    )


def table_decisions(results: dict) -> str:
    """Probe round trips in the live Conductor, and in-process decision times."""
    rows = []
    for shape in SHAPES:
        for label, s in results["probe"].get(shape, {}).items():
            rows.append([
                shape, label, str(s["num"]), f"{s['ping_p50_s'] * 1e3:.2f}",
                f"{s['schedule_p50_s'] * 1e3:.2f}", f"{s['schedule_p99_s'] * 1e3:.2f}",
                f"{s['decision_p50_s'] * 1e3:+.3f}", f"{s['decision_p99_s'] * 1e3:.2f}",
            ])  # fmt: skip
    live = _table(["cluster", "while running", "probes", "ping p50 ms", "schedule p50 ms",
                   "schedule p99 ms", "diff p50 ms", "diff p99 ms"], rows)  # fmt: skip
    rows = [
        [shape, str(d["num"]), f"{d['blocks_per_request']:.0f}", f"{d['p50_s'] * 1e6:.0f}",
         f"{d['p99_s'] * 1e6:.0f}", f"{d['mean_s'] * 1e6:.0f}"]
        for shape, d in results["decisions"].items()
    ]  # fmt: skip
    inproc = _table(["cluster", "decisions", "blocks/request", "p50 us", "p99 us", "mean us"], rows)
    return f"{live}\n\nIn-process (simulator replay of docqa x16, 16-token blocks):\n\n{inproc}"


def table_isolated(results: dict) -> str:
    """One request at a time: measured against the profile's engine times."""
    rows = []
    for shape, d in results.get("isolated", {}).items():
        rows.append([
            shape, str(d["num_requests"]), f"{d['ttft_p50_s'] * 1e3:.0f}",
            f"{d['ttft_model_p50_s'] * 1e3:.0f}", f"{d['ttft_extra_p50_s'] * 1e3:.0f}",
            f"{d['ttft_extra_p90_s'] * 1e3:.0f}", f"{d['itl_p50_s'] * 1e3:.2f}",
            f"{d['gap_model_p50_s'] * 1e3:.2f}", f"{d['gap_extra_p50_s'] * 1e3:+.2f}",
            f"{d['gap_extra_p90_s'] * 1e3:+.2f}", f"{d['first_gap_p50_s'] * 1e3:.1f}",
        ])  # fmt: skip
    return _table(["cluster", "requests", "TTFT p50 ms", "profile prefill p50 ms",
                   "TTFT extra p50 ms", "extra p90 ms", "ITL p50 ms", "profile step p50 ms",
                   "gap extra p50 ms", "extra p90 ms", "gap 0->1 p50 ms"], rows)  # fmt: skip


CPU_PARTS = ("workers", "gateway", "conductor", "bench client", "probe")


def table_cpu(results: dict) -> str:
    """Cores used during each run (CPU seconds / wall seconds), medians over repeats."""
    groups: dict[tuple[str, float, str], list[dict[str, float]]] = {}
    for run in results["runs"]:
        cpu = run.get("cpu_s")
        if not cpu:
            continue
        parts = {
            "workers": sum(v for k, v in cpu.items() if "-" in k),  # prefill-0, coupled-1...
            "gateway": cpu.get("gateway", 0.0), "conductor": cpu.get("conductor", 0.0),
            "bench client": cpu.get("bench client", 0.0), "probe": cpu.get("probe", 0.0),
            "foreign": cpu.get("foreign", 0.0),
        }  # fmt: skip
        cores = {k: v / run["wall_s"] for k, v in parts.items()}
        groups.setdefault((run["workload"], run["speed"], run["shape"]), []).append(cores)
    rows = []
    for (workload, speed, shape), items in sorted(groups.items()):
        medians = [statistics.median(item[k] for item in items) for k in CPU_PARTS]
        foreign = statistics.median(item["foreign"] for item in items)
        rows.append([workload, f"x{speed:g}", shape, *(f"{m:.2f}" for m in medians),
                     f"{sum(medians):.2f}", f"{foreign:.2f}"])  # fmt: skip
    return _table(["workload", "speed", "cluster", *CPU_PARTS, "total cores",
                   "other jobs (cores)"], rows)  # fmt: skip


def table_decode_gaps(results: dict, runs_dir: Path) -> str:
    """1P1D's inter-token gaps against the profile's step at the batch of the moment, and
    the gaps in which another request joined the batch (all speeds and repeats)."""
    from halfmoon.costmodel import CostProfile
    from halfmoon.metrics.records import records_from_json

    from .overhead import gaps_at_joins, gaps_by_batch

    profile = CostProfile.from_dict(results["profile"])
    rows, join_rows = [], []
    for workload in ("docqa", "short"):
        paths = sorted(runs_dir.glob(f"1P1D-{workload}-x*-r*.records.json"))
        runs = [records_from_json(json.loads(path.read_text())) for path in paths]
        if not runs:
            continue
        for row in gaps_by_batch(runs, profile):
            rows.append([
                workload, f"{row['batch_low']}-{row['batch_high']}", str(row["num_gaps"]),
                f"{row['gap_p50_s'] * 1e3:.1f}", f"{row['model_p50_s'] * 1e3:.1f}",
                f"{row['gap_p50_s'] / row['model_p50_s']:.2f}", f"{row['gap_p90_s'] * 1e3:.1f}",
            ])  # fmt: skip
        joins = gaps_at_joins(runs)
        join_rows.append([
            workload, str(joins["num_join_gaps"]), f"{joins['join_p50_s'] * 1e3:.1f}",
            f"{joins['join_p90_s'] * 1e3:.1f}", str(joins["num_other_gaps"]),
            f"{joins['other_p50_s'] * 1e3:.1f}", f"{joins['other_p90_s'] * 1e3:.1f}",
        ])  # fmt: skip
    by_batch = _table(["workload", "batch", "gaps", "gap p50 ms", "profile step p50 ms",
                       "ratio", "gap p90 ms"], rows)  # fmt: skip
    at_joins = _table(["workload", "gaps with a join", "p50 ms", "p90 ms", "other gaps",
                       "p50 ms", "p90 ms"], join_rows)  # fmt: skip
    return f"{by_batch}\n\n{at_joins}"


def write_markdown(results: dict, path: Path, runs_dir: Path) -> None:
    """Every table, with the run's configuration, as one markdown file."""
    cfg = results["config"]
    parts = [
        f"# Evaluation results ({cfg['date']}, {cfg['repeats']} repeats, "
        f"{cfg['num_requests']} requests per run, {cfg['wall_s'] / 60:.0f} min)",
        f"Load average (1/5/15 min) before the live runs {' '.join(cfg.get('loadavg_before', '?'))}"
        f", after {' '.join(cfg.get('loadavg_after', '?'))}.",
        f"SLO: TTFT <= {cfg['slo']['ttft_s']:g} s, TBT ({cfg['slo']['tbt_metric']}) <= "
        f"{cfg['slo']['tbt_s'] * 1e3:g} ms; loose: TBT <= {cfg['loose_slo']['tbt_s'] * 1e3:g} ms.",
    ]
    for workload in cfg["points"]:
        parts += [f"## {workload}", table_shapes(results, workload)]
    parts += ["## 1P1D vs 2M", table_goodput_ratio(results)]
    parts += ["## Prefix cache on / off", table_cache(results)]
    parts += ["## Simulator vs live", table_fidelity(results), table_fidelity_summary(results)]
    if results.get("serving_terms"):
        parts += ["## Serving-path terms (calibration runs)", table_serving_terms(results)]
    if results.get("ablation"):
        parts += [
            "## What each serving term contributes (median abs error, points within 25%)",
            table_ablation(results),
        ]
    parts += ["## One request at a time (serving path vs engine profile)", table_isolated(results)]
    parts += ["## CPU cores used during the runs", table_cpu(results)]
    if runs_dir.is_dir():
        parts += ["## 1P1D decode gaps against the profile", table_decode_gaps(results, runs_dir)]
    parts += ["## Conductor decisions", table_decisions(results)]
    path.write_text("\n\n".join(parts) + "\n")


def main() -> None:
    """Write the markdown tables and the plots."""
    from .plots import plot_cache, plot_cdfs, plot_rates

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", type=Path, default=ROOT / "benchmarks" / "results" / "eval.json"
    )
    parser.add_argument("--md", type=Path, default=ROOT / "benchmarks" / "results" / "eval.md")
    parser.add_argument("--img-dir", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--runs-dir", type=Path, default=ROOT / "out" / "eval" / "runs")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    write_markdown(results, args.md, args.runs_dir)
    print(f"tables written to {args.md}")
    args.img_dir.mkdir(parents=True, exist_ok=True)
    for written in (
        plot_rates(results, args.img_dir / "eval_rates.png"),
        plot_cache(results, args.img_dir / "eval_cache.png"),
        plot_cdfs(results, args.runs_dir, "docqa", 16, args.img_dir / "eval_cdf_docqa.png"),
    ):
        if written is not None:
            print(f"plot written to {written}")


if __name__ == "__main__":
    main()
