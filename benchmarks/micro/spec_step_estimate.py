"""How well a decode worker estimates its steps when it speculates.

The decode TBT guard and the Conductor estimate a decode step from the worker's cost
profile, which times one-token steps. A speculating engine (``--speculative-config``)
also runs each sequence's drafts as rows, so its steps are longer than the profile says
for the same batch; :class:`~halfmoon.costmodel.speculation.SpeculationRates` maps a
step of ``b`` sequences checking ``r - 1`` drafts each to the profile's step of ``b * r``
rows over ``r`` times the context. This script measures the engine's steps and sets
three estimates against each:

- ``blind``: the profile's step for the batch, as before speculation was modelled;
- ``recent``: the mapping with the rates of the engine's recent steps (what the worker's
  guard and its load reports use: :class:`RecentSpeculation` over its counters);
- ``exact``: the mapping with the step's own rows (checks the mapping itself).

and, for reference, the profile's estimate of the same requests' steps without
speculation (``plain``: the engine with its speculation suspended). The model is the real
one (SmolLM2 fp32, two threads), the profile measured in the run; the requests are the
chat prompts of :mod:`benchmarks.micro.spec_decode` (``edit``: answers that copy their
prompt, where drafts are long and right; ``open``: free writing), greedy, at batch 1
(one after another) and 8. Only decode steps count (a step that computes a prompt is
left out). Per case and round: the median of estimate / measured over its steps, and the
share of steps the estimate undershoots by more than 10% (a guard admitting on such an
estimate lets the step overrun the TBT SLO).

Usage::

    .venv/bin/python -m benchmarks.micro.spec_step_estimate [--rounds 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.micro.spec_decode import EDIT, OPEN
from halfmoon.core.request import SamplingParams
from halfmoon.core.speculative import parse_speculative_config
from halfmoon.costmodel.speculation import RecentSpeculation, SpeculationRates
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.profiler import measure_profile


def _totals(engine: LLMEngine) -> tuple[int, int, int]:
    spec = engine.stats().spec_decode
    assert spec is not None
    return spec.num_sequence_steps, spec.num_draft_tokens, spec.num_accepted_tokens


def run_batches(engine, batches, params, speculate: bool, windows) -> list[dict]:
    """Each decode step of running ``batches`` (lists of prompts run together, one batch
    after another): its batch, context, measured seconds, rows and tokens, and the
    recent rates before it over each of ``windows`` (sequence-steps)."""
    steps: list[dict] = []
    recent = {w: RecentSpeculation(w) for w in windows}
    for n, prompts in enumerate(batches):
        ctx: dict[str, int] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{n}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            before = _totals(engine)
            for tracker in recent.values():
                tracker.update(*before)
            rates = {w: [t.rates.rows_per_seq, t.rates.tokens_per_step]
                     for w, t in recent.items()}  # fmt: skip
            running = dict(ctx)
            start = time.perf_counter()
            outs = engine.step()
            elapsed = time.perf_counter() - start
            after = _totals(engine)
            decoding = all(o.request_id in running for o in outs) and outs
            for o in outs:
                ctx[o.request_id] = o.num_prompt_tokens + len(o.token_ids)
                if o.finished:
                    del ctx[o.request_id]
            if not decoding:
                continue
            batch = len(outs)
            steps.append({
                "batch": batch, "context": sum(running[o.request_id] for o in outs),
                "seconds": elapsed, "rows": batch + after[1] - before[1],
                "tokens": sum(len(o.new_token_ids) for o in outs),
                "recent": rates,
                "speculating": speculate,
            })  # fmt: skip
    return steps


def estimates(profile, step: dict) -> dict[str, float]:
    """The step's estimates (seconds) from ``profile``."""
    b, c = step["batch"], step["context"]
    fit = profile.decode_step_s
    rows = step["rows"] / b
    exact = SpeculationRates(rows, min(rows, step["tokens"] / b))
    out = {"blind": fit(b, c), "exact": exact.step_s(fit, b, c)}
    for w, rates in step["recent"].items():
        out[f"recent {w}"] = SpeculationRates(*rates).step_s(fit, b, c)
    return out


def summarize(profile, steps: list[dict]) -> dict:
    """Median estimate / measured and the share undershooting by >10%, per estimate."""
    out: dict = {"steps": len(steps), "measured_ms": statistics.median(
        s["seconds"] for s in steps) * 1e3}  # fmt: skip
    if steps and steps[0]["speculating"]:
        out["rows_per_seq"] = sum(s["rows"] for s in steps) / sum(s["batch"] for s in steps)
        out["tokens_per_step"] = sum(s["tokens"] for s in steps) / sum(s["batch"] for s in steps)
    names = list(estimates(profile, steps[0])) if steps[0]["speculating"] else ["blind"]
    for name in names:
        ratios = [estimates(profile, s)[name] / s["seconds"] for s in steps]
        out[name] = {"median_ratio": round(statistics.median(ratios), 3),
                     "under_10pct": round(sum(r < 0.9 for r in ratios) / len(ratios), 3)}  # fmt: skip
    return out


def main() -> None:
    """Run the benchmark and print (and optionally save) its figures."""
    from benchmarks.micro.engine_real import resolve_model_dir

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--tokens", type=int, default=160, help="max_tokens of each request")
    ap.add_argument("--b1-prompts", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--windows", default="64,256",
                    help="RecentSpeculation windows (sequence-steps) to compare")  # fmt: skip
    ap.add_argument("--json", help="write every round here")
    args = ap.parse_args()
    spec = parse_speculative_config(json.dumps({
        "method": "ngram", "num_speculative_tokens": args.k,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2,
    }))  # fmt: skip
    engine = LLMEngine(EngineConfig(model=resolve_model_dir(args.model), num_threads=args.threads,
                                    enable_prefix_caching=False, speculative=spec))  # fmt: skip
    tok = engine.tokenizer

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}])

    started = time.perf_counter()
    profile = measure_profile(engine, args.model, say=lambda line: None)
    print(f"profile measured in {time.perf_counter() - started:.0f}s")
    cases = {
        "edit b1": [[chat(t)] for t in EDIT[: args.b1_prompts]],
        "edit b8": [[chat(t) for t in EDIT]],
        "open b8": [[chat(t) for t in OPEN]],
    }
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    windows = [int(w) for w in args.windows.split(",")]
    rounds = []
    for r in range(args.rounds):
        for case, batches in cases.items():
            spec_steps = run_batches(engine, batches, params, True, windows)
            with engine.speculation_suspended():
                plain_steps = run_batches(engine, batches, params, False, windows)
            row = {"round": r, "case": case, "speculating": summarize(profile, spec_steps),
                   "plain": summarize(profile, plain_steps)}  # fmt: skip
            print(json.dumps(row))
            rounds.append(row)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "profile": profile.to_dict(), "rounds": rounds},
                      fh, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
