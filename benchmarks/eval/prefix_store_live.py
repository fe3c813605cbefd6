"""``--prefix-store copy`` against ``demote`` in a live cluster (#21 goal 5): the prefix hit
ratio, TTFT and block-store memory of the same requests, and whether the answers match.

For each store size and policy a fresh ``halfmoon serve`` (the ``tiny`` preset, 2 prefill
+ 1 decode workers, one torch thread each, a small ``--kv-cache-mb`` pool so the pool
evicts, ``--store-dram-mb`` the store) gets the same prompts: a document picked by a Zipf
law out of ``--documents``, then a question of its own (as
``benchmarks/micro/prefix_store.py``), ``--max-tokens`` greedy tokens each, streamed,
``--concurrency`` requests in flight. Store sizes are per prefill worker. Measured,
after ``--warmup`` requests:

- hit ratio: ``usage.prompt_tokens_details.cached_tokens`` / prompt tokens, summed;
- TTFT p50 / p90 (client side: request sent to first token event; a noisy 2-core host);
- the stores (``/metrics``, summed over the prefill workers, DRAM tier): bytes held,
  sampled every ``--sample-every`` requests and at the end, and blocks written into them
  (blocks held + blocks evicted: nothing else removes a block); the workers' pongs add
  blocks demoted, loaded from the store, pulled from a peer and read for peers;
- errors (none expected), and whether the answers (text and tokens) are the same under
  both policies (greedy: they must be), with the largest difference of a token's
  log-probability between them.

Run from the repository root (about 8 minutes on 2 cores)::

    .venv/bin/python -m benchmarks.eval.prefix_store_live \
        --json benchmarks/results/prefix_store_live.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import http.client
import json
import secrets
import statistics
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from benchmarks.micro.prefix_store import add_workload_options, equal_hit_savings, workload
from halfmoon.serve.launch.local import LocalCluster

POLICIES = ("copy", "demote")
#: A record's per-request answers: compared, digested, not written out.
ANSWER_KEYS = ("texts", "tokens", "logprobs")


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples in a Prometheus text exposition whose labels include
    ``labels`` (0.0 when there is none)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def stream_completion(url: str, prompt: list[int], max_tokens: int, timeout_s: float) -> dict:
    """One streamed greedy completion: its text, tokens and their log-probabilities, cached
    tokens and TTFT, or its error."""
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout_s)
    out: dict[str, Any] = {"text": "", "tokens": [], "logprobs": [], "cached_tokens": None,
                           "ttft_s": None, "error": None}  # fmt: skip
    start = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        if resp.status != 200:
            out["error"] = f"HTTP {resp.status}: {resp.read()[:300]!r}"
            return out
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                out["error"] = str(event["error"])[:300]
            for choice in event.get("choices") or []:
                if out["ttft_s"] is None:
                    out["ttft_s"] = time.monotonic() - start
                out["text"] += choice.get("text") or ""
                logprobs = choice.get("logprobs") or {}
                out["tokens"] += logprobs.get("tokens") or []
                out["logprobs"] += logprobs.get("token_logprobs") or []
            details = (event.get("usage") or {}).get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                out["cached_tokens"] = details["cached_tokens"]
    except (OSError, ValueError) as exc:
        out["error"] = repr(exc)[:300]
    finally:
        conn.close()
    return out


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return r.read().decode()


def store_state(text: str) -> dict[str, float]:
    """The prefill workers' stores and the gateway's prefix counters, from one scrape."""
    dram = {"role": "prefill", "tier": "dram"}
    return {
        "store_bytes": metric_sum(text, "halfmoon:kv_store_bytes", **dram),
        "store_blocks": metric_sum(text, "halfmoon:kv_store_blocks", **dram),
        "store_capacity_blocks": metric_sum(text, "halfmoon:kv_store_capacity_blocks", **dram),
        "store_evictions": metric_sum(text, "halfmoon:kv_store_evictions_total", **dram),
        "store_hits": metric_sum(text, "halfmoon:kv_store_hits_total", **dram),
        "pool_used_blocks": metric_sum(text, "halfmoon:kv_cache_used_blocks", role="prefill"),
        "prefix_queries": metric_sum(text, "halfmoon:prefix_cache_queries_total", role="gateway"),
        "prefix_hits": metric_sum(text, "halfmoon:prefix_cache_hits_total", role="gateway"),
    }


def _send_all(url: str, prompts: list[list[int]], args: argparse.Namespace,
              on_done: Any) -> list[dict]:  # fmt: skip
    """Every prompt, ``args.concurrency`` at a time, in order of submission."""
    results: list[dict] = [{} for _ in prompts]
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        futures = {
            pool.submit(stream_completion, url, p, args.max_tokens, args.timeout_s): i
            for i, p in enumerate(prompts)
        }  # the pool runs them first come first served
        for done, future in enumerate(concurrent.futures.as_completed(futures), 1):
            results[futures[future]] = future.result()
            on_done(done)
    return results


def run_one(policy: str, store_mb: float, prompts: list[list[int]], args: argparse.Namespace,
            cache: Path, work: Path) -> dict:  # fmt: skip
    """One fresh cluster through every prompt; its numbers and its answers."""
    argv = [
        "--model", args.model, "--served-model-name", "bench", "--prefill", "2", "--decode", "1",
        "--num-threads", "1", "--kv-cache-mb", str(args.pool_mb), "--store-dram-mb",
        str(store_mb), "--prefix-store", policy, "--max-model-len", str(args.max_model_len),
        "--early-reject", "none", "--ttft-slo", "3600", "--decode-guard", "off",
        "--disable-access-log",
    ]  # fmt: skip
    samples: list[float] = []  # store bytes held, during the measured requests
    cluster = LocalCluster(argv, cache, secrets.token_hex(16), work / f"{policy}-{store_mb:g}.log")
    try:
        cluster.start()
        cluster.wait_ready(timeout_s=900)  # the first start measures the cost profile
        url = cluster.base_url

        def on_done(num_done: int) -> None:
            if num_done > args.warmup and num_done % args.sample_every == 0:
                samples.append(store_state(_scrape(url))["store_bytes"])

        started = time.monotonic()
        results = _send_all(url, prompts, args, on_done)
        seconds = time.monotonic() - started
        state = store_state(_scrape(url))
        pongs = [p for p in cluster.ping_workers() if p.role == "prefill"]
    finally:
        cluster.stop()
    samples.append(state["store_bytes"])
    record = {"policy": policy, "store_mb": store_mb, "pool_mb": args.pool_mb,
              **measure(results, prompts, args.warmup), "seconds": seconds,
              "store_mib_held_mean": statistics.fmean(samples) / 2**20}  # fmt: skip
    record.update(store_numbers(state))
    for key in ("blocks_loaded", "blocks_pulled", "blocks_demoted", "blocks_read_for_peers"):
        record[key] = sum(int(p.stats.get(key, 0)) for p in pongs)
    record["texts"] = [r["text"] for r in results]
    record["tokens"] = [r["tokens"] for r in results]
    record["logprobs"] = [r["logprobs"] for r in results]
    return record


def measure(results: list[dict], prompts: list[list[int]], warmup: int) -> dict:
    """Errors over every request; hit ratio and TTFT over those after the warm-up."""
    measured = results[warmup:]
    prompt_tokens = sum(len(p) for p in prompts[warmup:])
    ttfts = sorted(r["ttft_s"] for r in measured if r["ttft_s"] is not None)
    return {
        "num_requests": len(results),
        "num_errors": sum(1 for r in results if r["error"]),
        "errors": [r["error"] for r in results if r["error"]][:5],
        "hit_ratio": sum(r["cached_tokens"] or 0 for r in measured) / prompt_tokens,
        "ttft_p50_s": _quantile(ttfts, 0.5),
        "ttft_p90_s": _quantile(ttfts, 0.9),
    }


def store_numbers(state: dict[str, float]) -> dict[str, Any]:
    """The stores at the end of a run; blocks written = held + evicted (nothing else
    removes a block from a store without an SSD tier)."""
    written = state["store_blocks"] + state["store_evictions"]
    block_bytes = state["store_bytes"] / state["store_blocks"] if state["store_blocks"] else 0.0
    return {
        "store_mib_held": state["store_bytes"] / 2**20,
        "store_blocks_written": int(written),
        "store_mib_written": written * block_bytes / 2**20,
        **state,
    }


def _quantile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def compare_answers(records: list[dict]) -> dict[str, Any]:
    """Per store size, the requests whose answer (text and tokens) differs between the
    policies, and the largest difference of a generated token's log-probability among
    the others."""
    out: dict[str, Any] = {}
    by_size: dict[float, list[dict]] = {}
    for r in records:
        by_size.setdefault(r["store_mb"], []).append(r)
    for size, runs in sorted(by_size.items()):
        if len(runs) < 2:
            continue
        first, *rest = runs
        differ: set[int] = set()
        max_diff = 0.0
        for other in rest:
            for i, text in enumerate(first["texts"]):
                if text != other["texts"][i] or first["tokens"][i] != other["tokens"][i]:
                    differ.add(i)
                    continue
                pairs = zip(first["logprobs"][i], other["logprobs"][i], strict=True)
                max_diff = max([max_diff, *(abs(x - y) for x, y in pairs)])
        out[f"{size:g}"] = {"num_differ": len(differ), "first_differ": sorted(differ)[:10],
                            "max_logprob_diff": max_diff}  # fmt: skip
    return out


def summary(record: dict) -> dict:
    """A record without its per-request answers, with a digest of its texts and tokens
    (equal digests: the same answers)."""
    answers = json.dumps([record["texts"], record["tokens"]]).encode()
    out = {k: v for k, v in record.items() if k not in ANSWER_KEYS}
    return {**out, "answers_sha256": hashlib.sha256(answers).hexdigest()[:16]}


def markdown(records: list[dict]) -> str:
    """The docs/benchmarks.md table."""
    lines = [
        "| store MiB | policy | hit ratio | TTFT p50 ms | TTFT p90 ms | store MiB held "
        "(mean, end) | MiB written into the store | demoted | pulled | read for peers | errors |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['store_mb']:g} | {r['policy']} | {r['hit_ratio']:.3f} | "
            f"{1000 * (r['ttft_p50_s'] or 0):.0f} | {1000 * (r['ttft_p90_s'] or 0):.0f} | "
            f"{r['store_mib_held_mean']:.1f}, {r['store_mib_held']:.1f} | "
            f"{r['store_mib_written']:.0f} | {r['blocks_demoted']} | {r['blocks_pulled']} | "
            f"{r['blocks_read_for_peers']} | {r['num_errors']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run every policy at every store size; print the table, optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--pool-mb", type=float, default=4.0, help="each worker's KV pool")
    p.add_argument(
        "--store-mb", default="1,2,4,6,8,12,16", help="store DRAM sizes (per worker) to sweep"
    )
    p.add_argument("--max-model-len", type=int, default=1000, help="as the measured run")
    add_workload_options(p, requests=600, warmup=100)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--sample-every", type=int, default=25)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--work-dir", default="/tmp/halfmoon-prefix-store-live")
    p.add_argument("--json", default=None, help="write every number here")
    args = p.parse_args(argv)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    cache = work / "cache"  # shared: the preset, kernels and profile are made once
    prompts = workload(args)
    records = []
    for size in (float(s) for s in args.store_mb.split(",")):
        for policy in POLICIES:
            r = run_one(policy, size, prompts, args, cache, work)
            records.append(r)
            print(json.dumps(summary(r)), flush=True)
    answers = compare_answers(records)
    savings = equal_hit_savings(records)
    print(markdown(records))
    print("answers differing between the policies, per store size:", json.dumps(answers))
    digests = {summary(r)["answers_sha256"] for r in records}
    print(f"distinct answer sets over the {len(records)} runs: {len(digests)}")
    print("at equal hit ratio (store MiB per prefill worker):")
    smallest = min((r["store_mb"] for r in records if r["policy"] == "demote"), default=None)
    for s in savings:
        if s["demote_store_mb"] is None:
            reached = "demote: not within the sweep"
        elif s["demote_store_mb"] == smallest:
            reached = f"demote reaches it with at most {smallest:g} (the sweep's smallest)"
        else:
            reached = (
                f"demote reaches it with {s['demote_store_mb']:.1f} (saves {s['saved_mb']:.1f})"
            )
        print(f"  copy, {s['copy_store_mb']:g}: hit ratio {s['hit_ratio']:.3f}; {reached}")
    if args.json:
        out = {"options": vars(args), "records": [summary(r) for r in records],
               "answers": answers, "equal_hit": savings}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
