"""Store benchmark: halfmoon's TieredStore vs Mooncake's MooncakeDistributedStore.

Run from the repository root::

    .venv/bin/python -m benchmarks.dataplane.store [--sizes 4K,64K,1M,16M] [--batch 64M]
        [--reps 5] [--rounds 1] [--latency-ops 200] [--ceiling]
        [--mooncake-slice-bytes 1048576] [--mooncake-env K=V] [--no-mooncake]
        [--json out.json] [--markdown]

Settings, compared like with like (every summary line names both sides' transports):

- tcp vs tcp: ours is a store in a peer process reached with ``put_blocks`` / ``pull``
  over tcp; Mooncake is ``mooncake_master`` plus a storage process that contributes the
  memory, and a client without its own segment (put/get, put_batch/get_batch, zero-copy
  batch_put_from/batch_get_into) over its TCP transport.
- local (Mooncake): a client that mounts its own segment, alone with the master (the
  storage process is stopped first), with ``MC_STORE_MEMCPY=1`` so it copies with memcpy.
  It is compared with ours local (``TieredStore.put`` / ``get_into`` in one process) and
  with ours shm (the store in another process, reached over shared memory).

A batch is ``--batch`` bytes (at most 1024 blocks, the same count on both sides);
``put+get`` GiB/s is the batch over the put time plus the get time of the same
repetition. Each repetition puts new bytes under new keys (untimed: a stamp in every
block, earlier blocks removed) and reads them back; what comes back is compared with what
was put, on both sides, and a missing or short block fails the run. One-block gets
(``--latency-ops`` per round, fewer for large blocks) give p50 and p99, each reading a
block put just before (untimed). With ``--rounds N`` ours and Mooncake alternate N times
(machine load shifts hit both); the tables show medians over rounds, and every ratio
prints per round. ``--ceiling`` also measures, in every round, how fast one direction of
loopback TCP goes without our code (loopback_ceiling.py): half of it bounds any put+get
over tcp. Mooncake runs from its own venv (mooncake_env.sh, created on first use) with
its documented TCP tuning (``_common.mooncake_env``), printed and recorded.
"""

from __future__ import annotations

import os

# Before numpy loads: idle OpenBLAS threads busy-wait and would steal CPU from the runs.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict

from halfmoon.core.heap import settle_gc
from halfmoon.transfer.microbench import (
    BenchResult,
    Step,
    VerificationError,
    aggregate,
    bench_store_local,
    bench_store_remote,
    format_table,
    make_plan,
    plan_arg,
)

from ._common import (
    HERE,
    MOONCAKE_VENV,
    JsonProcess,
    Ratio,
    add_mooncake_options,
    alternate_rounds,
    ceiling_rows,
    check_plan,
    figure,
    find,
    finish,
    free_port,
    mooncake_env,
    mooncake_python,
    parse_size,
    print_env,
    processes,
    ratio_report,
    results_from,
    run_report,
    size_label,
)

SEGMENT_BYTES = 1 << 30
#: Only Mooncake's local client (its own segment, alone) copies with memcpy: its store
#: documents the knob; the tcp client keeps the default (its object lives elsewhere).
MOONCAKE_LOCAL_ENV = {"MC_STORE_MEMCPY": "1"}


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


def run_mooncake(plan: list[Step], reps: int, env: dict[str, str]) -> list[BenchResult]:
    """Mooncake Store over tcp (a client without a segment, a storage process holding the
    objects), then local (a client with its own segment, the storage process gone)."""
    python, script = str(mooncake_python()), str(HERE / "mooncake_peer.py")
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
    bench = [python, script, "store-bench", *common, "--plan", plan_arg(plan), "--reps", str(reps)]
    records: list[dict] = []
    with processes() as procs:
        procs.append(JsonProcess(master, env))
        wait_listening(master_port)
        wait_listening(metadata_port)
        node = JsonProcess(
            [python, script, "store-node", *common, "--segment-bytes", str(SEGMENT_BYTES)], env
        )
        procs.append(node)
        node.first("ready")
        remote = JsonProcess([*bench, "--segment-bytes", "0"], env)
        procs.append(remote)
        records += list(remote.records(timeout_s=900))
        node.stop()  # local: the client's own segment is the only one left
        local = JsonProcess(
            [*bench, "--segment-bytes", str(SEGMENT_BYTES)], {**env, **MOONCAKE_LOCAL_ENV}
        )
        procs.append(local)
        records += list(local.records(timeout_s=900))
    results = results_from(records)
    check_plan(results, plan)
    return results


def mooncake_put_get(transport: str, size: int):
    """Mooncake's put+get GiB/s in one round with its fastest put API and its fastest get
    API (mixed: the most favourable reading for Mooncake)."""

    def read(results: Sequence[BenchResult]) -> float | None:
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

    return read


def mooncake_get_latency(transport: str, size: int, attr: str):
    """Mooncake's faster one-block read in one round: get (bytes) or get_into (zero-copy)."""

    def read(results: Sequence[BenchResult]) -> float | None:
        found = [find(results, "mooncake", op, transport, size) for op in ("get", "zero-copy get")]
        values = [getattr(r, attr) for r in found if r is not None]
        return min(values, default=None)

    return read


#: (ours, Mooncake's, label): the pairings the summary prints, like with like.
PAIRS = (
    ("tcp", "tcp", "tcp vs tcp"),
    ("local", "local", "local (ours, in-process) vs local (Mooncake, own segment)"),
    ("shm", "local", "shm (ours, store in another process) vs local (Mooncake, own segment)"),
)


NOTE = (
    "Mooncake's figure in each ratio: put+get with its fastest put API and its fastest get "
    "API of that round; one-block get latency with the faster of get and get_into."
)


def ratios(sizes: list[int], ceiling: bool) -> list[Ratio]:
    """What the summary compares, each ratio labelled with both sides' transports."""
    out = []
    for s in sizes:
        for ours, theirs, label in PAIRS:
            out.append(
                Ratio(
                    f"store put+get {size_label(s)} GiB/s, {label}: ours/Mooncake",
                    figure("halfmoon", "put+get", ours, s),
                    mooncake_put_get(theirs, s),
                )
            )
        for sender in ("bare", "bare+xxh3") if ceiling else ():
            out.append(
                Ratio(
                    f"store put+get {size_label(s)} GiB/s, our tcp vs half the loopback tcp "
                    f"one-way ceiling ({sender}): ours/bound",
                    figure("halfmoon", "put+get", "tcp", s),
                    lambda results, sender=sender: half(
                        figure("ceiling", "one-way", sender, 1 << 20)(results)
                    ),
                    "%",
                )
            )
    for s in (s for s in sizes if s <= 64 << 10):
        for pct in ("p50", "p99"):
            for ours, theirs, label in PAIRS:
                out.append(
                    Ratio(
                        f"store one-block get {size_label(s)} {pct} latency, {label}: "
                        "ours/Mooncake (lower is better)",
                        figure("halfmoon", "get", ours, s, f"op_us_{pct}"),
                        mooncake_get_latency(theirs, s, f"op_us_{pct}"),
                    )
                )
    return out


def half(value: float | None) -> float | None:
    """``value / 2`` (None stays None): put+get over tcp moves every byte both ways."""
    return None if value is None else value / 2


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
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
    parser.add_argument(
        "--latency-ops", type=int, default=200, help="one-block gets per round (p50, p99)"
    )
    parser.add_argument(
        "--ceiling", action="store_true", help="also measure one-way loopback tcp each round"
    )
    parser.add_argument("--ceiling-seconds", type=float, default=3.0)
    add_mooncake_options(parser)
    parser.add_argument("--json", help="write every round, the medians and the ratios here")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    return parser


def main() -> int:
    """Run the rounds, print the table and the per-round ratios."""
    parser = build_parser()
    args = parser.parse_args()
    if args.latency_ops < 1 or args.reps < 1 or args.rounds < 1:
        parser.error("--latency-ops, --reps and --rounds must be at least 1")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batch_bytes = parse_size(args.batch)
    env = mooncake_env(args.mooncake_slice_bytes, args.mooncake_env)
    plan = make_plan(sizes, batch_bytes, args.latency_ops)
    if not args.no_mooncake:
        print_env(env)
        print_env(MOONCAKE_LOCAL_ENV, "Mooncake env, local client only")
    settle_gc()  # as every halfmoon server process does; the Mooncake side does too
    started = time.monotonic()
    try:
        rounds, mooncake_error = alternate_rounds(
            args.rounds,
            lambda: (
                bench_store_local(sizes, batch_bytes, args.reps, args.latency_ops)
                + bench_store_remote(sizes, batch_bytes, args.reps, latency_ops=args.latency_ops)
                + (ceiling_rows(args.ceiling_seconds) if args.ceiling else [])
            ),
            None if args.no_mooncake else lambda: run_mooncake(plan, args.reps, env),
        )
    except VerificationError as exc:
        print(f"VERIFICATION FAILED: {exc}", file=sys.stderr)
        return 1
    results = aggregate(rounds)
    print(format_table(results))
    lines, per_round = ratio_report(ratios(sizes, args.ceiling), rounds)
    print(f"\n{NOTE}\n" + "\n".join(lines))
    report = run_report(
        rounds,
        results,
        per_round,
        plan=[asdict(s) for s in plan],
        mooncake_env=None if args.no_mooncake else env,
        mooncake_env_local_client=None if args.no_mooncake else MOONCAKE_LOCAL_ENV,
        mooncake_error=mooncake_error,
        note=NOTE,
    )
    finish(args, report, results, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
