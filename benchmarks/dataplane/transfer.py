"""Transfer engine benchmark: halfmoon tcp / shm push vs Mooncake's TransferEngine (tcp).

Run from the repository root::

    .venv/bin/python -m benchmarks.dataplane.transfer [--sizes 64K,1M,16M] [--batch 64M]
        [--reps 5] [--rounds 3] [--latency-sizes 4K,64K] [--latency-ops 200] [--ceiling]
        [--unchecked] [--write-turns 20 [--write-warmup 100]]
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
rows ``tcp unchecked``, batches and single writes), the like-for-like match for bare
batches and for Mooncake, which checksum nothing either. ``--write-turns N`` takes the
single writes out of the rounds: ours and Mooncake's take N turns of ``--latency-ops``
writes each (after ``--write-warmup`` untimed ones; who goes first alternates), so a slow
moment of the machine falls on both; p50 and p99 are reported per turn and pooled over
every turn. ``--sizes ''`` runs the single writes alone. Mooncake (``mooncake-transfer-engine-non-cuda==0.3.13.post1``) runs from
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
from halfmoon.transfer import TransferEngine
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
    new_stamps,
    peer_process,
    percentile,
    plan_arg,
    write_latency,
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


def mooncake_pair(
    procs: list[JsonProcess], buffer_bytes: int, env: dict[str, str], role: str, *args: str
) -> tuple[JsonProcess, JsonProcess]:
    """Mooncake's ``te-target`` with a ``buffer_bytes`` buffer, and a ``role`` process
    (``te-bench``, ``te-writer``) writing into it with ``args``; both in ``procs``."""
    python, script = str(mooncake_python()), str(HERE / "mooncake_peer.py")
    target = JsonProcess([python, script, "te-target", "--buffer-bytes", str(buffer_bytes)], env)
    procs.append(target)
    info = target.first("segment")
    argv = [python, script, role, "--segment", info["segment"], "--addr", str(info["addr"])]
    sender = JsonProcess([*argv, *args], env)
    procs.append(sender)
    return target, sender


def run_mooncake(
    plan: list[Step], latency: list[Step], reps: int, env: dict[str, str]
) -> list[BenchResult]:
    """Mooncake TransferEngine writes over tcp between two processes; the target's bytes
    are compared with the sender's after every step."""
    buffer_bytes = max(s.block_bytes * s.num_blocks for s in [*plan, *latency])
    records = []
    with processes() as procs:
        args = ("--plan", plan_arg(plan), "--latency", plan_arg(latency), "--reps", str(reps))
        target, bench = mooncake_pair(procs, buffer_bytes, env, "te-bench", *args)
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


def interleaved_writes(
    sizes: list[int],
    turns: int,
    ops: int,
    warmup: int,
    env: dict[str, str] | None,
    unchecked: bool,
) -> tuple[list[list[BenchResult]], str]:
    """Single one-block writes, ours and Mooncake's taking turns: per turn and size,
    ``warmup`` untimed and ``ops`` timed writes from each system in turn (who goes first
    alternates, and so does the order of our checked and unchecked engines), so a slow moment of the machine falls on both instead of on one
    system's whole round. Every turn checks both receivers against the last bytes
    written. Returns one list of ``write`` rows per turn (``env`` None: ours only) and
    why Mooncake could not start ("" if it did; then ours run alone)."""
    largest = max(sizes)
    out: list[list[BenchResult]] = []
    stamps = new_stamps()
    with ExitStack() as stack:
        peer = stack.enter_context(peer_process("--region", f"kv:{largest}:shared"))
        clients = []
        for label, checksum in (("tcp", True), (TCP_UNCHECKED, False)):
            if checksum or unchecked:
                engine = TransferEngine(peer.secret, checksum=checksum)
                stack.callback(engine.close)
                clients.append((label, engine.connect(peer.endpoint, "tcp")))
        target = writer = None
        mooncake_error = ""
        if env is not None:
            procs = stack.enter_context(processes())
            try:
                target, writer = mooncake_pair(
                    procs, largest, env, "te-writer", "--max-bytes", str(largest)
                )
                writer.first("ready")
            except (RuntimeError, OSError) as exc:
                mooncake_error, target, writer = str(exc), None, None
                print(f"Mooncake could not run: {exc}", file=sys.stderr)

        def ours(step: Step, turn: int) -> list[BenchResult]:  # our engines alternate too
            order = clients if turn % 2 == 0 else clients[::-1]
            return [write_latency(c, peer, step, stamps, label, warmup) for label, c in order]

        def theirs(step: Step, turn: int) -> list[BenchResult]:
            nonlocal writer, mooncake_error
            if writer is None or target is None:
                return []
            try:
                writer.send(f"write {step.block_bytes} {warmup} {step.num_one_ops}")
                record = writer.first("digest", timeout_s=600)
                target.send(f"digest {step.block_bytes}")
                digest = target.first("digest")["digest"]
            except (RuntimeError, OSError) as exc:  # it died mid-run: ours go on alone
                mooncake_error, writer = str(exc), None
                print(f"Mooncake stopped running: {exc}", file=sys.stderr)
                return []
            if digest != record["digest"]:
                raise VerificationError(
                    f"Mooncake single {step.block_bytes} B write: the target's bytes differ"
                )
            return results_from([record])

        for turn in range(turns):
            rows: list[BenchResult] = []
            for size in sizes:
                first, second = (ours, theirs) if turn % 2 == 0 else (theirs, ours)
                rows += first(Step(size, 1, ops), turn) + second(Step(size, 1, ops), turn)
            out.append(rows)
    return out, mooncake_error


def pooled_writes(turns: list[list[BenchResult]]) -> list[dict[str, object]]:
    """Every turn's writes of one system, transport and size pooled: p50 and p99 over all."""
    pooled: dict[tuple[str, str, int], list[float]] = {}
    for rows in turns:
        for r in rows:
            pooled.setdefault((r.system, r.transport, r.block_bytes), []).extend(r.batch_s_reps)
    return [
        {
            "system": system,
            "transport": transport,
            "block_bytes": size,
            "writes": len(times),
            "p50_us": percentile(times, 50) * 1e6,
            "p99_us": percentile(times, 99) * 1e6,
        }
        for (system, transport, size), times in pooled.items()
    ]


def turn_row(result: BenchResult, samples: bool) -> dict[str, object]:
    """A turn's ``write`` row for the JSON report, with every write's time or without."""
    row = result.to_dict()
    if not samples:
        row.pop("batch_s_reps")
    return row


def pooled_table(pooled: list[dict[str, object]]) -> str:
    """The pooled single-write rows."""
    lines = [
        f"{'system':<10} {'transport':<14} {'block':>6} {'writes':>7} {'p50 us':>9} {'p99 us':>9}"
    ]
    for p in pooled:
        lines.append(
            f"{p['system']:<10} {p['transport']:<14} {size_label(int(p['block_bytes'])):>6} "
            f"{p['writes']:>7} {p['p50_us']:>9.1f} {p['p99_us']:>9.1f}"
        )
    return "\n".join(lines)


def pooled_ratio_lines(pooled: list[dict[str, object]]) -> list[str]:
    """Ours over Mooncake's, p50 and p99 of the pooled writes, per transport and size."""
    theirs = {p["block_bytes"]: p for p in pooled if p["system"] == "mooncake"}
    lines = []
    for p in pooled:
        other = theirs.get(p["block_bytes"])
        if p["system"] != "halfmoon" or other is None:
            continue
        lines.append(
            f"single write {size_label(int(p['block_bytes']))}, pooled, ours {p['transport']} / "
            f"Mooncake tcp: p50 {p['p50_us'] / other['p50_us']:.2f}x, "
            f"p99 {p['p99_us'] / other['p99_us']:.2f}x (lower is better)"
        )
    return lines


def latency_ratios(latency_sizes: list[int], unchecked: bool) -> list[Ratio]:
    """Our single writes over Mooncake's, p50 and p99 (lower is better)."""
    out = []
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
            if unchecked:
                out.append(
                    Ratio(
                        f"single write {size_label(s)} {pct}, tcp vs tcp, neither side "
                        "checksumming its payloads: ours unchecked/Mooncake (lower is better)",
                        figure("halfmoon", "write", TCP_UNCHECKED, s, attr),
                        figure("mooncake", "write", "tcp", s, attr),
                    )
                )
    return out


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
    return out + latency_ratios(latency_sizes, unchecked)


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
    parser.add_argument(
        "--sizes", default="64K,1M,16M", help="batch block sizes ('': only the single writes)"
    )
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
    parser.add_argument(
        "--write-turns",
        type=int,
        default=0,
        help="measure the single writes apart from the rounds, ours and Mooncake's taking "
        "this many turns of --latency-ops writes each (0: inside every round)",
    )
    parser.add_argument(
        "--write-warmup",
        type=int,
        default=100,
        help="untimed single writes before each turn's timed ones (with --write-turns)",
    )
    parser.add_argument(
        "--json-samples",
        action="store_true",
        help="with --write-turns: keep every write's time in --json (20,000 writes per "
        "system and size take ~1 MB; by default each turn's p50 and p99 are kept)",
    )
    add_mooncake_options(parser)
    parser.add_argument("--json", help="write every round, the medians and the ratios here")
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    return parser


def main() -> int:
    """Run the rounds, print the tables and the per-round ratios."""
    parser = build_parser()
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]  # "": single writes only
    latency_sizes = [parse_size(s) for s in args.latency_sizes.split(",") if s]
    batch_bytes = parse_size(args.batch)
    if any(batch_bytes % s for s in sizes):
        parser.error("--batch must be a multiple of every block size")
    if args.latency_ops < 1 or args.reps < 1 or args.rounds < 1:
        parser.error("--latency-ops, --reps and --rounds must be at least 1")
    if args.write_turns < 0 or args.write_warmup < 0:
        parser.error("--write-turns and --write-warmup must be at least 0")
    env = mooncake_env(args.mooncake_slice_bytes, args.mooncake_env)
    plan = make_plan(sizes, batch_bytes, args.latency_ops)
    turn_sizes = latency_sizes if args.write_turns else []
    if turn_sizes:  # the single writes get their own interleaved turns, not the rounds
        latency_sizes = []
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

    rounds, mooncake_error, turns = [], "", []
    try:
        if sizes or latency_sizes:
            rounds, mooncake_error = alternate_rounds(
                args.rounds,
                ours,
                None if args.no_mooncake else lambda: run_mooncake(plan, latency, args.reps, env),
            )
        if turn_sizes:
            turns, turn_error = interleaved_writes(
                turn_sizes,
                args.write_turns,
                args.latency_ops,
                args.write_warmup,
                None if args.no_mooncake or mooncake_error else env,
                args.unchecked,
            )
            mooncake_error = mooncake_error or turn_error
    except VerificationError as exc:
        print(f"VERIFICATION FAILED: {exc}", file=sys.stderr)
        return 1
    results = aggregate(rounds) if rounds else []
    if sizes:
        print(format_table([r for r in results if r.op != "write"]))
    if latency_sizes:
        print(f"\nsingle one-block writes, {args.latency_ops} per round (median over rounds):")
        print(latency_table(results))
    pooled = pooled_writes(turns)
    if turns:
        print(
            f"\nsingle one-block writes, {args.write_turns} turns of {args.latency_ops} "
            f"(after {args.write_warmup} untimed) per system, taking turns; pooled:"
        )
        print(pooled_table(pooled))
    if rounds:
        print(
            "(our shm has no counterpart: Mooncake's TransferEngine here has no shared-memory "
            "transport)"
        )
    lines, per_round = ratio_report(
        ratios(sizes, latency_sizes, args.ceiling, args.unchecked), rounds
    )
    if lines:
        print("\n" + "\n".join(lines))
    turn_lines, per_turn = ratio_report(latency_ratios(turn_sizes, args.unchecked), turns)
    turn_lines = [line.replace("per round", "per turn") for line in turn_lines]
    turn_lines += pooled_ratio_lines(pooled)
    if turn_lines:
        print("\n" + "\n".join(turn_lines))
    report = run_report(
        rounds,
        results,
        per_round,
        plan=[asdict(s) for s in plan],
        mooncake_env=None if args.no_mooncake else env,
        mooncake_error=mooncake_error,
        write_turns=[[turn_row(r, args.json_samples) for r in rows] for rows in turns],
        writes_pooled=pooled,
        write_ratios_per_turn=per_turn,
    )
    finish(args, report, results, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
