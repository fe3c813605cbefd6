"""End-to-end evaluation (issue 7): live coupled vs disaggregated, cache on/off, the
simulator against the live numbers, Conductor decision latency. See docs/evaluation.md.

Run: .venv/bin/python -m benchmarks.eval.serving [--repeats 3] [--num-requests 64]
         [--out out/eval] [--results benchmarks/results/eval.json] [--quick]
         [--max-quiet-wait-s 900] [--max-attempts 3]
then: .venv/bin/python -m benchmarks.eval.report   (tables + plots from the results)

Two clusters of two tiny-model workers each run side by side (idle between runs):
``--mode coupled --instances 2`` (2M) and ``--prefill 1 --decode 1`` (1P1D), one torch
thread per worker. For each repeat and each (workload, replay speed), both clusters run
the same trace back to back, in alternating order, each with a fresh ``--salt`` (its
prompts share nothing with earlier runs, so every run starts with a cold cache, as a
simulated run does). A probe measures the Conductor's decisions meanwhile
(``probe.py``). Before the runs, two calibration runs per cluster measure the
serving path's terms (``calibration.py``). Then ``halfmoon simulate`` replays every
point with the profile the workers measured plus those terms, and once per cumulative
subset of the terms (which fix contributed what, ``simulate.py``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from halfmoon.bench.workload import PromptMaker, PromptSpec
from halfmoon.core.config import SLOConfig
from halfmoon.costmodel import CostProfile
from halfmoon.metrics.records import records_from_json
from halfmoon.metrics.report import summarize
from halfmoon.workload.trace import read_trace

from .calibration import CALIBRATION_ROUNDS, median_entries, serving_terms, write_burst_trace
from .cluster import ServeCluster
from .overhead import busy_cpu_seconds, cpu_seconds, isolated_overheads, steady_batch_gaps
from .probe import ConductorProbe, set_workload
from .simulate import (
    HOST_CORES,
    decision_times,
    rounded,
    run_ablation,
    run_simulation,
    sim_command,
)
from .workloads import write_all

ROOT = Path(__file__).resolve().parents[2]
SLO = SLOConfig(ttft_s=2.0, tbt_s=0.1, tbt_metric="top10mean")
LOOSE_SLO = SLOConfig(ttft_s=2.0, tbt_s=0.3, tbt_metric="top10mean")
COMMON = ["--model", "tiny", "--num-threads", "1", "--kv-cache-mb", "256",
          "--early-reject", "none", "--decode-guard", "off",
          "--ttft-slo", "2", "--tbt-slo", "0.1"]  # fmt: skip
SHAPES = {
    "2M": ["--mode", "coupled", "--instances", "2", *COMMON],
    "1P1D": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1", *COMMON],
}
POINTS = {  # workload -> replay speeds (x1: docqa ~0.76, short ~0.98 requests/s)
    "docqa": (4, 8, 12, 16),
    "short": (8, 16, 24, 32),
    "docqa-unshared": (4, 8),
}
#: Other jobs may use this much of the machine during a run before it is done again.
FOREIGN_LIMIT_CORES = 0.3
QUICK_POINTS = {"docqa": (4, 16), "short": (16,), "docqa-unshared": (8,)}


def bench_command(
    url: str, trace: Path, speed: float, salt: int, out: Path, *extra: str
) -> list[str]:
    """The ``halfmoon bench`` command line of one live run."""
    return [
        "halfmoon", "bench", "--url", url, "--trace", str(trace), "--time-scale", f"{speed:g}",
        "--salt", str(salt), "--ttft-slo", f"{SLO.ttft_s:g}", "--tbt-slo", f"{SLO.tbt_s:g}",
        "--tbt-metric", SLO.tbt_metric, "--json", f"{out}.json",
        "--records", f"{out}.records.json", *extra,
    ]  # fmt: skip


def _bench(argv: list[str]) -> tuple[dict, list]:
    cmd = [sys.executable, "-m", "halfmoon.cli", *argv[1:]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"bench failed: {done.stderr.strip()}")
    json_path = Path(argv[argv.index("--json") + 1])
    records_path = Path(argv[argv.index("--records") + 1])
    return json.loads(json_path.read_text()), records_from_json(
        json.loads(records_path.read_text())
    )


def _probe_stats(probe: ConductorProbe) -> dict[str, Any]:
    out = {}
    for label, schedules in probe.samples.schedule_s.items():
        pings = probe.samples.ping_s[label]
        diffs = sorted(s - p for s, p in zip(schedules, pings, strict=True))
        out[label] = {
            "num": len(diffs),
            "ping_p50_s": statistics.median(pings),
            "schedule_p50_s": statistics.median(schedules),
            "schedule_p99_s": sorted(schedules)[int(0.99 * (len(schedules) - 1))],
            "decision_p50_s": statistics.median(diffs),
            "decision_p99_s": diffs[int(0.99 * (len(diffs) - 1))],
        }
    return out


def run_live(args: argparse.Namespace, traces: dict[str, Path], points: dict) -> dict:
    """Every (repeat, workload, speed, shape) run against live clusters."""
    secret = os.urandom(16).hex()
    cache = args.out / "cache"
    runs, probes, salts = [], {}, itertools.count(1000)
    _wait_for_quiet(args.max_quiet_wait_s)  # the workers measure their profile as they start
    with ServeCluster(SHAPES["2M"], cache, secret, args.out / "serve-2M.log") as coupled, \
            ServeCluster(SHAPES["1P1D"], cache, secret, args.out / "serve-1P1D.log") as disagg:  # fmt: skip
        clusters = {"2M": coupled, "1P1D": disagg}
        probe_of = {
            name: ConductorProbe(c.conductor_endpoint(), secret.encode(), name == "2M")
            for name, c in clusters.items()
        }
        isolated, bursts = {}, {}
        for shape, cluster in clusters.items():
            isolated[shape], measured = calibrate(args, cluster, shape, traces, salts)
            bursts.update(measured)
        with probe_of["2M"], probe_of["1P1D"]:
            turn = itertools.count()
            for repeat in range(args.repeats):
                for workload, speeds in points.items():
                    for speed in speeds:  # who goes first alternates from point to point
                        order = list(clusters) if next(turn) % 2 else list(clusters)[::-1]
                        for shape in order:
                            run = [clusters[shape], probe_of[shape], shape, workload]
                            runs.append(
                                _clean_run(args, *run, traces[workload], speed, salts, repeat)
                            )
        for name, probe in probe_of.items():
            probes[name] = _probe_stats(probe)
    return {"runs": runs, "probe": probes, "isolated": isolated, "bursts": bursts}


def _profile(args: argparse.Namespace) -> Path:
    profiles = sorted((args.out / "cache" / "profiles").glob("profile-*.json"))
    if len(profiles) != 1:
        raise RuntimeError(f"expected one measured profile, found {profiles}")
    return profiles[0]


def _burst(args, cluster, shape: str, salt: int, loaded: bool = False) -> dict[str, Any]:
    """16 short prompts at once: the decode steps' cost per sequence beyond the profile
    (``loaded``: while a stream of long prompts keeps the prefill worker busy)."""
    _wait_for_quiet(args.max_quiet_wait_s)
    name = "burst-loaded" if loaded else "burst"
    stem = args.out / "runs" / f"{shape}-{name}"
    trace = write_burst_trace(args.out / "traces" / f"{name}.jsonl", loaded)
    cpu_before, busy_before = cpu_seconds(cluster.proc.pid), busy_cpu_seconds()
    client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    report, records = _bench(bench_command(cluster.url, trace, 1000, salt, stem))
    wall_s = time.monotonic() - start
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_seconds(cluster.proc.pid).items()}
    client_s = (client_after.ru_utime + client_after.ru_stime
                - client_before.ru_utime - client_before.ru_stime)  # fmt: skip
    # Everything but the workers: the load the serving path puts on the shared cores.
    path_s = client_s + sum(v for k, v in cpu.items() if k in ("gateway", "conductor"))
    foreign_s = max(0.0, busy_cpu_seconds() - busy_before - sum(cpu.values()) - client_s)
    num_instances = 2 if shape == "2M" else 1
    busy = 2 if shape == "2M" or loaded else 1  # instances computing during the window
    out = steady_batch_gaps(records, CostProfile.load(_profile(args)), num_instances,
                            HOST_CORES, (path_s + foreign_s) / wall_s, busy)  # fmt: skip
    out["path_cpu_s"], out["num_output_tokens"] = path_s, report["num_output_tokens"]
    out["path_cpu_s_per_token"] = path_s / max(1, report["num_output_tokens"])
    out["foreign_cores"], out["wall_s"] = foreign_s / wall_s, wall_s
    return out


def calibrate(args, cluster, shape: str, traces: dict[str, Path], salts) -> tuple[dict, dict]:
    """The calibration runs of ``shape`` (``CALIBRATION_ROUNDS`` of each, medians): the
    isolated run's figures, and ``{burst name: figures}`` (1P1D: also the loaded burst)."""
    names = {"": False, "-loaded": True} if shape == "1P1D" else {"": False}
    isolated, bursts = [], {name: [] for name in names}
    for _ in range(CALIBRATION_ROUNDS):
        isolated.append(_isolated(args, cluster, shape, traces["docqa"], next(salts)))
        for name, loaded in names.items():
            bursts[name].append(_burst(args, cluster, shape, next(salts), loaded))
    return median_entries(isolated), {
        shape + name: median_entries(entries) for name, entries in bursts.items()
    }


def _isolated(args, cluster, shape: str, trace: Path, salt: int) -> dict[str, Any]:
    """16 docqa requests one at a time: what the path adds to the profile's times."""
    _wait_for_quiet(args.max_quiet_wait_s)
    stem = args.out / "runs" / f"{shape}-isolated"
    stem.parent.mkdir(parents=True, exist_ok=True)
    argv = bench_command(cluster.url, trace, 1000, salt, stem,
                         "--max-concurrency", "1", "--max-requests", "16")  # fmt: skip
    cpu_before = cpu_seconds(cluster.proc.pid)
    report, records = _bench(argv)
    cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_seconds(cluster.proc.pid).items()}
    profile = CostProfile.load(_profile(args))
    out = isolated_overheads(records, profile)
    out["ttft_p50_s"], out["itl_p50_s"] = report["ttft_s"]["p50"], report["itl_s"]["p50"]
    out["worker_cpu_s"] = {k: v for k, v in cpu.items() if "-" in k}
    if "prefill-0" in cpu:  # CPU time is work done, whatever else the machine ran
        done = [r for r in records if r.completed]
        engine_s = sum(profile.prefill_s(r.input_length - r.cached_tokens, r.cached_tokens)
                       for r in done)  # fmt: skip
        out["prefill_cpu_extra_s"] = (cpu["prefill-0"] - engine_s) / max(1, len(done))
        out["input_tokens_mean"] = sum(r.input_length for r in done) / max(1, len(done))
    return out


def _clean_run(args, cluster, probe, shape, workload, trace, speed, salts, repeat) -> dict:
    """One run, done again (up to twice) when other jobs took more than
    ``FOREIGN_LIMIT_CORES`` of the machine meanwhile."""
    for attempt in range(args.max_attempts):
        run = _one_run(args, cluster, probe, shape, workload, trace, speed, next(salts), repeat)
        run["attempt"] = attempt
        if run["cpu_s"]["foreign"] / run["wall_s"] <= FOREIGN_LIMIT_CORES:
            break
    return run


def _self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _wait_for_quiet(max_wait_s: float = 900.0, cores: float = 0.3) -> float:
    """Wait (up to ``max_wait_s``) until the machine's busy CPU over 2 s is below
    ``cores`` (our idle clusters use almost nothing); returns the last reading."""
    deadline = time.monotonic() + max_wait_s
    waited = False
    while True:
        before = busy_cpu_seconds()
        time.sleep(2.0)
        busy = (busy_cpu_seconds() - before) / 2.0
        if busy < cores or time.monotonic() > deadline:
            return busy
        if not waited:
            print(f"  waiting for other jobs to finish ({busy:.1f} cores busy)", flush=True)
            waited = True


def _one_run(args, cluster, probe, shape, workload, trace, speed, salt, repeat) -> dict:
    maker = PromptMaker(PromptSpec(salt=salt), 512)
    requests = read_trace(trace)
    set_workload(probe, f"{workload} x{speed:g}", [maker.prompt_ids(r) for r in requests[:16]])
    idle_busy = _wait_for_quiet(args.max_quiet_wait_s)
    load = os.getloadavg()[0]
    stem = args.out / "runs" / f"{shape}-{workload}-x{speed:g}-r{repeat}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    cpu_before = cpu_seconds(cluster.proc.pid)
    client_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    self_before, busy_before = _self_cpu_s(), busy_cpu_seconds()
    try:
        report, records = _bench(bench_command(cluster.url, trace, speed, salt, stem))
    finally:
        set_workload(probe, None, ())
    client_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_seconds(cluster.proc.pid).items()}
    cpu["bench client"] = (client_after.ru_utime + client_after.ru_stime
                           - client_before.ru_utime - client_before.ru_stime)  # fmt: skip
    cpu["probe"] = _self_cpu_s() - self_before
    # Everything else the machine did meanwhile (other users' jobs): the noise to watch.
    cpu["foreign"] = max(0.0, busy_cpu_seconds() - busy_before - sum(cpu.values()))
    loose = summarize(records, LOOSE_SLO)
    print(f"{shape:5} {workload:15} x{speed:<3g} r{repeat}  TTFT p50 {report['ttft_s']['p50']:.3f}"
          f"  TBT p90 {report['tbt_s']['p90'] * 1e3:6.1f} ms  goodput {report['goodput_rps']:.2f}"
          f"  load {load:.1f}  foreign {cpu['foreign'] / (time.monotonic() - start):.2f} cores",
          flush=True)  # fmt: skip
    return {
        "shape": shape, "workload": workload, "speed": speed, "repeat": repeat, "salt": salt,
        "load_before": load, "busy_before": idle_busy, "wall_s": time.monotonic() - start, "report": report, "cpu_s": cpu,
        "loose": {k: loose[k] for k in ("slo_attainment", "goodput_rps", "slo")},
    }  # fmt: skip


def calibrated_profiles(args: argparse.Namespace, live: dict) -> dict[str, Path]:
    """The measured profile with each cluster's serving terms, one file per cluster."""
    measured = CostProfile.load(_profile(args))
    terms = serving_terms(measured, live["isolated"], live["bursts"])
    paths = {}
    for shape, shape_terms in terms.items():
        paths[shape] = args.out / "sim" / f"profile-{shape}.json"
        paths[shape].parent.mkdir(parents=True, exist_ok=True)
        measured.with_serving(shape_terms).save(paths[shape])
    return paths


def host_cores(runs: list[dict], shape: str, workload: str, speed: float) -> float:
    """The cores the point's live runs had for themselves: the machine's, less the median
    of what other jobs took meanwhile (at least a quarter of a core)."""
    foreign = [run["cpu_s"]["foreign"] / run["wall_s"] for run in runs
               if (run["shape"], run["workload"], run["speed"]) == (shape, workload, speed)]  # fmt: skip
    return max(0.25, HOST_CORES - (statistics.median(foreign) if foreign else 0.0))


def run_sims(
    args: argparse.Namespace,
    traces: dict[str, Path],
    points: dict,
    profiles: dict[str, Path],
    live_runs: list[dict],
) -> dict:
    """``halfmoon simulate`` for every (workload, speed, shape), strict and loose SLO, with
    the cluster's calibrated profile; then the ablation over the serving terms."""
    profile = _profile(args)
    sims = []
    for workload, speeds in points.items():
        for speed in speeds:
            for shape in SHAPES:
                entry: dict[str, Any] = {"shape": shape, "workload": workload, "speed": speed}
                for key, slo in (("report", SLO), ("loose", LOOSE_SLO)):
                    out = args.out / "sim" / f"{shape}-{workload}-x{speed:g}-{key}.json"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    cores = host_cores(live_runs, shape, workload, speed)
                    argv = sim_command(traces[workload], speed, shape, profiles[shape], slo,
                                       out, "--host-cores", f"{cores:.3g}")  # fmt: skip
                    entry[key] = run_simulation(argv)
                    entry.setdefault("command", " ".join(argv))
                sims.append(entry)
    decisions = {
        shape: decision_times(traces["docqa"], 16, shape, profile, SLO) for shape in SHAPES
    }
    return {
        "profile": json.loads(profile.read_text()),
        "serving_terms": {s: json.loads(p.read_text())["serving"] for s, p in profiles.items()},
        "sims": sims,
        "ablation": run_ablation(
            sims,
            profiles,
            SLO,
            args.out / "sim-ablation",
            {
                (e["shape"], e["workload"], e["speed"]): host_cores(
                    live_runs, e["shape"], e["workload"], e["speed"]
                )
                for e in sims
            },
        ),  # fmt: skip
        "decisions": decisions,
    }


def main() -> None:
    """Run everything and write the results JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "eval")
    parser.add_argument(
        "--results", type=Path, default=ROOT / "benchmarks" / "results" / "eval.json"
    )
    parser.add_argument("--quick", action="store_true", help="two speeds, one repeat")
    parser.add_argument(
        "--max-quiet-wait-s",
        type=float,
        default=900.0,
        help="wait at most this long for other jobs to finish before a run",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=3,
        help="runs of a point while other jobs take over 0.3 cores",
    )
    args = parser.parse_args()
    # Started in the background, SIGINT may be ignored and SIGTERM would skip cleanup:
    # make both unwind, so the clusters are always stopped.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.repeats = 1
    points = QUICK_POINTS if args.quick else POINTS
    traces = write_all(args.out / "traces", args.num_requests)
    started = time.monotonic()
    uptime_before = Path("/proc/loadavg").read_text().split()[:3]
    live = run_live(args, traces, points)
    uptime_after = Path("/proc/loadavg").read_text().split()[:3]
    sim = run_sims(args, traces, points, calibrated_profiles(args, live), live["runs"])
    results = {
        "config": {
            "shapes": SHAPES, "points": points, "repeats": args.repeats,
            "num_requests": args.num_requests, "slo": SLO.__dict__, "loose_slo": LOOSE_SLO.__dict__,
            "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
            "loadavg_before": uptime_before, "loadavg_after": uptime_after,
            "wall_s": time.monotonic() - started,
        },
        "traces": {name: str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
                   for name, path in traces.items()},
        **live, **sim,
    }  # fmt: skip
    args.results.write_text(json.dumps(rounded(results)) + "\n")
    print(f"results written to {args.results} ({results['config']['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
