"""Transfer engine benchmark: halfmoon tcp / shm push vs Mooncake's TransferEngine (tcp).

Run from the repository root::

    .venv/bin/python -m benchmarks.dataplane.transfer [--sizes 64K,1M,16M] [--batch 64M] [--reps 5]
        [--no-mooncake] [--json out.json] [--markdown]

Every peer is a separate process bound to 127.0.0.1. Each configuration moves one batch
of ``--batch`` bytes in blocks of each size from a sender process into a receiver's
preallocated buffer; a round reports the median over ``--reps`` (after a warm-up) as
GiB/s and the median latency of a one-block transfer, and the result is the median over
``--rounds`` rounds that alternate ours and Mooncake. Block-by-block memcpy in one process,
measured right before our transports at each size, is the physical limit. Mooncake (``mooncake-transfer-engine-non-cuda==0.3.13.post1``) runs from
its own venv, created on first use by benchmarks/dataplane/mooncake_env.sh.
"""

from __future__ import annotations

import os

# Before numpy loads: idle OpenBLAS threads busy-wait and would steal CPU from the runs.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys
import time

from halfmoon.transfer.microbench import BenchResult, aggregate, bench_transfer, format_table

from ._common import (
    HERE,
    MOONCAKE_ENV,
    JsonProcess,
    alternate_rounds,
    find,
    finish,
    mooncake_python,
    parse_size,
    processes,
    results_from,
    size_label,
)


def run_mooncake(sizes: list[int], batch_bytes: int, reps: int) -> list[BenchResult]:
    """Mooncake TransferEngine batch writes over tcp between two processes."""
    python = str(mooncake_python())
    script = str(HERE / "mooncake_peer.py")
    with processes() as procs:
        target = JsonProcess(
            [python, script, "te-target", "--buffer-bytes", str(batch_bytes)], MOONCAKE_ENV
        )
        procs.append(target)
        info = target.first("segment")
        argv = [
            python,
            script,
            "te-bench",
            "--segment",
            info["segment"],
            "--addr",
            str(info["addr"]),
        ]
        argv += [
            "--sizes",
            ",".join(map(str, sizes)),
            "--batch-bytes",
            str(batch_bytes),
            "--reps",
            str(reps),
        ]
        bench = JsonProcess(argv, MOONCAKE_ENV)
        procs.append(bench)
        records = list(bench.records(timeout_s=600))
        target.send("digest")
        digest = target.first("digest")["digest"]
        sent = next(r["digest_src"] for r in records if "digest_src" in r)
        if digest != sent:
            raise RuntimeError("Mooncake's target buffer differs from what was written")
    return results_from(records)


def summary(results: list[BenchResult], sizes: list[int]) -> list[str]:
    """Ratios the issue sets targets for."""
    lines = []
    for size in sizes:
        tcp = find(results, "halfmoon", "push", "tcp", size)
        shm = find(results, "halfmoon", "push", "shm", size)
        mc = find(results, "mooncake", "batch_write", "tcp", size)
        copy = find(results, "memcpy", "copy", "-", size)
        parts = [f"{size_label(size)}:"]
        if tcp and mc:
            parts.append(f"our tcp / Mooncake tcp = {tcp.gib_per_s / mc.gib_per_s:.2f}x")
        if shm and copy:
            parts.append(f"our shm / memcpy = {100 * shm.gib_per_s / copy.gib_per_s:.0f}%")
        lines.append("  ".join(parts))
    return lines


def markdown(results: list[BenchResult]) -> str:
    """Results as a markdown table."""
    rows = [
        "| system | op | transport | block | GiB/s | batch ms (p50) | 1-block us (p50) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        rows.append(
            f"| {r.system} | {r.op} | {r.transport} | {size_label(r.block_bytes)} | {r.gib_per_s:.2f} "
            f"| {r.batch_s_p50 * 1e3:.1f} | {r.op_us_p50:.0f} |"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64K,1M,16M")
    parser.add_argument("--batch", default="64M", help="bytes moved per measured transfer")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds of ours and Mooncake"
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=None,
        help="our parallel tcp connections (default: min(4, cores))",
    )
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument("--json", help="write raw results here")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batch_bytes = parse_size(args.batch)
    if any(batch_bytes % s for s in sizes):
        parser.error("--batch must be a multiple of every block size")
    started = time.monotonic()
    rounds, mooncake_error = alternate_rounds(
        args.rounds,
        lambda: bench_transfer(sizes, batch_bytes, args.reps, num_connections=args.connections),
        None if args.no_mooncake else lambda: run_mooncake(sizes, batch_bytes, args.reps),
    )
    results = aggregate(rounds)
    print(format_table(results))
    print("\n".join(summary(results, sizes)))
    finish(args, results, mooncake_error, started, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
