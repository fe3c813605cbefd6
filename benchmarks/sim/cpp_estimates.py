"""How well the Conductor's TTFT estimate of a CPP placement matches the simulated TTFT.

Run: .venv/bin/python -m benchmarks.sim.cpp_estimates [--rates 0.5,1.0]
     [--json benchmarks/results/sim_cpp_estimates.json]

LLaMA2-70B on 8xA800 per instance (roofline cost model), 5P1D with 2-stage CPP groups
(P1+P2, P3+P4; P5 alone), 1,024-token chunks, 120 Poisson arrivals of 32k-token prompts
whose first 24k tokens are one of four shared prefixes, so some group placements fetch a
prefix held by another instance. For each placement kind (group or single instance, the
prefix fetched or local) it prints how many requests took it and the mean of simulated
minus estimated TTFT, with the Conductor's link books off and on (``link_backlog``).
The simulator runs the same Conductor; what it adds is the network and the queues as
they turn out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from halfmoon.conductor import ConductorConfig
from halfmoon.core.request import Request
from halfmoon.costmodel import build_cost_model
from halfmoon.sim import ClusterSpec, SimConfig, Simulator

BLOCK = 512
PREFIX_BLOCKS, OWN_BLOCKS, NUM_PREFIXES, NUM_REQUESTS = 48, 16, 4, 120
KINDS = ("group, fetched", "group, local", "single, fetched", "single, local")


def workload(rate: float, seed: int = 1) -> list[Request]:
    """Poisson arrivals at ``rate``; each prompt is a shared prefix plus its own blocks."""
    rng = random.Random(seed)
    prefixes = [tuple(range(p * 1000, p * 1000 + PREFIX_BLOCKS)) for p in range(NUM_PREFIXES)]
    out, t, next_hash = [], 0.0, 10**6
    for i in range(NUM_REQUESTS):
        t += rng.expovariate(rate)
        own = tuple(range(next_hash, next_hash + OWN_BLOCKS))
        next_hash += OWN_BLOCKS
        hashes = prefixes[rng.randrange(NUM_PREFIXES)] + own
        out.append(Request(f"r{i}", t, len(hashes) * BLOCK, 16, hashes, BLOCK))
    return out


def run(rate: float, link_backlog: bool) -> dict[str, object]:
    """One simulation; per placement kind: count and mean TTFT error (simulated - estimated)."""
    config = ConductorConfig(
        cpp_stages=2,
        cpp_chunk_tokens=1024,
        cpp_min_tokens=2048,
        link_backlog=link_backlog,
        kvcache_balancing_threshold=0.05,
    )
    sim = Simulator(
        SimConfig(ClusterSpec.parse("5P1D")), config, build_cost_model("llama2-70b", "a800", 8)
    )
    estimates: dict[str, tuple[float, str]] = {}
    schedule = sim.conductor.schedule

    def recording(request: Request, *args: object, **kwargs: object):
        decision = schedule(request, *args, **kwargs)
        if decision.accepted:
            chosen = decision.prefill
            kind = f"{'group' if chosen.group else 'single'}, {'fetched' if chosen.is_remote else 'local'}"
            estimates[request.request_id] = (chosen.ttft_s, kind)
        return decision

    sim.conductor.schedule = recording  # type: ignore[method-assign]
    result = sim.run(workload(rate))
    sim.check_integrity()
    errors: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for record in result.records:
        if record.request_id in estimates and record.ttft_s is not None:
            estimate, kind = estimates[record.request_id]
            errors[kind].append(record.ttft_s - estimate)
    ttfts = [r.ttft_s for r in result.records if r.ttft_s is not None]
    return {
        "mean_ttft_s": statistics.fmean(ttfts),
        "errors": {
            k: {"n": len(v), "mean_error_s": statistics.fmean(v) if v else None}
            for k, v in errors.items()
        },
    }


def main() -> None:
    """Run every rate with link books off and on; print the table, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,1.0", help="arrival rates, req/s")
    parser.add_argument("--json", default="benchmarks/results/sim_cpp_estimates.json")
    args = parser.parse_args()
    rows = {}
    print("| rate | link books | mean TTFT | " + " | ".join(KINDS) + " |")
    print("|---|---|---:|" + "---:|" * len(KINDS))
    for rate in (float(r) for r in args.rates.split(",") if r):
        for backlog in (False, True):
            out = run(rate, backlog)
            rows[f"{rate} {'on' if backlog else 'off'}"] = out
            cells = []
            for kind in KINDS:
                e = out["errors"][kind]  # type: ignore[index]
                cells.append("-" if not e["n"] else f"{e['n']}: {e['mean_error_s'] * 1e3:+.1f} ms")
            print(
                f"| {rate} req/s | {'on' if backlog else 'off'} | {out['mean_ttft_s']:.3f} s | "
                + " | ".join(cells)
                + " |"
            )
    Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"\n(cells: placements, then mean simulated - estimated TTFT)\nwrote {args.json}")


if __name__ == "__main__":
    main()
