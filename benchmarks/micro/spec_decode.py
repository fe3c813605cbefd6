"""Prompt-lookup speculative decoding, side by side with vLLM's CPU build.

Both engines run the real model with and without the same ``--speculative-config``
(``ngram``; vLLM's own proposer and rejection sampler, its peer process tuned as in
:mod:`benchmarks.micro.engine_real`, two threads each). The prompts are chat requests
of two kinds, greedy, each ending at its end-of-sequence token or ``--tokens``:

- ``edit``: rewrite a given text or code with a small change (what prompt lookup is for:
  the answer copies long runs of the prompt);
- ``open``: free writing (drafts are rarely right: what speculating costs when it does
  not pay);
- ``json``: extract a person's details from a sentence as JSON held to a regex by each
  engine's structured outputs (halfmoon drafts what the grammar forces, else n-grams it
  admits; vLLM its n-grams, checked under its grammar).

Each kind runs as ``b1`` (the prompts one after another, batch 1: decode is bound by
reading the weights, so a checked draft costs little) and ``b8`` (all together). Each
round times whole ``generate`` calls of all four engines in turn (the order rotating
between rounds) and reports output tokens per second, each engine's speed-up from
speculation (ngram over its own base), and vLLM's time over halfmoon's. Tokens are
compared: an engine with and without drafts must give the same tokens (both engines'
speculation is exact for greedy decoding), and halfmoon's against vLLM's (the share of
prompts whose answers are identical). Acceptance: drafts checked and accepted from
halfmoon's engine counters and from vLLM's own (``LLM.get_metrics``).

Usage::

    .venv/bin/python -m benchmarks.micro.spec_decode [--model smollm2-135m-instruct] \\
        [--k 4] [--lookup-max 4] [--lookup-min 2] [--tokens 160] [--rounds 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from types import SimpleNamespace

from halfmoon.core.request import SamplingParams, StructuredOutput
from halfmoon.core.speculative import parse_speculative_config
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine

CODE = """def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for value in values:
        total = total + (value - m) ** 2
    return total / len(values)
"""
PARAGRAPH = (
    "The old lighthouse stood at the edge of the cliff for more than a hundred years. "
    "Every night its lamp turned slowly, sending a beam of light across the dark water, "
    "and every morning the keeper climbed the narrow stairs to clean the glass. Ships "
    "passing in the night knew the rocks were near when they saw the light, and sailors "
    "told stories about the keeper who never missed a single night."
)
EDIT = [
    f"Rename the function mean to average everywhere in this code and write out the "
    f"whole code:\n\n{CODE}",
    f"Add a docstring to each function in this code and write out the whole code:\n\n{CODE}",
    f"Rewrite this paragraph in the present tense, changing nothing else:\n\n{PARAGRAPH}",
    f"Copy this paragraph exactly, then add one sentence at the end:\n\n{PARAGRAPH}",
    "Fix the spelling mistakes in this text and write it out in full:\n\n"
    + PARAGRAPH.replace("lighthouse", "lighthuose").replace("every", "evry"),
    "Convert this list to a numbered list, one item a line: apples, bananas, cherries, "
    "dates, elderberries, figs, grapes, honeydew melons, kiwis, lemons, mangoes",
    f"Write this code again with the variable total renamed to acc:\n\n{CODE}",
    f"Repeat this paragraph word for word:\n\n{PARAGRAPH}",
]
PEOPLE = [
    "Maria Lopez is 34 years old and lives in Valencia, where she teaches music.",
    "The report was written by Tom Becker, 51, an engineer from Hamburg.",
    "Yuki Tanaka (age 27) moved to Osaka last spring to open a bakery.",
    "Our new colleague, Ahmed Farouk, is 45 and commutes from Alexandria every day.",
]
#: ``json`` cases: the answer held to this regex by each engine's structured outputs.
JSON_REGEX = (
    r'\{"name": "[A-Za-z ]{1,30}", "age": [0-9]{1,3}, "city": "[A-Za-z ]{1,30}", '
    r'"summary": "[A-Za-z ,.]{1,80}"\}'
)
JSON = [
    f"Extract the person's name, age and city from this text, with a one-line summary, "
    f'as JSON {{"name": ..., "age": ..., "city": ..., "summary": ...}}:\n\n{text}'
    for text in PEOPLE
]
OPEN = [
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue to a ten-year-old.",
    "What are three good habits for staying healthy? Explain each.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about your summer holiday.",
    "Why do cats purr? Give a few possible reasons.",
    "Invent a new board game and explain its rules.",
    "Describe how bread is made, step by step.",
]


def main() -> None:
    """Run the benchmark and print (and optionally save) its figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=160, help="max_tokens of each request")
    ap.add_argument("--b1-prompts", type=int, default=4, help="prompts of each b1 case")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--no-vllm", action="store_true", help="halfmoon alone")
    ap.add_argument("--cases", help="only these cases, comma-separated (e.g. 'json b1')")
    ap.add_argument("--json", help="write every round here")
    args = ap.parse_args()
    result = run(args)
    summary = {k: v for k, v in result.items() if k != "rounds"}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


def run(args: argparse.Namespace) -> dict:
    """Every round of the four engines (halfmoon's two alone with ``--no-vllm``)."""
    from benchmarks.micro.engine_real import VllmPeer, resolve_model_dir

    spec_json = json.dumps({"method": "ngram", "num_speculative_tokens": args.k,
                            "prompt_lookup_max": args.lookup_max,
                            "prompt_lookup_min": args.lookup_min})  # fmt: skip
    spec = parse_speculative_config(spec_json)
    model_dir = resolve_model_dir(args.model)
    engines = {
        name: LLMEngine(EngineConfig(model=model_dir, num_threads=args.threads,
                                     enable_prefix_caching=False, speculative=s))
        for name, s in (("halfmoon", None), ("halfmoon-ngram", spec))
    }  # fmt: skip
    tok = engines["halfmoon"].tokenizer

    def chat(text: str) -> list[int]:
        return tok.apply_chat_template([{"role": "user", "content": text}])

    cases = {
        "edit b1": [chat(t) for t in EDIT[: args.b1_prompts]],
        "open b1": [chat(t) for t in OPEN[: args.b1_prompts]],
        "json b1": [chat(t) for t in JSON[: args.b1_prompts]],
        "edit b8": [chat(t) for t in EDIT],
        "open b8": [chat(t) for t in OPEN],
    }
    if args.cases:
        cases = {k: v for k, v in cases.items() if k in args.cases.split(",")}

    def ours(engine: LLMEngine, case: str) -> tuple[float, list[list[int]]]:
        held = StructuredOutput("regex", JSON_REGEX) if case.startswith("json") else None
        params = SamplingParams(max_tokens=args.tokens, temperature=0.0, structured=held)
        prompts = cases[case]
        start = time.perf_counter()
        if case.endswith("b1"):
            outs = [engine.generate([p], params)[0] for p in prompts]
        else:
            outs = engine.generate(prompts, params)
        return time.perf_counter() - start, [list(o.token_ids) for o in outs]

    runners = {name: (lambda case, e=e: ours(e, case)) for name, e in engines.items()}
    peers: dict[str, VllmPeer] = {}
    if not args.no_vllm:
        for name, config in (("vllm", None), ("vllm-ngram", spec_json)):
            peer_args = SimpleNamespace(
                threads=args.threads, max_model_len=2048, batches=[8],
                max_num_batched_tokens=2048, vllm_kv_gb=4, speculative_config=config,
                log_stats=True,
            )  # fmt: skip
            peers[name] = VllmPeer(args.vllm_python, model_dir, peer_args,
                                   f"/tmp/halfmoon-spec-{name}.log")  # fmt: skip

        def theirs(peer: VllmPeer, case: str) -> tuple[float, list[list[int]]]:
            prompts = cases[case]
            regex = JSON_REGEX if case.startswith("json") else None
            if not case.endswith("b1"):
                return peer.generate(prompts, args.tokens, False, regex, ignore_eos=False,
                                     all_ids=True)  # fmt: skip
            elapsed, ids = 0.0, []
            for p in prompts:
                s, (one,) = peer.generate([p], args.tokens, False, regex, ignore_eos=False,
                                          all_ids=True)  # fmt: skip
                elapsed += s
                ids.append(one)
            return elapsed, ids

        runners.update({name: (lambda case, p=p: theirs(p, case)) for name, p in peers.items()})
    try:
        for peer in peers.values():
            peer.wait_ready()
        for case in cases:  # warm-up: kernels, allocators, vLLM's compiled graphs
            for run_case in runners.values():
                run_case(case)
        before = {n: p.counters() for n, p in peers.items()}
        spec_before = engines["halfmoon-ngram"].stats().spec_decode
        rounds, same, tokens = [], {}, {}
        names = list(runners)
        for r in range(args.rounds):
            row: dict[str, float] = {}
            for case in cases:
                order = names[r % len(names) :] + names[: r % len(names)]
                ids = {}
                for name in order:
                    elapsed, ids[name] = runners[name](case)
                    n = sum(len(t) for t in ids[name])
                    row[f"{name} {case} s"] = elapsed
                    row[f"{name} {case} tok/s"] = n / elapsed
                    tokens[f"{name} {case}"] = n
                for name in ids:
                    base = name.split("-")[0]
                    if name != base:
                        key = f"{case}: {name} = {base}"
                        same[key] = same.get(key, True) and ids[name] == ids[base]
                        row[f"{name}/{base} speed-up {case}"] = (
                            row[f"{base} {case} s"] / row[f"{name} {case} s"]
                        )
                if "vllm" in ids:
                    agree = sum(a == b for a, b in zip(ids["vllm"], ids["halfmoon"], strict=True))
                    same[f"{case}: vllm = halfmoon, answers"] = f"{agree}/{len(ids['vllm'])}"
                    for name in ("vllm", "vllm-ngram"):
                        ours_name = name.replace("vllm", "halfmoon")
                        row[f"{name}/{ours_name} time {case}"] = (
                            row[f"{name} {case} s"] / row[f"{ours_name} {case} s"]
                        )
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()
                                              if not k.endswith(" s")), flush=True)  # fmt: skip
        acceptance = {"halfmoon-ngram": _ours_acceptance(
            spec_before, engines["halfmoon-ngram"].stats().spec_decode)}  # fmt: skip
        if "vllm-ngram" in peers:
            acceptance["vllm-ngram"] = _vllm_acceptance(
                before["vllm-ngram"], peers["vllm-ngram"].counters()
            )
    finally:
        for peer in peers.values():
            peer.close()
    keys = [k for k in rounds[0] if not k.endswith(" s")]
    return {
        "model": args.model, "speculative_config": json.loads(spec_json),
        "max_tokens": args.tokens, "threads": args.threads, "rounds_n": args.rounds,
        "vllm": {n: p.info for n, p in peers.items()}, "same_tokens": same,
        "output_tokens": tokens, "acceptance (timed rounds)": acceptance,
        "median": {k: statistics.median(r[k] for r in rounds) for k in keys},
        "rounds": rounds,
    }  # fmt: skip


def _acceptance(drafts: float, accepted: float, steps: float) -> dict[str, float]:
    """Drafts checked and accepted over the timed rounds, from either engine's counters."""
    return {"draft_tokens": drafts, "accepted": accepted,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "tokens_per_drafting_step": 1 + accepted / steps if steps else 1.0}  # fmt: skip


def _ours_acceptance(before, after) -> dict[str, float]:
    return _acceptance(after.num_draft_tokens - before.num_draft_tokens,
                       after.num_accepted_tokens - before.num_accepted_tokens,
                       after.num_drafts - before.num_drafts)  # fmt: skip


def _vllm_acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    return _acceptance(delta("vllm:spec_decode_num_draft_tokens"),
                       delta("vllm:spec_decode_num_accepted_tokens"),
                       delta("vllm:spec_decode_num_drafts"))  # fmt: skip


if __name__ == "__main__":
    main()
