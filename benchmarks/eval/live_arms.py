"""What the live A/B evaluations share: a fresh overloaded tiny 1P1D cluster per arm,
the arms' order rotating by round, one streamed request and its outcome, a run's
summary (admitted, refused, on time, goodput, TTFT) and its table cells and JSON.
Used by :mod:`benchmarks.eval.prefill_calibration_live` and
:mod:`benchmarks.eval.priority_live`."""

from __future__ import annotations

import argparse
import contextlib
import json
import secrets
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from halfmoon.engine.catalog import cache_dir
from halfmoon.serve.launch.local import LocalCluster


def rotated(order: list[str], round_index: int) -> list[str]:
    """The arms of a round: ``order`` started one further each round."""
    start = round_index % len(order)
    return order[start:] + order[:start]


@contextlib.contextmanager
def overloaded_1p1d(ttft_slo: float, serve_args: list[str]) -> Iterator[LocalCluster]:
    """A fresh ``halfmoon serve --model tiny --prefill 1 --decode 1 --num-threads 1
    --early-reject snapshot --ttft-slo S`` with ``serve_args`` (its log in a temporary
    directory), stopped on exit."""
    serve = [
        "--model", "tiny", "--prefill", "1", "--decode", "1", "--num-threads", "1",
        "--early-reject", "snapshot", "--ttft-slo", str(ttft_slo), *serve_args,
    ]  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="halfmoon-eval-") as tmp:
        log = Path(tmp) / "serve.log"
        with LocalCluster(serve, cache_dir(), secrets.token_hex(16), log) as cluster:
            yield cluster


async def one(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[int, float]:
    """(HTTP status, seconds to the answer's head: a 200's first token)."""
    sent = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            head = time.perf_counter() - sent
            raw = await r.aread()
    except httpx.HTTPError:
        return -1, time.perf_counter() - sent
    if r.status_code == 200 and b"[DONE]" not in raw:
        return -1, head
    return r.status_code, head


def summary(results: list[tuple[float, int, float]], slo: float, duration: float) -> dict:
    ok = [head for _, status, head in results if status == 200]
    on_time = [h for h in ok if h <= slo]
    ordered = sorted(ok)
    return {
        "requests": len(results),
        "admitted": len(ok),
        "refused": sum(1 for _, s, _ in results if s == 429),
        "failed": sum(1 for _, s, _ in results if s not in (200, 429)),
        "admitted_on_time": len(on_time),
        "promise_kept": len(on_time) / len(ok) if ok else None,
        "goodput_rps": len(on_time) / duration,
        "ttft_p50_s": statistics.median(ordered) if ordered else None,
        "ttft_p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else None,
    }


def summary_cells(s: dict) -> tuple[str, str]:
    """A :func:`summary`'s promise kept and TTFT p50 / p90 as table cells."""
    kept = "-" if s["promise_kept"] is None else f"{s['promise_kept']:.2f}"
    ttft = "-" if s["ttft_p50_s"] is None else f"{s['ttft_p50_s']:.2f} / {s['ttft_p90_s']:.2f}"
    return kept, ttft


def write_runs(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    """Every run, with the arguments, to ``args.json`` (when given)."""
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "runs": runs}, indent=1) + "\n")  # fmt: skip
