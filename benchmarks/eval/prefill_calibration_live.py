"""Prefill calibration on a live cluster: does early rejection keep its promise?

Run from the repository root::

    .venv/bin/python -m benchmarks.eval.prefill_calibration_live [--rate 6] [--duration 40]
        [--prompt-tokens 1024] [--max-tokens 16] [--ttft-slo 1.0] [--rounds 2]
        [--modes off,on:0,on:1.3] [--json out.json] [-- EXTRA SERVE ARGS]

Each round starts ``halfmoon serve --model tiny --prefill 1 --decode 1 --num-threads 1
--early-reject snapshot --ttft-slo S`` once per ``--modes`` entry: ``off``
(``--prefill-calibration off``) or ``on:K`` (on, with ``--lateness-stddevs K``), the
order rotating by round, and sends the same open-loop stream to each: requests
at ``--rate`` a second (exponential gaps, seeded) for ``--duration`` seconds, each a
streamed completion of ``--prompt-tokens`` distinct random token ids (no prefix hits).
The rate is above what one prefill worker on this host serves, so the Conductor must
refuse some. An admitted request is a promise: its estimated TTFT met the SLO. Per run it
reports the requests admitted and refused, the admitted ones' TTFT (to the first token),
how many of them met the SLO (the promise kept), goodput (admitted and on time, per
second of the stream) and what the Conductor learned (its ``/metrics``): the prefill
scale and the lateness of first tokens (read at the end of the stream, so relaxed toward
neutral for the seconds the last requests took to finish).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
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
from benchmarks.sim.prefill_calibration import mode_args


async def stream(base_url: str, args: argparse.Namespace) -> list[tuple[float, int, float]]:
    """Send the open-loop stream; (arrival offset, status, seconds to head) per request."""
    rng = random.Random(args.seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration:
            break
        arrivals.append(t)
    bodies = [
        {"model": "tiny", "prompt": [rng.randrange(1, 500) for _ in range(args.prompt_tokens)],
         "max_tokens": args.max_tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        for _ in arrivals
    ]  # fmt: skip
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(600.0, connect=60.0, pool=600.0)
    results: list[tuple[float, int, float]] = []
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=timeout, trust_env=False
    ) as client:
        start = time.perf_counter()

        async def at(offset: float, body: dict[str, Any]) -> None:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            status, head = await one(client, body)
            results.append((offset, status, head))

        await asyncio.gather(*(at(o, b) for o, b in zip(arrivals, bodies, strict=True)))
    return sorted(results)


def learned(base_url: str) -> tuple[dict[str, float], float | None]:
    """The Conductor's learned prefill scales and TTFT lateness, from the gateway's
    /metrics."""
    text = httpx.get(base_url + "/metrics", timeout=30, trust_env=False).text
    pattern = r'halfmoon:conductor_prefill_scale\{[^}]*instance_id="([^"]+)"[^}]*\} ([0-9.e+-]+)'
    scales = {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text)}
    late = re.search(r"halfmoon:conductor_ttft_lateness_seconds(?:\{[^}]*\})? ([0-9.e+-]+)", text)
    return scales, float(late.group(1)) if late else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ttft-slo", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes", default="off,on:0,on:1.3",
        help="comma-separated runs per round: off, or on:K (calibration on, the lateness "
        "held as its mean plus K standard deviations, --lateness-stddevs K)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every run here")
    parser.add_argument("serve_args", nargs="*", help="extra `halfmoon serve` arguments")
    args = parser.parse_args(argv)
    if args.rate <= 0 or args.duration <= 0 or args.rounds < 1:
        parser.error("--rate, --duration and --rounds must be positive")
    modes = {m.strip(): mode_args(m.strip()) for m in args.modes.split(",") if m.strip()}
    order = list(modes)
    runs: list[dict[str, Any]] = []
    for r in range(args.rounds):
        for mode in rotated(order, r):
            with overloaded_1p1d(args.ttft_slo, [*modes[mode], *args.serve_args]) as c:
                results = asyncio.run(stream(c.base_url, args))
                scales, lateness = learned(c.base_url)
            run = {"round": r, "calibration": mode, "scales": scales, "lateness_s": lateness,
                   **summary(results, args.ttft_slo, args.duration), "results": results}  # fmt: skip
            runs.append(run)
            shown = {k: v for k, v in run.items() if k != "results"}
            print(json.dumps(shown), flush=True)
    print("\n| round | calibration | admitted | refused | on time | promise kept | goodput "
          "req/s | TTFT p50 / p90 s | learned scale | learned lateness s |")  # fmt: skip
    print("|---:|---|---:|---:|---:|---:|---:|---|---|---:|")
    for run in runs:
        kept, ttft = summary_cells(run)
        scale = ", ".join(f"{v:.2f}" for v in run["scales"].values()) or "-"
        print(f"| {run['round']} | {run['calibration']} | {run['admitted']} | {run['refused']} "
              f"| {run['admitted_on_time']} | {kept} | {run['goodput_rps']:.2f} | {ttft} "
              f"| {scale} | {run['lateness_s'] or 0:.3f} |")  # fmt: skip
    write_runs(args, runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
