"""Live TTFT of long prompts: one prefill worker vs a 2-stage CPP group (issue #8).

Two ``halfmoon serve`` clusters run side by side on 127.0.0.1, both with the same model
(``small`` preset by default), one torch thread per worker process and the prefix cache
off (every prompt is new anyway):

- ``1 stage``: 1 prefill + 1 decode worker (``--cpp-stages 1``);
- ``2 stages``: 2 prefill + 1 decode worker, ``--cpp-stages 2`` — the Conductor sends a
  long prompt through the group when it estimates a lower TTFT.

Requests alternate between the clusters, one at a time, so both see the same background
load. TTFT is the gateway's own (``halfmoon:time_to_first_token_seconds``: request
arrival to first token, read from ``/metrics`` around each request); each request asks
for 2 tokens so the KV reaches the decode worker as in real serving.

Command (about 20 minutes on 2 cores): ``.venv/bin/python -m benchmarks.eval.cpp_live
--sizes 8192 16384 32000 --repeats 1 --json benchmarks/results/cpp_live.json``
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path

from halfmoon.serve.launch.local import LocalCluster

SECRET = "cpp-live-benchmark-secret-0123456789"


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _complete(url: str, prompt: list[int], timeout_s: float) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def measure(url: str, prompt: list[int], timeout_s: float) -> dict[str, float]:
    """One request: the gateway's TTFT for it, and the client's end-to-end time."""
    name = "halfmoon:time_to_first_token_seconds_sum"
    before = _metric(url, name)
    start = time.monotonic()
    out = _complete(url, prompt, timeout_s)
    e2e_s = time.monotonic() - start
    assert out["usage"]["completion_tokens"] == 2, out
    return {"ttft_s": _metric(url, name) - before, "e2e_s": e2e_s}


def stage_counts(cluster: LocalCluster) -> int:
    """CPP requests run so far by the cluster's first prefill worker."""
    pongs = [p for p in cluster.ping_workers() if p.role == "prefill"]
    return max((int(p.stats.get("cpp_requests", 0)) for p in pongs), default=0)


def run(args: argparse.Namespace) -> dict:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    common = [
        "--model", args.model, "--served-model-name", "bench", "--num-threads", "1",
        "--no-prefix-caching",
        "--kv-cache-mb", str(args.kv_cache_mb), "--max-model-len", str(max(args.sizes) + 64),
        "--ttft-slo", "3600", "--cpp-chunk-tokens", str(args.chunk_tokens),
        "--cpp-min-tokens", "1024",
    ]  # fmt: skip
    shapes = {
        "1 stage": ["--prefill", "1", "--decode", "1", "--cpp-stages", "1"],
        "2 stages": ["--prefill", "2", "--decode", "1", "--cpp-stages", "2"],
    }
    clusters = {
        name: LocalCluster([*common, *argv], work / "cache", SECRET, work / f"{i}.log")
        for i, (name, argv) in enumerate(shapes.items())
    }
    rng = random.Random(0)
    rows: list[dict] = []
    try:
        for cluster in clusters.values():  # one at a time: they share the profile cache
            cluster.start()
            cluster.wait_ready(timeout_s=900)
        vocab = 4000  # inside both presets' vocabularies (tiny 4,096, small 8,192)
        for size in args.sizes:
            for rep in range(args.repeats):
                for name, cluster in clusters.items():
                    prompt = [rng.randrange(2, vocab) for _ in range(size)]
                    cpp_before = stage_counts(cluster)
                    result = measure(cluster.base_url, prompt, args.timeout_s)
                    result.update(shape=name, size=size, repeat=rep,
                                  via_group=stage_counts(cluster) > cpp_before)  # fmt: skip
                    rows.append(result)
                    print(json.dumps(result), flush=True)
    finally:
        for cluster in clusters.values():
            cluster.stop()
    return {"args": vars(args), "rows": rows, "summary": summarize(rows, args.sizes)}


def summarize(rows: list[dict], sizes: list[int]) -> list[dict]:
    """Median TTFT per size and shape, and the speed-up of 2 stages over 1."""
    out = []
    for size in sizes:
        med = {}
        for shape in ("1 stage", "2 stages"):
            picked = [r for r in rows if r["size"] == size and r["shape"] == shape]
            med[shape] = {
                "ttft_s": statistics.median(r["ttft_s"] for r in picked),
                "e2e_s": statistics.median(r["e2e_s"] for r in picked),
                "via_group": all(r["via_group"] for r in picked),
                "n": len(picked),
            }
        speedup = med["1 stage"]["ttft_s"] / med["2 stages"]["ttft_s"]
        out.append({"size": size, **{k: v for k, v in med.items()}, "speedup": speedup})
    return out


def markdown(summary: list[dict]) -> str:
    """The docs/benchmarks.md table."""
    lines = [
        "| prompt tokens | 1 stage TTFT s | 2 stages TTFT s | speed-up | via the group |",
        "|---:|---:|---:|---:|---|",
    ]
    for row in summary:
        one, two = row["1 stage"], row["2 stages"]
        lines.append(
            f"| {row['size']:,} | {one['ttft_s']:.1f} | {two['ttft_s']:.1f} | "
            f"{row['speedup']:.2f}x | {'yes' if two['via_group'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="small")
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32000])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--kv-cache-mb", type=float, default=1024.0)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--work-dir", default="/tmp/halfmoon-cpp-live")
    p.add_argument("--json", default=None, help="write rows and summary here")
    args = p.parse_args(argv)
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
