"""``halfmoon bench``: replay a trace or a synthetic dataset against an OpenAI endpoint."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from halfmoon.bench.client import ClientConfig
from halfmoon.bench.report import bench_report, format_bench
from halfmoon.bench.runner import BenchRun, run_benchmark
from halfmoon.bench.workload import (
    BenchRequest,
    PromptMaker,
    PromptSpec,
    block_tokens_for_scale,
    plan_requests,
)
from halfmoon.core.config import TBT_METRICS, SLOConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.flags import check_positive
from halfmoon.metrics.records import records_to_json
from halfmoon.workload.cli import add_workload_args, with_priority_mix
from halfmoon.workload.datasets import DATASETS, generate_dataset
from halfmoon.workload.trace import iter_trace


def normalize_url(url: str) -> str:
    """``http(s)://host[:port][/prefix]`` without a trailing ``/`` or ``/v1``."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HalfmoonError(f"--url must look like http://HOST:PORT, got {url!r}")
    base = url.strip().rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def discover_model(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> str:
    """The first model the server lists at ``/v1/models``."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(
            f"{base_url}/v1/models", headers=headers, timeout=timeout_s, trust_env=False
        )
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except httpx.HTTPStatusError as exc:
        raise HalfmoonError(
            f"cannot list models at {base_url}/v1/models: HTTP {exc.response.status_code}"
        ) from None
    except httpx.HTTPError as exc:
        raise HalfmoonError(f"cannot reach {base_url}: {exc or type(exc).__name__}") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise HalfmoonError(f"{base_url}/v1/models lists no model; pass --model") from None


def profiler_call(base_url: str, api_key: str | None, op: str, timeout_s: float) -> dict:
    """``POST /start_profile`` or ``/stop_profile`` (``op``: ``start`` or ``stop``; vLLM's
    routes, which halfmoon and vLLM serve with ``--profiler-config``): the answer's JSON
    (``{}`` for vLLM's empty one); a HalfmoonError names a server without them."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{base_url}/{op}_profile"
    try:
        response = httpx.post(url, headers=headers, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as exc:
        raise HalfmoonError(f"cannot reach {url}: {exc or type(exc).__name__}") from None
    if response.status_code == 404:
        raise HalfmoonError(f"{base_url} serves no /{op}_profile: start the server with "
                            "--profiler-config (--profile asks it to profile the run)")  # fmt: skip
    if response.status_code != 200:
        raise HalfmoonError(f"{url}: HTTP {response.status_code}: {response.text[:200]}")
    try:
        answer = response.json() if response.content else {}
    except ValueError:
        answer = {}
    return answer if isinstance(answer, dict) else {}


def _plan(args: argparse.Namespace) -> tuple[list[BenchRequest], str]:
    """The planned requests and a short description of the workload."""
    if args.trace is not None:
        if args.rate is not None or args.num_requests is not None:
            raise HalfmoonError("--rate and --num-requests go with --dataset, not --trace")
        requests: Any = iter_trace(args.trace)
        label = Path(args.trace).name
    else:
        if args.rate is None or args.num_requests is None:
            raise HalfmoonError("--dataset needs --rate and --num-requests")
        if args.dataset not in DATASETS:
            raise HalfmoonError(
                f"unknown dataset {args.dataset!r}; choose from {', '.join(DATASETS)}"
            )
        requests = generate_dataset(args.dataset, args.rate, args.num_requests, args.seed)
        label = f"{args.dataset}@{args.rate:g}/s"
    planned = plan_requests(
        with_priority_mix(requests, args), args.time_scale, args.length_scale, args.max_requests
    )
    return planned, label


def _progress(total: int) -> tuple[Callable[[], None] | None, Callable[[], None]]:
    """A tqdm bar on stderr when it is a terminal: (per-request tick, close)."""
    if not sys.stderr.isatty():
        return None, lambda: None
    from tqdm import tqdm  # only for interactive runs

    bar = tqdm(total=total, desc="bench", unit="req", file=sys.stderr)
    return bar.update, bar.close


def run_bench(args: argparse.Namespace) -> int:
    """Plan the workload, run it against the server, print and write the report."""
    if args.tbt_metric not in TBT_METRICS:
        raise HalfmoonError(
            f"unknown tbt metric {args.tbt_metric!r}; choose from {', '.join(TBT_METRICS)}"
        )
    slo = SLOConfig(
        check_positive("--ttft-slo", args.ttft_slo), check_positive("--tbt-slo", args.tbt_slo),
        args.tbt_metric,
    )  # fmt: skip
    base_url = normalize_url(args.url)
    planned, label = _plan(args)
    prompts = PromptMaker(
        PromptSpec(args.vocab_size, args.min_token_id, args.salt),
        block_tokens_for_scale(args.length_scale),
    )
    model = args.model or discover_model(base_url, args.api_key)
    config = ClientConfig(
        base_url, model, args.api_key, args.temperature, not args.no_vllm_extensions,
        check_positive("--timeout", args.timeout),
    )  # fmt: skip
    if args.profile:
        profiler_call(base_url, args.api_key, "start", 60.0)
    tick, close = _progress(len(planned))
    try:
        run = run_benchmark(planned, config, prompts, args.max_concurrency, tick)
    finally:
        close()
        if args.profile:
            stopped = profiler_call(base_url, args.api_key, "stop", 300.0)
            for worker, paths in sorted((stopped.get("traces") or {}).items()):
                print(f"profiler trace of {worker}: {', '.join(paths)}")
    report = bench_report(run, slo, {
        "url": base_url, "model": model, "workload": label, "time_scale": args.time_scale,
        "length_scale": args.length_scale, "max_concurrency": args.max_concurrency,
        "salt": args.salt,
    }, {p.request_id: p.request.priority for p in planned if p.request.priority})  # fmt: skip
    print(format_bench(report))
    _write_outputs(args, report, run, label, slo)
    return 0


def _write(path: str, text: str) -> None:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        raise HalfmoonError(f"cannot write {path}: {exc.strerror}") from None


def _write_outputs(
    args: argparse.Namespace, report: dict, run: BenchRun, label: str, slo: SLOConfig
) -> None:
    if args.json is not None:
        _write(args.json, json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.json}")
    if args.records is not None:
        _write(args.records, json.dumps(records_to_json(run.records)) + "\n")
        print(f"records written to {args.records}")
    if args.plot is not None:
        from halfmoon.metrics.plots import plot_report

        plot_report({label: run.records}, slo, args.plot)
        print(f"plot written to {args.plot}")


def register(subparsers: Any) -> None:
    """Add ``halfmoon bench``."""
    parser = subparsers.add_parser(
        "bench",
        help="replay a trace or dataset against an OpenAI-compatible server",
        description="Stream /v1/completions requests built from a Mooncake trace's block "
        "ids (shared prefixes are real) at the trace's times; measure TTFT, every "
        "inter-token gap, SLO attainment and goodput; report with the same keys as "
        "halfmoon simulate.",
    )
    parser.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    add_workload_args(parser)
    parser.add_argument("--salt", type=int, default=0, help="token universe (new salt: cold cache)")
    parser.add_argument("--vocab-size", type=int, default=4096, help="token ids are < this")
    parser.add_argument("--min-token-id", type=int, default=16, help="token ids are >= this")
    parser.add_argument("--model", help="model name (default: the server's first /v1/models)")
    parser.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default $OPENAI_API_KEY)",
    )  # fmt: skip
    parser.add_argument("--max-concurrency", type=int, help="at most C requests in flight")
    parser.add_argument(
        "--temperature", type=float, default=1.0,
        help="sampling temperature (1: OpenAI's default; greedy decoding of a random-weight "
        "model repeats one token, whose text may be empty)",
    )  # fmt: skip
    parser.add_argument("--timeout", type=float, default=600.0, help="per-request limit, seconds")
    parser.add_argument(
        "--no-vllm-extensions", action="store_true",
        help="send only OpenAI's own fields (no ignore_eos/min_tokens/continuous usage)",
    )  # fmt: skip
    parser.add_argument("--ttft-slo", type=float, default=30.0, help="TTFT limit, seconds")
    parser.add_argument("--tbt-slo", type=float, default=0.1, help="TBT limit, seconds")
    parser.add_argument(
        "--tbt-metric", default="top10mean", help=f"one of {', '.join(TBT_METRICS)}"
    )
    parser.add_argument(
        "--profile", action="store_true",
        help="have the server profile the run (its POST /start_profile before, /stop_profile "
        "after: a server started with --profiler-config, halfmoon's or vLLM's) and print "
        "where each worker's trace went",
    )  # fmt: skip
    parser.add_argument("--json", metavar="OUT", help="write the JSON report here")
    parser.add_argument("--records", metavar="OUT", help="write every request's record (JSON)")
    parser.add_argument("--plot", metavar="OUT.png", help="write TTFT/TBT CDFs here")
    parser.set_defaults(func=run_bench)
