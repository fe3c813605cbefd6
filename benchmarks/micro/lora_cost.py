"""What LoRA adapters cost the engine, side by side with vLLM's CPU build.

Four random adapters in PEFT's format (rank ``--rank`` on all seven linears of each
layer, :func:`halfmoon.engine.lora.write_random_adapter`) for the real model, served by
both engines: halfmoon's ``--lora-modules`` and vLLM's ``enable_lora`` (``max_loras`` 4,
``max_lora_rank`` the rank; its peer process tuned as in :mod:`benchmarks.micro.engine_real`).
Each round times, for both engines in turn (the order alternating), whole ``generate``
calls of the same token-id prompts, greedy, ``ignore_eos``:

- ``decode``: ``--batch`` prompts of ~100 tokens, ``--tokens`` generated: the base model
  (``base``), every prompt on one adapter (``one``), and the batch split over the four
  adapters (``four``, a step of four adapters' rows);
- ``prefill``: one prompt of ``--prefill-tokens``, one token generated, base and one
  adapter.

A second vLLM peer without ``enable_lora`` runs the base cases too (``vllm-plain``): what
enabling LoRA costs vLLM's requests that use none (halfmoon's engine does no LoRA work
in a step without adapters, so its base is one figure).

Reported per round: each engine's time with adapters over its own base time (what LoRA
costs it), and vLLM's time over halfmoon's for each case; the first 16 greedy tokens of
every prompt are compared between the engines (the same adapter applied the same way
gives the same tokens, up to float rounding late in a sequence).

Usage::

    .venv/bin/python -m benchmarks.micro.lora_cost [--model smollm2-135m-instruct] \\
        [--rank 16] [--batch 8] [--tokens 32] [--rounds 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from halfmoon.core.request import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.lora import write_random_adapter

NAMES = ("a0", "a1", "a2", "a3")


def _cases(batch: int) -> dict[str, list[str | None]]:
    """Per decode case, each prompt's adapter."""
    return {
        "base": [None] * batch,
        "one": ["a0"] * batch,
        "four": [NAMES[i % len(NAMES)] for i in range(batch)],
    }


def main() -> None:
    """Run the benchmark and print (and optionally save) its figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--no-vllm", action="store_true", help="halfmoon alone")
    ap.add_argument("--json", help="write every round here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="halfmoon-lora-") as tmp:
        result = run(args, Path(tmp))
    summary = {k: v for k, v in result.items() if k != "rounds"}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


def run(args: argparse.Namespace, tmp: Path) -> dict:
    """Every round of both engines (or halfmoon's alone with ``--no-vllm``)."""
    from benchmarks.micro.engine_real import VllmPeer, resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    probe = LLMEngine(EngineConfig(model=model_dir, kv_cache_mb=16))
    adapters = {n: write_random_adapter(probe.model_config, tmp / n, rank=args.rank,
                                        alpha=2.0 * args.rank, seed=i, std=0.02)
                for i, n in enumerate(NAMES)}  # fmt: skip
    del probe
    engine = LLMEngine(EngineConfig(
        model=model_dir, num_threads=args.threads, enable_prefix_caching=False,
        lora_modules=tuple((n, str(p)) for n, p in adapters.items()),
    ))  # fmt: skip
    tok = engine.tokenizer
    decode_prompts = [tok.encode(f"Story {i}: " + "the sea and the sky and the wind " * 12)
                      for i in range(args.batch)]  # fmt: skip
    long = tok.encode("A long document. " * (args.prefill_tokens // 4))[: args.prefill_tokens]
    cases = {f"decode {k}": (decode_prompts, v, args.tokens) for k, v in _cases(args.batch).items()}
    cases["prefill base"] = ([long], [None], 1)
    cases["prefill one"] = ([long], ["a0"], 1)

    def ours(prompts, loras, tokens) -> tuple[float, list[list[int]]]:
        params = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, lora=lora)
                  for lora in loras]  # fmt: skip
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return time.perf_counter() - start, [list(o.token_ids[:16]) for o in outs]

    peers: dict[str, VllmPeer] = {}
    if not args.no_vllm:
        for name, modules in (("vllm", [f"{n}={p}" for n, p in adapters.items()]),
                              ("vllm-plain", [])):  # fmt: skip
            peer_args = SimpleNamespace(
                threads=args.threads, max_model_len=2304, batches=[args.batch],
                max_num_batched_tokens=2048, vllm_kv_gb=4, max_lora_rank=args.rank,
                lora_modules=modules,
            )  # fmt: skip
            peers[name] = VllmPeer(args.vllm_python, model_dir, peer_args,
                                   f"/tmp/halfmoon-lora-{name}.log")  # fmt: skip
    runners = {"halfmoon": ours}
    for name, peer in peers.items():
        runners[name] = lambda prompts, loras, tokens, peer=peer: peer.generate(
            prompts, tokens, False, None, None if not any(loras) else loras
        )

    def engines_of(case: str) -> list[str]:
        return [n for n in runners if n != "vllm-plain" or case.endswith("base")]

    try:
        for peer in peers.values():
            peer.wait_ready()
        for case, spec in cases.items():  # warm them all: kernels, adapters, allocators
            for name in engines_of(case):
                runners[name](*spec)
        rounds, agree = [], {}
        for r in range(args.rounds):
            row: dict[str, float] = {}
            for case, spec in cases.items():
                engines = engines_of(case)
                engines = engines[r % len(engines) :] + engines[: r % len(engines)]  # rotated
                ids = {}
                for name in engines:
                    row[f"{name} {case} s"], ids[name] = runners[name](*spec)
                for name in ids.keys() - {"halfmoon"}:
                    key = f"{case}: {name}"
                    agree[key] = agree.get(key, True) and ids["halfmoon"] == ids[name]
            for name in ("halfmoon", *(n for n in peers if n != "vllm-plain")):
                for kind, base in (("decode", "decode base"), ("prefill", "prefill base")):
                    for case in cases:
                        if case.startswith(kind) and case != base:
                            row[f"{name} {case} / base"] = (
                                row[f"{name} {case} s"] / row[f"{name} {base} s"]
                            )
            for name in peers:
                for case in cases:
                    if f"{name} {case} s" in row:
                        row[f"{name}/halfmoon {case}"] = (
                            row[f"{name} {case} s"] / row[f"halfmoon {case} s"]
                        )
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    finally:
        for peer in peers.values():
            peer.close()
    ratio_keys = [k for k in rounds[0] if not k.endswith(" s")]
    return {
        "model": args.model, "rank": args.rank, "batch": args.batch, "tokens": args.tokens,
        "prefill_tokens": len(long), "threads": args.threads,
        "vllm": {n: p.info for n, p in peers.items()}, "greedy_tokens_agree": agree,
        "median": {k: statistics.median(r[k] for r in rounds) for k in ratio_keys},
        "median_s": {k: statistics.median(r[k] for r in rounds) for k in rounds[0]
                     if k.endswith(" s")},
        "rounds": rounds,
    }  # fmt: skip


if __name__ == "__main__":
    main()
