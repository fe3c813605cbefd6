"""#19 figures (b) and (c): vLLM servers disaggregated by halfmoon (1 prefill + 1 decode,
the KV moved by halfmoon's KV connector) against the same two vLLM servers coupled, and
the connector's KV transfer time per request against the prefill time.

Run from the repository root (``make vllm`` first)::

    .venv/bin/python -m benchmarks.eval.vllm_pd [--rounds 2] [--num-requests 24]
        [--speeds 2,4] [--length-scale 0.25] [--kv-cache-mb 256]
        [--out out/vllm-pd] [--json benchmarks/results/vllm_pd.json]

For every round and replay speed, two clusters run one after the other (the order
alternates from round to round), each starting its own two vLLM servers (vLLM's CPU
build, ``--enforce-eager``, one OpenMP thread each, 32-token blocks):

- ``1P1D``: ``halfmoon serve --engine vllm --prefill 1 --decode 1``;
- ``2 coupled``: ``halfmoon serve --engine vllm --mode coupled --instances 2`` (halfmoon's
  gateway in front of two ordinary vLLM servers, its default ``kvcache-centric`` router).

``halfmoon bench`` replays the evaluation's ``docqa`` trace (documents asked several
questions each), lengths scaled by ``--length-scale``, with a fresh ``--salt`` per run, and
reports TTFT and TBT p50/p90, SLO attainment (TTFT <= ``--ttft-slo``, top-10%-mean TBT <=
``--tbt-slo``) and goodput. Figure (c) comes from the 1P1D runs: the prefill server's
connector writes one line per request (``$HALFMOON_KV_STATS_DIR``): the forward's time
(``compute_s``, from the scheduler's metadata to the end of the step that finished the
prompt), the sender thread's busy time (``send_busy_s``) and how long the stream took
after the forward ended (``exposed_s``: the part of the transfer not hidden behind compute).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from halfmoon.engine.catalog import resolve_model
from halfmoon.serve.launch.local import LocalCluster
from halfmoon.serve.runtime import new_secret

from .vllm_routing import use_vllm_venv
from .workloads import write_all

ROOT = Path(__file__).resolve().parents[2]
SHAPES = {
    "1P1D": ["--prefill", "1", "--decode", "1"],
    "2 coupled": ["--mode", "coupled", "--instances", "2"],
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (round, speed, shape); returns the results."""
    model_dir = resolve_model(args.model, 0)
    traces = write_all(args.out / "traces", args.num_requests)
    args.out.mkdir(parents=True, exist_ok=True)
    runs, transfers = [], []
    salts = itertools.count(9000)
    for rnd in range(args.rounds):
        for speed in args.speeds:
            order = list(SHAPES) if rnd % 2 == 0 else list(reversed(SHAPES))
            for shape in order:
                result, stats = _one(
                    args, rnd, speed, shape, model_dir, traces["docqa"], next(salts)
                )
                runs.append(result)
                transfers += stats
                print(json.dumps(result), flush=True)
    return {
        "config": {
            "model": args.model, "kv_cache_mb": args.kv_cache_mb, "rounds": args.rounds,
            "num_requests": args.num_requests, "speeds": args.speeds, "workload": "docqa",
            "length_scale": args.length_scale, "ttft_slo_s": args.ttft_slo,
            "tbt_slo_s": args.tbt_slo, "tbt_metric": "top10mean", "enforce_eager": True,
            "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
        },
        "runs": runs,
        "transfers": transfers,
    }  # fmt: skip


def _one(args: argparse.Namespace, rnd: int, speed: float, shape: str, model_dir: Path,
         trace: Path, salt: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
    stem = args.out / f"r{rnd}-x{speed:g}-{shape.replace(' ', '')}"
    stats_dir = Path(f"{stem}.kv")
    stats_dir.mkdir(parents=True, exist_ok=True)
    os.environ["HALFMOON_KV_STATS_DIR"] = str(stats_dir)
    serve_args = ["--engine", "vllm", *SHAPES[shape], "--model", str(model_dir),
                  "--kv-cache-mb", str(args.kv_cache_mb), "--num-threads", "1",
                  "--vllm-args=--enforce-eager", "--early-reject", "none"]  # fmt: skip
    try:
        with LocalCluster(
            serve_args, args.out / "cache", new_secret(), Path(f"{stem}.serve.log")
        ) as c:
            c.wait_ready(900)
            cmd = [sys.executable, "-m", "halfmoon.cli", "bench", "--url", c.base_url,
                   "--trace", str(trace), "--time-scale", f"{speed:g}",
                   "--length-scale", f"{args.length_scale:g}", "--salt", str(salt),
                   "--ttft-slo", f"{args.ttft_slo:g}", "--tbt-slo", f"{args.tbt_slo:g}",
                   "--tbt-metric", "top10mean", "--json", f"{stem}.json"]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True, timeout=3600)
    finally:
        os.environ.pop("HALFMOON_KV_STATS_DIR", None)
    report = json.loads(Path(f"{stem}.json").read_text())
    result = {
        "round": rnd, "speed": speed, "shape": shape, "num_completed": report["num_completed"],
        "num_errors": report["num_errors"], "cache_hit_ratio": report["cache_hit_ratio"],
        "ttft_p50_s": report["ttft_s"]["p50"], "ttft_p90_s": report["ttft_s"]["p90"],
        "tbt_p50_s": report["tbt_s"]["p50"], "tbt_p90_s": report["tbt_s"]["p90"],
        "slo_attainment": report["slo_attainment"], "goodput_rps": report["goodput_rps"],
    }  # fmt: skip
    stats = [
        {"round": rnd, "speed": speed, **json.loads(line)}
        for f in sorted(stats_dir.glob("prefill-*.jsonl"))
        for line in f.read_text().splitlines()
    ]
    return result, stats


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def tables(results: dict[str, Any]) -> str:
    """Markdown: every run, the medians per (speed, shape), then the transfer figure."""
    lines = ["| round | speed | shape | TTFT p50 / p90 (s) | TBT p50 / p90 (ms) | SLO attainment | goodput (req/s) | errors |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in results["runs"]:
        lines.append(
            f"| {r['round']} | x{r['speed']:g} | {r['shape']} | {r['ttft_p50_s']:.2f} / "
            f"{r['ttft_p90_s']:.2f} | {1e3 * r['tbt_p50_s']:.0f} / {1e3 * r['tbt_p90_s']:.0f} | "
            f"{r['slo_attainment']:.2f} | {r['goodput_rps']:.3f} | {r['num_errors']} |"
        )
    for speed in results["config"]["speeds"]:
        for shape in SHAPES:
            mine = [r for r in results["runs"] if r["shape"] == shape and r["speed"] == speed]
            med = {k: _median([r[k] for r in mine]) for k in
                   ("ttft_p50_s", "ttft_p90_s", "tbt_p50_s", "tbt_p90_s", "slo_attainment", "goodput_rps")}  # fmt: skip
            lines.append(
                f"| median | x{speed:g} | {shape} | {med['ttft_p50_s']:.2f} / {med['ttft_p90_s']:.2f} | "
                f"{1e3 * med['tbt_p50_s']:.0f} / {1e3 * med['tbt_p90_s']:.0f} | "
                f"{med['slo_attainment']:.2f} | {med['goodput_rps']:.3f} | |"
            )
    t = results["transfers"]
    ok = [r for r in t if r["stream_ok"]]
    lines += [
        "",
        "| requests (streams ok) | prompt tokens p50 | MB streamed p50 | prefill forward p50 (ms) | sender busy p50 (ms) | exposed after the forward p50 / p90 / max (ms) |",
        "|---|---|---|---|---|---|",
        f"| {len(t)} ({len(ok)}) | {_median([r['num_tokens'] for r in t]):.0f} | "
        f"{_median([r['bytes_streamed'] / 1e6 for r in t]):.1f} | "
        f"{1e3 * _median([r['compute_s'] for r in t]):.0f} | {1e3 * _median([r['send_busy_s'] for r in t]):.1f} | "
        f"{1e3 * _median([r['exposed_s'] for r in t]):.1f} / "
        f"{1e3 * (sorted(r['exposed_s'] for r in t)[int(0.9 * (len(t) - 1))] if t else float('nan')):.1f} / "
        f"{1e3 * max((r['exposed_s'] for r in t), default=float('nan')):.1f} |",
    ]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    """Parse the flags, run, write the JSON and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--speeds", type=lambda s: [float(x) for x in s.split(",")], default=[2.0, 4.0],
                        help="trace replay speeds, comma-separated")  # fmt: skip
    parser.add_argument("--length-scale", type=float, default=0.25)
    parser.add_argument("--kv-cache-mb", type=float, default=256.0)
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--tbt-slo", type=float, default=0.3)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "vllm-pd")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_pd.json"
    )
    parser.add_argument("--tables-only", type=Path, default=None, metavar="JSON",
                        help="print the tables of an earlier run's JSON and exit")  # fmt: skip
    args = parser.parse_args()
    if args.tables_only is not None:
        print(tables(json.loads(args.tables_only.read_text())))
        return
    use_vllm_venv()
    results = run(args)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(tables(results))


if __name__ == "__main__":
    main()
