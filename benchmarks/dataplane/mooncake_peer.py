"""Mooncake's side of the benchmarks; runs inside the separate Mooncake virtual environment.

Started by path by benchmarks/dataplane/transfer.py and store.py (never imported by
halfmoon, whose packages this venv lacks). Roles, each printing JSON lines on stdout:

- ``te-target``: a TransferEngine (tcp, P2P handshake, 127.0.0.1) with a registered
  receive buffer; prints {"segment", "addr"}; on a stdin line "digest N" prints the xxh3
  of the buffer's first N bytes; exits when stdin closes.
- ``te-bench``: per plan step, batch writes (``batch_transfer_sync_write``) of the step's
  blocks into the target's buffer and one-block writes; per latency step, single writes
  (``transfer_sync_write``). After each step it prints {"verify", "num_bytes", "digest"}
  of what it sent and waits for a stdin line "go" (the parent compares the target's
  digest first).
- ``te-writer``: single writes on command, so the parent can interleave them with ours:
  prints {"ready"}; each stdin line "write SIZE WARMUP OPS" makes WARMUP untimed, then
  OPS timed writes of one SIZE-byte block (a fresh stamp before each) and prints the
  ``write`` row with every time and {"digest"} of the block as last written.
- ``store-node``: a MooncakeDistributedStore client that only contributes memory.
- ``store-bench``: put/get, put_batch/get_batch and the zero-copy
  batch_put_from/batch_get_into against ``mooncake_master``; prints one result per op.

The parent passes every count (``--plan SIZE:BLOCKS:OPS,...``) so both systems move the
same blocks. Timing and honesty rules follow halfmoon.transfer.microbench (one warm-up;
before every timed repetition the first 8 bytes of each source block get a fresh stamp;
what arrives is checked; a missing, short or different block prints
{"verification_error"} and exits with status 3, never timed).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import secrets
import statistics
import sys
import time

import numpy as np
import xxhash

GIB = 1 << 30
STAMP_BYTES = 8


class VerificationFailed(Exception):
    """A block came back missing, short or different."""


def emit(record: dict) -> None:
    """One JSON line on stdout."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def parse_plan(text: str) -> list[tuple[int, int, int]]:
    """``SIZE:BLOCKS:OPS,...`` -> [(block_bytes, num_blocks, num_one_ops)]."""
    return [tuple(int(x) for x in item.split(":")) for item in text.split(",") if item]


def timed_s(fn, num: int, setup=None) -> list[float]:
    """Wall times of ``num`` calls after one untimed warm-up; ``setup`` untimed before each."""
    times = []
    for i in range(num + 1):
        if setup is not None:
            setup()
        started = time.perf_counter()
        fn()
        if i:
            times.append(time.perf_counter() - started)
    return times


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def stamper(blocks: np.ndarray):
    """A function that rewrites the first STAMP_BYTES of every row of ``blocks`` (or of
    its first ``count`` rows) with a new rolling stamp and the row index."""
    stamps = itertools.count(secrets.randbits(32))

    def stamp(count: int | None = None) -> None:
        rows = blocks if count is None else blocks[:count]
        base = np.uint64((next(stamps) << 24) % (1 << 64))
        words = np.arange(rows.shape[0], dtype=np.uint64) + base
        rows[:, :STAMP_BYTES] = words.view(np.uint8).reshape(-1, STAMP_BYTES)

    return stamp


def row(op: str, transport: str, step: tuple, batch: list[float], one=(), num_blocks=None) -> dict:
    """A result record with the fields of halfmoon's BenchResult."""
    size, n = step[0], step[1] if num_blocks is None else num_blocks
    batch_s = statistics.median(batch)
    return {
        "system": "mooncake",
        "op": op,
        "transport": transport,
        "block_bytes": size,
        "num_blocks": n,
        "gib_per_s": n * size / batch_s / GIB,
        "batch_s_p50": batch_s,
        "op_us_p50": statistics.median(one) * 1e6 if one else 0.0,
        "op_us_p99": percentile(list(one), 99) * 1e6 if one else 0.0,
        "batch_s_reps": list(batch),
    }


def new_engine():
    """A TransferEngine over tcp with the P2P handshake on 127.0.0.1."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"TransferEngine.initialize failed with {rc}")
    return engine


def te_target(args: argparse.Namespace) -> None:
    """Receive buffer; answers "digest N" lines."""
    engine = new_engine()
    buf = np.zeros(args.buffer_bytes, np.uint8)
    if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
        raise SystemExit("register_memory failed")
    emit({"segment": f"127.0.0.1:{engine.get_rpc_port()}", "addr": buf.ctypes.data})
    for line in sys.stdin:
        word, _, num = line.strip().partition(" ")
        if word == "digest":
            emit({"digest": xxhash.xxh3_64_hexdigest(memoryview(buf[: int(num)]))})


def verified(label: str, src: np.ndarray) -> None:
    """Let the parent compare the target with ``src``; continue only on its "go"."""
    emit({"verify": label, "num_bytes": src.nbytes, "digest": xxhash.xxh3_64_hexdigest(src)})
    if sys.stdin.readline().strip() != "go":
        raise SystemExit(f"the parent did not confirm {label}")


def te_bench(args: argparse.Namespace) -> None:
    """Batch writes per plan step, then single writes per latency step."""
    engine = new_engine()
    steps = parse_plan(args.plan) + parse_plan(args.latency)
    src = np.random.default_rng(2).integers(0, 256, max(s[0] * s[1] for s in steps), np.uint8)
    if engine.register_memory(src.ctypes.data, src.nbytes) != 0:
        raise SystemExit("register_memory failed")

    def check(rc: int, call: str) -> None:
        if rc != 0:
            raise SystemExit(f"{call} failed with {rc}")

    for step in parse_plan(args.plan):
        size, n, ops = step
        blocks, stamp = src[: n * size].reshape(n, size), stamper(src[: n * size].reshape(n, size))
        srcs = [src.ctypes.data + i * size for i in range(n)]
        dsts = [args.addr + i * size for i in range(n)]

        def write(k: int, srcs=srcs, dsts=dsts, size=size) -> None:
            rc = engine.batch_transfer_sync_write(args.segment, srcs[:k], dsts[:k], [size] * k)
            check(rc, "batch_transfer_sync_write")

        batch = timed_s(lambda n=n, w=write: w(n), args.reps, setup=stamp)
        one = timed_s(lambda w=write: w(1), ops, setup=lambda s=stamp: s(1))
        emit(row("batch_write", "tcp", step, batch, one))
        verified(f"batch_write {size} B", blocks)
    for step in parse_plan(args.latency):
        size, _, ops = step
        one_block = src[:size].reshape(1, size)
        stamp = stamper(one_block)

        def write_one(size=size) -> None:
            rc = engine.transfer_sync_write(args.segment, src.ctypes.data, args.addr, size)
            check(rc, "transfer_sync_write")

        times = timed_s(write_one, ops, setup=stamp)
        emit(row("write", "tcp", step, times, times, num_blocks=1))
        verified(f"single write {size} B", one_block)


def te_writer(args: argparse.Namespace) -> None:
    """Single writes on command ("write SIZE WARMUP OPS"), one row per command."""
    engine = new_engine()
    src = np.random.default_rng(5).integers(0, 256, args.max_bytes, np.uint8)
    if engine.register_memory(src.ctypes.data, src.nbytes) != 0:
        raise SystemExit("register_memory failed")
    emit({"ready": True})
    for line in sys.stdin:
        word, *numbers = line.split()
        if word != "write" or len(numbers) != 3:
            raise SystemExit(f"te-writer: unknown command {line.strip()!r}")
        size, warmup, ops = (int(x) for x in numbers)
        if not 0 < size <= args.max_bytes:
            raise SystemExit(f"te-writer: block of {size} B outside the {args.max_bytes} B buffer")
        block = src[:size].reshape(1, size)
        stamp = stamper(block)

        def write_one(size: int = size) -> None:
            rc = engine.transfer_sync_write(args.segment, src.ctypes.data, args.addr, size)
            if rc != 0:
                raise SystemExit(f"transfer_sync_write failed with {rc}")

        for _ in range(warmup):
            stamp()
            write_one()
        times = timed_s(write_one, ops, setup=stamp)
        record = row("write", "tcp", (size, 1, ops), times, times, num_blocks=1)
        emit({**record, "digest": xxhash.xxh3_64_hexdigest(block)})


def new_store(args: argparse.Namespace, segment_bytes: int):
    """A MooncakeDistributedStore client over tcp (``segment_bytes`` 0: no own segment)."""
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
    """Contribute a segment until stdin closes."""
    store = new_store(args, args.segment_bytes)  # keep it: its segment lives as long as it does
    emit({"ready": True})
    sys.stdin.read()
    store.close()


def check(rc, call: str) -> None:
    """Mooncake store calls return negative codes on failure (lists for batch calls)."""
    bad = [r for r in (rc if isinstance(rc, list) else [rc]) if r < 0]
    if bad:
        raise SystemExit(f"mooncake {call} failed with {bad[0]}")


def check_reads(values: list, size: int, call: str) -> None:
    """Every value read must be ``size`` long (a miss reads as b"" or a negative size)."""
    bad = [v for v in values if (len(v) if isinstance(v, bytes) else v) != size]
    if bad:
        raise VerificationFailed(f"{call}: {len(bad)} of {len(values)} blocks missing or short")


class StoreApis:
    """Mooncake's three put/get API pairs over one batch of keys and buffers."""

    def __init__(self, store, data: np.ndarray, out: np.ndarray) -> None:
        self.store, self.data, self.out = store, data, out
        self.size = data.shape[1]
        self.keys: list[str] = []
        self.values: list[bytes] = []  # put / put_batch take bytes: made untimed
        self.got: list[bytes] = []  # what get / get_batch returned (zero-copy: in ``out``)

    def ptrs(self, arr: np.ndarray, k: int) -> list[int]:
        """Addresses of the first ``k`` rows of ``arr``."""
        return [arr.ctypes.data + i * self.size for i in range(k)]

    def put(self, k: int) -> None:
        """``put`` per key."""
        for key, value in zip(self.keys[:k], self.values[:k], strict=True):
            check(self.store.put(key, value), "put")

    def get(self, k: int) -> None:
        """``get`` per key (returns bytes)."""
        self.got = [self.store.get(key) for key in self.keys[:k]]
        check_reads(self.got, self.size, "get")

    def put_batch(self, k: int) -> None:
        """``put_batch``."""
        check(self.store.put_batch(self.keys[:k], self.values[:k]), "put_batch")

    def get_batch(self, k: int) -> None:
        """``get_batch``."""
        self.got = self.store.get_batch(self.keys[:k])
        check_reads(self.got, self.size, "get_batch")

    def put_from(self, k: int) -> None:
        """Zero-copy ``batch_put_from``."""
        rc = self.store.batch_put_from(self.keys[:k], self.ptrs(self.data, k), [self.size] * k)
        check(rc, "batch_put_from")

    def get_into(self, k: int) -> None:
        """Zero-copy ``batch_get_into`` (one key: ``get_into``)."""
        if k == 1:
            got = [self.store.get_into(self.keys[0], self.out.ctypes.data, self.size)]
        else:
            got = self.store.batch_get_into(self.keys[:k], self.ptrs(self.out, k), [self.size] * k)
        check_reads(got, self.size, "get_into")

    def read_back(self, k: int, zero_copy: bool) -> np.ndarray:
        """What the last get delivered, as rows."""
        if zero_copy:
            return self.out[:k]
        return np.frombuffer(b"".join(self.got), np.uint8).reshape(k, self.size)


def store_api(apis: StoreApis, label: str, put, get, step: tuple, args) -> None:
    """Timed put+get repetitions, then one-block gets, of one API pair; emits its rows."""
    size, n, ops = step
    stamp, run = stamper(apis.data), itertools.count()
    zero_copy = label == "zero-copy "

    def fresh(k: int) -> None:  # untimed: drop everything, new keys, new bytes
        apis.store.remove_all(True)
        apis.keys = [f"k{size}-{next(run)}-{i}" for i in range(k)]
        stamp(k)
        apis.values = [] if zero_copy else [block.tobytes() for block in apis.data[:k]]

    put_s, get_s = [], []
    for rep in range(args.reps + 1):  # the first is a warm-up
        fresh(n)
        started = time.perf_counter()
        put(n)
        put_done = time.perf_counter()
        get(n)
        if rep:
            put_s.append(put_done - started)
            get_s.append(time.perf_counter() - put_done)
        if not np.array_equal(apis.read_back(n, zero_copy), apis.data):
            raise VerificationFailed(f"{label}get of {size} B blocks returned different bytes")
    one = []
    if label != "batch ":  # get_batch of one key is get
        one = timed_s(lambda: get(1), ops, setup=lambda: (fresh(1), put(1)))
        if not np.array_equal(apis.read_back(1, zero_copy), apis.data[:1]):
            raise VerificationFailed(f"one-block {label}get of {size} B returned different bytes")
    transport = "tcp" if args.segment_bytes == 0 else "local"
    put_get = [p + g for p, g in zip(put_s, get_s, strict=True)]
    emit(row(f"{label}put", transport, step, put_s))
    emit(row(f"{label}get", transport, step, get_s, one))
    emit(row(f"{label}put+get", transport, step, put_get))


def store_bench(args: argparse.Namespace) -> None:
    """Each API pair at each plan step."""
    store = new_store(args, args.segment_bytes)
    for step in parse_plan(args.plan):
        size, n, _ = step
        data = np.random.default_rng(4).integers(0, 256, (n, size), dtype=np.uint8)
        out = np.empty((n, size), np.uint8)
        store.register_buffer(data.ctypes.data, data.nbytes)
        store.register_buffer(out.ctypes.data, out.nbytes)
        apis = StoreApis(store, data, out)
        store_api(apis, "", apis.put, apis.get, step, args)
        store_api(apis, "batch ", apis.put_batch, apis.get_batch, step, args)
        store_api(apis, "zero-copy ", apis.put_from, apis.get_into, step, args)
        store.remove_all(True)
        store.unregister_buffer(data.ctypes.data)
        store.unregister_buffer(out.ctypes.data)
    store.close()


def build_parser() -> argparse.ArgumentParser:
    """The roles and their arguments."""
    parser = argparse.ArgumentParser(description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)
    target = sub.add_parser("te-target")
    target.add_argument("--buffer-bytes", type=int, required=True)
    bench = sub.add_parser("te-bench")
    bench.add_argument("--segment", required=True)
    bench.add_argument("--addr", type=int, required=True)
    bench.add_argument("--plan", required=True, help="SIZE:BLOCKS:OPS,... batch writes")
    bench.add_argument("--latency", default="", help="SIZE:1:OPS,... single writes")
    bench.add_argument("--reps", type=int, default=5)
    writer = sub.add_parser("te-writer")
    writer.add_argument("--segment", required=True)
    writer.add_argument("--addr", type=int, required=True)
    writer.add_argument("--max-bytes", type=int, required=True, help="largest block written")
    for name in ("store-node", "store-bench"):
        p = sub.add_parser(name)
        p.add_argument("--master-port", type=int, required=True)
        p.add_argument("--metadata-port", type=int, required=True)
        p.add_argument("--segment-bytes", type=int, default=0)
        p.add_argument("--local-buffer-bytes", type=int, default=256 << 20)
        if name == "store-bench":
            p.add_argument("--plan", required=True, help="SIZE:BLOCKS:OPS,...")
            p.add_argument("--reps", type=int, default=5)
    return parser


def main() -> None:
    """Run one role; a verification failure prints a record and exits with status 3."""
    args = build_parser().parse_args()
    role = {
        "te-target": te_target,
        "te-bench": te_bench,
        "te-writer": te_writer,
        "store-node": store_node,
        "store-bench": store_bench,
    }[args.role]
    # As halfmoon's processes in these benchmarks do (halfmoon.core.heap.settle_gc): the
    # start-up heap leaves the garbage collector's reach, so no full collection of the
    # imported modules falls inside a timed batch.
    gc.collect()
    gc.freeze()
    try:
        role(args)
    except VerificationFailed as exc:
        emit({"verification_error": str(exc)})
        sys.exit(3)


if __name__ == "__main__":
    main()
