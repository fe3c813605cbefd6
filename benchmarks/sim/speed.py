"""Simulator speed on the whole synthetic trace, and the Conductor's decision latency.

Run: .venv/bin/python -m benchmarks.sim.speed [--trace FILE] [--repeats R]
         [--sizes 8 32 64 128 256] [--instances 64 256] [--blocks 1000000]
         [--decisions 5000] [--cpu-time] [--skip-simulate] [--skip-schedule]

1. ``simulate``: the whole trace on 8P8D and on 16M (LLaMA2-70B, 8xA800 per instance),
   median wall time over ``--repeats`` runs, then one run under tracemalloc for the peak
   Python heap; the process's peak RSS is printed at the end. Target: < 30 s for 8P8D.
2. ``scaling`` (with ``--sizes``): the whole trace on NPND for each N, the arrival rate
   scaled with the cluster (``time_scale`` = 1.5 x N / 8, so every size is as loaded as
   8P8D at 1.5); process CPU microseconds per event (a busy machine inflates wall
   time), best of ``--repeats``. Target: flat (within 1.5x) from 8P8D to 256P256D.
3. ``schedule``: for each ``--instances`` N, a Conductor with N prefill and N (then 8)
   decode instances, whose index holds ``--blocks`` distinct blocks (filled through
   BlockStored events), places requests shaped like the trace (30 blocks on average, a
   cached document prefix of 1-30 blocks). About 256 requests stay in flight (their
   lifecycle events are sent), so queue and decode bookkeeping is realistic. Wall time
   per decision, or thread CPU time with ``--cpu-time`` (what a busy machine's other
   processes do not inflate). Targets: p99 < 1 ms at 64+64, < 2 ms at 256+256.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import time
import tracemalloc
from collections import deque
from collections.abc import Callable
from pathlib import Path

from halfmoon.conductor import (
    BlockStored,
    Conductor,
    ConductorConfig,
    DecodeStarted,
    PrefillFinished,
    PrefillStarted,
    RequestFinished,
)
from halfmoon.core.clock import ManualClock
from halfmoon.core.request import Request
from halfmoon.costmodel import build_cost_model
from halfmoon.sim import ClusterSpec, SimConfig, simulate
from halfmoon.workload import read_trace

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = ROOT.parent / "shared/traces/synthetic_trace.jsonl"
DOC_BLOCKS = 50  # blocks per cached "document" chain in the decision benchmark
IN_FLIGHT = 256


def bench_simulate(trace: Path, repeats: int) -> None:
    """Time whole-trace runs on 8P8D and 16M; print a markdown table."""
    requests = read_trace(trace)
    cost_model = build_cost_model("llama2-70b", "a800", 8)
    print(f"simulate: {len(requests)} requests from {trace.name}, {repeats} repeats\n")
    print("| cluster | policy | median s | min s | events | events/s | peak heap MiB |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for cluster in ("8P8D", "16M"):
        config = SimConfig(ClusterSpec.parse(cluster))
        conductor = ConductorConfig()
        times_s = []
        for _ in range(repeats):
            start = time.perf_counter()
            result = simulate(requests, config, conductor, cost_model)
            times_s.append(time.perf_counter() - start)
        tracemalloc.start()
        simulate(requests, config, conductor, cost_model)
        _, peak_bytes = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        events = result.report["num_events"]
        median_s = statistics.median(times_s)
        print(
            f"| {cluster} | {result.report['policy']} | {median_s:.2f} | {min(times_s):.2f} | "
            f"{events:,} | {events / median_s:,.0f} | {peak_bytes / 2**20:.0f} |"
        )


def bench_scaling(trace: Path, sizes: list[int], repeats: int) -> None:
    """Microseconds per event of whole-trace runs on NPND clusters of each size, the
    arrival rate scaled with the cluster (time_scale 1.5 at 8P8D, proportional to the
    instance count) so every size is equally loaded; print a markdown table."""
    requests = read_trace(trace)
    cost_model = build_cost_model("llama2-70b", "a800", 8)
    print(f"scaling: {len(requests)} requests from {trace.name}, best of {repeats}\n")
    print("| cluster | time scale | wall s | CPU s | events | us/event (CPU) | SLO attainment |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for n in sizes:
        config = SimConfig(ClusterSpec.parse(f"{n}P{n}D"), time_scale=1.5 * n / 8)
        wall_s, cpu_s = [], []
        for _ in range(repeats):
            start, start_cpu = time.perf_counter(), time.process_time()
            result = simulate(requests, config, ConductorConfig(), cost_model)
            wall_s.append(time.perf_counter() - start)
            cpu_s.append(time.process_time() - start_cpu)
        events = result.report["num_events"]
        print(
            f"| {n}P{n}D | {config.time_scale:g} | {min(wall_s):.2f} | {min(cpu_s):.2f} | "
            f"{events:,} | {min(cpu_s) / events * 1e6:.1f} | "
            f"{result.report['slo_attainment']:.3f} |",
            flush=True,
        )


def _fill_index(conductor: Conductor, num_blocks: int, rng: random.Random) -> list[list[int]]:
    """Documents of DOC_BLOCKS chained blocks, each cached whole on one instance and as a
    prefix of random length on 0-2 more; returns the documents."""
    instances = conductor.prefill_instances
    documents = [
        list(range(d * DOC_BLOCKS, (d + 1) * DOC_BLOCKS)) for d in range(num_blocks // DOC_BLOCKS)
    ]
    for doc in documents:
        holders = rng.sample(instances, rng.randint(1, 3))
        for n, iid in enumerate(holders):
            length = DOC_BLOCKS if n == 0 else rng.randint(1, DOC_BLOCKS)
            for h in doc[:length]:
                conductor.handle(BlockStored(h, instance_id=iid))
    return documents


def _request(rid: int, documents: list[list[int]], rng: random.Random, fresh: int) -> Request:
    doc = documents[rng.randrange(len(documents))]
    shared = doc[: rng.randint(1, 30)]
    num_blocks = max(len(shared) + 1, int(rng.expovariate(1 / 30)))
    hashes = tuple(shared) + tuple(range(fresh, fresh + num_blocks - len(shared)))
    input_length = num_blocks * 512 - rng.randint(0, 511)
    return Request(f"r{rid}", 0.0, input_length, rng.randint(10, 400), hashes, 512)


def bench_schedule(
    num_instances: int,
    num_decode: int,
    num_blocks: int,
    num_decisions: int,
    clock_ns: Callable[[], int] = time.perf_counter_ns,
) -> None:
    """Time Conductor.schedule with a large index; print markdown table rows."""
    rng = random.Random(0)
    clock = ManualClock()
    cost_model = build_cost_model("llama2-70b", "a800", 8)
    for mode in ("none", "predict"):
        conductor = Conductor(
            ConductorConfig(early_reject=mode, slo=SimConfig(ClusterSpec.parse("1P1D")).slo),
            cost_model,
            clock,
            random.Random(0),
        )
        for i in range(num_instances):
            conductor.add_prefill_instance(f"P{i}")
        for i in range(num_decode):
            conductor.add_decode_instance(f"D{i}")
        tracemalloc.start()
        documents = _fill_index(conductor, num_blocks, rng)
        index_bytes = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        in_flight: deque[tuple[str, str, str]] = deque()
        fresh = 10 * num_blocks
        times_ns = []
        for n in range(num_decisions):
            request = _request(n, documents, rng, fresh)
            fresh += len(request.block_hashes)
            clock.advance(0.05)
            start = clock_ns()
            decision = conductor.schedule(request)
            times_ns.append(clock_ns() - start)
            if decision.accepted:
                _advance_lifecycle(conductor, decision, in_flight)
        times_ns.sort()
        print(
            f"| {num_instances} | {num_decode} | {len(conductor.index):,} | {mode} | "
            f"{times_ns[len(times_ns) // 2] / 1e3:.0f} | {times_ns[int(0.99 * len(times_ns))] / 1e3:.0f} | "
            f"{statistics.fmean(times_ns) / 1e3:.0f} | {index_bytes / 2**20:.0f} |"
        )


def _advance_lifecycle(conductor: Conductor, decision, in_flight: deque) -> None:
    """Start the new placement and retire the oldest, keeping IN_FLIGHT requests."""
    rid, p, d = decision.request_id, decision.prefill.instance_id, decision.decode.instance_id
    conductor.handle(PrefillStarted(p, rid))
    in_flight.append((rid, p, d))
    if len(in_flight) > IN_FLIGHT // 2:
        old, op, od = in_flight[-IN_FLIGHT // 2]
        conductor.handle(PrefillFinished(op, old))
        conductor.handle(DecodeStarted(od, old))
    if len(in_flight) > IN_FLIGHT:
        old, _, od = in_flight.popleft()
        conductor.handle(RequestFinished(od, old))


def main() -> None:
    """Run both benchmarks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--instances", type=int, nargs="+", default=[64])
    parser.add_argument("--sizes", type=int, nargs="*", default=[])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--decisions", type=int, default=5000)
    parser.add_argument("--skip-simulate", action="store_true")
    parser.add_argument("--skip-schedule", action="store_true")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time decisions in thread CPU time (robust to a busy machine) instead of wall time",
    )
    args = parser.parse_args()
    if not args.skip_simulate:
        bench_simulate(args.trace, args.repeats)
        print()
    if args.sizes:
        bench_scaling(args.trace, args.sizes, args.repeats)
        print()
    if args.skip_schedule:
        return
    clock_ns = time.thread_time_ns if args.cpu_time else time.perf_counter_ns
    clock_name = "thread CPU time" if args.cpu_time else "wall time"
    print(f"schedule: {args.decisions} decisions, kvcache-centric, {clock_name}\n")
    print(
        "| prefill instances | decode instances | indexed blocks | early reject | "
        "p50 us | p99 us | mean us | index MiB |"
    )
    print("|---:|---:|---:|---|---:|---:|---:|---:|")
    for num_instances in args.instances:
        for num_decode in sorted({num_instances, 8}):
            bench_schedule(num_instances, num_decode, args.blocks, args.decisions, clock_ns)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak RSS of the whole benchmark process: {peak_rss_mib:.0f} MiB")


if __name__ == "__main__":
    main()
