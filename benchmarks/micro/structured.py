"""What structured outputs cost the engine: decode step time with every sequence of the
batch held to a grammar, against the same batch unconstrained, side by side.

Each round runs both variants in turn (the order alternating): ``batch`` requests with the
same prompts, ``ignore_eos`` and ``max_tokens`` (so both generate exactly as many tokens;
the grammar is an unbounded regex of words, ``(\\w+ )+``, which never ends a request
early), greedy; the decode steps are timed (the prefill step left out). Also the grammar's
own costs per token, outside a step: the mask of a JSON schema's matcher
(:meth:`Constraint.allowed`) and following the drawn token, over a real JSON answer.
Every round's ratio is printed; the median in bold in the docs.

With ``--vllm``, vLLM's CPU build (``.venv-vllm``, tuned as in
:mod:`benchmarks.micro.engine_real`: its peer process) runs the same token-id prompts
in the same rounds, plain and held to the same regex by its own structured outputs
(its default backend), and both engines are timed over whole ``generate`` calls
(prefill + decode): each engine's held / plain ratio, per round, and the greedy tokens
compared between the engines.

Usage::

    .venv/bin/python -m benchmarks.micro.structured --model smollm2-135m-instruct \\
        [--batch 8] [--tokens 48] [--rounds 5] [--vllm] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from halfmoon.core.request import SamplingParams, StructuredOutput
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine

WORDS = StructuredOutput("regex", r"(\w+ )+")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
}
ANSWER = '{"name": "Ann Lee", "age": 31, "tags": ["painter", "runner", "reader"]}'


def _decode_steps(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> float:
    """Mean seconds per decode step of one batch run to its end."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # the prefill (and the first token)
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - start) / max(steps, 1)


def main() -> None:
    """Run the benchmark and print (and optionally save) its figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--vllm", action="store_true", help="vLLM side by side (whole generates)")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    args = ap.parse_args()
    if args.vllm:
        result = side_by_side(args)
        print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=1)
        return

    engine = LLMEngine(EngineConfig(model=args.model, num_threads=args.threads))
    prompts = [f"Write {i + 3} words about the sea:" for i in range(args.batch)]
    plain = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    held = SamplingParams(
        max_tokens=args.tokens, temperature=0.0, ignore_eos=True, structured=WORDS
    )
    _decode_steps(engine, prompts, held)  # warm: the grammar tokenizer, the kernels
    rounds = []
    for r in range(args.rounds):
        order = [("plain", plain), ("held", held)]
        times = dict(
            (name, _decode_steps(engine, prompts, p)) for name, p in order[:: 1 - 2 * (r % 2)]
        )
        rounds.append({**times, "ratio": times["held"] / times["plain"]})
        print(f"round {r}: plain {times['plain'] * 1e3:.2f} ms/step, held "
              f"{times['held'] * 1e3:.2f} ms/step, ratio {rounds[-1]['ratio']:.3f}")  # fmt: skip

    # The grammar alone, per token of a real JSON answer.
    tokens = engine.tokenizer.encode(ANSWER, add_special_tokens=False)
    schema = StructuredOutput("json", json.dumps(SCHEMA))
    mask_s, follow_s = [], []
    for _ in range(20):
        constraint = engine.new_constraint(SamplingParams(structured=schema))
        for token in tokens:
            t0 = time.perf_counter()
            allowed = constraint.allowed()
            t1 = time.perf_counter()
            assert allowed[token], "the answer must follow the schema"
            constraint.finish_after(token)
            mask_s.append(t1 - t0)
            follow_s.append(time.perf_counter() - t1)
    result = {
        "model": args.model,
        "batch": args.batch,
        "tokens": args.tokens,
        "rounds": rounds,
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "json_mask_us_p50": statistics.median(mask_s) * 1e6,
        "json_mask_us_p99": sorted(mask_s)[int(0.99 * len(mask_s))] * 1e6,
        "json_follow_us_p50": statistics.median(follow_s) * 1e6,
        "answer_tokens": len(tokens),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


def side_by_side(args: argparse.Namespace) -> dict:
    """Both engines, whole generates of the same token-id prompts, plain and held."""
    from types import SimpleNamespace

    from benchmarks.micro.engine_real import VllmPeer, resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    engine = LLMEngine(EngineConfig(model=model_dir, num_threads=args.threads,
                                    enable_prefix_caching=False))  # fmt: skip
    prompts = [engine.tokenizer.encode(f"Write {i + 3} words about the sea:") for i in
               range(args.batch)]  # fmt: skip
    peer_args = SimpleNamespace(threads=args.threads, max_model_len=2304, batches=[args.batch],
                                max_num_batched_tokens=2048, vllm_kv_gb=4)  # fmt: skip
    peer = VllmPeer(args.vllm_python, model_dir, peer_args, "/tmp/halfmoon-structured-vllm.log")
    regex = WORDS.spec

    def ours(held: bool) -> tuple[float, list[list[int]]]:
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True,
                                structured=WORDS if held else None)  # fmt: skip
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        return time.perf_counter() - start, [list(o.token_ids[:16]) for o in outs]

    try:
        peer.wait_ready()
        ours(True), peer.generate(prompts, args.tokens, False, regex)  # warm both
        rounds, agree = [], True
        for r in range(args.rounds):
            row = {}
            for held in (r % 2 == 0, r % 2 != 0):  # the order alternating
                name = "held" if held else "plain"
                row[f"halfmoon_{name}_s"], hm_ids = ours(held)
                row[f"vllm_{name}_s"], vl_ids = peer.generate(
                    prompts, args.tokens, False, regex if held else None
                )
                agree = agree and hm_ids == vl_ids
            row["halfmoon_ratio"] = row["halfmoon_held_s"] / row["halfmoon_plain_s"]
            row["vllm_ratio"] = row["vllm_held_s"] / row["vllm_plain_s"]
            row["held_vllm_over_halfmoon"] = row["vllm_held_s"] / row["halfmoon_held_s"]
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
    finally:
        peer.close()
    return {
        "model": args.model, "batch": args.batch, "tokens": args.tokens, "regex": regex,
        "rounds": rounds, "greedy_tokens_agree": agree,
        **{f"median_{k}": statistics.median(r[k] for r in rounds)
           for k in ("halfmoon_ratio", "vllm_ratio", "held_vllm_over_halfmoon")},
    }  # fmt: skip


if __name__ == "__main__":
    main()
