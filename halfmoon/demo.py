"""``halfmoon demo``: a synthetic workload, its statistics and its LRU cache-hit curve.

This is what ``make demo`` runs; it takes well under ten seconds and needs no model.
"""

from __future__ import annotations

import argparse
from typing import Any

from halfmoon.workload.datasets import DATASETS, generate_dataset
from halfmoon.workload.report import format_cache, format_stats
from halfmoon.workload.stats import replay_cache, trace_stats

#: Cache sizes shown, as fractions of the workload's unique blocks (None: unbounded).
CAPACITY_FRACTIONS = (0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


def capacity_curve(unique_blocks: int) -> list[int | None]:
    """Capacities (blocks) for the hit-ratio curve of a workload with ``unique_blocks``."""
    capacities = sorted({max(1, round(f * unique_blocks)) for f in CAPACITY_FRACTIONS})
    return [*capacities, None]


def run_demo(args: argparse.Namespace) -> int:
    """Generate the workload, print its stats and its LRU hit ratio per cache capacity."""
    requests = generate_dataset(args.dataset, args.rate, args.num_requests, args.seed)
    print(
        f"halfmoon demo: {args.num_requests} '{args.dataset}' requests at {args.rate} req/s "
        f"(seed {args.seed}); 512-token blocks\n"
    )
    stats = trace_stats(requests)
    print(format_stats(stats))
    print()
    result = replay_cache(requests, "lru", capacity_curve(stats["unique_blocks"]))
    print(format_cache(result))
    return 0


def register(subparsers: Any) -> None:
    """Add ``halfmoon demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="generate a synthetic workload, print its stats and cache-hit curve",
        description="Generate a synthetic workload and show its statistics and the LRU "
        "prefix-cache hit ratio at a few capacities.",
    )
    parser.add_argument("--dataset", default="leval", help=f"one of: {', '.join(DATASETS)}")
    parser.add_argument("--num-requests", type=int, default=300, help="number of requests")
    parser.add_argument("--rate", type=float, default=2.0, help="arrival rate, requests/s")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.set_defaults(func=run_demo)
