"""The simulator experiments of docs/simulation.md (issue 3, "What it must show" 1-4).

Run: .venv/bin/python -m benchmarks.sim.experiments [--only 1,2,3,4] [--quick]
     [--trace FILE] [--img-dir docs/img] [--results benchmarks/results/sim_experiments]

Writes one PNG per experiment under ``--img-dir`` and the tables (markdown) and every
number (JSON) to ``--results``.md / .json (with ``--only``, the other experiments'
recorded results are kept). All runs: LLaMA2-70B on 8xA800 per instance,
first-principles roofline cost model at its default efficiencies, default SimConfig.

1. Policies on the synthetic trace, 8P8D, over a range of replay speeds.
2. 16M vs 8P8D (and 12P4D, the same 16 nodes split differently) at TBT limits
   100/200/300 ms (top10mean), TTFT 30 s: effective request capacity at fixed loads,
   and the fastest replay each sustains with >= 90% of requests within the SLO.
3. Long-context datasets, [3P1D] vs [4M]: the highest Poisson rate with >= 90% of
   requests within SLOs of 10x TTFT / 5x TBT of one request alone, for both TBT metrics.
4. Overload: wasted prefills without early rejection, with snapshot and with prediction,
   at x2 (the paper's setting) and around x3 (three nearby speeds show how much the
   snapshot/predict difference moves from run to run), then decode-bound (outputs x4,
   13P3D, TBT 40 ms) at x3.5-x4.5, with the decode instances' load fluctuation.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from halfmoon.conductor import ConductorConfig
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request
from halfmoon.costmodel import build_cost_model
from halfmoon.costmodel.base import CostModel
from halfmoon.sim import ClusterSpec, SimConfig, Simulator, max_rate_within_slo, simulate
from halfmoon.workload import generate_dataset, read_trace

from .experiment_report import (
    plot_capacity,
    plot_long_context,
    plot_policies,
    plot_wasted,
    table_capacity,
    table_long_context,
    table_policies,
    table_wasted,
)

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = ROOT.parent / "shared/traces/synthetic_trace.jsonl"
PAPER_POLICY_TTFT_S = {
    "random": 92.07,
    "load-balance": 60.41,
    "cache-aware": 14.36,
    "kvcache-centric": 6.26,
}
PAPER_CAPACITY_GAIN = {0.1: 0.62, 0.2: 0.40, 0.3: 0.28}
PAPER_LONG_CONTEXT_GAIN = {16: 0.50, 128: 5.25}
PAPER_WASTED = {"none": 4183, "snapshot": 3771, "predict": 3589}
TARGET_ATTAINMENT = 0.9


def run(
    requests: list[Request],
    cluster: str,
    cost_model: CostModel,
    slo: SLOConfig,
    time_scale: float = 1.0,
    **conductor: Any,
) -> dict[str, Any]:
    """One simulation's report."""
    config = SimConfig(ClusterSpec.parse(cluster), slo=slo, time_scale=time_scale)
    return simulate(requests, config, ConductorConfig(slo=slo, **conductor), cost_model).report


def exp1_policies(requests, cost_model, scales, headline) -> dict[str, Any]:
    """Mean TTFT per policy and replay speed on 8P8D."""
    slo = SLOConfig(ttft_s=30.0, tbt_s=0.1)
    rows = {}
    for scale in scales:
        for policy in ("random", "load-balance", "cache-aware", "kvcache-centric"):
            report = run(requests, "8P8D", cost_model, slo, scale, policy=policy)
            rows[f"{scale:g}/{policy}"] = {
                "time_scale": scale,
                "policy": policy,
                "ttft_mean_s": report["ttft_s"]["mean"],
                "ttft_p90_s": report["ttft_s"]["p90"],
                "cache_hit_ratio": report["cache_hit_ratio"],
                "remote_fetches": report["num_remote_fetches"],
            }
    return {"headline_time_scale": headline, "rows": rows}


def exp2_capacity(requests, cost_model, loads, clusters, tbts) -> dict[str, Any]:
    """Effective request capacity per cluster and TBT limit at fixed loads, and the
    fastest sustainable replay (>= 90% within SLO)."""
    at_load, sustained = {}, {}
    for tbt_s in tbts:
        slo = SLOConfig(ttft_s=30.0, tbt_s=tbt_s, tbt_metric="top10mean")
        for cluster in clusters:
            for load in loads:
                report = run(requests, cluster, cost_model, slo, load)
                at_load[f"{tbt_s:g}/{cluster}/{load:g}"] = {
                    "tbt_s": tbt_s,
                    "cluster": cluster,
                    "time_scale": load,
                    "capacity": report["effective_request_capacity"],
                    "goodput_rps": report["goodput_rps"],
                    "ttft_mean_s": report["ttft_s"]["mean"],
                    "tbt_p90_s": report["tbt_s"]["p90"],
                }

            def ok(scale: float, cluster: str = cluster, slo: SLOConfig = slo) -> bool:
                report = run(requests, cluster, cost_model, slo, scale)
                return report["slo_attainment"] >= TARGET_ATTAINMENT

            sustained[f"{tbt_s:g}/{cluster}"] = max_rate_within_slo(ok, 1.0, rel_tol=0.03)
    return {"at_load": at_load, "max_time_scale": sustained}


def single_request_slo(cost_model: CostModel, context_tokens: int, metric: str) -> SLOConfig:
    """The arXiv paper's SLO: 10x the TTFT and 5x the TBT of one request alone."""
    return SLOConfig(
        ttft_s=10 * cost_model.prefill_time_s(context_tokens, 0),
        tbt_s=5 * cost_model.decode_step_time_s(1, context_tokens),
        tbt_metric=metric,
    )


def exp3_long_context(cost_model, contexts_k, num_requests, metrics) -> dict[str, Any]:
    """Max Poisson rate within SLO for 3P1D and 4M per long-context dataset."""
    out = {}
    for metric in metrics:
        for k in contexts_k:
            slo = single_request_slo(cost_model, k * 1024, metric)
            rates = {}
            for cluster in ("3P1D", "4M"):

                def ok(rate: float, cluster: str = cluster, k: int = k, slo=slo) -> bool:
                    requests = generate_dataset(f"longctx-{k}k", rate, num_requests, seed=0)
                    report = run(requests, cluster, cost_model, slo)
                    return report["slo_attainment"] >= TARGET_ATTAINMENT

                rates[cluster] = max_rate_within_slo(ok, 1.0 * 16 / k, rel_tol=0.03)
            gain = rates["3P1D"] / rates["4M"] - 1 if rates["4M"] else None
            out[f"{metric}/{k}"] = {
                "metric": metric,
                "context_k": k,
                "ttft_slo_s": slo.ttft_s,
                "tbt_slo_s": slo.tbt_s,
                "rate_3P1D": rates["3P1D"],
                "rate_4M": rates["4M"],
                "advantage": gain,
            }
    return out


def exp4_early_rejection(requests, cost_model, scales, bound_scales) -> dict[str, Any]:
    """Wasted prefills and decode-load fluctuation per early-rejection mode under overload:
    the trace on 8P8D at TBT 100 ms (decode never binds: all waste is TTFT misses) and a
    decode-bound case (outputs x4, 13P3D, TBT 40 ms: decode instances refuse after
    prefill). The decode-bound run at the middle load keeps its load series (10 s means)."""
    long_out = [replace(r, output_length=4 * r.output_length) for r in requests]
    cases = [("trace", requests, "8P8D", 0.1, s) for s in scales]
    cases += [("outputs x4", long_out, "13P3D", 0.04, s) for s in bound_scales]
    rows, series = {}, {}
    for workload, reqs, cluster, tbt_s, scale in cases:
        slo = SLOConfig(ttft_s=30.0, tbt_s=tbt_s)
        config = SimConfig(ClusterSpec.parse(cluster), slo=slo, time_scale=scale)
        for mode in ("none", "snapshot", "predict"):
            conductor = ConductorConfig(slo=slo, early_reject=mode)
            sim = Simulator(config, conductor, cost_model)
            report, load = sim.run(reqs).report, sim.decode_load
            rows[f"{workload}/{scale:g}/{mode}"] = {
                "workload": workload,
                "cluster": cluster,
                "tbt_ms": tbt_s * 1e3,
                "time_scale": scale,
                "mode": mode,
                "wasted": report["num_wasted_prefill"],
                "rejected_early": report["num_rejected_early"],
                "refused_after_prefill": report["num_refused_after_prefill"],
                "goodput_rps": report["goodput_rps"],
                "attainment": report["slo_attainment"],
                **{f"decode_{k}": v for k, v in report["decode_load"].items()},
            }
            if workload != "trace" and scale == bound_scales[len(bound_scales) // 2]:
                series[mode] = {"slo_ms": tbt_s * 1e3, "scale": scale, **_step_series(load)}
    return {"rows": rows, "decode_load_series": series}


def _step_series(load, bucket_s: float = 10.0) -> dict[str, Any]:
    """Each decode instance's sampled step time (ms), averaged over ``bucket_s`` windows."""
    times = np.array(load.times_s)
    bucket = (times // bucket_s).astype(int)
    counts = np.bincount(bucket)
    keep = counts > 0
    out = {"t_s": ((np.arange(len(counts)) + 0.5) * bucket_s)[keep].tolist()}
    for iid, steps in load.step_s.items():
        sums = np.bincount(bucket, weights=np.array(steps) * 1e3, minlength=len(counts))
        out[iid] = (sums[keep] / counts[keep]).round(2).tolist()
    return out


def tables(results: dict[str, Any]) -> str:
    """Markdown tables of every experiment that ran."""
    parts = []
    if "1" in results:
        parts.append(table_policies(results["1"], PAPER_POLICY_TTFT_S))
    if "2" in results:
        parts.append(table_capacity(results["2"], PAPER_CAPACITY_GAIN))
    if "3" in results:
        parts.append(table_long_context(results["3"], PAPER_LONG_CONTEXT_GAIN))
    if "4" in results:
        parts.append(table_wasted(results["4"], PAPER_WASTED))
    return "\n\n".join(parts) + "\n"


def main() -> None:
    """Run the chosen experiments; write plots, tables and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="1,2,3,4", help="comma-separated experiment numbers")
    parser.add_argument("--quick", action="store_true", help="fewer loads and requests")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--img-dir", type=Path, default=ROOT / "docs/img")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/sim_experiments")
    args = parser.parse_args()
    chosen = {part.strip() for part in args.only.split(",")}
    requests = read_trace(args.trace)
    cost_model = build_cost_model("llama2-70b", "a800", 8)
    args.img_dir.mkdir(parents=True, exist_ok=True)
    quick = args.quick
    experiments: dict[str, Callable[[], dict[str, Any]]] = {
        "1": lambda: exp1_policies(
            requests, cost_model, (1.0, 1.5, 2.0) if quick else (1.0, 1.25, 1.5, 1.75, 2.0), 1.5
        ),
        "2": lambda: exp2_capacity(
            requests,
            cost_model,
            (1.0, 1.5) if quick else (1.0, 1.5, 2.0),
            ("16M", "8P8D") if quick else ("16M", "8P8D", "12P4D"),
            (0.1, 0.2, 0.3),
        ),
        "3": lambda: exp3_long_context(
            cost_model, (16, 32, 64, 128), 200 if quick else 1000, ("p90", "top10mean")
        ),
        "4": lambda: exp4_early_rejection(
            requests,
            cost_model,
            (2.0,) if quick else (2.0, 2.9, 3.0, 3.1),
            (4.0,) if quick else (3.5, 4.0, 4.5),
        ),
    }
    plots = {"1": plot_policies, "2": plot_capacity, "3": plot_long_context, "4": plot_wasted}
    results: dict[str, Any] = {}
    for key in sorted(chosen & set(experiments)):
        start = time.perf_counter()
        results[key] = experiments[key]()
        path = plots[key](results[key], args.img_dir)
        print(f"experiment {key}: {time.perf_counter() - start:.0f} s, plot {path}", flush=True)
    # --only reruns some experiments: keep the others' recorded results
    saved = args.results.with_suffix(".json")
    merged = json.loads(saved.read_text()) if saved.exists() else {}
    merged.update(results)
    text = tables(merged)
    print(text)
    args.results.with_suffix(".md").write_text(text)
    saved.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


if __name__ == "__main__":
    main()
