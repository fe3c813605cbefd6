"""Prefill attention alone: halfmoon's call of torch's SDPA against vLLM's CPU kernel.

#20's prefill goal (>= 0.95x vLLM's prefill throughput) holds on AVX2 hosts and not on
the AVX-512 / AMX ones (SmolLM2 at 2,048 tokens 0.85x in session 43's run); that run
reasoned the gap is attention, as the linears run at the host's peak either way. This
measures it directly: one causal prefill of ``--tokens`` tokens of a model's attention
shape (query / KV heads, head size), in float32,

- ``halfmoon``: :func:`halfmoon.engine.attention.prefill_attention` as the engine calls
  it (q, k, v views of one fused q|k|v projection; SDPA's flash kernel, GQA inside it);
- ``vllm``: vLLM's ``cpu_attention_with_kv_cache`` (the kernel its CPU attention
  backend calls for prefill and decode alike, hand-written per ISA), the prompt's K/V
  first written into its paged cache by its own ``cpu_attn_reshape_and_cache``
  (untimed), its scheduler metadata built as its backend builds it;

both in one process (so it must run where vLLM is installed: the vLLM virtual
environment has the same torch), on the same inputs, taking turns each round; the
outputs are checked against each other. Per round the ratio halfmoon / vLLM time is
kept (> 1: vLLM's kernel is faster).

Usage::

    PYTHONPATH=. OMP_NUM_THREADS=2 .venv-vllm/bin/python -m benchmarks.micro.prefill_attention \\
        [--model smollm2-135m-instruct] [--tokens 1024,2048,4096] [--rounds 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.attention import PrefillSegment, prefill_attention
from halfmoon.engine.catalog import cache_dir, resolve_model
from halfmoon.engine.config import ModelConfig


def _vllm_kernel(q, k, v, block_size: int):
    """vLLM's CPU attention over a paged cache holding ``k``/``v``: a no-argument call."""
    import vllm._custom_ops as ops  # noqa: PLC0415 - only where vLLM is installed

    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    num_blocks = -(-n // block_size)
    isa = "vec" if block_size % 32 == 0 else "vec16"
    cache = torch.zeros(num_blocks, num_kv_heads, 2 * block_size, head_dim, dtype=q.dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache,
                                   torch.arange(n, dtype=torch.int64), isa)  # fmt: skip
    starts = torch.tensor([0, n], dtype=torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    meta = ops.cpu_attn_get_scheduler_metadata(1, num_heads, num_kv_heads, head_dim, lens,
                                               q.dtype, starts, True, -1, isa, False)  # fmt: skip
    out = torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim)

    def run() -> torch.Tensor:
        ops.cpu_attention_with_kv_cache(q, key_cache, value_cache, out, starts, lens, scale,
                                        True, None, -1, table, 0.0, meta, None)  # fmt: skip
        return out

    return run


def _halfmoon(q, k, v):
    """The engine's prefill attention of a whole prompt (no cached context)."""
    n, num_heads, head_dim = q.shape
    seg = PrefillSegment("r", 0, 0, n, torch.empty(0, dtype=torch.long), [], False)
    scale = 1.0 / math.sqrt(head_dim)
    return lambda: prefill_attention(q, k, v, None, None, seg, None, scale)  # type: ignore[arg-type]


def measure(config: ModelConfig, tokens: int, rounds: int, block_size: int) -> dict:
    """One prompt length: per-round times of both, and their ratios."""
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    gen = torch.Generator().manual_seed(tokens)
    # one fused projection's output, as the engine's q|k|v linear leaves it
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    runs = {"halfmoon": _halfmoon(q, k, v), "vllm": _vllm_kernel(q, k, v, block_size)}
    ours = runs["halfmoon"]().view(tokens, heads, head_dim)
    theirs = runs["vllm"]()
    max_diff = float((ours - theirs).abs().max())
    assert max_diff < 1e-4, f"the two kernels disagree by {max_diff}"
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    ratios = [h / v for h, v in zip(times["halfmoon"], times["vllm"], strict=True)]
    flops = 4 * heads * head_dim * tokens * (tokens + 1) / 2  # causal QK^T and PV
    return {
        "tokens": tokens,
        "max_abs_diff": max_diff,
        "ms": {name: [round(t * 1e3, 3) for t in ts] for name, ts in times.items()},
        "median_ms": {name: round(statistics.median(ts) * 1e3, 2) for name, ts in times.items()},
        "gflops": {
            name: round(flops / statistics.median(ts) / 1e9, 1) for name, ts in times.items()
        },  # fmt: skip
        "halfmoon_over_vllm": [round(x, 3) for x in ratios],
    }


def _model_dir(model: str) -> Path:
    """The model's directory: as halfmoon resolves it, or (the vLLM environment lacks
    the package a named model ships in) where halfmoon's own run imported it."""
    try:
        return resolve_model(model)
    except HalfmoonError:
        cached = cache_dir() / "models" / model
        if (cached / "config.json").is_file():
            return cached
        raise


def main() -> None:
    """Run the comparison and print one line per prompt length."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", default="1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=128, help="vLLM's cache blocks")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = ModelConfig.from_hf(json.loads((_model_dir(args.model) / "config.json").read_text()))
    print(f"{args.model}: {config.num_heads} query / {config.num_kv_heads} KV heads of "
          f"{config.head_dim}; float32, {args.threads} threads, {args.rounds} rounds")  # fmt: skip
    results = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        res = measure(config, tokens, args.rounds, args.block_size)
        results.append(res)
        r = res["halfmoon_over_vllm"]
        print(f"{tokens:6d} tokens: halfmoon {res['median_ms']['halfmoon']:7.1f} ms "
              f"({res['gflops']['halfmoon']} GFLOP/s)  vLLM {res['median_ms']['vllm']:7.1f} ms "
              f"({res['gflops']['vllm']} GFLOP/s)  halfmoon/vLLM {statistics.median(r):.2f} "
              f"[{min(r):.2f}, {max(r):.2f}]")  # fmt: skip
    if args.json:
        doc = {"model": args.model, "threads": args.threads, "rounds": args.rounds,
               "machine": platform.processor() or platform.machine(),
               "torch": torch.__version__, "results": results}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
