"""The simulator's side of the evaluation: ``halfmoon simulate`` on the live runs' traces,
cluster shapes and SLOs, with the cost profile the live workers measured; and the
Conductor's decision time in-process on the same workload.

Matching the live cluster (``halfmoon serve --model tiny --kv-cache-mb 256``):
``--model tiny --gpus-per-instance 1`` gives the tiny model's KV size (4 KiB/token);
``--kv-capacity-tokens 65536`` is a 256 MiB pool; ``--cache-capacity-tokens 65536`` the
prefill worker's engine pool (its 256 MiB block store doubles it; the workloads' shared
documents fit either way); ``--chunk-tokens 2048`` and ``--coupled-chunked-prefill
--coupled-token-budget 2048`` are the engine's scheduler (mixed batches of at most 2048
tokens); ``--decode-guard off --early-reject none`` as the live runs admit everything.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from halfmoon.bench.workload import PromptMaker, PromptSpec
from halfmoon.conductor import ConductorConfig
from halfmoon.core.config import SLOConfig
from halfmoon.core.hashing import hash_blocks
from halfmoon.core.request import Request
from halfmoon.costmodel import CostProfile
from halfmoon.costmodel.profile import ProfileCostModel
from halfmoon.costmodel.roofline import build_cost_model
from halfmoon.sim import ClusterSpec, SimConfig, Simulator
from halfmoon.workload.trace import read_trace

KV_CAPACITY_TOKENS = 65536


def sim_command(
    trace: Path, time_scale: float, cluster: str, profile: Path, slo: SLOConfig, out: Path
) -> list[str]:
    """The ``halfmoon simulate`` command line of one point."""
    return [
        "halfmoon", "simulate", "--trace", str(trace), "--time-scale", f"{time_scale:g}",
        "--cluster", cluster, "--model", "tiny", "--gpus-per-instance", "1",
        "--profile", str(profile), "--kv-capacity-tokens", str(KV_CAPACITY_TOKENS),
        "--cache-capacity-tokens", str(KV_CAPACITY_TOKENS), "--chunk-tokens", "2048",
        "--coupled-chunked-prefill", "--coupled-token-budget", "2048",
        "--decode-guard", "off", "--early-reject", "none",
        "--ttft-slo", f"{slo.ttft_s:g}", "--tbt-slo", f"{slo.tbt_s:g}",
        "--tbt-metric", slo.tbt_metric, "--json", str(out),
    ]  # fmt: skip


def run_simulation(argv: Sequence[str]) -> dict[str, Any]:
    """Run one ``halfmoon simulate`` command (this interpreter) and return its report."""
    out = Path(argv[argv.index("--json") + 1])
    cmd = [sys.executable, "-m", "halfmoon.cli", *argv[1:]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"simulate failed: {done.stderr.strip()}")
    return json.loads(out.read_text())


def _fine_grained(trace: Path, time_scale: float, salt: int) -> list[Request]:
    """The trace's requests with 16-token block hashes of their real prompts, as the
    live gateway hashes them (so the Conductor sees as many blocks as it does live)."""
    maker = PromptMaker(PromptSpec(salt=salt), 512)
    out = []
    for request in read_trace(trace):
        tokens = maker.prompt_ids(request)
        out.append(
            Request(
                request.request_id, request.arrival_time_s / time_scale,
                request.input_length, request.output_length,
                tuple(hash_blocks(tokens, 16).hashes), 16,
            )
        )  # fmt: skip
    return out


def _timed(function: Callable, samples: list[float]) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            samples.append(time.perf_counter() - start)

    return wrapper


def decision_times(
    trace: Path, time_scale: float, cluster: str, profile: Path, slo: SLOConfig
) -> dict[str, float]:
    """p50 / p99 / mean seconds of the Conductor's placements (``schedule`` or
    ``route_coupled``) while the simulator replays ``trace`` on ``cluster``."""
    requests = _fine_grained(trace, time_scale, salt=0)
    roofline = build_cost_model("tiny", "a800", 1)
    cost = ProfileCostModel.from_roofline(CostProfile.load(profile), roofline)
    spec = ClusterSpec.parse(cluster)
    config = SimConfig(
        spec, slo, num_layers=4, prefill_chunk_tokens=2048,
        cache_capacity_tokens=KV_CAPACITY_TOKENS, kv_capacity_tokens=KV_CAPACITY_TOKENS,
        decode_tbt_guard="off", coupled_chunked_prefill=True,
    )  # fmt: skip
    conductor = ConductorConfig(block_size_tokens=16, slo=slo, early_reject="none")
    simulator = Simulator(config, conductor, cost, seed=0)
    samples: list[float] = []
    name = "route_coupled" if spec.coupled else "schedule"
    setattr(simulator.conductor, name, _timed(getattr(simulator.conductor, name), samples))
    simulator.run(requests)
    ordered = sorted(samples)
    return {
        "num": len(ordered),
        "p50_s": statistics.median(ordered),
        "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "mean_s": statistics.fmean(ordered),
        "blocks_per_request": statistics.fmean(len(r.block_hashes) for r in requests),
    }


def rounded(value: Any) -> Any:
    """``value`` with every float rounded to 6 significant digits (a smaller results file)."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [rounded(v) for v in value]
    return value


def path_adjusted_profile(profile: dict[str, Any], isolated: dict[str, Any]) -> dict[str, Any]:
    """``profile`` (JSON) with what one request at a time measured on top of it added to
    the constant terms: the median TTFT excess to the prefill's, the median per-gap
    excess to the decode step's. A what-if: the simulator then books the serving path's
    time on the instances, which it should rather add to each request's latency."""
    adjusted = json.loads(json.dumps(profile))
    for part, key in (("prefill", "ttft_extra_p50_s"), ("decode", "gap_extra_p50_s")):
        features = adjusted[part]["features"]
        constant = features.index("1")
        adjusted[part]["coefficients"][constant] += max(0.0, isolated[key])
    return adjusted


def run_adjusted(results: dict[str, Any], out_dir: Path) -> list[dict[str, Any]]:
    """Every simulated point again, each cluster with its own path-adjusted profile."""
    slo = SLOConfig(**results["config"]["slo"])
    sims = []
    for shape, isolated in results["isolated"].items():
        path = out_dir / f"profile-adjusted-{shape}.json"
        path.write_text(json.dumps(path_adjusted_profile(results["profile"], isolated)))
        for entry in results["sims"]:
            if entry["shape"] != shape:
                continue
            trace = Path(entry["command"].split(" --trace ")[1].split()[0])
            out = out_dir / f"{shape}-{entry['workload']}-x{entry['speed']:g}-adjusted.json"
            argv = sim_command(trace, entry["speed"], shape, path, slo, out)
            sims.append({**{k: entry[k] for k in ("shape", "workload", "speed")},
                         "report": run_simulation(argv), "command": " ".join(argv)})  # fmt: skip
    return sims


def main() -> None:
    """Add the path-adjusted simulations to a results file of ``eval_serving.py``."""
    import argparse

    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--results", type=Path, default=root / "benchmarks" / "eval_results.json")
    parser.add_argument("--out", type=Path, default=root / "out" / "eval" / "sim-adjusted")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    results["sims_adjusted"] = run_adjusted(results, args.out)
    args.results.write_text(json.dumps(rounded(results)) + "\n")
    print(f"{len(results['sims_adjusted'])} adjusted simulations added to {args.results}")


if __name__ == "__main__":
    main()
