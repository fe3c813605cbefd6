"""Decoder linears plain (``F.linear``) against oneDNN-packed, in float32 and bfloat16.

What :mod:`halfmoon.engine.prepack` decides on: for a model's four decoder linear shapes
(q|k|v, o, gate|up, down) and its LM head, at 1, 8 and 32 rows, the time of one call
with the layers' weights streamed from memory as in a decode step (``--layers`` distinct
copies of each matrix, taken in turn). Variants take turns within each round (the order
rotates), and each round's packed / plain ratio is kept.

Usage::

    PYTHONPATH=. .venv/bin/python -m benchmarks.micro.linears [--model smollm2-135m-instruct]
        [--threads 2] [--rounds 5] [--json benchmarks/results/linears_bf16.json]

Prints, per dtype and row count, the median time of a layer's four linears and of the LM
head, plain and packed, and the median [min, max] of the per-round packed/plain ratios
(< 1: packing is faster).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from halfmoon.engine.catalog import resolve_model
from halfmoon.engine.config import ModelConfig
from halfmoon.engine.prepack import native_bf16

PACK = torch.ops.mkldnn._reorder_linear_weight
PACKED = torch.ops.mkldnn._linear_pointwise.default


def shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """``name -> (out, in)`` of the decoder's fused linears and the LM head."""
    h, d = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    return {
        "qkv": (qkv, h),
        "o": (h, config.num_heads * d),
        "gate_up": (2 * config.intermediate_size, h),
        "down": (h, config.intermediate_size),
        "lm_head": (config.vocab_size, h),
    }


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Mean microseconds of ``fn`` over ``calls`` calls (after 3 unmeasured ones)."""
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def variants(out: int, inp: int, rows: int, dtype: torch.dtype, copies: int):
    """``{"plain": fn, "packed": fn}``: one call each over ``copies`` weights in turn."""
    gen = torch.Generator().manual_seed(out * 7 + inp)
    plain = [(torch.randn(out, inp, generator=gen) * 0.02).to(dtype) for _ in range(copies)]
    packed = [PACK(w, 8) for w in plain]
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    torch.testing.assert_close(
        PACKED(x, packed[0], None, "none", [], "").float(), F.linear(x, plain[0]).float(),
        rtol=2e-2, atol=2e-2,
    )  # fmt: skip
    turn = {"plain": 0, "packed": 0}

    def run(name: str, weights: list) -> Callable[[], object]:
        def call() -> object:
            turn[name] = (turn[name] + 1) % copies
            w = weights[turn[name]]
            return F.linear(x, w) if name == "plain" else PACKED(x, w, None, "none", [], "")

        return call

    return {"plain": run("plain", plain), "packed": run("packed", packed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30, help="weight copies streamed")
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = ModelConfig.from_hf(
        json.loads((resolve_model(args.model) / "config.json").read_text())
    )
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{args.model}: {args.threads} threads, torch {torch.__version__}, "
          f"native bfloat16: {native_bf16()}")  # fmt: skip
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for rows in rows_list:
            cases = {}
            for name, (out, inp) in shapes(config).items():
                copies = 2 if name == "lm_head" else args.layers
                cases[name] = variants(out, inp, rows, dtype, copies)
            rounds = []
            for r in range(args.rounds):
                order = ["plain", "packed"] if r % 2 == 0 else ["packed", "plain"]
                got: dict[str, dict[str, float]] = {v: {} for v in order}
                for name, fns in cases.items():
                    calls = 20 if name == "lm_head" else 4 * args.layers
                    for v in order:
                        got[v][name] = per_call_us(fns[v], calls)
                rounds.append(got)
            row = {"dtype": dtype_name, "rows": rows, "rounds": rounds}
            for part, names in (
                ("layer", ["qkv", "o", "gate_up", "down"]),
                ("lm_head", ["lm_head"]),
            ):
                plain = [sum(g["plain"][n] for n in names) for g in rounds]
                packed = [sum(g["packed"][n] for n in names) for g in rounds]
                ratios = [p / q for p, q in zip(packed, plain, strict=True)]
                row[part] = {"plain_us": statistics.median(plain),
                             "packed_us": statistics.median(packed),
                             "ratio_median": statistics.median(ratios),
                             "ratio_min": min(ratios), "ratio_max": max(ratios)}  # fmt: skip
                print(f"{dtype_name:9s} rows {rows:3d} {part:8s} plain {row[part]['plain_us']:8.1f} us "
                      f"packed {row[part]['packed_us']:8.1f} us  packed/plain "
                      f"{row[part]['ratio_median']:.2f} [{min(ratios):.2f}, {max(ratios):.2f}]",
                      flush=True)  # fmt: skip
            results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "threads": args.threads, "torch": torch.__version__,
                       "machine": platform.machine(), "native_bf16": native_bf16(),
                       "rows": results}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
