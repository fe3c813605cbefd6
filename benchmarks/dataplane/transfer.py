"""Transfer engine benchmark: halfmoon tcp / shm push vs Mooncake's TransferEngine (tcp).

Run from the repository root::

    .venv/bin/python -m benchmarks.dataplane.transfer [--sizes 64K,1M,16M] [--batch 64M]
        [--reps 5] [--rounds 3] [--latency-sizes 4K,64K] [--latency-ops 200] [--ceiling]
        [--unchecked]
        [--mooncake-slice-bytes 1048576] [--mooncake-env K=V] [--no-mooncake]
        [--json out.json] [--markdown]

Every peer is a separate process bound to 127.0.0.1. Each configuration moves one batch
of ``--batch`` bytes (at most 1024 blocks; the same count on both sides) in blocks of
each size from a sender process into a receiver's preallocated buffer; a round reports
the median over ``--reps`` (after a warm-up) as GiB/s, and p50 / p99 of one-block
transfers. Then single one-block writes at ``--latency-sizes`` (``--latency-ops`` per
round, p50 and p99) get their own table. Before every timed repetition the source bytes
change (untimed), and after every configuration the receiver's bytes are compared with
what was sent, on both sides; a difference fails the run.

``--rounds`` rounds alternate ours and Mooncake; every round's figures and every round's
ratio go to ``--json``, and the ratios print per round. Block-by-block memcpy in one
process, taking turns with our transports repetition by repetition at each size, is the
physical limit for shared memory. ``--ceiling`` measures bare loopback tcp two ways and
prints our tcp over each (loopback_ceiling.py): streaming for ``--ceiling-seconds`` each
round (rows ``ceiling one-way``), and bare process pairs moving the same batch over two
connections, taking turns with ours batch by batch (rows ``ceiling batch``); a second set
of bare pairs takes its turn too, and bare over bare (an A/A ratio) shows how far one
round's ratio strays on this machine when both sides are the same. ``--unchecked`` adds
our tcp push from an engine that does not checksum its payloads (``checksum=False``;
rows ``tcp unchecked``), the like-for-like match for bare batches and for Mooncake, which
checksum nothing either. Mooncake
(``mooncake-transfer-engine-non-cuda==0.3.13.post1``) runs from
its own venv, created on first use by benchmarks/dataplane/mooncake_env.sh, with its
documented TCP tuning (see ``_common.mooncake_env``), printed and recorded.
"""

from __future__ import annotations

import os

# Before numpy loads: idle OpenBLAS threads busy-wait and would steal CPU from the runs.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict

from halfmoon.core.heap import settle_gc
from halfmoon.transfer.microbench import (
    TCP_UNCHECKED,
    Arm,
    BenchResult,
    Step,
    VerificationError,
    aggregate,
    bench_transfer,
    format_table,
    make_plan,
    plan_arg,
)

from ._common import (
    HERE,
    JsonProcess,
    Ratio,
    add_mooncake_options,
    alternate_rounds,
    ceiling_rows,
    check_plan,
    figure,
    finish,
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
from .loopback_ceiling import BarePairs


def run_mooncake(
    plan: list[Step], latency: list[Step], reps: int, env: dict[str, str]
) -> list[BenchResult]:
    """Mooncake TransferEngine writes over tcp between two processes; the target's bytes
    are compared with the sender's after every step."""
    python, script = str(mooncake_python()), str(HERE / "mooncake_peer.py")
    buffer_bytes = max(s.block_bytes * s.num_blocks for s in [*plan, *latency])
    records = []
    with processes() as procs:
        target = JsonProcess(
            [python, script, "te-target", "--buffer-bytes", str(buffer_bytes)], env
        )
        procs.append(target)
        info = target.first("segment")
        argv = [python, script, "te-bench", "--segment", info["segment"]]
        argv += ["--addr", str(info["addr"]), "--plan", plan_arg(plan)]
        argv += ["--latency", plan_arg(latency), "--reps", str(reps)]
        bench = JsonProcess(argv, env)
        procs.append(bench)
        for record in bench.records(timeout_s=600):
            if "verify" not in record:
                records.append(record)
                continue
            target.send(f"digest {record['num_bytes']}")
            if target.first("digest")["digest"] != record["digest"]:
                raise VerificationError(
                    f"Mooncake {record['verify']}: the target's bytes differ from those written"
                )
            bench.send("go")
    results = results_from(records)
    check_plan(results, plan)
    return results


#: Bare batches without a checksum, a second set of process pairs: bare against bare, in
#: turns like ours, gives the spread a per-round ratio has when both sides are the same.
BARE_AGAIN = "bare again"


def bare_batches(stack: ExitStack) -> Callable[[Step], list[Arm]]:
    """Arms that move each step's batch over bare loopback (two process pairs, without
    and with xxh3, and a second pair without: :data:`BARE_AGAIN`), kept alive in
    ``stack`` and shared by steps of one batch size."""
    pairs: dict[tuple[int, str], BarePairs] = {}

    def arms(step: Step) -> list[Arm]:
        out = []
        for sender in ("bare", "bare+xxh3", BARE_AGAIN):
            key = (step.num_blocks * step.block_bytes, sender)
            if key not in pairs:
                pairs[key] = stack.enter_context(BarePairs(key[0], sender == "bare+xxh3"))
            out.append(Arm("ceiling", "batch", sender, pairs[key].batch))
        return out

    return arms


def ratios(
    sizes: list[int], latency_sizes: list[int], ceiling: bool, unchecked: bool = False
) -> list[Ratio]:
    """What the summary compares, like with like, each ratio labelled with both sides."""
    out = []
    for s in sizes:
        label = f"push {size_label(s)} batch GiB/s"
        ours_tcp = figure("halfmoon", "push", "tcp", s)
        out.append(
            Ratio(
                f"{label}, tcp vs tcp: ours/Mooncake",
                ours_tcp,
                figure("mooncake", "batch_write", "tcp", s),
            )
        )
        quick = figure("halfmoon", "push", TCP_UNCHECKED, s)
        if unchecked:
            out.append(
                Ratio(
                    f"{label}, tcp vs tcp, neither side checksumming its payloads: "
                    "ours unchecked/Mooncake",
                    quick,
                    figure("mooncake", "batch_write", "tcp", s),
                )
            )
        if unchecked and ceiling:
            out.append(
                Ratio(
                    f"{label}, our tcp without payload checksums vs bare batches in turn "
                    "(bare): ours unchecked/bare",
                    quick,
                    figure("ceiling", "batch", "bare", s),
                    "%",
                )
            )
        for op, into, where in (
            ("push", "-", ""),
            ("push", "shm", " into shared memory"),
            ("push scattered", "shm", " into shared memory, blocks not adjacent in memory"),
        ):
            out.append(
                Ratio(
                    f"{label}, shm (ours) vs in-process memcpy{where}: ours/memcpy",
                    figure("halfmoon", op, "shm", s),
                    figure("memcpy", "copy", into, s),
                    "%",
                )
            )
        for sender in ("bare", "bare+xxh3") if ceiling else ():
            out.append(
                Ratio(
                    f"{label}, our tcp vs loopback tcp one way ({sender}): ours/ceiling",
                    ours_tcp,
                    figure("ceiling", "one-way", sender, 1 << 20),
                    "%",
                )
            )
            out.append(
                Ratio(
                    f"{label}, our tcp vs bare batches in turn ({sender}): ours/bare",
                    ours_tcp,
                    figure("ceiling", "batch", sender, s),
                    "%",
                )
            )
        if ceiling:
            out.append(
                Ratio(
                    f"{label}, bare batches vs bare batches in turn (A/A: how far one "
                    "round's ratio strays when both sides are the same): bare/bare",
                    figure("ceiling", "batch", BARE_AGAIN, s),
                    figure("ceiling", "batch", "bare", s),
                    "%",
                )
            )
    for s in latency_sizes:
        for pct in ("p50", "p99"):
            attr = f"op_us_{pct}"
            out.append(
                Ratio(
                    f"single write {size_label(s)} {pct}, tcp vs tcp: ours/Mooncake "
                    "(latency: lower is better)",
                    figure("halfmoon", "write", "tcp", s, attr),
                    figure("mooncake", "write", "tcp", s, attr),
                )
            )
    return out


def latency_table(results: list[BenchResult]) -> str:
    """The single-write rows: p50 and p99 over every write of a round."""
    lines = [f"{'system':<10} {'transport':<10} {'block':>6} {'p50 us':>9} {'p99 us':>9}"]
    for r in results:
        if r.op == "write":
            lines.append(
                f"{r.system:<10} {r.transport:<10} {size_label(r.block_bytes):>6} "
                f"{r.op_us_p50:>9.1f} {r.op_us_p99:>9.1f}"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="64K,1M,16M")
    parser.add_argument("--batch", default="64M", help="bytes moved per measured transfer")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per round")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternating rounds of ours and Mooncake"
    )
    parser.add_argument("--latency-sizes", default="4K,64K", help="single-write latency sizes")
    parser.add_argument(
        "--latency-ops", type=int, default=200, help="one-block writes per round (p50, p99)"
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=None,
        help="our parallel tcp connections (default: min(4, cores))",
    )
    parser.add_argument(
        "--ceiling", action="store_true", help="also measure one-way loopback tcp each round"
    )
    parser.add_argument("--ceiling-seconds", type=float, default=3.0)
    parser.add_argument(
        "--unchecked",
        action="store_true",
        help=f"also push from an engine without payload checksums (rows '{TCP_UNCHECKED}')",
    )
    add_mooncake_options(parser)
    parser.add_argument("--json", help="write every round, the medians and the ratios here")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    return parser


def main() -> int:
    """Run the rounds, print the tables and the per-round ratios."""
    parser = build_parser()
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    latency_sizes = [parse_size(s) for s in args.latency_sizes.split(",") if s]
    batch_bytes = parse_size(args.batch)
    if any(batch_bytes % s for s in sizes):
        parser.error("--batch must be a multiple of every block size")
    if args.latency_ops < 1 or args.reps < 1 or args.rounds < 1:
        parser.error("--latency-ops, --reps and --rounds must be at least 1")
    env = mooncake_env(args.mooncake_slice_bytes, args.mooncake_env)
    plan = make_plan(sizes, batch_bytes, args.latency_ops)
    latency = [Step(s, 1, args.latency_ops) for s in latency_sizes]
    if not args.no_mooncake:
        print_env(env)
    settle_gc()  # as every halfmoon server process does; the Mooncake side does too
    started = time.monotonic()

    def ours() -> list[BenchResult]:
        with ExitStack() as stack:
            results = bench_transfer(
                sizes,
                batch_bytes,
                args.reps,
                num_connections=args.connections,
                latency_sizes=latency_sizes,
                latency_ops=args.latency_ops,
                baselines=bare_batches(stack) if args.ceiling else None,
                unchecked=args.unchecked,
            )
        return results + (ceiling_rows(args.ceiling_seconds) if args.ceiling else [])

    try:
        rounds, mooncake_error = alternate_rounds(
            args.rounds,
            ours,
            None if args.no_mooncake else lambda: run_mooncake(plan, latency, args.reps, env),
        )
    except VerificationError as exc:
        print(f"VERIFICATION FAILED: {exc}", file=sys.stderr)
        return 1
    results = aggregate(rounds)
    print(format_table([r for r in results if r.op != "write"]))
    print(f"\nsingle one-block writes, {args.latency_ops} per round (median over rounds):")
    print(latency_table(results))
    print(
        "(our shm has no counterpart: Mooncake's TransferEngine here has no shared-memory transport)"
    )
    lines, per_round = ratio_report(
        ratios(sizes, latency_sizes, args.ceiling, args.unchecked), rounds
    )
    print("\n" + "\n".join(lines))
    report = run_report(
        rounds,
        results,
        per_round,
        plan=[asdict(s) for s in plan],
        mooncake_env=None if args.no_mooncake else env,
        mooncake_error=mooncake_error,
    )
    finish(args, report, results, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
