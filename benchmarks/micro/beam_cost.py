"""What beam search (``use_beam_search``) costs against greedy and sampled answers, asked
of a running server one request at a time.

Run against a served cluster, e.g. ``halfmoon serve --model tiny --port 8431``::

    .venv/bin/python -m benchmarks.micro.beam_cost --url http://127.0.0.1:8431 --rounds 5

Each case sends the same prompt (``--prompt-words`` words, 16 tokens with ``ignore_eos``)
``--rounds`` times; prints every round's seconds and the median, and checks each answer
has the choices it asked for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

CASES = {
    "greedy, n=1": {"temperature": 0},
    "beam search, n=1": {"n": 1, "use_beam_search": True, "length_penalty": 0.0},
    "sampled, n=4": {"n": 4, "temperature": 1.0, "seed": 1},
    "beam search, n=4": {"n": 4, "use_beam_search": True},
}


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Time every case; returns its rounds' seconds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=120)
    parser.add_argument("--json", help="write every round here")
    args = parser.parse_args(argv)
    words = "The history of the printing press begins".split()
    prompt = " ".join(words[i % len(words)] for i in range(args.prompt_words))
    base = {"model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
            "ignore_eos": True}  # fmt: skip
    rounds: dict[str, list[float]] = {}
    with httpx.Client(base_url=args.url, timeout=600) as client:
        for name, extra in CASES.items():
            rounds[name] = []
            for _ in range(args.rounds):
                started = time.perf_counter()
                answer = client.post("/v1/completions", json={**base, **extra})
                rounds[name].append(time.perf_counter() - started)
                answer.raise_for_status()
                assert len(answer.json()["choices"]) == extra.get("n", 1), answer.text
            print(f"{name:18} median {statistics.median(rounds[name]):.3f} s, rounds "
                  + ", ".join(f"{s:.3f}" for s in rounds[name]))  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1) + "\n")
    return rounds


if __name__ == "__main__":
    main()
