"""Prefix fetches after the queue or beside it, and the Conductor's estimate of them.

Run: .venv/bin/python -m benchmarks.sim.prefix_fetch [--quick] [--processes N]
     [--trace FILE] [--results benchmarks/results/sim_prefix_fetch]

A prefill instance that takes a request whose prefix lives on another instance can pull
it when the request's turn comes (``queued``: the paper's estimate, TTFT = T_queue +
T_transfer + T_prefill, and how the simulator ran every fetch until now) or from the
request's arrival, while the requests before it run (``overlap``: halfmoon's live prefill
workers, which pull on threads of their own; TTFT = max(T_queue, T_transfer) + T_prefill).
Three arms per workload, each with the Conductor's link books off and on
(``--link-backlog``):

- ``paper``: instances and estimate ``queued``;
- ``overlap, paper estimate``: instances ``overlap`` (``SimConfig.instance_prefix_fetch``),
  the Conductor still estimating ``queued``: what a live cluster did before the estimate
  followed its workers;
- ``overlap``: both ``overlap`` (``--prefix-fetch overlap``, the live preset's).

The workloads, cluster (8P8D, LLaMA2-70B on 8xA800 per instance, the network bandwidth
per GPU varied), SLOs and the five perturbed replays per configuration are those of
``benchmarks.sim.balancing`` (fixed threshold 0.1). Writes a markdown table and every
replay's figures (JSON) to ``--results``.md / .json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from benchmarks.sim.balancing import (
    DEFAULT_TRACE,
    REPLAYS,
    SLO,
    WORKLOADS,
    _requests,
    summarize_replays,
    workload_record,
)
from halfmoon.conductor import ConductorConfig
from halfmoon.costmodel import build_cost_model
from halfmoon.costmodel.hardware import get_gpu
from halfmoon.sim import ClusterSpec, SimConfig
from halfmoon.sim.parallel import SimJob, run_jobs

ROOT = Path(__file__).resolve().parents[2]
#: (label, how the instances fetch, how the Conductor estimates).
ARMS = (
    ("paper", "queued", "queued"),
    ("overlap, paper estimate", "overlap", "queued"),
    ("overlap", "overlap", "overlap"),
)
#: The balancing sweep's workloads where a fetch costs enough to matter, and one where
#: it is cheap (100G) and one with little sharing (longctx-16k).
NAMES = (
    "trace x1.5, 100G",
    "trace x1.25, 25G",
    "trace x1.25, 20G",
    "trace x1.25, 15G",
    "trace x1, 10G",
    "leval 4/s, 15G",
    "longctx-16k 3/s, 25G",
)
QUICK = ("trace x1.25, 15G", "leval 4/s, 15G")
#: Label suffix of the arms with the Conductor's link books on.
LINKS = " +links"


def sim_config(time_scale: float, instances: str) -> SimConfig:
    """8P8D at ``time_scale``, its instances fetching as ``instances`` says."""
    cluster = ClusterSpec.parse("8P8D")
    return SimConfig(cluster, slo=SLO, time_scale=time_scale, instance_prefix_fetch=instances)


def run_workload(name: str, trace: Path, processes: int | None) -> dict[str, Any]:
    """Every arm, links off and on, on one workload (five replays each)."""
    source, time_scale, nic = WORKLOADS[name]
    gpu = dataclasses.replace(get_gpu("a800"), nic_gbps_per_gpu=nic)
    cost_model = build_cost_model("llama2-70b", gpu, 8)
    arms = [
        (label + (LINKS if links else ""), instances,
         ConductorConfig(slo=SLO, link_backlog=links, prefix_fetch=estimate))
        for links in (False, True)
        for label, instances, estimate in ARMS
    ]  # fmt: skip
    jobs = [
        SimJob(sim_config(time_scale * speed, instances), conductor)
        for _, instances, conductor in arms
        for speed in REPLAYS
    ]
    reports = run_jobs(_requests(source, trace), cost_model, jobs, processes)
    k = len(REPLAYS)
    runs = {
        label: summarize_replays(reports[i * k : (i + 1) * k], ("prefix_fetch",))
        for i, (label, _, _) in enumerate(arms)
    }
    return workload_record(name, runs)


def table(results: list[dict[str, Any]]) -> str:
    """Mean TTFT (SLO attainment) [fetches per replay] per arm; the ratios of mean TTFT
    that say what overlapping gives and what the matching estimate adds."""
    labels = [label + suffix for suffix in ("", LINKS) for label, _, _ in ARMS]
    lines = [
        "| workload | " + " | ".join(labels) + " | overlap / paper | overlap / overlap "
        "with paper estimate (links off, on) |",
        "|---|" + "---:|" * (len(labels) + 2),
    ]
    for r in results:
        runs = r["runs"]
        cells = [
            f"{runs[x]['ttft_mean_s']:.2f} ({runs[x]['slo_attainment']:.3f}) "
            f"[{runs[x]['num_remote_fetches']:.0f}]"
            for x in labels
        ]
        world = runs["overlap"]["ttft_mean_s"] / runs["paper"]["ttft_mean_s"]
        match = [
            runs["overlap" + s]["ttft_mean_s"] / runs["overlap, paper estimate" + s]["ttft_mean_s"]
            for s in ("", LINKS)
        ]
        lines.append(
            f"| {r['workload']} | " + " | ".join(cells)
            + f" | {world:.3f} | {match[0]:.3f}, {match[1]:.3f} |"
        )  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    """Run the arms on every workload; print and write the table and the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--processes", type=int, help="parallel simulations (default: cores)")
    parser.add_argument(
        "--results", type=Path, default=ROOT / "benchmarks/results/sim_prefix_fetch"
    )  # fmt: skip
    args = parser.parse_args()
    start = time.perf_counter()
    results = []
    for name in QUICK if args.quick else NAMES:
        results.append(run_workload(name, args.trace, args.processes))
        print(f"{name} done ({time.perf_counter() - start:.0f} s)", flush=True)
    text = table(results)
    print(text)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.with_suffix(".md").write_text(text + "\n")
    args.results.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.results}.md/.json in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
