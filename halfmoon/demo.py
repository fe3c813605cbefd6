"""``halfmoon demo``: a synthetic workload, its statistics, the same workload simulated on
a disaggregated and a coupled cluster side by side, and its LRU cache-hit curve.

This is what ``make demo`` runs; it takes a few seconds and needs no model.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from halfmoon.conductor.config import ConductorConfig
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request
from halfmoon.costmodel.roofline import build_cost_model
from halfmoon.sim.config import ClusterSpec, SimConfig
from halfmoon.sim.report import format_comparison
from halfmoon.sim.simulator import simulate
from halfmoon.workload.datasets import DATASETS, generate_dataset
from halfmoon.workload.report import format_cache, format_stats
from halfmoon.workload.stats import replay_cache, trace_stats

#: Cache sizes shown, as fractions of the workload's unique blocks (None: unbounded).
CAPACITY_FRACTIONS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


def capacity_curve(unique_blocks: int) -> list[int | None]:
    """Capacities (blocks) for the hit-ratio curve of a workload with ``unique_blocks``."""
    capacities = sorted({max(1, round(f * unique_blocks)) for f in CAPACITY_FRACTIONS})
    return [*capacities, None]


def simulate_clusters(
    requests: Sequence[Request], clusters: Sequence[str], plot: str | None
) -> str:
    """Simulate ``requests`` on each cluster (LLaMA2-70B on 8xA800 per instance, the
    kvcache-centric Conductor, TTFT 30 s / TBT 100 ms top10mean); returns the side-by-side
    table and writes the TTFT/TBT CDF plot to ``plot`` when given."""
    slo = SLOConfig()
    cost_model = build_cost_model("llama2-70b", "a800", 8)
    results = {
        name: simulate(
            requests,
            SimConfig(ClusterSpec.parse(name), slo=slo),
            ConductorConfig(slo=slo),
            cost_model,
        )
        for name in clusters
    }
    table = format_comparison({name: result.report for name, result in results.items()})
    if plot is None:
        return table
    from halfmoon.metrics.plots import plot_report

    Path(plot).parent.mkdir(parents=True, exist_ok=True)
    plot_report({name: result.records for name, result in results.items()}, slo, plot)
    return f"{table}\nplot written to {plot}"


def run_demo(args: argparse.Namespace) -> int:
    """Generate the workload, print its stats, simulate it on two clusters, and print its
    LRU hit ratio per cache capacity."""
    requests = generate_dataset(args.dataset, args.rate, args.num_requests, args.seed)
    print(
        f"halfmoon demo: {args.num_requests} '{args.dataset}' requests at {args.rate} req/s "
        f"(seed {args.seed}); 512-token blocks\n"
    )
    stats = trace_stats(requests)
    print(format_stats(stats))
    print()
    if args.clusters:
        clusters = [name.strip() for name in args.clusters.split(",") if name.strip()]
        print(f"simulated on {' vs '.join(clusters)} (LLaMA2-70B, 8xA800 per instance):")
        print(simulate_clusters(requests, clusters, args.plot or None))
        print()
    result = replay_cache(requests, "lru", capacity_curve(stats["unique_blocks"]))
    print(format_cache(result))
    return 0


def register(subparsers: Any) -> None:
    """Add ``halfmoon demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="generate a synthetic workload, simulate it, print its stats and cache-hit curve",
        description="Generate a synthetic workload; show its statistics, a simulation of it "
        "on a disaggregated and a coupled cluster side by side, and the LRU prefix-cache "
        "hit ratio at a few capacities.",
    )
    parser.add_argument("--dataset", default="leval", help=f"one of: {', '.join(DATASETS)}")
    parser.add_argument("--num-requests", type=int, default=300, help="number of requests")
    parser.add_argument("--rate", type=float, default=4.0, help="arrival rate, requests/s")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument(
        "--clusters",
        default="3P1D,4M",
        help="comma-separated clusters to simulate side by side ('' skips the simulation)",
    )
    parser.add_argument(
        "--plot", default="out/demo_sim.png", help="TTFT/TBT CDF plot ('' skips it)"
    )
    parser.set_defaults(func=run_demo)
