"""Block hashing speed: chained xxh3_128 over a 128k-token prompt (16-token blocks).

Run: .venv/bin/python -m benchmarks.micro.hashing [--tokens N] [--repeats R]
Prints the median time per prompt and the throughput in tokens/s; the issue's target is
under 5 ms for 131,072 tokens at 16 tokens per block.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from halfmoon.core.hashing import hash_blocks


def main() -> None:
    """Time hash_blocks on random prompts and print a small table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'block':>6} {'tokens':>8} {'median ms':>10} {'p90 ms':>8} {'Mtok/s':>8}")
    for block_size in (16, 64, 512):
        tokens = rng.integers(0, 128_000, size=args.tokens, dtype=np.int64)
        hash_blocks(tokens, block_size)  # warm-up
        times_s = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            hash_blocks(tokens, block_size)
            times_s.append(time.perf_counter() - t0)
        med = statistics.median(times_s)
        p90 = sorted(times_s)[int(0.9 * (len(times_s) - 1))]
        print(
            f"{block_size:>6} {args.tokens:>8} {med * 1e3:>10.2f} {p90 * 1e3:>8.2f} "
            f"{args.tokens / med / 1e6:>8.1f}"
        )


if __name__ == "__main__":
    main()
