"""Chunked pipeline parallelism (CPP) in the simulator: TTFT against the number of stages.

Run: .venv/bin/python -m benchmarks.sim.cpp [--out docs/img/sim_cpp.png]
     [--json benchmarks/results/sim_cpp.json]

LLaMA2-70B on 8xA800 per instance (roofline cost model at its defaults), 4P1D, CPP
chunks of 1,024 tokens, every prompt unique (no prefix reuse), 16 output tokens:

1. one request alone, 8k / 16k / 32k / 128k tokens, with 1 / 2 / 4 stages (groups of
   K consecutive prefill instances; K = 1 is the ordinary one-pass prefill);
2. a light and a moderate load: 40 Poisson arrivals of 128k-token prompts at 0.02 and
   0.05 req/s (with K = 4 the four instances form one group, so prompts run one after
   another instead of four at a time).

Prints a markdown table and writes the plot and the numbers.
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

LENGTHS = (8192, 16384, 32768, 131072)
STAGES = (1, 2, 4)
RATES = (0.02, 0.05)
BLOCK = 512


def _requests(lengths: list[int], arrivals: list[float]) -> list[Request]:
    out, next_hash = [], 1
    for i, (n, t) in enumerate(zip(lengths, arrivals, strict=True)):
        num_blocks = -(-n // BLOCK)
        hashes = tuple(range(next_hash, next_hash + num_blocks))
        next_hash += num_blocks
        out.append(Request(f"r{i}", t, n, 16, hashes, BLOCK))
    return out


def _ttfts(requests: list[Request], stages: int) -> list[float]:
    cost_model = build_cost_model("llama2-70b", "a800", 8)
    conductor = ConductorConfig(cpp_stages=stages, cpp_chunk_tokens=1024, cpp_min_tokens=2048)
    sim = Simulator(SimConfig(ClusterSpec.parse("4P1D")), conductor, cost_model)
    result = sim.run(requests)
    sim.check_integrity()
    return [r.ttft_s for r in result.records]


def main() -> None:
    """Run both experiments, print the tables, write the plot and JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/sim_cpp.png")
    parser.add_argument("--json", default="benchmarks/results/sim_cpp.json")
    args = parser.parse_args()
    single = {n: {k: _ttfts(_requests([n], [0.0]), k)[0] for k in STAGES} for n in LENGTHS}
    load: dict[str, dict[int, dict[str, float]]] = {}
    for rate in RATES:
        rng = random.Random(0)
        arrivals, t = [], 0.0
        for _ in range(40):
            t += rng.expovariate(rate)
            arrivals.append(t)
        load[str(rate)] = {}
        for k in STAGES:
            ttfts = sorted(_ttfts(_requests([131072] * 40, arrivals), k))
            load[str(rate)][k] = {"mean": statistics.fmean(ttfts), "p90": ttfts[35]}
    print("| prompt | 1 stage | 2 stages | 4 stages | 2 / 1 | 4 / 1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for n, row in single.items():
        print(
            f"| {n // 1024}k | {row[1]:.2f} s | {row[2]:.2f} s | {row[4]:.2f} s | "
            f"{row[2] / row[1]:.3f} | {row[4] / row[1]:.3f} |"
        )
    print("\n| 128k, 40 Poisson requests | 1 stage | 2 stages | 4 stages |")
    print("|---|---:|---:|---:|")
    for rate, rows in load.items():
        for stat in ("mean", "p90"):
            cells = " | ".join(f"{rows[k][stat]:.2f} s" for k in STAGES)
            print(f"| {rate} req/s, {stat} TTFT | {cells} |")
    Path(args.json).write_text(json.dumps({"single": single, "load_128k": load}, indent=2) + "\n")
    _plot(single, args.out)
    print(f"\nwrote {args.json} and {args.out}")


def _plot(single: dict[int, dict[int, float]], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_abs, ax_rel) = plt.subplots(1, 2, figsize=(10, 4))
    for n, row in single.items():
        ys = [row[k] for k in STAGES]
        ax_abs.plot(STAGES, ys, marker="o", label=f"{n // 1024}k")
        ax_rel.plot(STAGES, [y / row[1] for y in ys], marker="o", label=f"{n // 1024}k")
    ax_rel.plot(STAGES, [1 / k for k in STAGES], "k--", label="ideal 1/K")
    ax_abs.set(
        xlabel="CPP stages K",
        ylabel="TTFT (s)",
        yscale="log",
        xticks=STAGES,
        title="TTFT, one request, LLaMA2-70B 8xA800",
    )
    ax_rel.set(
        xlabel="CPP stages K",
        ylabel="TTFT / TTFT(K=1)",
        xticks=STAGES,
        title="relative to one instance",
    )
    for ax in (ax_abs, ax_rel):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main()
