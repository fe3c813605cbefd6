"""A request's KV hand-off in a live cluster: co-located prefill and decode workers over a
socket (``--transport tcp``) against shared memory (``auto``: the decode worker's inbox
is a shared region the prefill worker copies each layer into), with and without
``--kv-compression int8``.

Every configuration runs as its own ``halfmoon serve`` cluster (1 prefill + 1 decode
worker, all on this host), all up at once; requests go to them in turn (one at a time,
the order rotating each round), each a distinct prompt of ``--prompt-tokens`` (no prefix
reuse) streamed with ``max_tokens=2``. Per request: TTFT (the prefill worker sends the
first token once its KV stream is acknowledged, so the stream's tail is in it), the time
to the second token, and the **hand-off gap** between the two (the decode worker's part:
the handoff message, the import into the pool and one decode step). All medians. The
decode worker's counters say where the streams landed (its inbox or a region of their
own). Run from the repository root::

    .venv/bin/python -m benchmarks.micro.kv_handoff --json benchmarks/results/kv_handoff.json
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

CONFIGS = {
    "tcp": ("--transport", "tcp"),
    "shm": ("--transport", "auto"),
    "tcp+int8": ("--transport", "tcp", "--kv-compression", "int8"),
    "shm+int8": ("--transport", "auto", "--kv-compression", "int8"),
}


def prompt(base_url: str, model: str, rng: random.Random, tokens: int) -> str:
    """A prompt of at most ``tokens`` tokens (counted by the server's ``/tokenize``) that
    no other request shares a prefix with."""
    words = [f"{rng.randrange(1000)}" for _ in range(tokens)]
    while True:
        text = " ".join(words)
        count = httpx.post(base_url + "/tokenize", json={"model": model, "prompt": text}).json()
        if count["count"] <= tokens:
            return text
        words = words[: int(len(words) * tokens / count["count"]) - 1]


def one_request(base_url: str, model: str, text: str) -> tuple[float, float, int]:
    """(TTFT, first-to-second-token gap, prompt tokens) of one streamed request."""
    body = {"model": model, "prompt": text, "max_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    stamps, usage = [], {}
    start = time.perf_counter()
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    if len(stamps) != 2:
        raise RuntimeError(f"expected 2 streamed tokens, got {len(stamps)}")
    return stamps[0] - start, stamps[1] - stamps[0], int(usage.get("prompt_tokens", 0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=8, help="requests per configuration")
    parser.add_argument("--kv-cache-mb", type=int, default=1024)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    from halfmoon.engine.catalog import cache_dir
    from halfmoon.serve.launch.local import LocalCluster

    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    stats: dict[str, list[dict[str, Any]]] = {}
    logs = Path(tempfile.mkdtemp(prefix="kv-handoff-"))
    with ExitStack() as stack:
        clusters = {}
        for name in names:  # one by one: the first start may build kernels into the cache
            argv = ["--model", args.model, "--prefill", "1", "--decode", "1",
                    "--kv-cache-mb", str(args.kv_cache_mb), "--startup-timeout", "900",
                    *CONFIGS[name]]  # fmt: skip
            cluster = LocalCluster(argv, cache_dir(), secrets.token_hex(16), logs / f"{name}.log")
            stack.callback(cluster.stop)
            cluster.start().wait_ready(900)  # a first start measures the engine, builds kernels
            clusters[name] = cluster
            print(f"{name}: up at {cluster.base_url}", flush=True)
        model = httpx.get(next(iter(clusters.values())).base_url + "/v1/models").json()
        model_id = model["data"][0]["id"]
        first = next(iter(clusters.values())).base_url
        rng = random.Random(7)
        prompts = [prompt(first, model_id, rng, args.prompt_tokens) for _ in range(args.rounds + 1)]
        for cluster in clusters.values():  # warm-up (not timed)
            one_request(cluster.base_url, model_id, prompts[0])
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                ttft, gap, tokens = one_request(clusters[name].base_url, model_id, prompts[r + 1])
                runs[name].append({"ttft_s": ttft, "handoff_gap_s": gap, "prompt_tokens": tokens})
            print(f"round {r + 1}: " + ", ".join(
                f"{n} {runs[n][-1]['handoff_gap_s'] * 1e3:.1f} ms" for n in names), flush=True)  # fmt: skip
        for name, cluster in clusters.items():
            stats[name] = [{"role": p.role, **p.stats} for p in cluster.ping_workers()]
    result = {"args": vars(args), "runs": runs, "stats": stats, "summary": {}}
    print("\n| configuration | prompt tokens | TTFT ms | 2nd token ms | hand-off gap ms | "
          "gap, each round | decode landings (inbox / own) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---|---|")
    for name in names:
        gaps = [x["handoff_gap_s"] * 1e3 for x in runs[name]]
        ttft = statistics.median(x["ttft_s"] * 1e3 for x in runs[name])
        second = statistics.median((x["ttft_s"] + x["handoff_gap_s"]) * 1e3 for x in runs[name])
        decode = next(s for s in stats[name] if s["role"] == "decode")
        landings = f"{decode.get('kv_inbox_landings')} / {decode.get('kv_private_landings')}"
        result["summary"][name] = {"ttft_ms": ttft, "second_token_ms": second,
                                   "handoff_gap_ms": statistics.median(gaps)}  # fmt: skip
        print(f"| {name} | {runs[name][0]['prompt_tokens']} | {ttft:.1f} | {second:.1f} | "
              f"{statistics.median(gaps):.1f} | {', '.join(f'{g:.1f}' for g in gaps)} | {landings} |")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
