"""#19 figure (a): the same two vLLM servers behind halfmoon's KV-aware routers and behind
round-robin: prefix hit ratio and TTFT on a trace with shared prefixes.

Run from the repository root (``make vllm`` first)::

    .venv/bin/python -m benchmarks.eval.vllm_routing [--rounds 2] [--num-requests 32]
        [--speed 0.5] [--length-scale 0.25] [--eager] [--kv-cache-mb 256]
        [--out out/vllm-routing] [--json benchmarks/results/vllm_routing.json]

Two vLLM OpenAI servers (vLLM's CPU build, its default compilation unless ``--eager``,
one OpenMP thread each, 32-token blocks, KV events on) start once and serve every run. For each
round, halfmoon's gateway and Conductor start three times in front of them (``halfmoon
serve --engine vllm --attach ...``), with ``--coupled-router kvcache-centric`` (least
estimated TTFT from the Conductor's index, fed by the servers' KV events, and its queue
estimates: the default of ``--engine vllm``), ``cache-aware`` (longest cached prefix)
and ``round-robin``, the order rotating from round to round, and ``halfmoon bench`` replays the evaluation's ``docqa`` trace
(documents asked several questions each: ~80% of prompt tokens can come from a prefix
cache), its lengths scaled by ``--length-scale`` (0.25: ~400-500-token prompts, 8 output
tokens), with a fresh ``--salt`` per run, so no run finds another's prefixes. The hit ratio
is read on both sides: from the responses (``usage.prompt_tokens_details.cached_tokens``,
what ``halfmoon bench`` reports) and from the servers' own counters
(``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``). Same model, same servers,
same cores, same trace.
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
from halfmoon.serve.vllm.server import (
    VLLM_PYTHON_ENV,
    VllmLaunch,
    VllmProcess,
    find_vllm_python,
    fitting_max_model_len,
    metric_values,
)

from .workloads import write_all

ROOT = Path(__file__).resolve().parents[2]
ROUTERS = ("kvcache-centric", "cache-aware", "round-robin")
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def use_vllm_venv() -> None:
    """Point ``$HALFMOON_VLLM_PYTHON`` at the repository's ``.venv-vllm`` (what ``make
    vllm`` makes), unless it is set."""
    venv_python = ROOT / ".venv-vllm" / "bin" / "python"
    if venv_python.exists():
        os.environ.setdefault(VLLM_PYTHON_ENV, str(venv_python))


def _counters(urls: list[str]) -> dict[str, dict[str, float]]:
    return {url: metric_values(url, (HITS, QUERIES)) for url in urls}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start the servers, run every (round, router), return the results."""
    model_dir = resolve_model(args.model, 0)
    traces = write_all(args.out / "traces", args.num_requests)
    max_len = fitting_max_model_len(model_dir, args.kv_cache_mb, 16, "float32")
    launch = VllmLaunch(
        python=find_vllm_python(), model_dir=str(model_dir), served_model_name=model_dir.name,
        kv_cache_mb=args.kv_cache_mb, max_model_len=max_len, num_threads=1,
        extra_args=("--enforce-eager",) if args.eager else (),
    )  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    servers = [VllmProcess(launch, f"kv@vllm-{i}", args.out / f"vllm-{i}.log") for i in range(2)]
    runs = []
    salts = itertools.count(7000)
    try:
        for server in servers:
            server.wait_ready(900)
        urls = [s.endpoints.url for s in servers]
        attach = [arg for s in servers for arg in ("--attach", s.endpoints.spec())]
        for rnd in range(args.rounds):
            order = ROUTERS[rnd % len(ROUTERS) :] + ROUTERS[: rnd % len(ROUTERS)]
            for router in order:
                runs.append(_one(args, rnd, router, attach, urls, model_dir, traces, next(salts)))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        for server in servers:
            server.stop()
    return {
        "config": {
            "model": args.model, "kv_cache_mb": args.kv_cache_mb, "rounds": args.rounds,
            "num_requests": args.num_requests, "speed": args.speed, "workload": "docqa",
            "length_scale": args.length_scale, "enforce_eager": args.eager,
            "vllm_max_model_len": max_len, "date": time.strftime("%Y-%m-%d"),
            "cpus": os.cpu_count(),
        },
        "runs": runs,
    }  # fmt: skip


def _one(args, rnd: int, router: str, attach: list[str], urls: list[str], model_dir: Path,
         traces: dict[str, Path], salt: int) -> dict[str, Any]:  # fmt: skip
    serve_args = ["--engine", "vllm", "--mode", "coupled", *attach, "--model", str(model_dir),
                  "--kv-cache-mb", str(args.kv_cache_mb), "--coupled-router", router,
                  "--early-reject", "none"]  # fmt: skip
    stem = args.out / f"r{rnd}-{router}"
    with LocalCluster(serve_args, args.out / "cache", new_secret(), Path(f"{stem}.serve.log")) as c:
        c.wait_ready(900)
        before = _counters(urls)
        cmd = [sys.executable, "-m", "halfmoon.cli", "bench", "--url", c.base_url,
               "--trace", str(traces["docqa"]), "--time-scale", f"{args.speed:g}",
               "--length-scale", f"{args.length_scale:g}", "--salt", str(salt),
               "--json", f"{stem}.json"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=3600)
        after = _counters(urls)
    report = json.loads(Path(f"{stem}.json").read_text())
    hits = sum(after[u].get(HITS, 0) - before[u].get(HITS, 0) for u in urls)
    queries = sum(after[u].get(QUERIES, 0) - before[u].get(QUERIES, 0) for u in urls)
    return {
        "round": rnd, "router": router, "num_completed": report["num_completed"],
        "num_errors": report["num_errors"], "hit_ratio_responses": report["cache_hit_ratio"],
        "hit_ratio_vllm": hits / queries if queries else None,
        "ttft_p50_s": report["ttft_s"]["p50"], "ttft_p90_s": report["ttft_s"]["p90"],
        "tbt_p50_s": report["tbt_s"]["p50"], "tbt_p90_s": report["tbt_s"]["p90"],
        "queries_per_server": [after[u].get(QUERIES, 0) - before[u].get(QUERIES, 0) for u in urls],
    }  # fmt: skip


def table(results: dict[str, Any]) -> str:
    """Markdown: every run, then the medians per router."""
    lines = ["| round | router | hit ratio (responses / vLLM) | TTFT p50 / p90 (s) | prompt tokens per server |",
             "|---|---|---|---|---|"]  # fmt: skip
    for r in results["runs"]:
        lines.append(
            f"| {r['round']} | {r['router']} | {r['hit_ratio_responses']:.2f} / "
            f"{r['hit_ratio_vllm']:.2f} | {r['ttft_p50_s']:.2f} / {r['ttft_p90_s']:.2f} | "
            f"{', '.join(f'{q:.0f}' for q in r['queries_per_server'])} |"
        )
    for router in ROUTERS:
        mine = [r for r in results["runs"] if r["router"] == router]
        med = {k: statistics.median(r[k] for r in mine)
               for k in ("hit_ratio_responses", "ttft_p50_s", "ttft_p90_s")}  # fmt: skip
        lines.append(f"| median | {router} | {med['hit_ratio_responses']:.2f} | "
                     f"{med['ttft_p50_s']:.2f} / {med['ttft_p90_s']:.2f} | |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    """Parse the flags, run, write the JSON and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--speed", type=float, default=0.5, help="trace replay speed")
    parser.add_argument(
        "--length-scale", type=float, default=0.25,
        help="prompt and output lengths x this (docqa's ~2k-token prompts take seconds "
        "each on one core)",
    )  # fmt: skip
    parser.add_argument(
        "--eager", action="store_true",
        help="start vLLM with --enforce-eager (minutes less start-up; both routers get it)",
    )  # fmt: skip
    parser.add_argument("--kv-cache-mb", type=float, default=256.0)
    parser.add_argument("--out", type=Path, default=ROOT / "out" / "vllm-routing")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "vllm_routing.json"
    )
    args = parser.parse_args()
    use_vllm_venv()
    results = run(args)
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()
