"""``halfmoon trace stats | cache | generate``: inspect, replay and synthesise Mooncake traces."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from halfmoon.core.eviction import POLICY_NAMES
from halfmoon.core.request import Request
from halfmoon.workload.datasets import DATASETS, generate_dataset
from halfmoon.workload.priority import parse_priority_mix, with_priorities
from halfmoon.workload.report import format_cache, format_stats
from halfmoon.workload.stats import replay_cache, trace_stats
from halfmoon.workload.trace import count_lines, iter_trace, write_trace

_INFINITE = ("inf", "infinite", "none")


def parse_capacity(text: str) -> int | None:
    """A ``--capacity-blocks`` value: an integer >= 0, or ``inf`` for unbounded (None)."""
    if text.strip().lower() in _INFINITE:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"--capacity-blocks takes integers >= 0 or 'inf', got {text!r}")
    return value


def add_workload_args(parser: argparse.ArgumentParser, seed_help: str = "dataset seed") -> None:
    """The workload options ``halfmoon bench`` and ``halfmoon simulate`` share, so both
    replay the same requests from the same flags: a trace or a dataset, its rate and
    size, time and length scaling, a request cap, the seed and a priority mix."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="Mooncake JSONL trace to replay")
    source.add_argument("--dataset", metavar="NAME", help=f"synthetic: {', '.join(DATASETS)}")
    parser.add_argument("--rate", type=float, help="dataset arrival rate, requests/s")
    parser.add_argument("--num-requests", type=int, help="dataset size")
    parser.add_argument("--seed", type=int, default=0, help=seed_help)
    parser.add_argument(
        "--time-scale", type=float, default=1.0,
        help="divide arrival times by X (2 = twice as fast)",
    )  # fmt: skip
    parser.add_argument(
        "--length-scale", type=float, default=1.0,
        help="shrink prompt and output lengths by Y (512*Y tokens per trace block; "
        "halfmoon bench and halfmoon simulate shrink alike)",
    )  # fmt: skip
    parser.add_argument("--max-requests", type=int, help="use only the first N requests")
    parser.add_argument(
        "--priority-mix", metavar="VALUE:FRACTION,...",
        help="give that fraction of the requests that priority (vLLM's: lower first under "
        "--scheduling-policy priority; seeded by --seed, the rest keep 0), e.g. -1:0.1 for "
        "10%% urgent requests; the report adds each priority's figures",
    )  # fmt: skip


def with_priority_mix(requests: Iterable[Request], args: argparse.Namespace) -> Iterable[Request]:
    """``requests`` with the priorities of ``--priority-mix`` (seeded by ``--seed``), or as
    they are without the flag."""
    if not args.priority_mix:
        return requests
    return with_priorities(requests, parse_priority_mix(args.priority_mix), args.seed)


def _with_progress(requests: Iterator[Request], path: Path, desc: str) -> Iterable[Request]:
    """Wrap ``requests`` in a tqdm bar on stderr, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        return requests
    from tqdm import tqdm  # imported only for interactive runs

    return tqdm(requests, total=count_lines(path), desc=desc, unit="req", file=sys.stderr)


def _print_json(payload: dict[str, Any]) -> None:
    print(json.dumps(payload, indent=2))


def _cmd_stats(args: argparse.Namespace) -> int:
    path = Path(args.file)
    stats = trace_stats(_with_progress(iter_trace(path), path, "stats"))
    if args.json:
        _print_json(stats)
    else:
        print(format_stats(stats))
    return 0


def _cmd_cache(args: argparse.Namespace) -> int:
    capacities = [parse_capacity(text) for text in args.capacity_blocks]
    path = Path(args.file)
    result = replay_cache(
        _with_progress(iter_trace(path), path, args.policy), args.policy, capacities
    )
    if args.json:
        _print_json(result)
    else:
        print(format_cache(result))
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.seed < 0:
        raise ValueError(f"--seed must be >= 0, got {args.seed}")
    requests = generate_dataset(args.dataset, args.rate, args.num_requests, args.seed)
    num_written = write_trace(requests, args.out)
    print(f"wrote {num_written} {args.dataset} requests to {args.out}")
    return 0


def _add_stats(commands: Any) -> None:
    parser = commands.add_parser(
        "stats",
        help="request count, span, rate, length distribution, unique blocks, hit ratio",
        description="Summarise a Mooncake JSONL trace in one streaming pass.",
    )
    parser.add_argument("file", help="Mooncake JSONL trace")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.set_defaults(func=_cmd_stats)


def _add_cache(commands: Any) -> None:
    parser = commands.add_parser(
        "cache",
        help="replay a trace through one global prefix cache per capacity",
        description="Prefix-cache hit ratio (total hit blocks / total blocks) of a trace "
        "replayed in arrival order, for each capacity, in one pass.",
    )
    parser.add_argument("file", help="Mooncake JSONL trace")
    parser.add_argument(
        "--policy", default="lru", help=f"eviction policy: {' | '.join(POLICY_NAMES)} (default lru)"
    )
    parser.add_argument(
        "--capacity-blocks",
        nargs="+",
        required=True,
        metavar="N",
        help="cache capacities in 512-token blocks ('inf' for unbounded)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=_cmd_cache)


def _add_generate(commands: Any) -> None:
    parser = commands.add_parser(
        "generate",
        help="write a synthetic dataset as a Mooncake JSONL trace",
        description="Generate a synthetic dataset with Poisson arrivals.",
    )
    parser.add_argument("--dataset", required=True, help=f"one of: {', '.join(DATASETS)}")
    parser.add_argument("--rate", type=float, required=True, help="arrival rate, requests/s")
    parser.add_argument("--num-requests", type=int, required=True, help="number of requests")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", required=True, help="output JSONL file")
    parser.set_defaults(func=_cmd_generate)


def register(subparsers: Any) -> None:
    """Add ``halfmoon trace`` and its subcommands."""
    parser = subparsers.add_parser(
        "trace",
        help="inspect, replay and generate Mooncake JSONL traces",
        description="Mooncake JSONL traces: statistics, cache replay, synthetic datasets.",
    )
    commands = parser.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    _add_stats(commands)
    _add_cache(commands)
    _add_generate(commands)

    def _usage(_: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_usage)
