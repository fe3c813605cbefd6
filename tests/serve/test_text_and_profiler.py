import itertools

import pytest

from halfmoon.costmodel import CostProfile


@pytest.fixture(scope="module")
def engine():
    from halfmoon.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model="tiny", kv_cache_mb=32, num_threads=1))


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_stop_string_across_deltas_is_cut_and_never_sent(engine):
    from halfmoon.serve.gateway.text import OutputText

    tok = engine.tokenizer
    ids = _ids(tok, "alpha beta STOP gamma")
    out = OutputText(tok, [], stop=("STOP",))
    sent = "".join(out.add([i]) for i in ids)
    sent += out.flush()
    assert out.stopped
    assert sent == out.text == "alpha beta "
    assert "STOP" not in sent


def test_without_stop_everything_is_sent(engine):
    from halfmoon.serve.gateway.text import OutputText

    tok = engine.tokenizer
    ids = _ids(tok, "one two three")
    out = OutputText(tok, [], stop=("zzz-not-there",))
    sent = "".join(out.add([i]) for i in ids) + out.flush()
    assert sent == tok.decode(ids) and not out.stopped


@pytest.mark.slow  # ~6 s here
def test_profile_is_measured_fitted_and_cached(engine, tmp_path):
    from halfmoon.engine.profiler import cached_profile

    profile = cached_profile(engine, "tiny", tmp_path)
    files = list(tmp_path.glob("profile-*.json"))
    assert len(files) == 1
    assert CostProfile.load(files[0]) == profile
    assert cached_profile(engine, "tiny", tmp_path) == profile  # read back, not re-measured
    # longer prompts and bigger batches cost more; nothing is free
    assert profile.prefill_s(1024, 0) > profile.prefill_s(64, 0) > 0
    assert profile.decode_step_s(16, 4096) > 0
    engine.check_integrity()


def test_decode_points_time_only_pure_decode_steps(engine, monkeypatch):
    """A decode point's batch is one prefilled prompt's KV imported once per sequence:
    every timed step decodes the whole batch, none computes a prompt chunk (a mixed
    step must not be in the median)."""
    from halfmoon.engine import profiler

    events: list[str] = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        prompt = any(c.start < c.seq.num_prompt_tokens for c in out.chunks)
        events.append("prompt-step" if prompt else f"decode-step-{len(out.chunks)}")
        return out

    clock = profiler.time.perf_counter

    class Clock:
        @staticmethod
        def perf_counter():
            events.append("clock")
            return clock()

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    monkeypatch.setattr(profiler, "time", Clock)
    assert profiler._time_decode(engine, 3, 1000, 4242) > 0
    timed = [b for a, b in itertools.pairwise(events) if a == "clock" and b != "clock"]
    assert len(timed) == profiler._DECODE_STEPS and set(timed) == {"decode-step-3"}
    # the one prompt ran before the clock started, and only it (1,000 tokens: one step)
    assert events.index("clock") > events.index("prompt-step")
    assert events.count("prompt-step") == 1
    engine.check_integrity()


@pytest.mark.parametrize(
    "kv_cache_mb,points,probe",
    [(6, "SMALL_DECODE_POINTS", (4, 512)), (1, "TINY_DECODE_POINTS", (2, 128))],
)
def test_a_small_kv_pool_is_profiled_with_short_contexts(monkeypatch, kv_cache_mb, points, probe):
    """A pool too small for three of the usual decode points (a real model's KV is ~10x
    the tiny preset's per token; 6 MiB: 1.5k tokens) is measured at short contexts
    instead of failing; one too small for three of those (``--kv-cache-mb 1``: 256
    tokens, which failed to start: "need at least 3 decode points, got 1") at the
    tiniest."""
    from halfmoon.engine import EngineConfig, LLMEngine, profiler

    small = LLMEngine(EngineConfig(model="tiny", kv_cache_mb=kv_cache_mb, num_threads=1))
    timed: list[tuple[int, int]] = []
    real = profiler._time_decode

    def record(engine, batch, context, salt):
        timed.append((batch, context))
        return real(engine, batch, context, salt)

    monkeypatch.setattr(profiler, "_time_decode", record)
    profile = profiler.measure_profile(small, "tiny")
    assert len(timed) >= 3 and set(timed) <= set(getattr(profiler, points))
    assert profile.decode_step_s(*probe) > 0
    small.check_integrity()


def test_a_short_context_and_a_tiny_pool_are_profiled_with_short_prompts(monkeypatch):
    """--max-model-len 512 leaves two of the usual prefill points and a 4 MiB pool (1,024
    tokens) no room for the 1,024-token KV import: short prompts and imports instead."""
    from halfmoon.engine import EngineConfig, LLMEngine, profiler

    engine = LLMEngine(EngineConfig(model="tiny", kv_cache_mb=4, max_model_len=512, num_threads=1))
    prefills: list[tuple[int, int]] = []
    imports: list[int] = []
    real_prefill, real_import = profiler._time_prefill, profiler._time_kv_import

    def record_prefill(engine, new, cached, salt):
        prefills.append((new, cached))
        return real_prefill(engine, new, cached, salt)

    def record_import(engine, n, salt):
        imports.append(n)
        return real_import(engine, n, salt)

    monkeypatch.setattr(profiler, "_time_prefill", record_prefill)
    monkeypatch.setattr(profiler, "_time_kv_import", record_import)
    profile = profiler.measure_profile(engine, "tiny")
    timed = prefills[1:]  # the first is the warm-up
    assert len(timed) >= 3 and set(timed) <= set(profiler.SMALL_PREFILL_POINTS)
    assert imports and all(n + 8 <= 512 for n in imports)
    assert profile.prefill_s(128, 0) > 0 and profile.serving.kv_import_s_per_token > 0
    engine.check_integrity()


def test_each_prefill_point_counts_its_fastest_run(monkeypatch):
    """A run slowed by something else on the machine (here: every point's first) does
    not reach the fit; each run of a point uses other tokens (no cache hit between them)."""
    from halfmoon.engine import EngineConfig, LLMEngine, profiler

    engine = LLMEngine(EngineConfig(model="tiny", kv_cache_mb=4, max_model_len=512, num_threads=1))
    runs: dict[tuple[int, int], list[int]] = {}
    fitted = {}

    def scripted(engine, new, cached, salt):
        salts = runs.setdefault((new, cached), [])
        salts.append(salt)
        return 5.0 if len(salts) == 1 else 0.01 + 1e-4 * new

    def fit(prefill, decode, **kwargs):
        fitted["prefill"] = prefill
        return real_fit(prefill, decode, **kwargs)

    real_fit = profiler.fit_profile
    monkeypatch.setattr(profiler, "_time_prefill", scripted)
    monkeypatch.setattr(profiler, "fit_profile", fit)
    profiler.measure_profile(engine, "tiny")
    assert len(fitted["prefill"]) >= 3
    for new, cached, seconds in fitted["prefill"]:
        assert seconds == pytest.approx(0.01 + 1e-4 * new)
        salts = runs[(new, cached)]
        assert len(salts) >= profiler.PREFILL_REPEATS and len(set(salts)) == len(salts)
