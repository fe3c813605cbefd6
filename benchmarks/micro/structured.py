"""What structured outputs cost the engine: decode step time with every sequence of the
batch held to a grammar, against the same batch unconstrained, side by side.

Each round runs both variants in turn (the order alternating): ``batch`` requests with the
same prompts, ``ignore_eos`` and ``max_tokens`` (so both generate exactly as many tokens;
the grammar is an unbounded regex of words, ``(\\w+ )+``, which never ends a request
early), greedy; the decode steps are timed (the prefill step left out). Also the grammar's
own costs per token, outside a step: the mask of a JSON schema's matcher
(:meth:`Constraint.allowed`) and following the drawn token, over a real JSON answer.
Every round's ratio is printed; the median in bold in the docs.

Usage::

    .venv/bin/python -m benchmarks.micro.structured --model smollm2-135m-instruct \\
        [--batch 8] [--tokens 48] [--rounds 5] [--json OUT]
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
    args = ap.parse_args()

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


if __name__ == "__main__":
    main()
