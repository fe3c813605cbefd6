"""What sampling adds to a decode step: the engine's step time with the model's default
sampling (SmolLM2's generation config: temperature 0.2, top_p 0.9, what a served request
that leaves them out gets, as on vLLM), with temperature alone, and greedy.

Each round runs the three back to back (the order rotating) at each batch size, with
prompts of ``--context`` random tokens; a case's figure is the median step after the
first few (its prefill and warm-up excluded). Kept: every round's step times and the
ratio to greedy.

Run: ``PYTHONPATH=. .venv/bin/python -m benchmarks.micro.sampling_step --rounds 3``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from halfmoon.core.request import SamplingParams
from halfmoon.engine.catalog import resolve_model
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine

CASES = {
    "greedy": {"temperature": 0.0},
    "temperature 0.2": {"temperature": 0.2},
    "temperature 0.2, top_p 0.9": {"temperature": 0.2, "top_p": 0.9},
}
#: Steps left out of a case's median: its prefill and the first decode steps.
SKIP_STEPS = 3


def median_step_ms(engine: LLMEngine, batch: int, context: int, steps: int, options: dict,
                   tag: str, rng: random.Random) -> float:  # fmt: skip
    """One case: ``batch`` requests of ``context`` random tokens decoding ``steps``
    tokens each; the median step time in milliseconds."""
    params = SamplingParams(max_tokens=steps, ignore_eos=True, seed=1, **options)
    vocab = engine.model_config.vocab_size
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [rng.randrange(vocab) for _ in range(context)], params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[SKIP_STEPS:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sampling_step.json"))
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(EngineConfig(
        model=str(resolve_model(args.model, 0)), dtype="float32", kv_cache_mb=512,
        max_num_seqs=max(batches), num_threads=args.threads, enable_prefix_caching=False,
    ))  # fmt: skip
    rng = random.Random(0)
    names = list(CASES)
    rows = []
    for rnd in range(args.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for batch in batches:
            times = {name: median_step_ms(engine, batch, args.context, args.steps, CASES[name],
                                          f"r{rnd}-b{batch}-{name}", rng)
                     for name in order}  # fmt: skip
            row = {"round": rnd, "batch": batch, "step_ms": times,
                   "vs_greedy": {n: times[n] / times["greedy"] for n in names}}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"| batch | {' | '.join(names)} (ms, median of rounds) | sampled / greedy [rounds] |")
    print("|---:|" + "---:|" * len(names) + "---|")
    for batch in batches:
        mine = [r for r in rows if r["batch"] == batch]
        medians = [statistics.median(r["step_ms"][n] for r in mine) for n in names]
        ratios = sorted(r["vs_greedy"][names[-1]] for r in mine)
        print(f"| {batch} | " + " | ".join(f"{m:.1f}" for m in medians) + " | "
              + f"{statistics.median(ratios):.2f} [{', '.join(f'{x:.2f}' for x in ratios)}] |")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "context": args.context, "steps": args.steps,
            "threads": args.threads, "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
