"""A prefill worker's prefix pull from a peer's store: how long the worker's loop is held
(it does not wait for the pull: :meth:`ClusterPrefixCache.begin_load`), how long the pull
takes until its blocks are seeded (:meth:`~ClusterPrefixCache.end_load`), and, with
``--modes``, what KV compression (``--kv-compression``) does to it.

A peer is another process (this module with ``--serve``): a block store holding the
prompt's blocks, served by a transfer engine that encodes pulled blocks with its mode's
codec as a prefill worker's does (``none``: raw). The puller is a worker's own
:class:`ClusterPrefixCache` (``--policy``: its ``--prefix-store``, ``demote`` by default
as a worker's) over a stand-in engine of the given block size, decoding with the same
codec, so only the pull is measured, not a model: a real block manager and KV pool,
into which the load copies each block as it arrives (the pool blocks held when the
load begins, as an engine's are), or with ``--seed-at-end`` all of them on the loop
thread once the pull ended (as before prefix reservations). One such worker per mode lives across the rounds,
as a worker's store, pool and pull threads do (fresh ones every round paid ~23,000 page
faults a 90 MiB pull, on memory a running worker has mapped already). Every round
starts with the prompt's blocks deleted from the worker's store and pulls once per mode
(one peer per mode; the order rotates); every pulled block is checked: against the peer's bytes (``none``, lossless modes), or
against this process's own encode and decode of them (lossy modes: the same codec
gives the same bytes). Effective throughput: the blocks' raw bytes over the pull's
time; the wire ceiling is ``none`` in the same rounds. Each round also reports the CPU
time the puller's process and the peer's spent during the pull, and how long their
threads waited for a CPU (where both share a host's cores, that says whether the pull
was bound by the wire or by the CPUs).

The blocks: ``synthetic`` (default) float32 N(0, 1) values, SmolLM2-135M's block size
(737,280 bytes); ``real``: SmolLM2-135M-Instruct's own KV of this repository's docs
(transformers computes it; blocks laid out as the engine's pool holds them, layer by
layer, K then V), which only a lossless mode's ratio depends on. With ``--wire-gbit G``
(root, iproute2) the peers run in a network namespace behind a veth pair shaped to G
Gbit/s, a NIC-like wire (:mod:`benchmarks.micro.wire`); compression only applies over
tcp, the transport used then. With ``--local`` the blocks are in the worker's own store
(DRAM) before each round: a load that pulls nothing, timed the same way.

Run from the repository root::

    .venv/bin/python -m benchmarks.micro.prefix_pull --blocks 128 --rounds 8 \\
        --json benchmarks/results/prefix_pull.json
    .venv/bin/python -m benchmarks.micro.prefix_pull --modes none,int8 --data real \\
        --wire-gbit 10 --json benchmarks/results/prefix_pull_int8.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from halfmoon.core.hashing import NONE_HASH, hash_blocks
from halfmoon.core.heap import settle_gc
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.kv_cache import KVCache, KVLayout
from halfmoon.engine.seeding import reserve_prefix, seed_prefix
from halfmoon.serve.worker.prefix_cache import (
    PREFIX_STORE_POLICIES,
    ClusterPrefixCache,
    Holdings,
)
from halfmoon.store import BlockMeta, StoreConfig, TieredStore
from halfmoon.transfer import TransferEngine

SECRET = b"prefix-pull-bench-secret-0123456"
#: SmolLM2-135M in float32: 30 layers x K and V x 16 tokens x 3 KV heads x 64 x 4 bytes.
SMOLLM2_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4
BLOCK_TOKENS = 16
#: The codecs' group: values per KV head (SmolLM2's head size).
HEAD_DIM = 64


def prompt_of(num_blocks: int) -> list[int]:
    """A prompt of ``num_blocks`` full blocks and one more token."""
    return [(i * 31) % 4000 + 23 for i in range(num_blocks * BLOCK_TOKENS + 1)]


def synthetic_blocks(num_blocks: int, block_bytes: int) -> np.ndarray:
    """``[num_blocks, block_bytes]`` uint8: float32 N(0, 1) values, distinct per block
    (the bytes beyond a whole number of floats zero)."""
    out = np.zeros((num_blocks, block_bytes), np.uint8)
    floats = block_bytes // 4
    for i in range(num_blocks):
        values = np.random.default_rng(i).standard_normal(floats, dtype=np.float32)
        out[i, : floats * 4] = values.view(np.uint8)
    return out


def real_blocks(num_blocks: int, model: str) -> np.ndarray:
    """SmolLM2's (or ``model``'s) KV of this repository's docs, ``[num_blocks, block_bytes]``
    uint8, each block as the engine's pool lays it out: every stream layer's (K then V of
    each layer) ``[block_size, H_kv, D]`` float32 slice in turn."""
    import torch

    from benchmarks.micro.kv_compression import load_reference, prompt_kv, text_tokens
    from halfmoon.engine.catalog import resolve_model

    reference, tokenizer = load_reference(resolve_model(model))
    layers = prompt_kv(reference, text_tokens(tokenizer, num_blocks * BLOCK_TOKENS)
                       [: num_blocks * BLOCK_TOKENS], BLOCK_TOKENS)  # fmt: skip
    if layers[0].shape[-1] != HEAD_DIM:
        raise SystemExit(f"{model}: head size {layers[0].shape[-1]}, this benchmark's {HEAD_DIM}")
    blocks = torch.stack(layers, 1)  # [n, stream layers, block_size, H_kv, D]
    return blocks.reshape(num_blocks, -1).view(torch.uint8).numpy().copy()


def codec_of(mode: str):
    """The float32 codec of ``mode`` as prefill workers run it (compiled where it builds);
    None for ``none``."""
    if mode == "none":
        return None
    import torch

    from benchmarks.micro.kv_compression import codec_for

    torch.set_num_threads(1)  # a pull or transfer thread's share
    return codec_for(mode, HEAD_DIM)


def serve(data: Path, mode: str, transport: str, host: str, keep_encoded_mb: float = 0) -> None:
    """The peer: store the prompt's blocks, encode pulls with ``mode``'s codec (keeping up
    to ``keep_encoded_mb`` of encoded blocks for later pulls, as a worker does), print
    the endpoint, serve until killed."""
    blocks = np.load(data)
    num_blocks, block_bytes = blocks.shape
    store = TieredStore(
        StoreConfig(block_bytes=block_bytes, dram_capacity_bytes=block_bytes * (num_blocks + 4))
    )
    parent = NONE_HASH
    for i, h in enumerate(hash_blocks(prompt_of(num_blocks), BLOCK_TOKENS).full):
        store.put(h, blocks[i].tobytes(), BlockMeta(BLOCK_TOKENS, parent), position=i)
        parent = h
    engine = TransferEngine(SECRET, store=store, transport=transport, host=host)
    codec = codec_of(mode)
    if codec is not None:
        engine.set_pull_encoder(codec.encode, int(keep_encoded_mb * 2**20))
    endpoint = engine.start()
    settle_gc()  # as a serving worker does
    print(endpoint, flush=True)
    time.sleep(3600)


class _Engine:
    """The engine side of a prefix cache, without a model: a real block manager and KV
    pool (of a layout with the blocks' size), nothing cached at the start of a round;
    blocks are seeded as an engine seeds them (held when the load begins and copied
    into the pool as they arrive, or with ``seed_at_end`` all copied when it ends)."""

    def __init__(self, block_bytes: int, num_blocks: int, seed_at_end: bool = False) -> None:
        self.layout = stand_in_layout(block_bytes)
        self.config = SimpleNamespace(enable_prefix_caching=True)
        self.kv_bytes_per_block = block_bytes
        self.kv_cache = KVCache(self.layout, num_blocks + 2)
        self.seed_at_end = seed_at_end
        self.reset()

    def reset(self) -> None:
        """Forget every cached block (the pool's memory stays, touched, as a worker's)."""
        self.blocks = BlockManager(self.kv_cache.num_blocks, BLOCK_TOKENS)

    def seeded(self, token_ids: list[int]) -> list[bytes]:
        """The bytes of the prompt's cached blocks in the pool."""
        ids = self.blocks.match_prefix(token_ids)
        return [bytes(self.kv_cache.export_bytes([b])) for b in ids]

    def cached_prefix_blocks(self, token_ids: Any, cache_salt: Any) -> int:
        return len(self.blocks.match_prefix(token_ids, cache_salt))

    def reserve_prefix(self, token_ids: Any, first: int, count: int, cache_salt: Any) -> Any:
        if self.seed_at_end:
            return None
        return reserve_prefix(self.blocks, self.kv_cache, token_ids, first, count, cache_salt)

    def seed_prefix(self, token_ids: Any, first: int, payloads: Any, cache_salt: Any) -> int:
        return seed_prefix(self.blocks, self.kv_cache, token_ids, first, payloads, cache_salt)

    def read_cached_block(self, block_hash: int) -> None:
        return None

    def set_demote_hook(self, hook: Any) -> None:
        self.demote_hook = hook  # never called: nothing is evicted here

    def set_cache_listener(self, listener: Any) -> None:
        self.cache_listener = listener


def stand_in_layout(block_bytes: int) -> KVLayout:
    """A float32 KV layout whose blocks have ``block_bytes``: SmolLM2's (3 KV heads of 64)
    with as many layers as fit exactly, else one layer of one head."""
    per_layer = 2 * BLOCK_TOKENS * 3 * HEAD_DIM * 4
    if block_bytes % per_layer == 0:
        return KVLayout(block_bytes // per_layer, BLOCK_TOKENS, 3, HEAD_DIM, "float32")
    if block_bytes % (2 * BLOCK_TOKENS * 4) == 0:
        return KVLayout(1, BLOCK_TOKENS, 1, block_bytes // (2 * BLOCK_TOKENS * 4), "float32")
    raise ValueError(f"--block-bytes {block_bytes} is not a whole number of float32 KV rows")


class _Events:
    def cache_event(self, event: object) -> None:
        return None


def expected_blocks(blocks: np.ndarray, codec: Any) -> list[bytes]:
    """What a pull must seed: the blocks themselves, or a lossy codec's decode of their
    encoding (this process's codec; the peer's is the same)."""
    if codec is None or codec.name == "zstd":
        return [b.tobytes() for b in blocks]
    out = []
    for b in blocks:
        decoded = bytearray(b.nbytes)
        codec.decode(codec.encode(memoryview(b)), memoryview(decoded))
        out.append(bytes(decoded))
    return out


class Ticker:
    """A thread that wakes every ``period_s``: how late it wakes is how long another
    thread kept the GIL from it (what a worker's loop thread would wait meanwhile)."""

    def __init__(self, period_s: float = 0.0005) -> None:
        self.period_s = period_s
        self.late_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.period_s)
            self.late_s.append(time.perf_counter() - t0 - self.period_s)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join()
        return self.late_s


class Worker:
    """The puller's side, alive across rounds as a worker's is: its stand-in engine (with
    a pool the blocks are seeded into), its store and its prefix cache (with the
    buffers it reuses from load to load)."""

    def __init__(
        self, num_blocks: int, block_bytes: int, codec: Any, policy: str, seed_at_end: bool
    ) -> None:
        self.engine = _Engine(block_bytes, num_blocks, seed_at_end)
        holdings = Holdings(_Events())
        self.store = ClusterPrefixCache.make_store(  # type: ignore[arg-type]
            self.engine, block_bytes * (num_blocks + 4) / 2**20, None, 0, holdings
        )
        self.cache = ClusterPrefixCache(self.engine, self.store, holdings, policy)  # type: ignore[arg-type]
        if codec is not None:
            self.cache.pull_codec = codec
        self.hashes = list(hash_blocks(prompt_of(num_blocks), BLOCK_TOKENS).full)

    def reset(self, blocks: list[bytes] | None) -> None:
        """Empty the store and the pool of the prompt's blocks, then (``blocks``) put them
        in the store."""
        self.engine.reset()
        for h in self.hashes:
            self.store.delete(h)
        if blocks is not None:
            parent = NONE_HASH
            for i, h in enumerate(self.hashes):
                self.store.put(h, blocks[i], BlockMeta(BLOCK_TOKENS, parent), position=i)
                parent = h

    def close(self) -> None:
        self.cache.close()
        self.store.close()


def process_cpu(pid: int) -> tuple[float, float]:
    """Seconds the threads of process ``pid`` have run on a CPU, and waited for one
    while ready to run, so far (``/proc/<pid>/task/*/schedstat``; threads that ended
    are not counted; (0, 0) where the kernel does not say)."""
    on_cpu = waiting = 0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, 0.0
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                ran, waited, _ = f.read().split()
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        on_cpu += int(ran)
        waiting += int(waited)
    return on_cpu / 1e9, waiting / 1e9


def one_round(
    expected: list[bytes], worker: Worker, puller: TransferEngine, endpoint: str,
    local: bool = False, peer_pid: int | None = None,
) -> dict:  # fmt: skip
    """One pull with the prompt's blocks absent from the worker's store (``local``: in
    it): loop held (at the start, and while seeding at the end), whole pull, a ticking
    thread's largest delay meanwhile, the CPU time this process and the peer's
    (``peer_pid``) spent on it and waited for a CPU, blocks checked."""
    num_blocks, block_bytes = len(expected), len(expected[0])
    worker.reset(expected if local else None)  # not timed
    ticker = Ticker()
    cpu0 = process_cpu(os.getpid()), process_cpu(peer_pid) if peer_pid else (0.0, 0.0)
    started = time.perf_counter()
    load = worker.cache.begin_load(prompt_of(num_blocks), None if local else puller, endpoint)
    held_s = time.perf_counter() - started
    load.fetch.wait()
    seeding = time.perf_counter()
    loaded = worker.cache.end_load(load)
    total_s = time.perf_counter() - started
    seed_s = time.perf_counter() - seeding
    cpu1 = process_cpu(os.getpid()), process_cpu(peer_pid) if peer_pid else (0.0, 0.0)
    late = ticker.stop()
    seeded = worker.engine.seeded(prompt_of(num_blocks))
    ok = loaded == num_blocks and seeded == expected
    return {"loop_held_s": held_s, "seed_s": seed_s, "pull_s": total_s, "blocks": loaded,
            "pulled": load.fetch.num_pulled, "stored": sum(map(worker.store.contains,
                                                               worker.hashes)),
            "verified": ok, "effective_gib_s": num_blocks * block_bytes / total_s / 2**30,
            "ticker_max_late_s": max(late, default=0.0),
            # (the puller's includes its ticking thread's wake-ups, a few ms a pull)
            "puller_cpu_s": cpu1[0][0] - cpu0[0][0], "puller_wait_s": cpu1[0][1] - cpu0[0][1],
            "peer_cpu_s": cpu1[1][0] - cpu0[1][0], "peer_wait_s": cpu1[1][1] - cpu0[1][1]}  # fmt: skip


def start_peer(data: Path, mode: str, args: argparse.Namespace, netns: str | None, host: str):
    """A peer process serving ``data`` with ``mode``'s encoder; (process, endpoint)."""
    argv = [sys.executable, "-m", "benchmarks.micro.prefix_pull", "--serve", str(data),
            "--serve-mode", mode, "--transport", args.transport, "--host", host,
            "--keep-encoded-mb", str(args.keep_encoded_mb)]  # fmt: skip
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    peer = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    assert peer.stdout is not None
    endpoint = peer.stdout.readline().strip()
    if not endpoint:
        peer.kill()
        peer.wait()
        raise SystemExit(f"the {mode} peer process did not start")
    return peer, endpoint


def run_rounds(blocks: np.ndarray, modes: list[str], args, netns: str | None, host: str):
    """Every round pulls the prompt once per mode, the order rotating; rounds per mode."""
    codecs = {m: codec_of(m) for m in modes}
    expected = {m: expected_blocks(blocks, codecs[m]) for m in modes}
    per_mode: dict[str, list[dict]] = {m: [] for m in modes}
    peers: dict[str, tuple[subprocess.Popen, str]] = {}
    workers: dict[str, Worker] = {}
    with tempfile.TemporaryDirectory(prefix="hm-prefix-pull-") as tmp:
        data = Path(tmp) / "blocks.npy"
        np.save(data, blocks)
        os.chmod(tmp, 0o755)  # readable by a peer in another network namespace (same user)
        try:
            for m in modes:
                peers[m] = start_peer(data, m, args, netns, host)
            n, block_bytes = blocks.shape
            workers.update(
                (m, Worker(n, block_bytes, codecs[m], args.policy, args.seed_at_end)) for m in modes
            )
            with TransferEngine(SECRET, transport=args.transport) as puller:
                settle_gc()  # as a worker does once started (no full collection of the
                # reference model's objects inside a pull: ~170-200 ms every ~5th round)
                for r in range(args.rounds):
                    for m in modes[r % len(modes) :] + modes[: r % len(modes)]:
                        result = one_round(expected[m], workers[m], puller, peers[m][1],
                                           args.local, peers[m][0].pid)  # fmt: skip
                        per_mode[m].append({"round": r, **result})
        finally:
            for worker in workers.values():
                worker.close()
            for peer, _ in peers.values():
                peer.kill()
                peer.wait()
    return per_mode


def summary(per_mode: dict[str, list[dict]]) -> dict[str, dict]:
    """Medians per mode, and each round's effective throughput over ``none``'s."""
    ceiling = [r["effective_gib_s"] for r in per_mode.get("none", [])]
    out = {}
    for mode, rounds in per_mode.items():
        eff = [r["effective_gib_s"] for r in rounds]
        out[mode] = {
            "loop_held_ms": statistics.median(r["loop_held_s"] * 1e3 for r in rounds),
            "seed_ms": statistics.median(r["seed_s"] * 1e3 for r in rounds),
            "ticker_max_late_ms": statistics.median(r["ticker_max_late_s"] * 1e3 for r in rounds),
            **{
                f"{k}_ms": statistics.median(r[f"{k}_s"] * 1e3 for r in rounds)
                for k in ("puller_cpu", "puller_wait", "peer_cpu", "peer_wait")
            },
            "pull_ms": statistics.median(r["pull_s"] * 1e3 for r in rounds),
            "effective_gib_s": statistics.median(eff),
            "rounds_vs_none": [e / c for e, c in zip(eff, ceiling, strict=False)],
            # (with --keep-encoded-mb: after its first round a peer sends kept encodings)
            "later_rounds_vs_none": statistics.median(
                [e / c for e, c in zip(eff[1:], ceiling[1:], strict=False)] or [0.0]
            ),
            "verified": all(r["verified"] for r in rounds),
        }
    return out


def print_report(where: str, per_mode: dict[str, list[dict]], mib: float) -> None:
    """One block of lines per mode: loop held, pull, effective GiB/s, vs ``none``."""
    print(f"{where}: {mib:.0f} MiB of KV per pull")
    for mode, s in summary(per_mode).items():
        rounds = per_mode[mode]
        print(f"  {mode}: every block verified: {s['verified']}")
        print("    loop held ms: median {:.2f}, rounds {}".format(s["loop_held_ms"], " ".join(
            f"{r['loop_held_s'] * 1e3:.2f}" for r in rounds)))  # fmt: skip
        print("    end_load (loop) ms: median {:.2f}, rounds {}".format(s["seed_ms"],
              " ".join(f"{r['seed_s'] * 1e3:.2f}" for r in rounds)))  # fmt: skip
        print("    a ticking thread's longest wait ms: median {:.2f}, rounds {}".format(
            s["ticker_max_late_ms"], " ".join(
                f"{r['ticker_max_late_s'] * 1e3:.2f}" for r in rounds)))  # fmt: skip
        print("    CPU ms of the pull (median): puller {:.1f}, peer {:.1f}; waiting for a CPU:"
              " {:.1f}, {:.1f}".format(s["puller_cpu_ms"], s["peer_cpu_ms"],
                                      s["puller_wait_ms"], s["peer_wait_ms"]))  # fmt: skip
        print("    pull until seeded ms: median {:.1f}, rounds {}".format(s["pull_ms"], " ".join(
            f"{r['pull_s'] * 1e3:.1f}" for r in rounds)))  # fmt: skip
        print("    effective GiB/s: median {:.2f}, rounds {}".format(s["effective_gib_s"],
              " ".join(f"{r['effective_gib_s']:.2f}" for r in rounds)))  # fmt: skip
        if mode != "none" and s["rounds_vs_none"]:
            ratios = s["rounds_vs_none"]
            print("    vs none: median {:.2f}, rounds {}; rounds after the first {:.2f}".format(
                statistics.median(ratios), " ".join(f"{x:.2f}" for x in ratios),
                s["later_rounds_vs_none"]))  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; returns every round (``rounds``: loopback or this host's
    shared memory; ``rounds_shaped``: over the shaped wire) and their summaries."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=128, help="prefix blocks pulled")
    parser.add_argument("--block-bytes", type=int, default=SMOLLM2_BLOCK_BYTES,
                        help="block size of synthetic blocks")  # fmt: skip
    parser.add_argument("--data", default="synthetic", choices=("synthetic", "real"))
    parser.add_argument("--model", default="smollm2-135m-instruct", help="for --data real")
    parser.add_argument("--modes", default="none", help="KV compression modes, comma-separated")
    parser.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--wire-gbit", type=float, default=0.0,
                        help="also pull over a veth pair shaped to this rate (root)")  # fmt: skip
    parser.add_argument("--local", action="store_true",
                        help="the blocks are in the worker's own store: a load without a pull")  # fmt: skip
    parser.add_argument("--policy", default="demote", choices=PREFIX_STORE_POLICIES,
                        help="the worker's --prefix-store policy (copy: pulled blocks are "
                        "also put in its store)")  # fmt: skip
    parser.add_argument("--keep-encoded-mb", type=float, default=0.0,
                        help="encoded blocks a peer keeps for later pulls (a worker's "
                        "--kv-compression cache; 0: every pull encodes, so every round is "
                        "a first pull)")  # fmt: skip
    parser.add_argument("--seed-at-end", action="store_true",
                        help="copy the pulled blocks into the pool when the pull ended, on "
                        "the loop (as before prefix reservations), not as they arrive")  # fmt: skip
    parser.add_argument("--json", help="write every round here")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--serve-mode", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.block_bytes < 1 or args.rounds < 1:
        parser.error("--blocks, --block-bytes and --rounds must be positive")
    if args.serve:
        serve(Path(args.serve), args.serve_mode, args.transport, args.host, args.keep_encoded_mb)
        return {}
    from halfmoon.engine.kvcodec import MODES

    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    if len(set(modes)) != len(modes):
        parser.error("--modes names a mode twice")
    if modes != ["none"] and args.transport != "tcp":
        parser.error("compressed pulls go over tcp only (--transport tcp)")
    if args.local and (modes != ["none"] or args.wire_gbit):
        parser.error("--local loads from the worker's own store: no --modes, no --wire-gbit")
    if modes != ["none"] and "none" not in modes:
        modes.insert(0, "none")  # the wire ceiling
    if args.data == "real":
        blocks = real_blocks(args.blocks, args.model)
    else:
        if args.block_bytes % (4 * HEAD_DIM) and modes != ["none"]:
            parser.error(f"--block-bytes must be a multiple of {4 * HEAD_DIM} to compress")
        try:
            stand_in_layout(args.block_bytes)
        except ValueError as exc:
            parser.error(str(exc))
        blocks = synthetic_blocks(args.blocks, args.block_bytes)
    mib = blocks.nbytes / 2**20
    result: dict[str, Any] = {"args": vars(args), "modes": modes, "block_bytes": blocks.shape[1]}
    result["rounds"] = run_rounds(blocks, modes, args, None, "127.0.0.1")
    print_report(args.transport, result["rounds"], mib)
    result["summary"] = summary(result["rounds"])
    if args.wire_gbit:
        from benchmarks.micro.wire import NS_IP, shaped_wire

        with shaped_wire(args.wire_gbit) as netns:
            result["rounds_shaped"] = run_rounds(blocks, modes, args, netns, NS_IP)
        print_report(f"{args.wire_gbit:g} Gbit/s veth", result["rounds_shaped"], mib)
        result["summary_shaped"] = summary(result["rounds_shaped"])
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
