"""Request priorities on a live cluster: are urgent requests admitted and served first,
and do the others' admissions keep their promise?

Run from the repository root::

    .venv/bin/python -m benchmarks.eval.priority_live [--rate 6] [--duration 40]
        [--prompt-tokens 1024] [--max-tokens 16] [--ttft-slo 1.0] [--urgent 0.2]
        [--rounds 2] [--arms fcfs,blind,aware] [--json out.json] [-- EXTRA SERVE ARGS]

Each round starts ``halfmoon serve --model tiny --prefill 1 --decode 1 --num-threads 1
--early-reject snapshot --ttft-slo S`` once per arm, the order rotating by round:
``fcfs`` (the default policy; the requests carry no priority), ``blind``
(``--scheduling-policy priority --priority-estimates off``: the engines serve urgent
requests first, the Conductor's estimates count the whole queue) and ``aware``
(``--scheduling-policy priority``, the Conductor's estimates by priority,
halfmoon/conductor/priorities.py). Every arm gets the same open-loop stream (seeded):
requests at ``--rate`` a second for ``--duration`` seconds, each a streamed completion
of ``--prompt-tokens`` distinct random token ids, an ``--urgent`` share of them with
``priority`` -1 (the others 0). The rate is above what the prefill worker serves, so the
Conductor must refuse some. Per arm and class: admitted, refused, TTFT of the admitted
(to the first token), how many of them met the SLO, and goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.eval.live_arms import (
    one,
    overloaded_1p1d,
    rotated,
    summary,
    summary_cells,
    write_runs,
)

#: ``halfmoon serve`` flags of each arm.
ARMS: dict[str, list[str]] = {
    "fcfs": ["--scheduling-policy", "fcfs"],
    "blind": ["--scheduling-policy", "priority", "--priority-estimates", "off"],
    "aware": ["--scheduling-policy", "priority", "--priority-estimates", "on"],
}


def plan(args: argparse.Namespace) -> list[tuple[float, int, list[int]]]:
    """The stream: (arrival offset, priority, prompt) per request, seeded."""
    rng = random.Random(args.seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration:
            return out
        priority = -1 if rng.random() < args.urgent else 0
        prompt = [rng.randrange(1, 500) for _ in range(args.prompt_tokens)]
        out.append((t, priority, prompt))


async def stream(
    base_url: str, planned: list[tuple[float, int, list[int]]], args: argparse.Namespace, arm: str
) -> list[tuple[float, int, float, int]]:
    """Send the stream; (arrival offset, status, seconds to head, priority) per request."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(600.0, connect=60.0, pool=600.0)
    results: list[tuple[float, int, float, int]] = []
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=timeout, trust_env=False
    ) as client:
        start = time.perf_counter()

        async def at(offset: float, priority: int, prompt: list[int]) -> None:
            body: dict[str, Any] = {
                "model": "tiny", "prompt": prompt, "max_tokens": args.max_tokens,
                "ignore_eos": True, "temperature": 0, "stream": True,
            }  # fmt: skip
            if arm != "fcfs" and priority:  # fcfs refuses a priority (a 400)
                body["priority"] = priority
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            status, head = await one(client, body)
            results.append((offset, status, head, priority))

        await asyncio.gather(*(at(*p) for p in planned))
    return sorted(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ttft-slo", type=float, default=1.0)
    parser.add_argument("--urgent", type=float, default=0.2, help="share with priority -1")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default="fcfs,blind,aware", help=f"of {', '.join(ARMS)}")
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument("serve_args", nargs="*", help="extra `halfmoon serve` arguments")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.duration <= 0 or args.rounds < 1 or not 0 < args.urgent < 1:
        parser.error("--rate, --duration and --rounds must be positive, --urgent in (0, 1)")
    order = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not order or any(a not in ARMS for a in order):
        parser.error(f"--arms takes a list of {', '.join(ARMS)}")
    planned = plan(args)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for arm in rotated(order, r):
            with overloaded_1p1d(args.ttft_slo, [*ARMS[arm], *args.serve_args]) as c:
                results = asyncio.run(stream(c.base_url, planned, args, arm))
            classes = {}
            for priority in (-1, 0):
                part = [(o, s, h) for o, s, h, p in results if p == priority]
                classes[str(priority)] = summary(part, args.ttft_slo, args.duration)
            run = {"round": r, "arm": arm, **summary([x[:3] for x in results], args.ttft_slo,
                   args.duration), "by_priority": classes, "results": results}  # fmt: skip
            runs.append(run)
            shown = {k: v for k, v in run.items() if k != "results"}
            print(json.dumps(shown), flush=True)
    print("\n| round | arm | class | requests | admitted | refused | failed | on time | "
          "promise kept | goodput req/s | TTFT p50 / p90 s |")  # fmt: skip
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for run in runs:
        for label, s in (("all", run), ("urgent", run["by_priority"]["-1"]),
                         ("normal", run["by_priority"]["0"])):  # fmt: skip
            kept, ttft = summary_cells(s)
            print(f"| {run['round']} | {run['arm']} | {label} | {s['requests']} | "
                  f"{s['admitted']} | {s['refused']} | {s['failed']} | {s['admitted_on_time']} "
                  f"| {kept} | {s['goodput_rps']:.2f} | {ttft} |")  # fmt: skip
    write_runs(args, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
