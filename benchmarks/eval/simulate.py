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
The serving path's terms come with the profile (``calibration.py``); the ablation
(:func:`run_ablation`) sets them one by one with ``halfmoon simulate``'s flags.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from halfmoon.bench.workload import PromptMaker, PromptSpec
from halfmoon.cli import main as halfmoon_main
from halfmoon.conductor import ConductorConfig
from halfmoon.core.config import SLOConfig
from halfmoon.core.hashing import hash_blocks
from halfmoon.core.request import Request
from halfmoon.costmodel import CostProfile
from halfmoon.costmodel.profile import ProfileCostModel
from halfmoon.costmodel.roofline import build_cost_model
from halfmoon.costmodel.serving import SERVING_TERM_NAMES
from halfmoon.sim import ClusterSpec, SimConfig, Simulator
from halfmoon.workload.trace import read_trace

KV_CAPACITY_TOKENS = 65536
#: Cumulative subsets of the serving terms: what each one adds to the engine-only model.
ABLATION = (
    ("engine only", ()),
    ("+ request overhead", ("request_overhead_s",)),
    ("+ prefill hand-over", ("request_overhead_s", "prefill_handoff_s_per_token")),
    ("+ decode per-seq, per-step", ("request_overhead_s", "prefill_handoff_s_per_token",
                                    "decode_per_seq_overhead_s", "decode_step_overhead_s")),
    ("+ KV import", ("request_overhead_s", "prefill_handoff_s_per_token", "decode_per_seq_overhead_s",
                     "decode_step_overhead_s", "kv_import_s_per_token")),
    ("+ step jitter", ("request_overhead_s", "prefill_handoff_s_per_token", "decode_per_seq_overhead_s",
                       "decode_step_overhead_s", "kv_import_s_per_token", "step_jitter_sigma",
                       "step_wait_mean_s")),
    ("+ shared CPUs", SERVING_TERM_NAMES),
    ("+ other jobs' load (all)", SERVING_TERM_NAMES),
)  # fmt: skip
#: The live machine's cores: the host every simulated instance shares (last variant).
HOST_CORES = os.cpu_count() or 1


def sim_command(
    trace: Path,
    time_scale: float,
    cluster: str,
    profile: Path,
    slo: SLOConfig,
    out: Path,
    *extra: str,
) -> list[str]:
    """The ``halfmoon simulate`` command line of one point (``extra`` flags appended)."""
    return [
        "halfmoon", "simulate", "--trace", str(trace), "--time-scale", f"{time_scale:g}",
        "--cluster", cluster, "--model", "tiny", "--gpus-per-instance", "1",
        "--profile", str(profile), "--kv-capacity-tokens", str(KV_CAPACITY_TOKENS),
        "--cache-capacity-tokens", str(KV_CAPACITY_TOKENS), "--chunk-tokens", "2048",
        "--coupled-chunked-prefill", "--coupled-token-budget", "2048",
        "--decode-guard", "off", "--early-reject", "none",
        "--ttft-slo", f"{slo.ttft_s:g}", "--tbt-slo", f"{slo.tbt_s:g}",
        "--tbt-metric", slo.tbt_metric, "--first-token-at", "kv", "--json", str(out), *extra,
    ]  # fmt: skip


def run_simulation(argv: Sequence[str]) -> dict[str, Any]:
    """Run one ``halfmoon simulate`` command (in this process, through the CLI's entry
    point: hundreds of runs without an interpreter start each) and return its report."""
    out = Path(argv[argv.index("--json") + 1])
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = halfmoon_main(list(argv[1:]))
    if code != 0:
        raise RuntimeError(f"simulate failed: {errors.getvalue().strip()}")
    return json.loads(out.read_text())


def run_ablation(
    sims: Sequence[dict[str, Any]],
    profiles: dict[str, Path],
    slo: SLOConfig,
    out_dir: Path,
    point_cores: dict[tuple[str, str, float], float],
) -> dict[str, list[dict[str, Any]]]:
    """Every simulated point again for each :data:`ABLATION` subset of the serving terms
    (the others set to 0 by flag); variant -> entries like ``sims``' (strict SLO only).
    From "+ shared CPUs" on, the instances share the machine's cores; the last variant
    gives each point only the cores other jobs left it (``point_cores``, measured)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    variants: dict[str, list[dict[str, Any]]] = {}
    for name, kept in ABLATION:
        flags = [f for term in SERVING_TERM_NAMES if term not in kept
                 for f in ("--" + term.replace("_", "-"), "0")]  # fmt: skip
        sharing = "background_cpu_s_per_token" in kept
        entries = []
        for entry in sims:
            shape, workload, speed = entry["shape"], entry["workload"], entry["speed"]
            trace = Path(entry["command"].split(" --trace ")[1].split()[0])
            tag = name.strip("+ ").split()[0]
            out = out_dir / f"{shape}-{workload}-x{speed:g}-{tag}.json"
            cores = point_cores[(shape, workload, speed)] if "other" in name else HOST_CORES
            host = ["--host-cores", f"{cores:.3g}"] if sharing else []
            argv = sim_command(trace, speed, shape, profiles[shape], slo, out, *flags, *host)
            entries.append({"shape": shape, "workload": workload, "speed": speed,
                            "report": run_simulation(argv), "command": " ".join(argv)})  # fmt: skip
        variants[name] = entries
    return variants


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
