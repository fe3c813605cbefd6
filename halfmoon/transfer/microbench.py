"""Quick measurements of our transfer engine and store (``halfmoon microbench``).

Everything runs on 127.0.0.1. Transfer numbers push a batch of blocks from this process
into a peer *process* (``python -m halfmoon.transfer.peer``), so sender and receiver do
not share a GIL; store numbers cover the in-process store and a store peer reached over
tcp / shm. ``benchmarks/dataplane/transfer.py`` and ``benchmarks/dataplane/store.py`` add Mooncake's
implementation beside these numbers.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np

from halfmoon.store import BlockMeta, StoreConfig, TieredStore
from halfmoon.transfer.client import PeerClient
from halfmoon.transfer.engine import TransferEngine
from halfmoon.transfer.messages import PutBlock
from halfmoon.transfer.peer import SECRET_ENV

KIB, MIB = 1 << 10, 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class BenchResult:
    """One measured configuration: medians over repetitions.

    ``gib_per_s`` is ``batch_bytes / batch_s_p50`` (for ``put+get``: bytes over the put
    plus the get time); ``op_us_p50`` is the median latency of a one-block operation.
    """

    system: str
    op: str
    transport: str
    block_bytes: int
    num_blocks: int
    gib_per_s: float
    batch_s_p50: float
    op_us_p50: float

    def to_dict(self) -> dict[str, object]:
        """Plain dict for JSON."""
        return asdict(self)


def median_s(
    fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None
) -> float:
    """Median wall time of ``fn`` over ``reps`` runs after one warm-up (``setup`` untimed)."""
    times = []
    for i in range(reps + 1):
        if setup is not None:
            setup()
        started = time.perf_counter()
        fn()
        if i:  # the first run warms caches, page tables and connections
            times.append(time.perf_counter() - started)
    return statistics.median(times)


#: Batches of small blocks stop at this many blocks (4 KiB blocks: a 4 MiB batch).
MAX_BATCH_BLOCKS = 1024


def num_blocks_for(block_bytes: int, batch_bytes: int) -> int:
    """Blocks per batch: ``batch_bytes`` worth, at least 1, at most ``MAX_BATCH_BLOCKS``."""
    return max(1, min(MAX_BATCH_BLOCKS, batch_bytes // block_bytes))


def _pattern(num_bytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, num_bytes, dtype=np.uint8)


def _row(
    system: str, op: str, transport: str, size: int, n: int, batch_s: float, op_s: float = 0.0
) -> BenchResult:
    return BenchResult(
        system, op, transport, size, n, n * size / batch_s / GIB, batch_s, op_s * 1e6
    )


def _memcpy_one(size: int, n: int, reps: int) -> BenchResult:
    src, dst = memoryview(_pattern(n * size, 1)), memoryview(np.zeros(n * size, np.uint8))

    def copy_batch() -> None:
        for i in range(n):
            dst[i * size : (i + 1) * size] = src[i * size : (i + 1) * size]

    def copy_one() -> None:
        dst[:size] = src[:size]

    return _row(
        "memcpy", "copy", "-", size, n, median_s(copy_batch, reps), median_s(copy_one, reps * 4)
    )


def bench_memcpy(sizes: Sequence[int], batch_bytes: int, reps: int) -> list[BenchResult]:
    """Block-by-block copies between two preallocated buffers: the physical limit."""
    return [_memcpy_one(size, num_blocks_for(size, batch_bytes), reps) for size in sizes]


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """Ask a peer to exit (stdin EOF) so it frees its shared memory; kill it if it lingers."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=grace_s)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


@contextmanager
def peer_process(*args: str) -> Iterator[tuple[str, bytes]]:
    """A ``halfmoon.transfer.peer serve`` process; yields (endpoint, secret); always killed."""
    secret = secrets.token_bytes(32)
    # OpenBLAS worker threads (loaded with numpy) busy-wait after start-up; on a small
    # machine they steal measurable CPU from the transfer being measured.
    env = {**os.environ, SECRET_ENV: secret.hex(), "OPENBLAS_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "halfmoon.transfer.peer", "serve", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            raise RuntimeError(f"peer process exited with {proc.wait()} before listening")
        yield json.loads(line)["endpoint"], secret
    finally:
        stop_process(proc)
        if proc.stdout is not None:
            proc.stdout.close()


def _push_one(client: PeerClient, size: int, n: int, reps: int) -> BenchResult:
    src = _pattern(n * size, 2)
    blocks = [(i * size, src[i * size : (i + 1) * size]) for i in range(n)]
    batch_s = median_s(lambda: client.push("kv", blocks), reps)
    one_s = median_s(lambda: client.push("kv", blocks[:1]), reps * 4)
    return _row("halfmoon", "push", client.transport, size, n, batch_s, one_s)


def bench_transfer(
    sizes: Sequence[int],
    batch_bytes: int,
    reps: int,
    transports: Sequence[str] = ("tcp", "shm"),
    num_connections: int | None = None,
    with_memcpy: bool = True,
) -> list[BenchResult]:
    """Batched push of ``batch_bytes`` into a peer process's region, per block size.

    With ``with_memcpy`` each size is bracketed by the memcpy baseline, measured right
    before our transports so machine load affects both alike.
    """
    results = []
    with peer_process("--region", f"kv:{batch_bytes}:shared") as (endpoint, secret):
        engine = TransferEngine(secret, num_connections=num_connections)
        try:
            clients = [engine.connect(endpoint, transport) for transport in transports]
            for size in sizes:
                n = num_blocks_for(size, batch_bytes)
                if with_memcpy:
                    results.append(_memcpy_one(size, n, reps))
                results += [_push_one(client, size, n, reps) for client in clients]
        finally:
            engine.close()
    return results


def aggregate(rounds: Sequence[Sequence[BenchResult]]) -> list[BenchResult]:
    """Per configuration, the median of each figure over several rounds (order kept)."""
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
        )
        for key, group in groups.items()
    ]


def _random_hashes(n: int) -> list[int]:
    return [int.from_bytes(secrets.token_bytes(16), "little") for _ in range(n)]


def _store_local_one(size: int, n: int, reps: int) -> list[BenchResult]:
    store = TieredStore(StoreConfig(block_bytes=size, dram_capacity_bytes=(n + 1) * size))
    hashes, data = _random_hashes(n), _pattern(n * size, 3).reshape(n, size)
    outs, meta = np.empty((n, size), np.uint8), BlockMeta(16, 0)  # distinct destinations

    def put() -> None:
        for h, row in zip(hashes, data, strict=True):
            store.put(h, row, meta)

    def get() -> None:
        for h, out in zip(hashes, outs, strict=True):
            store.get_into(h, out)

    def clear() -> None:  # untimed: a repeated put of a present hash would be a no-op
        for h in hashes:
            store.delete(h)

    try:
        put_s = median_s(put, reps, setup=clear)
        get_s = median_s(get, reps)
        one_get_s = median_s(lambda: store.get_into(hashes[0], outs[0]), reps * 20)
        store.check_integrity()
    finally:
        store.close()
    return [
        _row("halfmoon", "put", "local", size, n, put_s),
        _row("halfmoon", "get", "local", size, n, get_s, one_get_s),
        _row("halfmoon", "put+get", "local", size, n, put_s + get_s),
    ]


def bench_store_local(sizes: Sequence[int], batch_bytes: int, reps: int) -> list[BenchResult]:
    """The in-process store: put then get of a batch, and one-block get latency."""
    return [
        r for size in sizes for r in _store_local_one(size, num_blocks_for(size, batch_bytes), reps)
    ]


def _store_remote_one(client: PeerClient, size: int, n: int, reps: int) -> list[BenchResult]:
    hashes, data = _random_hashes(n), _pattern(n * size, 4).reshape(n, size)
    dests = [np.empty(size, np.uint8) for _ in range(n)]
    meta = BlockMeta(16, 0)
    salts = iter(range(1, reps + 2))

    def put() -> None:
        salt = next(salts) << 100  # fresh hashes each run: a repeated put is a no-op
        client.put_blocks(
            [PutBlock(h ^ salt, row, meta) for h, row in zip(hashes, data, strict=True)]
        )

    put_s = median_s(put, reps)
    client.put_blocks([PutBlock(h, row, meta) for h, row in zip(hashes, data, strict=True)])
    get_s = median_s(lambda: client.pull(hashes, dests), reps)
    one_s = median_s(lambda: client.pull(hashes[:1], dests[:1]), reps * 20)
    return [
        _row("halfmoon", "put", client.transport, size, n, put_s),
        _row("halfmoon", "get", client.transport, size, n, get_s, one_s),
        _row("halfmoon", "put+get", client.transport, size, n, put_s + get_s),
    ]


def bench_store_remote(
    sizes: Sequence[int], batch_bytes: int, reps: int, transports: Sequence[str] = ("tcp", "shm")
) -> list[BenchResult]:
    """A store in a peer process: batched ``put_blocks`` then ``pull``; one-block pull latency."""
    results = []
    for size in sizes:
        n = num_blocks_for(size, batch_bytes)
        # Room for every salted put of the run without eviction.
        dram_bytes = (reps + 3) * n * size
        args = [
            "--store-block-bytes",
            str(size),
            "--store-dram-bytes",
            str(dram_bytes),
            "--shared-dram",
        ]
        with peer_process(*args) as (endpoint, secret):
            engine = TransferEngine(secret)
            try:
                for transport in transports:
                    results += _store_remote_one(engine.connect(endpoint, transport), size, n, reps)
            finally:
                engine.close()
    return results


def format_table(results: Sequence[BenchResult]) -> str:
    """A fixed-width text table of ``results``."""
    lines = [
        f"{'system':<10} {'op':<10} {'transport':<10} {'block':>8} {'blocks':>6} {'GiB/s':>8} {'batch ms':>9} {'1-op us':>9}"
    ]
    for r in results:
        block = f"{r.block_bytes // MIB}M" if r.block_bytes >= MIB else f"{r.block_bytes // KIB}K"
        lines.append(
            f"{r.system:<10} {r.op:<10} {r.transport:<10} {block:>8} {r.num_blocks:>6} "
            f"{r.gib_per_s:>8.2f} {r.batch_s_p50 * 1e3:>9.2f} {r.op_us_p50:>9.1f}"
        )
    return "\n".join(lines)
