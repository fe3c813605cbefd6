"""Measure the serving path's terms again for an evaluation already recorded, and redo its
simulations with them (the live runs stay as they are). See ``calibration.py`` for how
the terms are measured.

Run: .venv/bin/python -m benchmarks.eval.recalibrate --results benchmarks/results/eval.json
         --out out/eval [--max-quiet-wait-s 900] [--no-measure]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from halfmoon.metrics.records import records_from_json

from .cluster import ServeCluster
from .serving import ROOT, SHAPES, calibrate, calibrated_profiles, run_sims
from .simulate import rounded


def recalibrate(
    results_path: Path, out: Path, max_quiet_wait_s: float, measure: bool = True
) -> None:
    """Measure the calibration runs again on fresh clusters (the profile the workers
    find cached under ``out``) and redo every simulation of ``results_path`` with the new
    terms; the live runs stay as they are. For a calibration that was disturbed, or a
    change to how the terms are derived (``measure=False``: derive them again from the
    calibration already in the results and its records under ``out/runs``)."""
    results = json.loads(results_path.read_text())
    args = argparse.Namespace(out=out, max_quiet_wait_s=max_quiet_wait_s)
    traces = {name: ROOT / path for name, path in results["traces"].items()}
    secret, cache, salts = os.urandom(16).hex(), out / "cache", iter(range(900_000, 901_000))
    isolated, bursts = results["isolated"], results["bursts"]
    if measure:
        load_before = Path("/proc/loadavg").read_text().split()[:3]
        for shape, argv in SHAPES.items():
            log = out / f"recalibrate-{shape}.log"
            with ServeCluster(argv, cache, secret, log) as cluster:
                isolated[shape], measured = calibrate(args, cluster, shape, traces, salts)
                bursts.update(measured)
        results["config"]["recalibrated"] = {
            "date": time.strftime("%Y-%m-%d %H:%M"), "loadavg_before": load_before,
            "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
        }  # fmt: skip
    for shape, entry in isolated.items():  # results written before this key existed
        if "input_tokens_mean" not in entry:
            saved = json.loads((out / "runs" / f"{shape}-isolated.records.json").read_text())
            done = [r for r in records_from_json(saved) if r.completed]
            entry["input_tokens_mean"] = sum(r.input_length for r in done) / max(1, len(done))
    live = {"isolated": isolated, "bursts": bursts}
    sim = run_sims(args, traces, results["config"]["points"],
                   calibrated_profiles(args, live), results["runs"])  # fmt: skip
    results.update(sim)
    results_path.write_text(json.dumps(rounded(results)) + "\n")
    print(f"recalibrated and re-simulated: {results_path}")


def main() -> None:
    """``--results R --out DIR``: :func:`recalibrate`."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--results", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-quiet-wait-s", type=float, default=900.0)
    parser.add_argument(
        "--no-measure",
        action="store_true",
        help="derive the terms from the calibration already in the results",
    )
    args = parser.parse_args()
    recalibrate(args.results, args.out, args.max_quiet_wait_s, not args.no_measure)


if __name__ == "__main__":
    main()
