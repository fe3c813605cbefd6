"""Prefill calibration off and on, in the simulator, on hosts whose instances run slower
than the Conductor's cost model says (docs/conductor.md, "Prefill calibration"; on also
learns the lateness of first tokens).

Run: .venv/bin/python -m benchmarks.sim.prefill_calibration [--trace FILE]
     [--max-requests N] [--modes off,on:0,on:1.3]
     [--json benchmarks/results/sim_prefill_calibration.json]

Each configuration replays the public trace's first ``--max-requests`` requests with
early rejection (``snapshot``, TTFT SLO 30 s, TBT 100 ms, the simulator's default
LLaMA2-70B on 8xA800 per instance), once per ``--modes`` entry (``off``: calibration
off; ``on:K``: on, with ``--lateness-stddevs K``), at three replay speeds 0.2% apart (a
perturbation: a simulated cluster near saturation is chaotic, so every replay is kept).
``--host-cores N`` makes the instances share N cores (halfmoon.sim.host): every busy
instance beyond N slows all of them, which the cost model does not know; without it the
instances run at the model's speed and the calibration should change nothing.

Prints a table (medians over the replays, every replay's value in the JSON).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = ROOT.parent / "shared/traces/synthetic_trace.jsonl"
#: label -> extra `halfmoon simulate` arguments.
CONFIGS: dict[str, list[str]] = {
    "4P4D, no sharing": ["--cluster", "4P4D"],
    "2P2D on 4 cores": ["--cluster", "2P2D", "--host-cores", "4"],
    "2P2D on 3 cores": ["--cluster", "2P2D", "--host-cores", "3"],
    "4P4D on 6 cores": ["--cluster", "4P4D", "--host-cores", "6"],
    "4P4D on 2 cores": ["--cluster", "4P4D", "--host-cores", "2"],
}
REPLAYS = (1.0, 1.002, 0.998)
METRICS = (
    ("slo_attainment", "SLO attainment"),
    ("goodput_rps", "goodput req/s"),
    ("num_rejected_early", "rejected early"),
    ("num_wasted_prefill", "wasted prefill"),
    ("ttft_mean_s", "TTFT mean s"),
    ("ttft_p90_s", "TTFT p90 s"),
)


def mode_args(mode: str) -> list[str]:
    """A ``--modes`` entry, ``off`` or ``on:K``, as the calibration flags that `halfmoon
    simulate` and `halfmoon serve` share (K: --lateness-stddevs); SystemExit naming a bad
    entry. benchmarks.eval.prefill_calibration_live uses it too."""
    switch, _, stddevs = mode.partition(":")
    if mode != "off" and not re.fullmatch(r"on:\d+(\.\d+)?", mode):
        raise SystemExit(f"--modes: {mode!r} is neither off nor on:K")
    return ["--prefill-calibration", switch, "--lateness-stddevs", stddevs or "0"]


def run_one(trace: Path, max_requests: int, extra: list[str], mode: str,
            time_scale: float) -> dict[str, Any]:  # fmt: skip
    """One `halfmoon simulate` run; the report's figures and the learned scales."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        cmd = [
            sys.executable, "-m", "halfmoon.cli", "simulate", "--trace", str(trace),
            "--max-requests", str(max_requests), "--time-scale", f"{time_scale:g}",
            "--early-reject", "snapshot", "--ttft-slo", "30", "--tbt-slo", "0.1",
            *mode_args(mode), "--json", str(out), *extra,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
        report = json.loads(out.read_text())
    return {
        "slo_attainment": report["slo_attainment"],
        "goodput_rps": report["goodput_rps"],
        "num_rejected_early": report["num_rejected_early"],
        "num_wasted_prefill": report["num_wasted_prefill"],
        "ttft_mean_s": report["ttft_s"]["mean"],
        "ttft_p90_s": report["ttft_s"]["p90"],
        "scales": {i: c["scale"] for i, c in report.get("prefill_calibration", {}).items()},
        "lateness_s": report.get("ttft_lateness_s", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--max-requests", type=int, default=3000)
    parser.add_argument(
        "--modes", default="off,on:0",
        help="comma-separated: off, or on:K (calibration on, the lateness held as its mean "
        "plus K standard deviations)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, help="write every run here")
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:
        mode_args(mode)
    if not args.trace.exists():
        raise SystemExit(f"no trace at {args.trace}")
    start = time.perf_counter()
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for label, extra in CONFIGS.items():
        results[label] = {
            mode: [run_one(args.trace, args.max_requests, extra, mode, r) for r in REPLAYS]
            for mode in modes
        }
        print(f"[{time.perf_counter() - start:5.0f}s] {label} done", file=sys.stderr, flush=True)
    head = "| configuration | calibration | " + " | ".join(n for _, n in METRICS)
    print(head + " | learned scales, lateness s (first replay) |")
    print("|---|---|" + "---:|" * len(METRICS) + "---|")
    for label, modes in results.items():
        for mode, runs in modes.items():
            cells = [f"{statistics.median(r[key] for r in runs):.3g}" for key, _ in METRICS]
            scales = ", ".join(f"{v:.2f}" for v in runs[0]["scales"].values()) or "-"
            if runs[0]["scales"]:
                scales += f"; {runs[0]['lateness_s']:.2f} s"
            print(f"| {label} | {mode} | " + " | ".join(cells) + f" | {scales} |")
    if args.json:
        args.json.write_text(json.dumps({
            "trace": str(args.trace), "max_requests": args.max_requests, "replays": REPLAYS,
            "configs": CONFIGS, "results": results, "wall_s": time.perf_counter() - start,
        }, indent=1) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
