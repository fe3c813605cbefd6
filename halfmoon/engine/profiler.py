"""Measure an engine so the Conductor's estimates are in real seconds here.

A few prefills (with and without a cached prefix) and decode steps (several batch sizes and
context lengths, up to 2k tokens per sequence so long-prompt serving is inside the
measured range) are timed and fitted with :func:`halfmoon.costmodel.fit_profile`. The
engine-side serving term ``kv_import_s_per_token`` (a decode worker copying a handed-off
request's KV into its pool) is timed too. The result is cached as JSON per model
directory, engine shape and :data:`PROFILER_VERSION`, so restarts are instant.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.costmodel import CostProfile, fit_profile
from halfmoon.costmodel.serving import ServingTerms

log = logging.getLogger(__name__)
#: Where the profiler says how far it is (one line per point measured).
Say = Callable[[str], None]

#: Bumped when what is measured changes (or the engine gets faster), so cached profiles of
#: older code are not reused. 4: the compiled decode attention, packed LM head. 5: decode
#: batches built by KV imports (no mixed prefill steps before the timed ones). 6: each
#: prefill point the fastest of two runs.
PROFILER_VERSION = 6
#: Runs per prefill point; the fastest counts. One run each let a single slow one (a
#: 32-token prefill at 0.73 s beside a 128-token one at 0.52 s, the other test worker busy)
#: tilt the fit's fixed cost per call, which priced the chunked pipeline out of a 682-token
#: prompt it wins by ~1.5x in a CI run.
PREFILL_REPEATS = 2
#: (new, cached) prompt tokens; up to 2k-token prompts and 1.5k-token cached prefixes (a
#: fit extrapolated beyond its points was 10-20% short there).
PREFILL_POINTS = (
    (32, 0), (128, 0), (512, 0), (1024, 0), (2048, 0), (256, 512), (128, 1024), (384, 1536)
)  # fmt: skip
#: (batch, context per sequence); the batch's total context reaches 24k tokens.
DECODE_POINTS = (
    (1, 64), (4, 256), (8, 512), (16, 256), (4, 1536), (16, 1024), (8, 2048), (16, 1536)
)  # fmt: skip
#: Used when fewer than three of DECODE_POINTS fit the KV pool (at most 1k tokens at once).
SMALL_DECODE_POINTS = ((1, 64), (2, 128), (4, 64), (2, 256), (4, 192))
#: Used when fewer than three of those fit either (a pool of a few hundred tokens:
#: ``--kv-cache-mb 1`` with the tiny preset holds 256).
TINY_DECODE_POINTS = ((1, 16), (1, 64), (2, 32), (3, 16), (1, 128))
#: Used when fewer than three of PREFILL_POINTS fit (a short --max-model-len, a small pool).
SMALL_PREFILL_POINTS = ((16, 0), (32, 0), (64, 0), (128, 0), (256, 0), (64, 64), (128, 128))
#: Prompts whose KV is imported; SMALL_IMPORT_POINTS when none fits.
IMPORT_POINTS = (256, 1024)
SMALL_IMPORT_POINTS = (64, 128)
_DECODE_STEPS = 8


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


def _prefilled(engine: Any, request_id: str, num_tokens: int, salt: int) -> Any:
    """The exported KV (a ``KVHandoff``) of a ``num_tokens`` prompt prefilled here, its
    blocks given back."""
    once = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    engine.add_request(request_id, _tokens(engine, num_tokens, salt), once, keep_kv=True)
    while engine.has_unfinished_requests():
        engine.step()
    _raise_failures(engine)
    return engine.export_kv(request_id, release=True)


def _raise_failures(engine: Any) -> None:
    """A step that failed while profiling fails the profile (no time of it is kept)."""
    failures = engine.take_failures()
    if failures:
        raise HalfmoonError(f"profiling failed: {failures[0].error}")


def _time_decode(engine: Any, batch: int, context: int, salt: int) -> float:
    """Median seconds of a decode step of ``batch`` sequences of ``context`` tokens each.

    One prompt of ``context`` tokens is prefilled and its KV exported; the batch is that
    KV imported ``batch`` times, each copy under its own cache salt (its own blocks: no
    copy shares another's), so every timed step is a pure decode step of the whole batch.
    A step's time depends on the shapes, not on the values in the KV; prefilling every
    sequence took most of a first start (8 x 512 and 16 x 256 tokens: 35-60 s each on 2
    cores; in one process both ways gave the same steps within 10%). ``max_tokens``
    leaves room for every timed step: with a short one the early sequences ended and the
    "batch of 16" timed was a batch of a few."""
    handoff = _prefilled(engine, f"profile-{salt}-kv", context, salt)
    params = SamplingParams(max_tokens=_DECODE_STEPS + 4, temperature=0, ignore_eos=True)
    ids = [f"profile-{salt}-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        copy = dataclasses.replace(handoff, cache_salt=f"profile-{salt}-{i}")
        engine.import_request(copy, params, request_id=request_id)
    # The median step: one step slowed by another process on a shared machine must not
    # move the profile (the mean of 4 did, by up to 2x on a busy 2-core box).
    times = []
    while len(times) < _DECODE_STEPS:
        start = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        _raise_failures(engine)
        if len(outputs) != batch:  # a sequence ended (context limit) or was preempted
            break
    for request_id in ids:
        engine.abort_request(request_id)
    return statistics.median(times) if times else 0.0


def _time_kv_import(engine: Any, num_tokens: int, salt: int) -> float:
    """Seconds to import the KV of a ``num_tokens`` prompt handed off by a prefill (the
    decode worker's ``import_request``), exported from this same engine."""
    rid = f"profile-import-{salt}"
    handoff = _prefilled(engine, rid, num_tokens, salt)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.import_request(handoff, params, request_id=f"{rid}-in")
    elapsed = time.perf_counter() - start
    engine.abort_request(f"{rid}-in")
    return elapsed


def measure_profile(engine: Any, model_name: str, say: Say | None = None) -> CostProfile:
    """Time the engine and fit a cost profile (a few seconds on the tiny preset, about a
    minute for a 135M model on a small CPU); ``say`` (default: this module's logger) gets
    a line per point measured, ``profiling prefill 3/8 ...``. A fault drill's failing
    token (``HALFMOON_FAIL_STEP_ON_TOKEN``) is off meanwhile: its random prompts may hold it;
    so is speculative decoding (the profile's decode steps are one token per sequence)."""
    with engine.faults_suspended(), engine.speculation_suspended():
        return _measure(engine, model_name, say or log.info)


def _measure(engine: Any, model_name: str, say: Say) -> CostProfile:
    """:func:`measure_profile`'s work."""
    _time_prefill(engine, 16, 0, 999)  # warm-up
    limit = engine.max_model_len - 8
    # A prompt or a batch must fit in the KV pool at once, or it would be refused or
    # timed smaller than asked.
    pool_tokens = engine.stats().num_blocks * engine.config.block_size
    prompt_limit = min(limit, pool_tokens - 2 * engine.config.block_size)
    prefill_points = [
        (k, n, c)  # k: the salt's index in PREFILL_POINTS
        for k, (n, c) in enumerate(PREFILL_POINTS)
        if n + c + 16 <= prompt_limit
    ]
    if len(prefill_points) < 3:  # a short context or a small pool: short prompts instead
        prefill_points = [
            (len(PREFILL_POINTS) + k, n, c)
            for k, (n, c) in enumerate(SMALL_PREFILL_POINTS)
            if n + c + 16 <= prompt_limit
        ]

    def fits(batch: int, ctx: int) -> bool:
        return ctx + 64 <= limit and batch * (ctx + 4 * engine.config.block_size) <= pool_tokens

    points = [(b, ctx) for b, ctx in DECODE_POINTS if fits(b, ctx)]
    if len(points) < 3:  # a small pool (a real model's KV is large): short contexts instead
        points = [(b, ctx) for b, ctx in SMALL_DECODE_POINTS if fits(b, ctx)]
    if len(points) < 3:
        points = [(b, ctx) for b, ctx in TINY_DECODE_POINTS if fits(b, ctx)]
    # An imported prompt holds its KV in the pool too.
    sizes = [n for n in IMPORT_POINTS if n + 8 <= prompt_limit] or [
        n for n in SMALL_IMPORT_POINTS if n + 8 <= prompt_limit
    ]
    say(
        f"measuring the cost profile of {model_name}: {len(prefill_points)} prefills, "
        f"{len(points)} decode batches, {len(sizes)} KV imports (once per engine shape)"
    )
    prefill = []
    for i, (k, n, c) in enumerate(prefill_points):
        # Other tokens on each run (salts 10k, 10k+3, ...): no run finds another's cached.
        runs = [_time_prefill(engine, n, c, 10 * k + 3 * r) for r in range(PREFILL_REPEATS)]
        prefill.append((n, c, min(runs)))
        say(f"profiling prefill {i + 1}/{len(prefill_points)}: {n} new + {c} cached tokens "
            f"in {prefill[-1][2]:.2f}s")  # fmt: skip
    decode = []
    for k, (b, ctx) in enumerate(points):
        decode.append((b, b * ctx, _time_decode(engine, b, ctx, 1000 + 100 * k)))
        say(f"profiling decode {k + 1}/{len(points)}: batch {b} x {ctx} tokens, "
            f"{decode[-1][2] * 1e3:.1f} ms a step")  # fmt: skip
    import_s = sum(_time_kv_import(engine, n, 5000 + k) for k, n in enumerate(sizes))
    serving = ServingTerms(kv_import_s_per_token=import_s / max(1, sum(sizes)))
    return fit_profile(
        prefill, decode, model_name=model_name, device=engine.config.device, serving=serving
    )


def cached_profile(engine: Any, model: str, cache_dir: Path) -> CostProfile:
    """The profile of this engine shape, measured once and then read from ``cache_dir``."""
    cfg = engine.config
    key = json.dumps(
        [
            str(Path(model).resolve()),
            cfg.device,
            cfg.dtype,
            cfg.block_size,
            cfg.num_threads,
            getattr(engine, "attention_backend", "reference"),
            PROFILER_VERSION,
        ],  # fmt: skip
        sort_keys=True,
    )
    path = cache_dir / f"profile-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Workers of one cluster start together: one measures (alone, so the others' start-up
    # does not disturb its timings) while the rest wait on the lock and read its result.
    with open(path.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another worker measuring the same cost profile")
            fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return CostProfile.load(path)
        start_s = time.monotonic()
        profile = measure_profile(engine, Path(model).name)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        profile.save(tmp)
        tmp.replace(path)
    log.info("measured the cost profile in %.1fs (cached in %s)", time.monotonic() - start_s, path)
    return profile
