"""Quick measurements of our transfer engine and store (``halfmoon microbench``).

Everything runs on 127.0.0.1. Transfer numbers push a batch of blocks from this process
into a peer *process* (``python -m halfmoon.transfer.peer``), so sender and receiver do
not share a GIL; store numbers cover the in-process store and a store peer reached over
tcp / shm. ``benchmarks/dataplane/transfer.py`` and ``benchmarks/dataplane/store.py`` add
Mooncake's implementation beside these numbers.

Every measurement is honest about its bytes: before each timed repetition (untimed) the
first bytes of every source block are rewritten with a fresh stamp, so no repetition
sends what the previous one did; what arrived is then compared with what was sent (the
receiver's region by digest, store reads byte for byte), and a missing, short or
different block raises :class:`VerificationError` instead of being timed.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from typing import IO

import numpy as np
import xxhash

from halfmoon.store import BlockMeta, StoreConfig, TieredStore
from halfmoon.store.shm import SHM_DIR, attach_segment, create_segment
from halfmoon.transfer.client import PeerClient
from halfmoon.transfer.engine import TransferEngine
from halfmoon.transfer.messages import PutBlock
from halfmoon.transfer.peer import SECRET_ENV

KIB, MIB = 1 << 10, 1 << 20
GIB = 1 << 30
#: Batches of small blocks stop at this many blocks (4 KiB blocks: a 4 MiB batch).
MAX_BATCH_BLOCKS = 1024
#: One-block operations per round (p50 and p99), fewer only where the blocks are large.
DEFAULT_LATENCY_OPS = 200
#: ... at most this many bytes of one-block operations per configuration, and at least 20.
ONE_OPS_BUDGET_BYTES, MIN_ONE_OPS = 256 * MIB, 20
#: Bytes at the start of every block that each repetition rewrites.
STAMP_BYTES = 8
#: Name prefix of a peer's shared regions (halfmoon.transfer.regions creates them so).
REGION_SEGMENT_PREFIX = "hm-region-"


class VerificationError(Exception):
    """Bytes that arrived or were read back differ from those sent, or a block is missing.
    Not a RuntimeError on purpose: a benchmark must fail on it, never skip past it."""


@dataclass(frozen=True)
class BenchResult:
    """One measured configuration in one round (or, from :func:`aggregate`, the median
    over rounds).

    ``gib_per_s`` is ``num_blocks * block_bytes / batch_s_p50`` (for ``put+get``: over the
    put plus the get time of the same repetition); ``op_us_p50`` / ``op_us_p99`` are the
    latency percentiles of one-block operations; ``batch_s_reps`` keeps every timed
    repetition (for a ``write`` latency row: every one-block write).
    """

    system: str
    op: str
    transport: str
    block_bytes: int
    num_blocks: int
    gib_per_s: float
    batch_s_p50: float
    op_us_p50: float
    op_us_p99: float = 0.0
    batch_s_reps: tuple[float, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """Plain dict for JSON."""
        return asdict(self)

    @classmethod
    def from_dict(cls, record: dict) -> BenchResult:
        """Inverse of :meth:`to_dict` (fields a record lacks take their defaults)."""
        known = {k: record[k] for k in cls.__dataclass_fields__ if k in record}
        known["batch_s_reps"] = tuple(known.get("batch_s_reps", ()))
        return cls(**known)


@dataclass(frozen=True)
class Step:
    """One block size of a run: blocks per batch and one-block operations per round.
    Both systems get the same numbers (Mooncake's peer receives them explicitly)."""

    block_bytes: int
    num_blocks: int
    num_one_ops: int


#: The transport label of pushes from an engine without payload checksums.
TCP_UNCHECKED = "tcp unchecked"


def num_blocks_for(block_bytes: int, batch_bytes: int) -> int:
    """Blocks per batch: ``batch_bytes`` worth, at least 1, at most ``MAX_BATCH_BLOCKS``."""
    return max(1, min(MAX_BATCH_BLOCKS, batch_bytes // block_bytes))


def num_one_ops_for(block_bytes: int, latency_ops: int = DEFAULT_LATENCY_OPS) -> int:
    """One-block operations per round: ``latency_ops``, cut for large blocks to a byte
    budget, never below ``MIN_ONE_OPS`` (p99 needs samples)."""
    return max(MIN_ONE_OPS, min(latency_ops, ONE_OPS_BUDGET_BYTES // block_bytes))


def make_plan(
    sizes: Sequence[int], batch_bytes: int, latency_ops: int = DEFAULT_LATENCY_OPS
) -> list[Step]:
    """The steps of a run, shared by our side and Mooncake's."""
    return [Step(s, num_blocks_for(s, batch_bytes), num_one_ops_for(s, latency_ops)) for s in sizes]


def plan_arg(plan: Sequence[Step]) -> str:
    """``SIZE:BLOCKS:OPS,...``: the plan as Mooncake's peer reads it."""
    return ",".join(f"{s.block_bytes}:{s.num_blocks}:{s.num_one_ops}" for s in plan)


def timed_s(
    fn: Callable[[], object], num: int, setup: Callable[[], object] | None = None
) -> list[float]:
    """Wall times of ``num`` calls of ``fn`` after one untimed warm-up (which warms caches,
    page tables and connections); ``setup`` runs untimed before every call."""
    times = []
    for i in range(num + 1):
        if setup is not None:
            setup()
        started = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - started)
    return times


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (p99 of 200 samples: the second largest)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def stamp_blocks(blocks: np.ndarray, stamp: int) -> None:
    """Overwrite the first ``STAMP_BYTES`` of every row of ``blocks`` with ``stamp`` and the
    row's index: every block then differs from its previous contents and from the others.

    ``stamp << 24`` + index: 24 bits of block index (at most 1024 used) under the stamp.
    """
    words = np.arange(blocks.shape[0], dtype=np.uint64) + np.uint64((stamp << 24) % (1 << 64))
    blocks[:, :STAMP_BYTES] = words.view(np.uint8).reshape(-1, STAMP_BYTES)


def new_stamps() -> Iterator[int]:
    """A rolling stamp per benchmark run (random start: two runs differ too)."""
    return itertools.count(secrets.randbits(32))


def check_same(got: np.ndarray, sent: np.ndarray, what: str) -> None:
    """Raise :class:`VerificationError` unless ``got`` holds exactly the bytes ``sent``."""
    if got.shape != sent.shape or not np.array_equal(got, sent):
        raise VerificationError(f"{what}: the bytes received differ from the bytes sent")


def check_found(results: Sequence[object | None], what: str) -> None:
    """Raise :class:`VerificationError` if any read found nothing (None)."""
    missing = sum(r is None for r in results)
    if missing:
        raise VerificationError(f"{what}: {missing} of {len(results)} blocks were missing")


def check_digest(received_hex: str, sent: np.ndarray, what: str) -> None:
    """Raise :class:`VerificationError` unless ``received_hex`` is the xxh3 of ``sent``."""
    if received_hex != xxhash.xxh3_64_hexdigest(np.ascontiguousarray(sent)):
        raise VerificationError(f"{what}: the receiver's bytes differ from the bytes sent")


def _pattern(num_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def _row(
    system: str,
    op: str,
    transport: str,
    step: Step,
    batch_times: Sequence[float],
    one_times: Sequence[float] = (),
    num_blocks: int | None = None,
) -> BenchResult:
    n = step.num_blocks if num_blocks is None else num_blocks
    batch_s = statistics.median(batch_times)
    one_p50 = statistics.median(one_times) * 1e6 if one_times else 0.0
    one_p99 = percentile(one_times, 99) * 1e6 if one_times else 0.0
    gib_s = n * step.block_bytes / batch_s / GIB
    return BenchResult(
        system, op, transport, step.block_bytes, n, gib_s, batch_s, one_p50, one_p99,
        tuple(batch_times),
    )  # fmt: skip


@dataclass
class Arm:
    """One configuration of a step, timed in turn with the step's other configurations:
    ``batch`` moves the step's whole batch. ``stamp(n)`` (untimed) puts new bytes in the
    first ``n`` source blocks, ``verify(n)`` checks that the receiver holds them, and
    ``one`` moves the first block alone (one-block latency); a baseline that only times
    batches (bare loopback) leaves those None."""

    system: str
    op: str
    transport: str
    batch: Callable[[], object]
    one: Callable[[], object] | None = None
    stamp: Callable[[int], None] | None = None
    verify: Callable[[int], None] | None = None
    times: list[float] = field(default_factory=list)


def run_interleaved(arms: Sequence[Arm], step: Step, reps: int) -> list[BenchResult]:
    """Every arm's batch in turn, ``reps`` times after a warm-up turn, then each arm's
    one-block operations. Taking turns puts the machine's drift (a neighbour's load, a
    frequency change) on every arm alike, so a round's ratios compare like moments. Each
    arm's receiver is checked after its last batch and after its one-block operations."""
    n = step.num_blocks
    for rep in range(reps + 1):
        for arm in arms:
            if arm.stamp is not None:
                arm.stamp(n)
            started = time.perf_counter()
            arm.batch()
            elapsed = time.perf_counter() - started
            if rep:
                arm.times.append(elapsed)
            if rep == reps and arm.verify is not None:
                arm.verify(n)
    rows = []
    for arm in arms:
        one: list[float] = []
        if arm.one is not None:
            stamp = arm.stamp
            setup = None if stamp is None else (lambda stamp=stamp: stamp(1))
            one = timed_s(arm.one, step.num_one_ops, setup=setup)
            if arm.verify is not None:
                arm.verify(1)
        rows.append(_row(arm.system, arm.op, arm.transport, step, arm.times, one))
    return rows


def _memcpy_arms(step: Step, stamps: Iterator[int], stack: ExitStack) -> list[Arm]:
    """Block-by-block memcpy in this process: into private memory (transport ``-``) and
    into a shared-memory segment (``shm``: the kind of memory a co-located push writes,
    which here has 4 KiB pages while a large private buffer gets huge pages)."""
    size, n = step.block_bytes, step.num_blocks
    src = _pattern(n * size, 1).reshape(n, size)
    src_view = memoryview(src.reshape(-1))
    segment = create_segment(n * size, prefix="hm-bench")
    stack.callback(segment.close, unlink=True)
    private = np.zeros((n, size), np.uint8)
    arms = []
    for transport, dst_view in (("-", memoryview(private.reshape(-1))), ("shm", segment.buf)):

        def copy_batch(dst_view: memoryview = dst_view) -> None:
            for i in range(0, n * size, size):
                dst_view[i : i + size] = src_view[i : i + size]

        def copy_one(dst_view: memoryview = dst_view) -> None:
            dst_view[:size] = src_view[:size]

        def verify(count: int, dst_view: memoryview = dst_view, transport: str = transport) -> None:
            got = np.frombuffer(dst_view, np.uint8, count * size).reshape(count, size)
            check_same(got, src[:count], f"memcpy {size} B blocks ({transport})")

        copy_batch()  # untimed: fault the destination's pages in, as a warm region is
        stamp = _stamper(src, stamps)
        arms.append(Arm("memcpy", "copy", transport, copy_batch, copy_one, stamp, verify))
    return arms


def _stamper(src: np.ndarray, stamps: Iterator[int]) -> Callable[[int], None]:
    """``stamp(n)``: new bytes at the start of the first ``n`` rows of ``src``."""
    return lambda count: stamp_blocks(src[:count], next(stamps))


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Ask a peer to exit (stdin EOF) so it frees its shared memory; kill it if it lingers."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=grace_s)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class PeerProcess:
    """A running ``halfmoon.transfer.peer serve``: its endpoint, secret and process id."""

    endpoint: str
    secret: bytes
    pid: int

    def region_digest(self, num_bytes: int) -> str:
        """xxh3 of the first ``num_bytes`` of the peer's one shared region, read from this
        process (the segment's name is in /proc/PID/maps): the peer does no work for it."""
        with open(f"/proc/{self.pid}/maps", encoding="utf-8") as maps:
            marker = f"{SHM_DIR}/{REGION_SEGMENT_PREFIX}"
            names = {line.split(marker, 1)[1].split()[0] for line in maps if marker in line}
        if len(names) != 1:
            raise RuntimeError(f"peer {self.pid} maps {len(names)} shared regions, not one")
        segment = attach_segment(REGION_SEGMENT_PREFIX + names.pop())
        try:
            with segment.buf[:num_bytes] as view:
                return xxhash.xxh3_64_hexdigest(view)
        finally:
            segment.close()


def _discard_lines(stream: IO[str]) -> None:
    """Read ``stream`` to its end, keeping nothing."""
    collections.deque(stream, maxlen=0)


@contextmanager
def peer_process(*args: str) -> Iterator[PeerProcess]:
    """A ``halfmoon.transfer.peer serve`` process; always stopped."""
    secret = secrets.token_bytes(32)
    # OpenBLAS worker threads (loaded with numpy) busy-wait after start-up; on a small
    # machine they steal measurable CPU from the transfer being measured.
    env = {**os.environ, SECRET_ENV: secret.hex(), "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "halfmoon.transfer.peer", "serve", "--quiet", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    # The peer runs --quiet (a line per completed transfer, and this process reading it,
    # would be timed with every operation); anything it still prints is read and dropped,
    # or a full pipe would stall it mid-benchmark.
    drain = threading.Thread(target=_discard_lines, args=(proc.stdout,), daemon=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process exited with {proc.wait()} before listening")
        info = json.loads(line)
        drain.start()
        yield PeerProcess(info["endpoint"], secret, int(info["pid"]))
    finally:
        stop_process(proc)
        if drain.is_alive():
            drain.join(timeout=5.0)
        proc.stdout.close()


def _push_arm(
    client: PeerClient,
    peer: PeerProcess,
    step: Step,
    stamps: Iterator[int],
    scattered: bool = False,
    transport: str | None = None,
) -> Arm:
    """A batched push of ``step``'s blocks, and one-block pushes. The blocks are rows of
    one array (back to back: a co-located push copies them as one span), or with
    ``scattered`` rows with a gap after each (op ``push scattered``). ``transport``
    labels the rows (default: the client's)."""
    size, n = step.block_bytes, step.num_blocks
    gap = 4096 if scattered else 0
    src = _pattern(n * (size + gap), 2).reshape(n, size + gap)[:, :size]
    blocks = [(i * size, src[i]) for i in range(n)]
    op = "push scattered" if scattered else "push"

    def verify(count: int) -> None:
        what = f"{op} {size} B blocks over {client.transport}"
        check_digest(peer.region_digest(count * size), src[:count], what)

    return Arm(
        "halfmoon",
        op,
        transport or client.transport,
        lambda: client.push("kv", blocks),
        lambda: client.push("kv", blocks[:1]),
        _stamper(src, stamps),
        verify,
    )


def write_latency(
    client: PeerClient,
    peer: PeerProcess,
    step: Step,
    stamps: Iterator[int],
    transport: str | None = None,
    warmup: int = 0,
) -> BenchResult:
    """``step.num_one_ops`` single one-block pushes (after ``warmup`` untimed ones, besides
    :func:`timed_s`'s own); a ``write`` row (p50 and p99) labelled ``transport`` (default:
    the client's). The peer's region is checked against the last bytes written."""
    src = _pattern(step.block_bytes, 5).reshape(1, -1)

    def write() -> None:
        client.push("kv", [(0, src[0])])

    def stamp() -> None:
        stamp_blocks(src, next(stamps))

    for _ in range(warmup):
        stamp()
        write()
    times = timed_s(write, step.num_one_ops, setup=stamp)
    label = transport or client.transport
    check_digest(
        peer.region_digest(step.block_bytes), src, f"single {step.block_bytes} B write over {label}"
    )
    return _row("halfmoon", "write", label, step, times, times, num_blocks=1)


def bench_transfer(
    sizes: Sequence[int],
    batch_bytes: int,
    reps: int,
    transports: Sequence[str] = ("tcp", "shm"),
    num_connections: int | None = None,
    with_memcpy: bool = True,
    latency_sizes: Sequence[int] = (),
    latency_ops: int = DEFAULT_LATENCY_OPS,
    baselines: Callable[[Step], list[Arm]] | None = None,
    unchecked: bool = False,
) -> list[BenchResult]:
    """Batched push of ``batch_bytes`` into a peer process's region, per block size, then
    ``latency_ops`` single one-block writes per size in ``latency_sizes`` (``write`` rows).

    With ``with_memcpy`` the memcpy baselines take turns with our transports at each
    size, repetition by repetition, so machine load affects all alike. The receiver is
    checked against what was sent after every configuration. ``baselines(step)`` adds
    more arms that take turns with ours (bare loopback batches). ``unchecked`` adds our
    tcp push from an engine with ``checksum=False`` (rows of transport
    :data:`TCP_UNCHECKED`), taking turns with the rest, and its own single writes.
    """
    results, stamps = [], new_stamps()
    region_bytes = max([batch_bytes, *latency_sizes])
    with peer_process("--region", f"kv:{region_bytes}:shared") as peer:
        engine = TransferEngine(peer.secret, num_connections=num_connections)
        bare = TransferEngine(peer.secret, num_connections=num_connections, checksum=False)
        try:
            clients = [engine.connect(peer.endpoint, transport) for transport in transports]
            quick = bare.connect(peer.endpoint, "tcp") if unchecked else None
            for step in make_plan(sizes, batch_bytes, latency_ops):
                with ExitStack() as stack:
                    arms = _memcpy_arms(step, stamps, stack) if with_memcpy else []
                    arms += baselines(step) if baselines is not None else []
                    arms += [_push_arm(client, peer, step, stamps) for client in clients]
                    if quick is not None:
                        arms.append(_push_arm(quick, peer, step, stamps, transport=TCP_UNCHECKED))
                    arms += [
                        _push_arm(client, peer, step, stamps, scattered=True)
                        for client in clients
                        if client.transport == "shm"
                    ]
                    results += run_interleaved(arms, step, reps)
            for size in latency_sizes:
                step = Step(size, 1, latency_ops)
                results += [write_latency(client, peer, step, stamps) for client in clients]
                if quick is not None:
                    results.append(write_latency(quick, peer, step, stamps, TCP_UNCHECKED))
        finally:
            engine.close()
            bare.close()
    return results


def aggregate(rounds: Sequence[Sequence[BenchResult]]) -> list[BenchResult]:
    """Per configuration, the median of each figure over the rounds (order kept; every
    repetition of every round stays in ``batch_s_reps``)."""
    groups: dict[tuple[str, str, str, int], list[BenchResult]] = {}
    for result in (r for one_round in rounds for r in one_round):
        groups.setdefault(
            (result.system, result.op, result.transport, result.block_bytes), []
        ).append(result)
    return [
        BenchResult(
            *key[:3],
            key[3],
            group[0].num_blocks,
            statistics.median(r.gib_per_s for r in group),
            statistics.median(r.batch_s_p50 for r in group),
            statistics.median(r.op_us_p50 for r in group),
            statistics.median(r.op_us_p99 for r in group),
            tuple(t for r in group for t in r.batch_s_reps),
        )
        for key, group in groups.items()
    ]


def _random_hashes(n: int) -> list[int]:
    return [int.from_bytes(secrets.token_bytes(16), "little") for _ in range(n)]


def _store_rows(
    transport: str, step: Step, put: list[float], get: list[float], one: list[float]
) -> list[BenchResult]:
    put_get = [p + g for p, g in zip(put, get, strict=True)]
    return [
        _row("halfmoon", "put", transport, step, put),
        _row("halfmoon", "get", transport, step, get, one),
        _row("halfmoon", "put+get", transport, step, put_get),
    ]


def _store_local_one(step: Step, reps: int, stamps: Iterator[int]) -> list[BenchResult]:
    size, n = step.block_bytes, step.num_blocks
    store = TieredStore(StoreConfig(block_bytes=size, dram_capacity_bytes=(n + 1) * size))
    data, outs = _pattern(n * size, 3).reshape(n, size), np.empty((n, size), np.uint8)
    meta, hashes = BlockMeta(16, 0), [0] * n
    put_s, get_s, one_s = [], [], []

    def fresh(count: int) -> None:  # untimed: drop the last blocks, new bytes, new hashes
        for h in hashes:
            store.delete(h)
        hashes[:] = _random_hashes(count)
        stamp_blocks(data[:count], next(stamps))

    try:
        for rep in range(reps + 1):  # the first is a warm-up
            fresh(n)
            started = time.perf_counter()  # the batch calls, as Mooncake's fastest are
            stored = store.put_many(
                [(h, row, meta, 0) for h, row in zip(hashes, data, strict=True)]
            )
            put_done = time.perf_counter()
            if stored != n:  # fresh hashes: every block must be new
                raise VerificationError(f"put of {n} new blocks stored {stored}")
            check_found(store.get_many_into(hashes, list(outs)), "get")
            if rep:
                put_s.append(put_done - started)
                get_s.append(time.perf_counter() - put_done)
            check_same(outs, data, f"local store get of {size} B blocks")
        one_s = timed_s(
            lambda: check_found([store.get_into(hashes[0], outs[0])], "one-block get"),
            step.num_one_ops,
            setup=lambda: (fresh(1), store.put(hashes[0], data[0], meta)),
        )
        check_same(outs[0], data[0], f"local store one-block get of {size} B")
        store.check_integrity()
    finally:
        store.close()
    return _store_rows("local", step, put_s, get_s, one_s)


def bench_store_local(
    sizes: Sequence[int], batch_bytes: int, reps: int, latency_ops: int = DEFAULT_LATENCY_OPS
) -> list[BenchResult]:
    """The in-process store: put then get of a batch (``put_many``, ``get_many_into``),
    and one-block get latency (``get_into``)."""
    stamps = new_stamps()
    plan = make_plan(sizes, batch_bytes, latency_ops)
    return [r for step in plan for r in _store_local_one(step, reps, stamps)]


def _store_remote_one(
    client: PeerClient, step: Step, reps: int, stamps: Iterator[int]
) -> list[BenchResult]:
    size, n = step.block_bytes, step.num_blocks
    data, dests = _pattern(n * size, 4).reshape(n, size), np.empty((n, size), np.uint8)
    meta, hashes = BlockMeta(16, 0), [0] * n
    put_s, get_s = [], []

    def put(count: int) -> None:
        stored = client.put_blocks(
            [PutBlock(h, data[i], meta) for i, h in enumerate(hashes[:count])]
        )
        if stored != count:  # fresh hashes: every block must be new
            raise VerificationError(f"put of {count} new blocks stored {stored}")

    def fresh(count: int) -> None:  # untimed: new bytes under new hashes (no delete here)
        hashes[:count] = _random_hashes(count)
        stamp_blocks(data[:count], next(stamps))

    for rep in range(reps + 1):  # the first is a warm-up
        fresh(n)
        started = time.perf_counter()
        put(n)
        put_done = time.perf_counter()
        check_found(client.pull(hashes, list(dests)), f"pull over {client.transport}")
        if rep:
            put_s.append(put_done - started)
            get_s.append(time.perf_counter() - put_done)
        check_same(dests, data, f"store pull of {size} B blocks over {client.transport}")
    one_s = timed_s(
        lambda: check_found(client.pull(hashes[:1], [dests[0]]), "one-block pull"),
        step.num_one_ops,
        setup=lambda: (fresh(1), put(1)),
    )
    check_same(dests[0], data[0], f"one-block pull of {size} B over {client.transport}")
    return _store_rows(client.transport, step, put_s, get_s, one_s)


def bench_store_remote(
    sizes: Sequence[int],
    batch_bytes: int,
    reps: int,
    transports: Sequence[str] = ("tcp", "shm"),
    latency_ops: int = DEFAULT_LATENCY_OPS,
) -> list[BenchResult]:
    """A store in a peer process: batched ``put_blocks`` then ``pull``; one-block pull latency."""
    results, stamps = [], new_stamps()
    for step in make_plan(sizes, batch_bytes, latency_ops):
        # Every put uses fresh hashes; LRU drops the oldest (earlier repetitions') blocks,
        # never those of the batch just put, which are the most recent.
        num_slots = 2 * step.num_blocks + 4
        args = ["--store-block-bytes", str(step.block_bytes), "--shared-dram"]
        args += ["--store-dram-bytes", str(num_slots * step.block_bytes)]
        with peer_process(*args) as peer:
            engine = TransferEngine(peer.secret)
            try:
                for transport in transports:
                    client = engine.connect(peer.endpoint, transport)
                    results += _store_remote_one(client, step, reps, stamps)
            finally:
                engine.close()
    return results


def format_table(results: Sequence[BenchResult]) -> str:
    """A fixed-width text table of ``results``."""
    lines = [
        f"{'system':<10} {'op':<17} {'transport':<10} {'block':>8} {'blocks':>6} {'GiB/s':>8} "
        f"{'batch ms':>9} {'1-op p50':>9} {'1-op p99':>9}  (us)"
    ]
    for r in results:
        block = f"{r.block_bytes // MIB}M" if r.block_bytes >= MIB else f"{r.block_bytes // KIB}K"
        lines.append(
            f"{r.system:<10} {r.op:<17} {r.transport:<10} {block:>8} {r.num_blocks:>6} "
            f"{r.gib_per_s:>8.2f} {r.batch_s_p50 * 1e3:>9.2f} {r.op_us_p50:>9.1f} "
            f"{r.op_us_p99:>9.1f}"
        )
    return "\n".join(lines)
