"""The compiled paged decode-attention kernel in a step's conditions, against a plain read.

Timed alone, one layer's K and V (3 MB at SmolLM2's batch 1 x 2,048) sit in this host's
32 MB L3 after the first call, which flatters the kernel. In a real step every layer's
KV comes from memory, after the layer's linears have streamed ~18 MB of weights through
the caches. This benchmark rebuilds that: a pool of ``--layers`` layers (the engine's
``[L, 2, N, B, H_kv, D]`` layout), and before each layer's kernel call a read of 18 MB of
other memory (the "linears"); it sums the kernel's time over the layers, per step.

Three readings per (batch, context), the variants taking turns each round:

- ``cold``: the kernel as a step sees it (each sequence's blocks in pool order, as the
  allocator hands out runs);
- ``hot``: the same call with every table entry pointing at one block, so that K and V
  come from L1: the kernel's arithmetic without its memory traffic;
- ``stream``: ``sum()`` over the same K and V bytes, in place: the memory's ceiling for
  reading them once.

cold - hot is what the kernel's memory access costs beyond its arithmetic; cold /
stream how far it is from reading its bytes at the memory's speed.

Usage::

    .venv/bin/python -m benchmarks.micro.decode_kernel_cold [--shape 3x3x64] \\
        [--batches 1,8,32] [--contexts 512,2048] [--rounds 3] [--dtype float32|bfloat16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from halfmoon.engine.kernels import KernelShape, load_decode_kernel

#: Bytes each layer's "linears" read between kernel calls (SmolLM2: ~538 MB / 30 layers).
LINEAR_BYTES = 18 * 2**20


def step_ms(
    kernel, pool, evict, group: int, batch: int, context: int, variant: str, steps: int
) -> float:
    """Median over ``steps`` of the summed per-layer time of one variant, in ms."""
    layers, _, num_blocks, block_size, heads, dim = pool.shape
    blocks = -(-(context + 1) // block_size)
    if batch * blocks + 1 > num_blocks:
        raise SystemExit(f"the pool holds {num_blocks} blocks, {batch * blocks} needed")
    tables = torch.arange(batch * blocks).view(batch, blocks) + 1
    if variant == "hot":
        tables = torch.ones_like(tables)
    lens = torch.full((batch,), context + 1)
    q = torch.randn(batch, heads, group, dim).to(pool.dtype)
    scale = torch.tensor(dim**-0.5)
    used = batch * blocks
    times = []
    for _ in range(steps):
        total = 0
        for layer in range(layers):
            evict[layer].sum()
            keys, values = pool[layer, 0], pool[layer, 1]
            start = time.perf_counter_ns()
            if variant == "stream":
                keys[1 : 1 + used].sum() + values[1 : 1 + used].sum()
            else:
                kernel(q, keys, values, tables, lens, scale)
            total += time.perf_counter_ns() - start
        times.append(total / 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, dict[str, list[float]]]:
    """Run the comparison, print one table (and optionally write JSON); every round's
    milliseconds per case and variant."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="3x3x64", help="KV heads x group x head size")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per reading (median)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--json", help="write every round here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    heads, group, dim = (int(x) for x in args.shape.split("x"))
    dtype = getattr(torch, args.dtype)
    kernel = load_decode_kernel(KernelShape(heads, group, dim, 16, dtype, "cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    need = max(batches) * (-(-(max(contexts) + 1) // 16)) + 2
    pool = torch.randn(args.layers, 2, need, 16, heads, dim).to(dtype)
    evict = [torch.randn(LINEAR_BYTES // 4) for _ in range(args.layers)]
    variants = ["cold", "hot", "stream"]
    rounds: dict[str, dict[str, list[float]]] = {}
    for r in range(args.rounds):
        for batch in batches:
            for context in contexts:
                case = rounds.setdefault(f"b{batch}x{context}", {v: [] for v in variants})
                order = variants[r % 3 :] + variants[: r % 3]
                for variant in order:
                    case[variant].append(
                        step_ms(kernel, pool, evict, group, batch, context, variant, args.steps)
                    )
    print(f"shape {args.shape}, {args.dtype}, {args.layers} layers, {args.threads} threads; "
          "ms per step")  # fmt: skip
    print("case          cold    hot  stream  cold/hot  cold/stream (rounds)")
    for name, case in rounds.items():
        med = {v: statistics.median(case[v]) for v in variants}
        per_round = ", ".join(
            f"{c / s:.2f}" for c, s in zip(case["cold"], case["stream"], strict=True)
        )
        print(
            f"{name:<12} {med['cold']:6.2f} {med['hot']:6.2f} {med['stream']:7.2f}"
            f"  {med['cold'] / med['hot']:8.2f}  {med['cold'] / med['stream']:.2f} ({per_round})"
        )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "rounds_ms": rounds}, fh, indent=1)
    return rounds


if __name__ == "__main__":
    main()
