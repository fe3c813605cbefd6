"""A prefill worker's prefix pull from a peer's store: how long the worker's loop is held
(it does not wait for the pull: :meth:`ClusterPrefixCache.begin_load`), and how long the
pull takes until its blocks are seeded (:meth:`~ClusterPrefixCache.end_load`).

The peer is another process (this module with ``--serve``): a block store holding the
prompt's blocks, served by a transfer engine. The puller is the worker's own
:class:`ClusterPrefixCache` over a stand-in engine of the given block size (default:
SmolLM2-135M's float32 block, 737,280 bytes), so only the pull is measured, not a
model. Every round starts with an empty local store; every pulled block is checked
against the bytes the peer holds.

Run from the repository root::

    .venv/bin/python -m benchmarks.micro.prefix_pull --blocks 128 --rounds 8 \\
        --json benchmarks/results/prefix_pull.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import numpy as np

from halfmoon.core.hashing import NONE_HASH, hash_blocks
from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache, Holdings
from halfmoon.store import BlockMeta, StoreConfig, TieredStore
from halfmoon.transfer import TransferEngine

SECRET = b"prefix-pull-bench-secret-0123456"
#: SmolLM2-135M in float32: 30 layers x K and V x 16 tokens x 3 KV heads x 64 x 4 bytes.
SMOLLM2_BLOCK_BYTES = 30 * 2 * 16 * 3 * 64 * 4
BLOCK_TOKENS = 16


def prompt_of(num_blocks: int) -> list[int]:
    """A prompt of ``num_blocks`` full blocks and one more token."""
    return [(i * 31) % 4000 + 23 for i in range(num_blocks * BLOCK_TOKENS + 1)]


def payload_of(index: int, block_bytes: int) -> bytes:
    """Block ``index``'s bytes at the peer (distinct per block)."""
    return np.full(block_bytes, index % 251 + 1, np.uint8).tobytes()


def serve(block_bytes: int, num_blocks: int, transport: str) -> None:
    """The peer: store the prompt's blocks, print the endpoint, serve until killed."""
    store = TieredStore(
        StoreConfig(block_bytes=block_bytes, dram_capacity_bytes=block_bytes * (num_blocks + 4))
    )
    parent = NONE_HASH
    for i, h in enumerate(hash_blocks(prompt_of(num_blocks), BLOCK_TOKENS).full):
        store.put(h, payload_of(i, block_bytes), BlockMeta(BLOCK_TOKENS, parent), position=i)
        parent = h
    engine = TransferEngine(SECRET, store=store, transport=transport)
    print(engine.start(), flush=True)
    time.sleep(3600)


class _Engine:
    """The engine side of a prefix cache, without a model: nothing cached, every seeded
    block kept (to be checked)."""

    def __init__(self, block_bytes: int) -> None:
        self.layout = SimpleNamespace(block_size=BLOCK_TOKENS)
        self.config = SimpleNamespace(enable_prefix_caching=True)
        self.kv_bytes_per_block = block_bytes
        self.seeded: list[Any] = []

    def cached_prefix_blocks(self, token_ids: Any, cache_salt: Any) -> int:
        return 0

    def seed_prefix(self, token_ids: Any, first: int, payloads: Any, cache_salt: Any) -> int:
        self.seeded = list(payloads)
        return len(payloads)

    def read_cached_block(self, block_hash: int) -> None:
        return None


class _Events:
    def cache_event(self, event: object) -> None:
        return None


def one_round(block_bytes: int, num_blocks: int, puller: TransferEngine, endpoint: str) -> dict:
    """One pull into an empty store: loop held, whole pull, blocks checked."""
    engine = _Engine(block_bytes)
    holdings = Holdings(_Events())
    store = ClusterPrefixCache.make_store(  # type: ignore[arg-type]
        engine, block_bytes * (num_blocks + 4) / 2**20, None, 0, holdings
    )
    cache = ClusterPrefixCache(engine, store, holdings)  # type: ignore[arg-type]
    try:
        started = time.perf_counter()
        load = cache.begin_load(prompt_of(num_blocks), puller, endpoint)
        held_s = time.perf_counter() - started
        load.fetch.wait()
        loaded = cache.end_load(load)
        total_s = time.perf_counter() - started
        ok = loaded == num_blocks and all(
            bytes(p) == payload_of(i, block_bytes) for i, p in enumerate(engine.seeded)
        )
    finally:
        cache.close()
        store.close()
    return {"loop_held_s": held_s, "pull_s": total_s, "blocks": loaded, "verified": ok}


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark; returns every round."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=128, help="prefix blocks pulled")
    parser.add_argument("--block-bytes", type=int, default=SMOLLM2_BLOCK_BYTES)
    parser.add_argument("--transport", default="tcp", choices=("tcp", "shm"))
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", help="write every round here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.blocks < 1 or args.block_bytes < 1 or args.rounds < 1:
        parser.error("--blocks, --block-bytes and --rounds must be positive")
    if args.serve:
        serve(args.block_bytes, args.blocks, args.transport)
        return []
    peer = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.micro.prefix_pull", "--serve", "--blocks",
         str(args.blocks), "--block-bytes", str(args.block_bytes), "--transport", args.transport],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    rounds: list[dict] = []
    try:
        assert peer.stdout is not None
        endpoint = peer.stdout.readline().strip()
        if not endpoint:
            raise SystemExit("the peer process did not start")
        with TransferEngine(SECRET, transport=args.transport) as puller:
            for r in range(args.rounds):
                rounds.append({"round": r, **one_round(args.block_bytes, args.blocks, puller,
                                                       endpoint)})  # fmt: skip
    finally:
        peer.kill()
        peer.wait()
    mib = args.blocks * args.block_bytes / 2**20
    held = [r["loop_held_s"] * 1e3 for r in rounds]
    pull = [r["pull_s"] * 1e3 for r in rounds]
    print(f"{args.transport}: {args.blocks} blocks x {args.block_bytes} bytes = {mib:.0f} MiB, "
          f"every block verified: {all(r['verified'] for r in rounds)}")  # fmt: skip
    print(f"loop held ms: median {statistics.median(held):.2f}, rounds "
          + " ".join(f"{x:.2f}" for x in held))  # fmt: skip
    print(f"pull until seeded ms: median {statistics.median(pull):.1f}, rounds "
          + " ".join(f"{x:.1f}" for x in pull))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rounds": rounds}, f, indent=1)
    return rounds


if __name__ == "__main__":
    main()
