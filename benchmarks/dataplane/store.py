"""Store benchmark: halfmoon's TieredStore vs Mooncake's MooncakeDistributedStore.

Run from the repository root::

    .venv/bin/python -m benchmarks.dataplane.store [--sizes 4K,64K,1M,16M] [--batch 64M] [--reps 5]
        [--rounds 1] [--no-mooncake] [--ceiling] [--json out.json] [--markdown]

Two settings, each side by side:

- remote (over 127.0.0.1): ours is a store in a peer process reached with
  ``put_blocks`` / ``pull`` over tcp and shm; Mooncake is ``mooncake_master`` plus a
  storage process that contributes the memory, and a client without its own segment
  (put/get, put_batch/get_batch, zero-copy batch_put_from/batch_get_into).
- local (in one process): ours is ``TieredStore.put`` / ``get_into``; Mooncake is a
  client that mounts its own segment (it then copies with memcpy).

A batch is ``--batch`` bytes (at most 1024 blocks); ``put+get`` GiB/s is the batch size
over the put time plus the get time. The one-block get median at 4 KiB is the latency
figure. With ``--rounds N`` ours and Mooncake alternate N times (machine load shifts hit
both) and every figure is the median over the rounds; the per-round 4 KiB latency ratios
are printed too. ``--ceiling`` also measures, in every round, how fast one direction of
loopback TCP goes without our code (benchmarks/dataplane/loopback_ceiling.py): half of it
bounds any put+get over tcp. Mooncake runs from its own venv
(benchmarks/dataplane/mooncake_env.sh, created on first use).
"""

from __future__ import annotations

import os

# Before numpy loads: idle OpenBLAS threads busy-wait and would steal CPU from the runs.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import socket
import statistics
import sys
import time

from halfmoon.transfer.microbench import (
    GIB,
    BenchResult,
    aggregate,
    bench_store_local,
    bench_store_remote,
    format_table,
)

from ._common import (
    HERE,
    MOONCAKE_ENV,
    MOONCAKE_VENV,
    JsonProcess,
    alternate_rounds,
    find,
    finish,
    free_port,
    mooncake_python,
    parse_size,
    processes,
    results_from,
)
from .loopback_ceiling import pairs_gib_s
from .transfer import markdown

SEGMENT_BYTES = 1 << 30


def wait_listening(port: int, timeout_s: float = 30.0) -> None:
    """Block until something accepts on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


def run_mooncake(sizes: list[int], batch_bytes: int, reps: int) -> list[BenchResult]:
    """Mooncake Store, remote (client without a segment) and local (client with one)."""
    python = str(mooncake_python())
    script = str(HERE / "mooncake_peer.py")
    master_port, metadata_port, metrics_port = free_port(), free_port(), free_port()
    master = [
        str(MOONCAKE_VENV / "bin" / "mooncake_master"),
        "-rpc_address=127.0.0.1",
        f"-rpc_port={master_port}",
        "-enable_http_metadata_server=true",
        "-http_metadata_server_host=127.0.0.1",
        f"-http_metadata_server_port={metadata_port}",
        "-metrics_host=127.0.0.1",
        f"-metrics_port={metrics_port}",
    ]
    common = ["--master-port", str(master_port), "--metadata-port", str(metadata_port)]
    bench_args = [
        "--sizes",
        ",".join(map(str, sizes)),
        "--batch-bytes",
        str(batch_bytes),
        "--reps",
        str(reps),
    ]
    records: list[dict] = []
    with processes() as procs:
        procs.append(JsonProcess(master, MOONCAKE_ENV))
        wait_listening(master_port)
        wait_listening(metadata_port)
        node = JsonProcess(
            [python, script, "store-node", *common, "--segment-bytes", str(SEGMENT_BYTES)],
            MOONCAKE_ENV,
        )
        procs.append(node)
        node.first("ready")
        for segment_bytes in (0, SEGMENT_BYTES):  # remote first, then local
            argv = [
                python,
                script,
                "store-bench",
                *common,
                "--segment-bytes",
                str(segment_bytes),
                *bench_args,
            ]
            bench = JsonProcess(argv, MOONCAKE_ENV)
            procs.append(bench)
            records += list(bench.records(timeout_s=900))
    return results_from(records)


def mooncake_best_put_get(results: list[BenchResult], transport: str, size: int) -> float | None:
    """Mooncake's put+get GiB/s with its fastest put API and its fastest get API (mixed:
    the most favourable reading for Mooncake)."""
    rates = {}
    for op in ("put", "get"):
        candidates = [
            r.gib_per_s
            for r in results
            if r.system == "mooncake"
            and r.op.split()[-1] == op
            and r.transport == transport
            and r.block_bytes == size
        ]
        if not candidates:
            return None
        rates[op] = max(candidates)
    return 1.0 / (1.0 / rates["put"] + 1.0 / rates["get"])


def fastest_mooncake_get(results: list[BenchResult], transport: str) -> BenchResult | None:
    """Mooncake's faster one-block 4 KiB read: get (returns bytes) or get_into (zero-copy)."""
    mc = [find(results, "mooncake", op, transport, 4096) for op in ("get", "zero-copy get")]
    return min((r for r in mc if r is not None), key=lambda r: r.op_us_p50, default=None)


def latency_ratios(rounds: list[list[BenchResult]]) -> list[str]:
    """Per round: our remote 4 KiB get p50 over Mooncake's fastest remote one."""
    lines = []
    for transport in ("tcp", "shm"):
        ratios = []
        for one_round in rounds:
            ours = find(one_round, "halfmoon", "get", transport, 4096)
            theirs = fastest_mooncake_get(one_round, "tcp")
            if ours and theirs:
                ratios.append(ours.op_us_p50 / theirs.op_us_p50)
        if ratios:
            listed = ", ".join(f"{r:.2f}" for r in ratios)
            lines.append(
                f"4K get p50, ours {transport} / Mooncake tcp per round: {listed} "
                f"(median {statistics.median(ratios):.2f})"
            )
    return lines


def ceiling_rows(seconds: float) -> list[BenchResult]:
    """One-way loopback tcp of a cold 64 MiB batch without our code (two bare sender /
    receiver process pairs, 1 MiB writes; loopback_ceiling.py), with and
    without xxh3 on both sides; ``gib_per_s`` is the one-way figure."""
    return [
        ceiling_row("bare", pairs_gib_s(seconds, checksum=False)),
        ceiling_row("bare+xxh3", pairs_gib_s(seconds, checksum=True)),
    ]


def ceiling_row(sender: str, gib_s: float) -> BenchResult:
    return BenchResult(
        "ceiling", "one-way", sender, 1 << 20, 1, gib_s, (1 << 20) / gib_s / GIB, 0.0
    )


def summary(results: list[BenchResult]) -> list[str]:
    """The ratios the issue sets targets for (ours over Mooncake's fastest APIs)."""
    lines = []
    mib = 1 << 20
    mooncake_tcp = mooncake_best_put_get(results, "tcp", mib)
    for sender in ("bare", "bare+xxh3"):
        ceiling = find(results, "ceiling", "one-way", sender, mib)
        if ceiling and mooncake_tcp:
            bound = ceiling.gib_per_s / 2
            lines.append(
                f"loopback tcp ceiling ({sender}): one way {ceiling.gib_per_s:.2f} GiB/s, so "
                f"put+get over tcp <= {bound:.2f} GiB/s = {bound / mooncake_tcp:.1f}x Mooncake tcp"
            )
    for transport, theirs in (("local", "local"), ("shm", "tcp"), ("tcp", "tcp")):
        ours = find(results, "halfmoon", "put+get", transport, mib)
        best = mooncake_best_put_get(results, theirs, mib)
        if ours and best:
            label = "shm (auto's pick on one host)" if transport == "shm" else transport
            lines.append(
                f"1M put+get: ours {label} {ours.gib_per_s:.2f} GiB/s vs Mooncake {theirs} "
                f"(fastest put + fastest get) {best:.2f} GiB/s = {ours.gib_per_s / best:.1f}x"
            )
    for transport, theirs in (("local", "local"), ("tcp", "tcp"), ("shm", "tcp")):
        ours = find(results, "halfmoon", "get", transport, 4096)
        fastest = fastest_mooncake_get(results, theirs)
        if ours and fastest:
            lines.append(
                f"4K get p50: ours {transport} {ours.op_us_p50:.1f} us vs Mooncake {theirs} "
                f"'{fastest.op}' {fastest.op_us_p50:.1f} us"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="4K,64K,1M,16M")
    parser.add_argument(
        "--batch", default="64M", help="bytes per measured batch (at most 1024 blocks)"
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=1, help="alternating rounds of ours and Mooncake"
    )
    parser.add_argument("--no-mooncake", action="store_true")
    parser.add_argument(
        "--ceiling", action="store_true", help="also measure one-way loopback tcp each round"
    )
    parser.add_argument("--json", help="write raw results here")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batch_bytes = parse_size(args.batch)
    started = time.monotonic()
    rounds, mooncake_error = alternate_rounds(
        args.rounds,
        lambda: (
            bench_store_local(sizes, batch_bytes, args.reps)
            + bench_store_remote(sizes, batch_bytes, args.reps)
            + (ceiling_rows(3.0) if args.ceiling else [])
        ),
        None if args.no_mooncake else lambda: run_mooncake(sizes, batch_bytes, args.reps),
    )
    results = aggregate(rounds)
    print(format_table(results))
    print("\n".join(summary(results)))
    if len(rounds) > 1:
        print("\n".join(latency_ratios(rounds)))
    finish(args, results, mooncake_error, started, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
