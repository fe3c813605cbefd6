"""The evaluation's workloads, written as Mooncake JSONL traces (512-token blocks).

Sized for the ``tiny`` model on this 2-core machine and written without length scaling,
so ``halfmoon bench --trace`` and ``halfmoon simulate --trace`` replay exactly the same
requests. Arrivals are a Poisson process at 1 request/s; ``--time-scale R`` replays a
trace at R requests/s.

- ``docqa``: long prompts with shared prefixes (L-Eval-like). Documents of
  ``doc_blocks`` full blocks, each asked ``questions_per_doc`` questions in random order;
  a question adds a partial block of 64-480 tokens, so prompts are 1600-2016 tokens (one
  engine chunk of 2048) and about 80% of prompt tokens can come from a prefix cache.
- ``docqa-unshared``: the same lengths and arrivals, every block id fresh: the cache-off
  case (``halfmoon serve`` has no switch to turn its prefix caches off).
- ``short``: short prompts without reuse, 128-480 tokens.

Every request asks for ``output_tokens`` tokens (32 by default: 31 gaps per request,
enough for a per-request TBT).

Run: .venv/bin/python -m benchmarks.eval.workloads --out out/eval [--num-requests 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path

import numpy as np

from halfmoon.core.request import Request
from halfmoon.workload.datasets import poisson_arrivals_s
from halfmoon.workload.trace import TRACE_BLOCK_SIZE_TOKENS, write_trace

BLOCK = TRACE_BLOCK_SIZE_TOKENS


def docqa(
    num_requests: int,
    seed: int = 0,
    doc_blocks: int = 3,
    questions_per_doc: int = 8,
    output_tokens: int = 32,
) -> list[Request]:
    """Questions about shared documents, interleaved, at 1 request/s."""
    rng = np.random.default_rng(seed)
    ids = itertools.count()
    num_docs = -(-num_requests // questions_per_doc)
    docs = [tuple(next(ids) for _ in range(doc_blocks)) for _ in range(num_docs)]
    order = rng.permutation(np.repeat(np.arange(num_docs), questions_per_doc))[:num_requests]
    questions = rng.integers(64, 481, size=num_requests)
    arrivals = poisson_arrivals_s(rng, 1.0, num_requests)
    return [
        Request(
            f"docqa-{i}",
            float(arrivals[i]),
            doc_blocks * BLOCK + int(questions[i]),
            output_tokens,
            docs[doc] + (next(ids),),
            BLOCK,
        )
        for i, doc in enumerate(order)
    ]


def unshared(requests: list[Request]) -> list[Request]:
    """The same requests with every block id fresh (nothing to reuse)."""
    ids = itertools.count()
    return [
        dataclasses.replace(
            r,
            request_id=r.request_id.replace("docqa", "unshared"),
            block_hashes=tuple(next(ids) for _ in r.block_hashes),
        )
        for r in requests
    ]


def short(num_requests: int, seed: int = 1, output_tokens: int = 32) -> list[Request]:
    """Short unique prompts at 1 request/s."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(128, 481, size=num_requests)
    arrivals = poisson_arrivals_s(rng, 1.0, num_requests)
    return [
        Request(f"short-{i}", float(arrivals[i]), int(n), output_tokens, (i,), BLOCK)
        for i, n in enumerate(lengths)
    ]


def write_all(out_dir: Path, num_requests: int) -> dict[str, Path]:
    """Write the three traces (``short`` has 1.5x ``num_requests``: its runs are short
    and need more requests to reach a steady state); returns name -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    long_requests = docqa(num_requests)
    traces = {
        "docqa": long_requests,
        "docqa-unshared": unshared(long_requests),
        "short": short(num_requests * 3 // 2),
    }
    paths = {}
    for name, requests in traces.items():
        paths[name] = out_dir / f"{name}.jsonl"
        write_trace(requests, paths[name])
    return paths


def main() -> None:
    """Write the traces and print their paths."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("out/eval"))
    parser.add_argument("--num-requests", type=int, default=64)
    args = parser.parse_args()
    for name, path in write_all(args.out, args.num_requests).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
