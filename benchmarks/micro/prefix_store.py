"""A prefill worker's prefix cache, ``--prefix-store copy`` against ``demote``: the hit
ratio each reaches with a given block store, and so the memory ``demote`` saves at an
equal hit ratio (#21 goal 5).

``copy`` puts every prompt block into the store after its prefill, while the engine's
pool still holds it: the store's first blocks duplicate the pool's. ``demote`` puts a
block into the store only when the pool evicts it, so pool and store hold different
blocks. One engine (the ``tiny`` preset by default: 64 KiB blocks) with its prefix cache
and store, in this process, runs what a prefill worker runs per request: load the longest
cached prefix (engine pool, then store), prefill, save; the requests share documents
picked by a Zipf law (each prompt: a document, then a question of its own). Every
configuration replays the same requests on a fresh engine and store; the hit ratio is the
prompt tokens served from cache over all prompt tokens, after a warm-up. Run from the
repository root::

    .venv/bin/python -m benchmarks.micro.prefix_store --json benchmarks/results/prefix_store.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from typing import Any

from halfmoon.core.request import SamplingParams
from halfmoon.engine import EngineConfig, LLMEngine
from halfmoon.engine.connector import LocalConnector
from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache, Holdings

POLICIES = ("copy", "demote")


class _NoConductor:
    """The Conductor's end of a worker's cache events: counted, not sent."""

    def __init__(self) -> None:
        self.num_events = 0

    def cache_event(self, event: object) -> None:
        self.num_events += 1


def add_workload_options(parser: argparse.ArgumentParser, requests: int, warmup: int) -> None:
    """The shared-documents workload's options (this benchmark's and the live one's)."""
    parser.add_argument("--documents", type=int, default=24)
    parser.add_argument("--doc-tokens", type=int, default=128)
    parser.add_argument("--question-tokens", type=int, default=20)
    parser.add_argument("--zipf", type=float, default=0.8)
    parser.add_argument("--requests", type=int, default=requests)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--seed", type=int, default=0)


def workload(args: argparse.Namespace) -> list[list[int]]:
    """``args.requests`` prompts: a Zipf-picked document, then a question of its own."""
    rng = random.Random(args.seed)
    docs = [
        [rng.randrange(10, 4000) for _ in range(args.doc_tokens)] for _ in range(args.documents)
    ]
    weights = [1 / (rank + 1) ** args.zipf for rank in range(args.documents)]
    prompts = []
    for _ in range(args.requests):
        doc = rng.choices(docs, weights)[0]
        prompts.append(doc + [rng.randrange(10, 4000) for _ in range(args.question_tokens)])
    return prompts


def run(policy: str, store_mb: float, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    """Replay ``prompts`` on a fresh engine and store; hit ratio and what the store held."""
    engine = LLMEngine(EngineConfig(model=args.model, kv_cache_mb=args.pool_mb, num_threads=1))
    connector = LocalConnector(engine)
    holdings = Holdings(_NoConductor())
    store = ClusterPrefixCache.make_store(connector, store_mb, None, 0, holdings)
    cache = ClusterPrefixCache(connector, store, holdings, policy)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    hit = total = peak_store = 0
    started = time.perf_counter()
    for i, tokens in enumerate(prompts):
        cache.load(tokens)
        rid = f"r{i}"
        engine.add_request(rid, tokens, params, keep_kv=True)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                out = o if o.request_id == rid else out
        assert out is not None
        cache.save(rid, tokens)
        engine.export_kv(rid, release=True, with_data=False)
        if i >= args.warmup:
            hit += out.num_cached_tokens
            total += len(tokens)
        stats = store.stats()
        peak_store = max(peak_store, stats.dram.num_blocks)
    engine.check_integrity()
    store.check_integrity()
    stats = store.stats()
    block_mib = engine.kv_bytes_per_block / 2**20
    record = {
        "policy": policy,
        "store_mb": store_mb,
        "pool_mb": args.pool_mb,
        "hit_ratio": hit / total,
        "store_blocks_held": stats.dram.num_blocks,
        "store_mib_held": stats.dram.num_blocks * block_mib,
        "store_peak_mib": peak_store * block_mib,
        "pool_blocks": engine.stats().num_blocks,
        "blocks_demoted": cache.num_blocks_demoted,
        "store_bytes_written_mib": stats.dram.bytes_written / 2**20,
        "seconds": time.perf_counter() - started,
    }
    store.close()
    return record


def equal_hit_savings(records: list[dict]) -> list[dict]:
    """For each ``copy`` point, the ``demote`` store size that reaches its hit ratio (by
    linear interpolation between the two sweep points around it; None past the sweep)."""
    out = []
    demote = sorted((r for r in records if r["policy"] == "demote"), key=lambda r: r["store_mb"])
    for c in sorted((r for r in records if r["policy"] == "copy"), key=lambda r: r["store_mb"]):
        target, size = c["hit_ratio"], None
        if demote and demote[0]["hit_ratio"] >= target:
            size = demote[0]["store_mb"]  # (at most this: the sweep starts there)
        for lo, hi in zip(demote, demote[1:], strict=False):
            if size is None and lo["hit_ratio"] < target <= hi["hit_ratio"]:
                frac = (target - lo["hit_ratio"]) / (hi["hit_ratio"] - lo["hit_ratio"])
                size = lo["store_mb"] + frac * (hi["store_mb"] - lo["store_mb"])
        out.append(
            {
                "copy_store_mb": c["store_mb"],
                "hit_ratio": target,
                "demote_store_mb": size,
                "saved_mb": None if size is None else c["store_mb"] - size,
            }
        )
    return out


def main() -> int:
    """Run every policy at every store size; print the table and the savings."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--pool-mb", type=float, default=4.0, help="the engine's KV pool")
    parser.add_argument(
        "--store-mb", default="1,2,3,4,5,6,8,10,12,16", help="store DRAM sizes to sweep"
    )
    add_workload_options(parser, requests=400, warmup=50)
    parser.add_argument("--json", help="write every record here")
    args = parser.parse_args()
    prompts = workload(args)
    sizes = [float(s) for s in args.store_mb.split(",")]
    records: list[dict[str, Any]] = []
    print(f"{'policy':<7} {'store MiB':>9} {'hit ratio':>9} {'store held MiB':>14} "
          f"{'demoted':>8} {'store writes MiB':>16}")  # fmt: skip
    for size in sizes:
        for policy in POLICIES:
            r = run(policy, size, prompts, args)
            records.append(r)
            print(f"{policy:<7} {size:>9.1f} {r['hit_ratio']:>9.3f} {r['store_mib_held']:>14.1f} "
                  f"{r['blocks_demoted']:>8} {r['store_bytes_written_mib']:>16.1f}")  # fmt: skip
            sys.stdout.flush()
    savings = equal_hit_savings(records)
    print(f"\nengine pool: {args.pool_mb} MiB; at equal hit ratio:")
    for s in savings:
        if s["demote_store_mb"] is None:
            print(f"  copy, {s['copy_store_mb']:g} MiB store: hit ratio {s['hit_ratio']:.3f}; "
                  "demote: not within the sweep")  # fmt: skip
            continue
        print(f"  copy, {s['copy_store_mb']:g} MiB store: hit ratio {s['hit_ratio']:.3f}; demote "
              f"reaches it with {s['demote_store_mb']:.1f} MiB (saves {s['saved_mb']:.1f} MiB)")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"options": vars(args), "records": records, "equal_hit": savings}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
