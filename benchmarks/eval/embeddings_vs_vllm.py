"""``/v1/embeddings``: halfmoon's server against vLLM's, side by side.

The same model (SmolLM2 by default) served by ``halfmoon serve`` (its own engine, one
coupled worker: like with like) and by vLLM's OpenAI server (its CPU build) converted to
an embedding model as vLLM documents it (``--runner pooling --convert embed``: the last
token's normalized hidden state, the same pooling halfmoon does), both with the same
threads, KV pool, 16-token blocks and float32, each alone on the machine while measured.
vLLM gets its documented CPU tuning (:class:`~halfmoon.serve.vllm.server.VllmLaunch`).

Points, each timed by this client (wall time of the requests):

- ``batch``: one request of ``--inputs`` token-id inputs of ``--tokens`` tokens each
  (distinct, random; the same for both servers);
- ``c1``: ``--singles`` requests of one input each, one after another (latency);
- ``again``: the ``batch`` request once more (what a prefix cache saves when a corpus is
  embedded again; the default pool, 1 GiB, holds the batch's 16,384 tokens).

Every vector is checked: each server's embedding of an input against the other's
(cosine similarity, reported; the run fails under 0.999). Each round starts each server
afresh (the order alternating) and warms it; every round's figures are kept.

Run from the repository root (``make vllm`` first; ~6 minutes for 3 rounds on 2 cores)::

    .venv/bin/python -m benchmarks.eval.embeddings_vs_vllm --rounds 3 \\
        [--results benchmarks/results/embeddings_vs_vllm.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import time
from typing import Any

import httpx

from halfmoon.engine.catalog import resolve_model

from .served_vs_vllm import common_args, measure, serve_halfmoon, serve_vllm

#: How vLLM serves a generative model as an embedding model (its documented flags).
POOLING = ("--runner", "pooling", "--convert", "embed")
#: The smallest cosine similarity between the two servers' vectors of an input accepted.
MIN_COSINE = 0.999


def inputs(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` random token-id inputs of ``length`` tokens (ids 100.. of the vocabulary)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


def embed(client: httpx.Client, url: str, model: str, batch: list[list[int]]) -> list[list[float]]:
    """One ``/v1/embeddings`` request; its vectors in input order (checked unit length)."""
    r = client.post(url + "/v1/embeddings", json={"model": model, "input": batch,
                                                   "encoding_format": "float"})  # fmt: skip
    r.raise_for_status()
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    vectors = [d["embedding"] for d in data]
    assert len(vectors) == len(batch)
    for v in vectors:
        assert abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-3, "not normalized"
    return vectors


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (round, server, point), and the two servers' agreement."""
    model_dir = resolve_model(args.model, 0)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    cosines: list[float] = []
    for rnd in range(args.rounds):
        batch = inputs(args.inputs, args.tokens, vocab, 100 + rnd)
        singles = inputs(args.singles, args.tokens, vocab, 200 + rnd)
        warm = inputs(4, args.tokens, vocab, 7)
        order = ("halfmoon", "vllm") if rnd % 2 == 0 else ("vllm", "halfmoon")
        vectors: dict[str, list[list[float]]] = {}
        for arm in order:
            log = args.out / f"r{rnd}-{arm}.log"
            if arm == "halfmoon":
                server: Any = serve_halfmoon(args, log)
                url = server.base_url
            else:
                server = serve_vllm(args, model_dir, log, POOLING)
                url = server.endpoints.url
            try:
                with httpx.Client(timeout=900) as client:
                    embed(client, url, args.model, warm)
                    t0 = time.perf_counter()
                    vectors[arm] = embed(client, url, args.model, batch)
                    t_batch = time.perf_counter() - t0
                    latencies = []
                    for one in singles:
                        t0 = time.perf_counter()
                        embed(client, url, args.model, [one])
                        latencies.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    again = embed(client, url, args.model, batch)
                    t_again = time.perf_counter() - t0
                assert all(cosine(a, b) > 0.99999 for a, b in zip(again, vectors[arm],
                                                                  strict=True))  # fmt: skip
            finally:
                server.stop()
            tokens = args.inputs * args.tokens
            for point, seconds in (("batch", t_batch), ("again", t_again)):
                row = {"round": rnd, "server": arm, "point": point, "seconds": seconds,
                       "inputs_per_s": args.inputs / seconds, "tokens_per_s": tokens / seconds}  # fmt: skip
                runs.append(row)
                print(json.dumps(row), flush=True)
            row = {"round": rnd, "server": arm, "point": "c1",
                   "median_ms": 1000 * statistics.median(latencies),
                   "p90_ms": 1000 * sorted(latencies)[math.ceil(0.9 * len(latencies)) - 1]}  # fmt: skip
            runs.append(row)
            print(json.dumps(row), flush=True)
        agreement = [cosine(a, b) for a, b in zip(vectors["halfmoon"], vectors["vllm"],
                                                  strict=True)]  # fmt: skip
        cosines += agreement
        print(f"round {rnd}: cosine halfmoon/vLLM min {min(agreement):.6f}", flush=True)
        if min(agreement) < MIN_COSINE:
            raise SystemExit(f"the servers disagree: cosine {min(agreement):.6f} < {MIN_COSINE}")
    return {
        "config": {"model": args.model, "threads": args.threads, "kv_cache_mb": args.kv_cache_mb,
                   "rounds": args.rounds, "inputs": args.inputs, "tokens": args.tokens,
                   "singles": args.singles, "dtype": "float32",
                   "vllm": "--runner pooling --convert embed", "date": time.strftime("%Y-%m-%d"),
                   "cpus": os.cpu_count()},
        "runs": runs,
        "cosine": {"min": min(cosines), "median": statistics.median(cosines)},
    }  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """Per point: each server's median over rounds, and halfmoon / vLLM per round."""
    lines = ["| point | figure | halfmoon | vLLM | halfmoon / vLLM, median [rounds] |",
             "|---|---|---:|---:|---|"]  # fmt: skip
    for point, fig in (("batch", "inputs_per_s"), ("again", "inputs_per_s"),
                       ("c1", "median_ms"), ("c1", "p90_ms")):  # fmt: skip
        by_round: dict[int, dict[str, float]] = {}
        for r in results["runs"]:
            if r["point"] == point:
                by_round.setdefault(r["round"], {})[r["server"]] = r[fig]
        pairs = [v for v in by_round.values() if len(v) == 2]
        ratios = sorted(v["halfmoon"] / v["vllm"] for v in pairs)
        hm = statistics.median(v["halfmoon"] for v in pairs)
        vl = statistics.median(v["vllm"] for v in pairs)
        lines.append(f"| {point} | {fig} | {hm:.1f} | {vl:.1f} | {statistics.median(ratios):.2f} "
                     f"[{', '.join(f'{x:.2f}' for x in ratios)}] |")  # fmt: skip
    c = results["cosine"]
    lines.append(f"\ncosine similarity of the two servers' vectors: min {c['min']:.6f}, "
                 f"median {c['median']:.6f}")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(parser, "embeddings_vs_vllm", kv_cache_mb=1024)  # (holds the batch's inputs)
    parser.add_argument("--inputs", type=int, default=64, help="inputs of the batch request")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per input")
    parser.add_argument("--singles", type=int, default=16, help="one-input requests timed")
    measure(parser.parse_args(), run, table)


if __name__ == "__main__":
    main()
