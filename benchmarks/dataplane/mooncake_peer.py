"""Mooncake's side of the benchmarks; runs inside the separate Mooncake virtual environment.

Started by path by benchmarks/dataplane/transfer.py and store.py (never imported by
halfmoon).
Roles, each printing JSON lines on stdout:

- ``te-target``: a TransferEngine (tcp, P2P handshake, 127.0.0.1) with a registered
  receive buffer; prints {"segment", "addr"}; on a stdin line "digest" prints the xxh3
  of the buffer; exits when stdin closes.
- ``te-bench``: batch writes (``batch_transfer_sync_write``) of a batch of blocks into
  the target's buffer, per block size; prints one result per size.
- ``store-node``: a MooncakeDistributedStore client that only contributes memory.
- ``store-bench``: put/get, put_batch/get_batch and the zero-copy
  batch_put_from/batch_get_into against ``mooncake_master``; prints one result per op.

Timing follows halfmoon.transfer.microbench: one warm-up, then the median of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np
import xxhash

GIB = 1 << 30


def emit(record: dict) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def median_s(fn, reps: int, setup=None) -> float:
    times = []
    for i in range(reps + 1):
        if setup is not None:
            setup()
        started = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def row(op: str, transport: str, size: int, n: int, batch_s: float, op_s: float = 0.0) -> dict:
    return {
        "system": "mooncake",
        "op": op,
        "transport": transport,
        "block_bytes": size,
        "num_blocks": n,
        "gib_per_s": n * size / batch_s / GIB,
        "batch_s_p50": batch_s,
        "op_us_p50": op_s * 1e6,
    }


def new_engine():
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"TransferEngine.initialize failed with {rc}")
    return engine


def te_target(args: argparse.Namespace) -> None:
    engine = new_engine()
    buf = np.zeros(args.buffer_bytes, np.uint8)
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise SystemExit("register_memory failed")
    emit({"segment": f"127.0.0.1:{engine.get_rpc_port()}", "addr": buf.ctypes.data})
    for line in sys.stdin:
        if line.strip() == "digest":
            emit({"digest": xxhash.xxh3_64_hexdigest(memoryview(buf))})


def te_bench(args: argparse.Namespace) -> None:
    engine = new_engine()
    src = np.random.default_rng(2).integers(0, 256, args.batch_bytes, dtype=np.uint8)
    if engine.register_memory(src.ctypes.data, src.nbytes) != 0:
        raise SystemExit("register_memory failed")
    base = src.ctypes.data
    for size in args.sizes:
        n = max(1, args.batch_bytes // size)
        srcs = [base + i * size for i in range(n)]
        dsts = [args.addr + i * size for i in range(n)]

        def write(k: int = n, srcs=srcs, dsts=dsts, size=size) -> None:
            rc = engine.batch_transfer_sync_write(args.segment, srcs[:k], dsts[:k], [size] * k)
            if rc != 0:
                raise SystemExit(f"batch_transfer_sync_write failed with {rc}")

        batch_s = median_s(write, args.reps)
        one_s = median_s(lambda w=write: w(1), args.reps * 4)
        emit(row("batch_write", "tcp", size, n, batch_s, one_s))
    emit({"digest_src": xxhash.xxh3_64_hexdigest(memoryview(src))})


def new_store(args: argparse.Namespace, segment_bytes: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        "127.0.0.1",
        f"http://127.0.0.1:{args.metadata_port}/metadata",
        segment_bytes,
        args.local_buffer_bytes,
        "tcp",
        "",
        f"127.0.0.1:{args.master_port}",
    )
    if rc != 0:
        raise SystemExit(f"MooncakeDistributedStore.setup failed with {rc}")
    return store


def store_node(args: argparse.Namespace) -> None:
    store = new_store(args, args.segment_bytes)  # keep it: its segment lives as long as it does
    emit({"ready": True})
    sys.stdin.read()
    store.close()


def check(rc) -> None:
    """Mooncake store calls return negative codes on failure (lists for batch calls)."""
    bad = [r for r in (rc if isinstance(rc, list) else [rc]) if r < 0]
    if bad:
        raise SystemExit(f"mooncake store call failed with {bad[0]}")


def store_apis(store, keys: list[str], data: np.ndarray, out: np.ndarray, size: int) -> list[tuple]:
    """(label, put batch, get batch, get one block) for each Mooncake store API."""
    n = len(keys)
    values = [data[i * size : (i + 1) * size].tobytes() for i in range(n)]
    ptrs = [data.ctypes.data + i * size for i in range(n)]
    outs = [out.ctypes.data + i * size for i in range(n)]

    def put() -> None:
        for k, v in zip(keys, values, strict=True):
            check(store.put(k, v))

    def get() -> None:
        if sum(len(store.get(k)) for k in keys) != n * size:
            raise SystemExit("mooncake get returned short values")

    def get_batch() -> None:
        if sum(len(v) for v in store.get_batch(keys)) != n * size:
            raise SystemExit("mooncake get_batch returned short values")

    return [
        ("", put, get, lambda: store.get(keys[0])),
        ("batch ", lambda: check(store.put_batch(keys, values)), get_batch, None),
        (
            "zero-copy ",
            lambda: check(store.batch_put_from(keys, ptrs, [size] * n)),
            lambda: check(store.batch_get_into(keys, outs, [size] * n)),
            lambda: check(store.get_into(keys[0], outs[0], size)),
        ),
    ]


def store_bench_size(store, size: int, n: int, reps: int, label: str) -> None:
    data = np.random.default_rng(4).integers(0, 256, n * size, dtype=np.uint8)
    out = np.empty(n * size, np.uint8)
    store.register_buffer(data.ctypes.data, data.nbytes)
    store.register_buffer(out.ctypes.data, out.nbytes)
    keys = [f"k{size}-{i}" for i in range(n)]
    for op, put_fn, get_fn, get_one in store_apis(store, keys, data, out, size):
        put_s = median_s(put_fn, reps, setup=lambda: store.remove_all(True))
        get_s = median_s(get_fn, reps)
        one_get_s = median_s(get_one, reps * 20) if get_one is not None else 0.0
        emit(row(f"{op}put", label, size, n, put_s))
        emit(row(f"{op}get", label, size, n, get_s, one_get_s))
        emit(row(f"{op}put+get", label, size, n, put_s + get_s))
    if not np.array_equal(out, data):
        raise SystemExit("mooncake batch_get_into returned different bytes")
    store.remove_all(True)
    store.unregister_buffer(data.ctypes.data)
    store.unregister_buffer(out.ctypes.data)


def store_bench(args: argparse.Namespace) -> None:
    store = new_store(args, args.segment_bytes)
    label = "tcp" if args.segment_bytes == 0 else "local"
    for size in args.sizes:
        store_bench_size(store, size, max(1, min(1024, args.batch_bytes // size)), args.reps, label)
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)
    target = sub.add_parser("te-target")
    target.add_argument("--buffer-bytes", type=int, required=True)
    bench = sub.add_parser("te-bench")
    bench.add_argument("--segment", required=True)
    bench.add_argument("--addr", type=int, required=True)
    for p in (bench,):
        p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], required=True)
        p.add_argument("--batch-bytes", type=int, required=True)
        p.add_argument("--reps", type=int, default=5)
    for name in ("store-node", "store-bench"):
        p = sub.add_parser(name)
        p.add_argument("--master-port", type=int, required=True)
        p.add_argument("--metadata-port", type=int, required=True)
        p.add_argument("--segment-bytes", type=int, default=0)
        p.add_argument("--local-buffer-bytes", type=int, default=256 << 20)
        if name == "store-bench":
            p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], required=True)
            p.add_argument("--batch-bytes", type=int, required=True)
            p.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    {
        "te-target": te_target,
        "te-bench": te_bench,
        "store-node": store_node,
        "store-bench": store_bench,
    }[args.role](args)


if __name__ == "__main__":
    main()
