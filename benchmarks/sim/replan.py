"""Re-planning the P:D split when the workload's mix changes (issue #22, goal 3, simulated).

Run: .venv/bin/python -m benchmarks.sim.replan [--instances 16] [--rate 8]
     [--num-requests 4800] [--start 4] [--results benchmarks/results/sim_replan]

The ``mixshift`` dataset: chat (short prompts, long answers) for the first half of the
requests, summaries (long prompts, short answers) for the second. LLaMA2-70B on 8xA800
per instance, decode instances with 60k KV tokens each (memory-poor decode, so that the
chat half needs several of them), TTFT SLO 10 s, TBT 100 ms (top10mean), snapshot early
rejection. Runs every fixed split in :data:`FIXED` (as a share of the instances) and
``--replan`` starting from ``--start`` prefill instances (a split planned on the chat
traffic: it keeps up with chat with the most decode headroom), and reports goodput over
the whole run and each half, and when the instances changed role.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from halfmoon.conductor import ConductorConfig
from halfmoon.core.config import SLOConfig
from halfmoon.costmodel import build_cost_model
from halfmoon.metrics.report import summarize
from halfmoon.sim import ClusterSpec, SimConfig, Simulator
from halfmoon.sim.replan import ReplanConfig
from halfmoon.workload import generate_dataset

ROOT = Path(__file__).resolve().parents[2]
SLO = SLOConfig(ttft_s=10.0, tbt_s=0.1)
KV_TOKENS = 60_000
#: Fixed splits tried: prefill instances as eighths of the cluster.
FIXED = (2, 3, 4, 5, 6)


def _one(args: tuple[int, int, float, int, bool]) -> dict[str, Any]:
    prefill, instances, rate, num, replan = args
    requests = generate_dataset("mixshift", rate, num, 0)
    cost_model = build_cost_model("llama2-70b", "a800", 8)
    config = SimConfig(
        ClusterSpec(prefill, instances - prefill), slo=SLO, kv_capacity_tokens=KV_TOKENS
    )
    conductor = ConductorConfig(slo=SLO, early_reject="snapshot")
    plan = ReplanConfig() if replan else None
    start = time.perf_counter()
    sim = Simulator(config, conductor, cost_model, replan=plan)
    result = sim.run(requests)
    half = num // 2
    report = result.report
    return {
        "start": str(config.cluster),
        "replan": replan,
        "goodput_rps": report["goodput_rps"],
        "slo_attainment": report["slo_attainment"],
        "first_half_goodput_rps": summarize(result.records[:half], SLO)["goodput_rps"],
        "second_half_goodput_rps": summarize(result.records[half:], SLO)["goodput_rps"],
        "shift_s": requests[half].arrival_time_s,
        "end": f"{len(sim.prefill)}P{len(sim.decode)}D",
        "role_changes": report["role_changes"],
        "replans": report["replans"],
        "wall_s": time.perf_counter() - start,
    }


def main() -> None:
    """Run the fixed splits and the re-planned one; print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--instances", type=int, default=16)
    parser.add_argument("--rate", type=float, default=8.0, help="requests/s")
    parser.add_argument("--num-requests", type=int, default=4800)
    parser.add_argument("--start", type=int, default=4, help="prefill instances at the start")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks/results/sim_replan")
    args = parser.parse_args()
    n = args.instances
    fixed = sorted({max(1, min(n - 1, round(n * k / 8))) for k in FIXED} | {args.start})
    runs = [(p, n, args.rate, args.num_requests, False) for p in fixed]
    runs.append((args.start, n, args.rate, args.num_requests, True))
    from concurrent.futures import ProcessPoolExecutor

    start = time.perf_counter()
    with ProcessPoolExecutor() as pool:
        results = list(pool.map(_one, runs))
    lines = [
        f"mixshift, {args.num_requests} requests at {args.rate:g}/s on {n} instances "
        f"(shift at {results[0]['shift_s']:.0f} s); goodput req/s",
        "",
        "| split | whole run | chat half | summaries half | attainment | role changes |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        label = f"{r['start']} -> re-planned ({r['end']})" if r["replan"] else r["start"]
        moves = ", ".join(
            f"{c['from']}->{c['to']} at {c['time_s']:.0f} s" for c in r["role_changes"]
        )
        lines.append(
            f"| {label} | {r['goodput_rps']:.2f} | {r['first_half_goodput_rps']:.2f} | "
            f"{r['second_half_goodput_rps']:.2f} | {r['slo_attainment']:.3f} | {moves or '-'} |"
        )
    text = "\n".join(lines)
    print(text)
    print(f"\n{time.perf_counter() - start:.0f} s")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.with_suffix(".md").write_text(text + "\n")
    args.results.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
