"""halfmoon's server against vLLM's, measured by vLLM's own harness (``vllm bench serve``).

An outside evaluator's first comparison: the same model served by ``halfmoon serve``
(its own engine, one coupled worker: no disaggregation, like with like) and by vLLM's
OpenAI server (its CPU build), both with the same threads, the same KV pool, 16-token
blocks and float32, each alone on the machine while measured, and the same requests
from vLLM's benchmark client: its ``random`` dataset (fixed seed: the same prompts for
both), ``--ignore-eos`` (every output as long as asked), at a fixed concurrency. Each
round starts each server afresh (the order alternating), warms it with a few requests,
then runs every point; every round's figures are kept. The token counts are checked on
both sides (every request completed, every output its full length).

vLLM gets its documented CPU tuning (halfmoon.serve.vllm.server.VllmLaunch: OpenMP
threads set, not pinned, tcmalloc and torch's libgomp preloaded; its default
compilation unless ``--eager``).

Run from the repository root (``make vllm`` first)::

    .venv/bin/python -m benchmarks.eval.served_vs_vllm --rounds 3 \\
        [--model smollm2-135m-instruct] [--threads 2] [--kv-cache-mb 256] \\
        [--results benchmarks/results/served_vs_vllm.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from halfmoon.engine.catalog import cache_dir, resolve_model
from halfmoon.serve.launch.local import LocalCluster
from halfmoon.serve.runtime import new_secret
from halfmoon.serve.vllm.server import VllmLaunch, VllmProcess, find_vllm_python

from .vllm_routing import ROOT, use_vllm_venv

#: (name, concurrency, prompts, input tokens, output tokens) of each measured point.
POINTS = (
    ("c1-512x64", 1, 8, 512, 64),
    ("c8-512x64", 8, 32, 512, 64),
    ("c8-1024x16", 8, 32, 1024, 16),
)
#: Figures kept from each run of vLLM's benchmark (its result JSON's names).
FIGURES = (
    "duration", "request_throughput", "output_throughput", "total_token_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
    "p99_tpot_ms", "median_itl_ms", "p99_itl_ms",
)  # fmt: skip


def bench(url: str, model: str, tokenizer: Path, point: tuple, out: Path, seed: int) -> dict:
    """One run of vLLM's benchmark against ``url`` (completions, streamed); its results,
    checked: every request done, every output its full length."""
    name, concurrency, prompts, input_len, output_len = point
    argv = [
        find_vllm_python(), "-m", "benchmarks.eval.vllm_bench_cli", "--backend", "openai",
        "--base-url", url, "--model", model, "--tokenizer", str(tokenizer),
        "--dataset-name", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--random-range-ratio", "0",
        "--num-prompts", str(prompts), "--max-concurrency", str(concurrency),
        "--ignore-eos", "--seed", str(seed), "--save-result", "--save-detailed",
        "--result-dir", str(out.parent), "--result-filename", out.name,
    ]  # fmt: skip
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    if run.returncode != 0:
        raise RuntimeError(f"vllm bench failed ({name}):\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
    result = json.loads(out.read_text())
    if result["completed"] != prompts or result.get("failed", 0):
        raise RuntimeError(f"{name}: {result['completed']} of {prompts} requests completed")
    if result["total_output_tokens"] != prompts * output_len:
        raise RuntimeError(f"{name}: {result['total_output_tokens']} output tokens, asked "
                           f"{prompts * output_len}")  # fmt: skip
    return result


def serve_halfmoon(args: argparse.Namespace, log: Path) -> LocalCluster:
    """``halfmoon serve``, one coupled worker, float32, 16-token blocks, ``args``' threads
    and KV pool, no early rejection; ready."""
    serve = ["--mode", "coupled", "--instances", "1", "--model", args.model,
             "--num-threads", str(args.threads), "--kv-cache-mb", str(args.kv_cache_mb),
             "--block-size", "16", "--dtype", "float32", "--early-reject", "none"]  # fmt: skip
    cluster = LocalCluster(serve, cache_dir(), new_secret(), log).start()
    cluster.wait_ready(900)
    return cluster


def serve_vllm(
    args: argparse.Namespace, model_dir: Path, log: Path, extra_args: tuple[str, ...] = ()
) -> VllmProcess:
    """vLLM's server as :func:`serve_halfmoon`'s peer (``extra_args`` added to its command
    line; ``--enforce-eager`` with ``args.eager``)."""
    if getattr(args, "eager", False):
        extra_args = ("--enforce-eager", *extra_args)
    launch = VllmLaunch(
        python=find_vllm_python(), model_dir=str(model_dir), served_model_name=args.model,
        kv_cache_mb=args.kv_cache_mb, num_threads=args.threads, dtype="float32",
        max_model_len=args.max_model_len, extra_args=extra_args,
    )  # fmt: skip
    server = VllmProcess(launch, "kv@bench", log)
    server.wait_ready(900)
    return server


def common_args(parser: argparse.ArgumentParser, name: str, kv_cache_mb: int = 256) -> None:
    """The options every side-by-side run with vLLM takes (``name``: its output names)."""
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-mb", type=int, default=kv_cache_mb,
                        help="each server's KV pool")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, default=Path(f"out/{name}"))
    parser.add_argument("--results", type=Path, default=Path(f"benchmarks/results/{name}.json"))


def measure(args: argparse.Namespace, run_all: Any, table_of: Any) -> None:
    """Run ``run_all(args)`` with vLLM's environment, write its results and print their
    table."""
    use_vllm_venv()
    results = run_all(args)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    print(table_of(results))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every (round, server, point)."""
    model_dir = resolve_model(args.model, 0)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for rnd in range(args.rounds):
        order = ("halfmoon", "vllm") if rnd % 2 == 0 else ("vllm", "halfmoon")
        for arm in order:
            log = args.out / f"r{rnd}-{arm}.log"
            server = (
                serve_halfmoon(args, log) if arm == "halfmoon" else serve_vllm(args, model_dir, log)
            )
            url = server.base_url if arm == "halfmoon" else server.endpoints.url
            try:
                warm = ("warm", 2, 4, 256, 8)
                bench(url, args.model, model_dir, warm, args.out / f"r{rnd}-{arm}-warm.json", 1)
                for point in POINTS:
                    out = args.out / f"r{rnd}-{arm}-{point[0]}.json"
                    result = bench(url, args.model, model_dir, point, out, 100 + rnd)
                    row = {"round": rnd, "server": arm, "point": point[0],
                           **{k: result.get(k) for k in FIGURES}}  # fmt: skip
                    runs.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                server.stop()
    return {
        "config": {"model": args.model, "threads": args.threads, "kv_cache_mb": args.kv_cache_mb,
                   "rounds": args.rounds, "points": POINTS, "dtype": "float32",
                   "vllm_enforce_eager": args.eager, "date": time.strftime("%Y-%m-%d"),
                   "cpus": os.cpu_count()},
        "runs": runs,
    }  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """Per point: each server's medians over rounds, and halfmoon / vLLM per round."""
    lines = ["| point | figure | halfmoon | vLLM | halfmoon / vLLM, median [rounds] |",
             "|---|---|---:|---:|---|"]  # fmt: skip
    runs = results["runs"]
    for name, *_ in results["config"]["points"]:
        for fig in ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_itl_ms"):
            by_round: dict[int, dict[str, float]] = {}
            for r in runs:
                if r["point"] == name:
                    by_round.setdefault(r["round"], {})[r["server"]] = r[fig]
            pairs = [v for v in by_round.values() if len(v) == 2]
            if not pairs:
                continue
            ratios = sorted(v["halfmoon"] / v["vllm"] for v in pairs)
            hm = statistics.median(v["halfmoon"] for v in pairs)
            vl = statistics.median(v["vllm"] for v in pairs)
            lines.append(f"| {name} | {fig} | {hm:.1f} | {vl:.1f} | "
                         f"{statistics.median(ratios):.2f} [{', '.join(f'{x:.2f}' for x in ratios)}] |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(parser, "served_vs_vllm")
    parser.add_argument("--eager", action="store_true", help="vLLM with --enforce-eager")
    measure(parser.parse_args(), run, table)


if __name__ == "__main__":
    main()
