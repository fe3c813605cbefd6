"""Peak memory of halfmoon's engine, fast path against the reference path, same pool.

Each configuration runs in a fresh process (so peaks do not mix): load the model, make
the KV pool, prefill one prompt, import a batch of sequences with random KV and decode a
few steps at that batch, then report the process's peak resident set (``ru_maxrss``)
and the resident set after loading. The two paths:

- ``reference``: gather + SDPA decode attention, the linear layers packed as before the
  engine-speed work (``EngineConfig(attention="reference", prepack_lm_head=False)``);
- ``fast``: the defaults (compiled paged decode attention, packed LM head).

Usage::

    .venv/bin/python -m benchmarks.micro.engine_memory --model smollm2-135m-instruct \\
        [--batch 32] [--context 2048] [--kv-cache-mb 3300] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

CONFIGS = {
    "reference": {"attention": "reference", "prepack_lm_head": False},
    "fast": {"attention": "auto", "prepack_lm_head": True},
}


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(args: argparse.Namespace) -> None:
    """Run one configuration and print one JSON line."""
    import torch

    from benchmarks.micro.engine_real import greedy, random_prompts
    from halfmoon.engine.config import EngineConfig
    from halfmoon.engine.engine import KVHandoff, LLMEngine

    engine = LLMEngine(
        EngineConfig(
            model=args.model, kv_cache_mb=args.kv_cache_mb, max_num_seqs=args.batch,
            max_num_batched_tokens=max(2048, args.prefill), max_model_len=args.context + 64,
            enable_prefix_caching=False, num_threads=args.threads, **CONFIGS[args.config],
        )
    )  # fmt: skip
    loaded = _rss_mib()
    vocab = engine.model_config.vocab_size
    engine.generate(random_prompts(vocab, 1, args.prefill, seed=1), greedy(1))
    layout = engine.kv_layout
    computed = args.context - 1
    data = torch.randn(layout.buffer_shape(-(-computed // layout.block_size)))
    for i, prompt in enumerate(random_prompts(vocab, args.batch, args.context, seed=2)):
        handoff = KVHandoff(
            request_id=f"d{i}", token_ids=tuple(prompt), num_prompt_tokens=len(prompt),
            num_computed_tokens=computed, seed=0, layout=layout, data=data,
        )  # fmt: skip
        engine.import_request(handoff, greedy(args.steps), f"d{i}")
    while engine.has_unfinished_requests():
        engine.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "config": args.config, "attention": engine.attention_backend,
        "rss_after_load_mib": round(loaded, 1), "peak_rss_mib": round(peak, 1),
        "pool_mib": round(engine.kv_cache.pool.numel() * engine.kv_cache.pool.element_size() / 2**20, 1),
    }))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--kv-cache-mb", type=float, default=3300.0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--config", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.config:
        child(args)
        return
    results = []
    for name in CONFIGS:
        argv = [sys.executable, "-m", "benchmarks.micro.engine_memory", *sys.argv[1:]]
        argv = [a for a in argv if not a.startswith("--json")] + ["--config", name]
        if args.json:
            argv = [a for a in argv if a != args.json]
        out = subprocess.run(argv, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise SystemExit(f"{name} failed:\n{out.stderr[-2000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]))
    ratio = results[1]["peak_rss_mib"] / results[0]["peak_rss_mib"]
    print(f"peak RSS fast / reference: {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "config"},
                       "results": results, "peak_ratio": ratio}, fh, indent=1)  # fmt: skip
            fh.write("\n")


if __name__ == "__main__":
    main()
