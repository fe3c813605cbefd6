"""Measure a worker's engine so the Conductor's estimates are in real seconds here.

A few prefills (with and without a cached prefix) and decode steps (several batch sizes and
context lengths) are timed and fitted with :func:`halfmoon.costmodel.fit_profile`. The
result is cached as JSON per model directory and engine shape, so restarts are instant.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from halfmoon.core.request import SamplingParams
from halfmoon.costmodel import CostProfile, fit_profile

PREFILL_POINTS = ((32, 0), (128, 0), (512, 0), (1024, 0), (256, 512), (128, 1024))
DECODE_POINTS = ((1, 64), (4, 256), (8, 512), (16, 256))
_DECODE_STEPS = 4


def _tokens(engine: Any, n: int, salt: int) -> list[int]:
    vocab = engine.model_config.vocab_size
    return [(salt * 7919 + i * 104729) % (vocab - 16) + 8 for i in range(n)]


def _time_prefill(engine: Any, new: int, cached: int, salt: int) -> float:
    prefix = _tokens(engine, cached, salt)
    once = SamplingParams(max_tokens=1, temperature=0)
    if cached:  # compute the prefix first so the timed request finds it cached
        engine.generate([prefix + _tokens(engine, 16, salt + 1)], once)
    prompt = prefix + _tokens(engine, new, salt + 2)
    start = time.perf_counter()
    engine.generate([prompt], once)
    return time.perf_counter() - start


def _time_decode(engine: Any, batch: int, context: int, salt: int) -> float:
    params = SamplingParams(max_tokens=2 + _DECODE_STEPS, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profile-{salt}-{i}", _tokens(engine, context, salt + i), params)
    engine.step()  # prefills (and first tokens)
    while engine.stats().num_waiting:
        engine.step()
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests() and steps < _DECODE_STEPS:
        engine.step()
        steps += 1
    elapsed = (time.perf_counter() - start) / max(steps, 1)
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def measure_profile(engine: Any, model_name: str) -> CostProfile:
    """Time the engine and fit a cost profile (a few seconds on the tiny preset)."""
    _time_prefill(engine, 16, 0, 999)  # warm-up
    limit = engine.max_model_len - 8
    prefill = [
        (n, c, _time_prefill(engine, n, c, 10 * k))
        for k, (n, c) in enumerate(PREFILL_POINTS)
        if n + c + 16 <= limit
    ]
    decode = [
        (b, b * ctx, _time_decode(engine, b, ctx, 1000 + 100 * k))
        for k, (b, ctx) in enumerate(DECODE_POINTS)
        if ctx + 8 <= limit
    ]
    return fit_profile(prefill, decode, model_name=model_name, device=engine.config.device)


def cached_profile(engine: Any, model: str, cache_dir: Path) -> CostProfile:
    """The profile of this engine shape, measured once and then read from ``cache_dir``."""
    cfg = engine.config
    key = json.dumps(
        [str(Path(model).resolve()), cfg.device, cfg.dtype, cfg.block_size, cfg.num_threads],
        sort_keys=True,
    )
    path = cache_dir / f"profile-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Workers of one cluster start together: one measures (alone, so the others' start-up
    # does not disturb its timings) while the rest wait on the lock and read its result.
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return CostProfile.load(path)
        profile = measure_profile(engine, Path(model).name)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        profile.save(tmp)
        tmp.replace(path)
    return profile
