"""Early rejection's prediction with decode durations predicted from the prompt's prefix
(``--decode-time-by-prefix``, halfmoon/conductor/lengths.py) against the durations of
all requests, and against the snapshot.

Run: .venv/bin/python -m benchmarks.sim.decode_time_by_prefix [--trace FILE]
     [--json benchmarks/results/sim_decode_time_by_prefix.json]          # ~2 min

Workloads of docs/simulation.md, section 4: the decode-bound one (the synthetic trace
with every output four times longer, 13P3D, TBT 40 ms, TTFT 30 s) at x3.5, x4 and x4.5,
where the prediction matters, and the trace itself on 8P8D at TBT 100 ms and x3, where
decode never binds (a control). Each configuration on the five perturbed replays of
:data:`benchmarks.sim.balancing.REPLAYS`, compared by the mean over them (every replay
in the JSON). It also prints how well the first block predicts an output length on the
trace: each request against the median of the earlier requests sharing its first block,
and against the mean of all earlier requests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.sim.balancing import REPLAYS
from halfmoon.conductor import ConductorConfig
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request
from halfmoon.costmodel import build_cost_model
from halfmoon.sim import ClusterSpec, SimConfig
from halfmoon.sim.parallel import SimJob, run_jobs
from halfmoon.workload import read_trace

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = ROOT.parent / "shared/traces/synthetic_trace.jsonl"
#: label -> (early-reject mode, decode_time_by_prefix)
ARMS = {"snapshot": ("snapshot", False), "predict": ("predict", False),
        "predict + prefix": ("predict", True)}  # fmt: skip
KEYS = ("goodput_rps", "slo_attainment", "num_wasted_prefill", "num_rejected_early",
        "num_refused_after_prefill")  # fmt: skip


def length_prediction(requests: list[Request]) -> dict[str, float]:
    """Output lengths predicted in arrival order: by the median of the earlier requests
    sharing the first block (where there is one) and by the mean of all earlier ones."""
    by_root: dict[int, list[int]] = {}
    total, count = 0, 0
    errors_root, errors_all = [], []
    for r in sorted(requests, key=lambda r: r.arrival_time_s):
        root = r.block_hashes[0] if r.num_full_blocks else None
        earlier = by_root.get(root) if root is not None else None
        if earlier and count:
            errors_root.append(abs(statistics.median(earlier) - r.output_length))
            errors_all.append(abs(total / count - r.output_length))
        if root is not None:
            by_root.setdefault(root, []).append(r.output_length)
        total, count = total + r.output_length, count + 1
    return {
        "requests": len(requests),
        "predicted": len(errors_root),
        "mae_first_block": statistics.mean(errors_root),
        "mae_mean_of_all": statistics.mean(errors_all),
        "mean_output": total / count,
    }


def main() -> None:
    """Run every workload x arm x replay; print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--json", type=Path, help="write every replay here")
    args = parser.parse_args()
    requests = read_trace(args.trace)
    lengths = length_prediction(requests)
    print(json.dumps(lengths))
    long_out = [replace(r, output_length=4 * r.output_length) for r in requests]
    cases = [("outputs x4", long_out, "13P3D", 0.04, s) for s in (3.5, 4.0, 4.5)]
    cases.append(("trace", requests, "8P8D", 0.1, 3.0))
    cost_model = build_cost_model("llama2-70b", "a800", 8)
    rows: dict[str, Any] = {}
    start = time.perf_counter()
    for workload, reqs, cluster, tbt_s, scale in cases:
        slo = SLOConfig(ttft_s=30.0, tbt_s=tbt_s)
        sims = [SimConfig(ClusterSpec.parse(cluster), slo=slo, time_scale=scale * r)
                for r in REPLAYS]  # fmt: skip
        jobs = [
            SimJob(sim, ConductorConfig(slo=slo, early_reject=mode, decode_time_by_prefix=by))
            for mode, by in ARMS.values()
            for sim in sims
        ]
        reports = run_jobs(reqs, cost_model, jobs)
        for a, label in enumerate(ARMS):
            replays = [{k: rep[k] for k in KEYS} for rep in reports[a * 5 : (a + 1) * 5]]
            rows[f"{workload} x{scale:g} / {label}"] = {
                "workload": workload, "cluster": cluster, "time_scale": scale, "arm": label,
                "mean": {k: statistics.mean(r[k] for r in replays) for k in KEYS},
                "replays": replays,
            }  # fmt: skip
    print(f"{len(rows) * len(REPLAYS)} simulations in {time.perf_counter() - start:.0f} s\n")
    print("| workload | arm | goodput req/s | SLO attainment | wasted prefill | rejected early "
          "| refused after prefill |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    for key, row in rows.items():
        m = row["mean"]
        print(f"| {key.split(' / ')[0]} | {row['arm']} | {m['goodput_rps']:.3f} | "
              f"{m['slo_attainment']:.4f} | {m['num_wasted_prefill']:.1f} | "
              f"{m['num_rejected_early']:.1f} | {m['num_refused_after_prefill']:.1f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"length_prediction": lengths, "runs": rows},
                                        indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
