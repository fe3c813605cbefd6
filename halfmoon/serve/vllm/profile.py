"""A vLLM server's cost profile, measured through its own API (the Conductor's TTFT and
TBT estimates in real seconds for that server, as :mod:`halfmoon.engine.profiler` does for
halfmoon's engine).

Prefill: the time from sending a ``max_tokens=1`` request to its end, for a few prompt
lengths with and without a cached prefix (HTTP included: that is what a request pays).
Decode: ``b`` streams decoding together, the median gap between a stream's tokens once
all have their first. Prompts are distinct pseudo-random ids, so nothing is cached unless
meant to be. Cached as JSON per server shape and :data:`PROFILE_VERSION`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from halfmoon.core.request import SamplingParams
from halfmoon.costmodel import CostProfile, fit_profile
from halfmoon.serve.vllm.server import parse_metric_values

log = logging.getLogger(__name__)

PROFILE_VERSION = 2
PREFILL_POINTS = ((32, 0), (256, 0), (1024, 0), (256, 512), (128, 1024))
DECODE_POINTS = ((1, 64), (4, 256), (8, 256), (16, 128), (4, 1024))
#: Used when fewer than three of DECODE_POINTS fit the pool.
SMALL_DECODE_POINTS = ((1, 32), (2, 64), (4, 32), (2, 128), (4, 64))
_DECODE_TOKENS = 16
_TIMEOUT_S = 120.0
#: A request group with no output for this long is aborted and sent again (_ATTEMPTS in all).
_STALL_S = 30.0
_ATTEMPTS = 3
_RUNNING = "vllm:num_requests_running"
_WAITING = "vllm:num_requests_waiting"


def _tokens(vocab: int, n: int, salt: int) -> list[int]:
    return [(salt * 7919 + i * 104729) % (vocab - 16) + 8 for i in range(n)]


def _server_state(connector: Any) -> str:
    """What the server last said of its queues (from its polled ``/metrics``)."""
    values = parse_metric_values(getattr(connector, "metrics_text", ""), (_RUNNING, _WAITING))
    if not values:
        return "its /metrics not read yet"
    return f"vLLM reports {values.get(_RUNNING, 0):g} running, {values.get(_WAITING, 0):g} waiting"


def _run(
    connector: Any, prompts: dict[str, list[int]], params: SamplingParams
) -> tuple[dict[str, list[float]], float]:
    """Run requests to the end: ``{request id: [arrival time of each token]}`` and the
    ``perf_counter`` time they were sent.

    Requests that get nothing back for :data:`_STALL_S` (their work takes milliseconds)
    are aborted and the group is sent again, at most :data:`_ATTEMPTS` times, with a
    warning: a CI run once saw a fresh server leave the warm-up request unanswered.
    """
    for attempt in range(_ATTEMPTS):
        wire = {(rid if attempt == 0 else f"{rid}-retry{attempt}"): rid for rid in prompts}
        sent = time.perf_counter()
        for wire_id, rid in wire.items():
            connector.add_request(wire_id, prompts[rid], params)
        times: dict[str, list[float]] = {rid: [] for rid in prompts}
        pending = set(wire)
        deadline = time.monotonic() + _TIMEOUT_S
        heard = time.monotonic()
        while pending and time.monotonic() - heard < _STALL_S:
            if time.monotonic() > deadline:
                raise TimeoutError("profiling the vLLM server took too long")
            for out in connector.step():
                heard = time.monotonic()
                times[wire[out.request_id]] += [time.perf_counter()] * len(out.new_token_ids)
                if out.finished:
                    pending.discard(out.request_id)
            for failure in connector.take_failures():
                raise RuntimeError(f"profiling request failed: {failure.error}")
        if not pending:
            return times, sent
        for wire_id in pending:
            connector.abort_request(wire_id)
        log.warning(
            "profiling: no answer to %s from the vLLM server for %.0fs (%s)%s",
            ", ".join(sorted(pending)), _STALL_S, _server_state(connector),
            "; sending again" if attempt + 1 < _ATTEMPTS else "",
        )  # fmt: skip
    raise TimeoutError(
        f"profiling the vLLM server: no answer in {_ATTEMPTS} tries of {_STALL_S:g}s "
        f"({_server_state(connector)})"
    )


def measure_server_profile(connector: Any, model_name: str, vocab: int) -> CostProfile:
    """Time the server (tens of seconds on a CPU) and fit a profile."""
    once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    limit = connector.max_model_len - 32
    pool = connector.stats().num_blocks * connector.config.block_size
    _run(connector, {"warm": _tokens(vocab, 16, 1)}, once)
    prefill = []
    for k, (new, cached) in enumerate(PREFILL_POINTS):
        if new + cached + 16 > min(limit, pool - 64):
            continue
        prefix = _tokens(vocab, cached, 100 + k)
        if cached:
            _run(connector, {f"p{k}-prefix": prefix + _tokens(vocab, 16, 200 + k)}, once)
        _, sent = _run(connector, {f"p{k}": prefix + _tokens(vocab, new, 300 + k)}, once)
        prefill.append((new, cached, time.perf_counter() - sent))
    decode = []
    params = SamplingParams(max_tokens=_DECODE_TOKENS, temperature=0, ignore_eos=True)

    def fits(batch: int, ctx: int) -> bool:  # with room for vLLM's rounding to its blocks
        return ctx + _DECODE_TOKENS <= limit and batch * (ctx + _DECODE_TOKENS + 64) <= pool

    points = [(b, ctx) for b, ctx in DECODE_POINTS if fits(b, ctx)]
    if len(points) < 3:
        points = [(b, ctx) for b, ctx in SMALL_DECODE_POINTS if fits(b, ctx)]
    for k, (batch, ctx) in enumerate(points):
        prompts = {f"d{k}-{i}": _tokens(vocab, ctx, 1000 + 100 * k + i) for i in range(batch)}
        times, _ = _run(connector, prompts, params)
        all_started = max(t[0] for t in times.values())
        # Each sequence's mean gap once all run (not the median of single gaps: on a
        # loaded machine tokens arrive in bursts, and most single gaps are then 0).
        steps = []
        for t in times.values():
            running = [a for a in t if a >= all_started]
            if len(running) >= 2 and running[-1] > running[0]:
                steps.append((running[-1] - running[0]) / (len(running) - 1))
        if steps:
            decode.append((batch, batch * ctx, statistics.median(steps)))
    return fit_profile(prefill, decode, model_name=model_name, device="vllm")


def cached_server_profile(connector: Any, model: str, cache_dir: Path) -> CostProfile:
    """The server's profile, measured once per shape and then read from ``cache_dir``."""
    facts = connector.facts
    config = json.loads((Path(connector.config.model) / "config.json").read_text())
    launch = getattr(connector.process, "launch", None)
    # Servers of one shape share a profile (one measures, alone, while the others wait),
    # so equal servers get equal estimates: per-server profiles measured side by side
    # differ by the noise of that moment, and a least-TTFT router then favours one.
    key = json.dumps([
        str(Path(connector.config.model).resolve()), facts.model, facts.block_size,
        facts.num_blocks, facts.max_model_len, connector.config.dtype,
        launch.num_threads if launch else "attached", PROFILE_VERSION,
    ])  # fmt: skip
    path = cache_dir / f"vllm-profile-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    cache_dir.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one server of a fleet measures, the rest read
        if path.exists():
            return CostProfile.load(path)
        log.info("measuring the vLLM server's cost profile (once per shape)")
        profile = measure_server_profile(connector, model, int(config["vocab_size"]))
        profile.save(path)
        return profile
