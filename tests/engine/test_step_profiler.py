"""torch's profiler over the engine's steps (halfmoon.engine.step_profiler; vLLM's
``/start_profile`` and ``/stop_profile``): a Chrome trace whose step ranges name what
each step computed, vLLM's iteration bounds, its no-op start and stop, the same tokens."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from engine_testlib import Reference, engine_config

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.profiling import ProfilerConfig, ProfileSession
from halfmoon.core.request import SamplingParams
from halfmoon.engine.engine import LLMEngine

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _steps(trace: str) -> list[str]:
    """The step ranges of a trace, in order, and a check that torch's ops are in it."""
    opener = gzip.open if trace.endswith(".gz") else open
    with opener(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the ops inside
    ranges = [e for e in events if e.get("name", "").startswith("step[")]
    return [e["name"] for e in sorted(ranges, key=lambda e: e["ts"])]


def test_a_session_traces_every_step_and_changes_no_token(llama_ref: Reference, prompts, tmp_path):
    batch = prompts(5, [20, 9], llama_ref.vocab_size)
    plain = LLMEngine(engine_config(llama_ref.path)).generate(batch, PARAMS)
    engine = LLMEngine(engine_config(llama_ref.path))
    config = ProfilerConfig(str(tmp_path / "traces"), torch_profiler_with_stack=False)
    engine.start_profile(config, ProfileSession(profile_prefix="run1"), "decode-0")
    outputs = engine.generate(batch, PARAMS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    trace, summary = engine.stop_profile()
    assert Path(trace).parent == tmp_path / "traces"
    assert Path(trace).name.startswith("run1.decode-0.") and trace.endswith(".pt.trace.json.gz")
    assert summary == trace.replace(".pt.trace.json.gz", ".profiler_out.txt")
    written = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert written == sorted([Path(trace).name, Path(summary).name])  # no partial file left
    # one prefill step of both prompts, then five steps decoding both
    assert _steps(trace) == ["step[prefill 2x29]"] + ["step[decode 2]"] * 5
    table = Path(summary).read_text()  # the ops and steps by their own time
    assert "Self CPU" in table and "step[decode 2]" in table and "aten::" in table
    assert engine.stop_profile() == []  # stopped: nothing more, and no error


def test_delay_and_max_iterations_bound_the_session(llama_ref: Reference, prompts, tmp_path):
    batch = prompts(6, [12], llama_ref.vocab_size)
    engine = LLMEngine(engine_config(llama_ref.path))
    config = ProfilerConfig(str(tmp_path), torch_profiler_use_gzip=False, max_iterations=9)
    engine.start_profile(config, ProfileSession(delay_iterations=2, max_iterations=3))
    engine.start_profile(config, ProfileSession(delay_iterations=0))  # on already: ignored
    engine.generate(batch, PARAMS)  # six steps: two skipped, three recorded, one after
    assert not engine.profiler.active  # the session ended at its third step...
    trace, _ = engine.stop_profile()  # ...and its trace is the stop's to report
    assert trace.endswith(".pt.trace.json") and Path(trace).name.startswith("halfmoon.engine.")
    assert _steps(trace) == ["step[decode 1]"] * 3
    # the config's bounds when the session names none; a new session after the last
    engine.start_profile(config, ProfileSession())
    engine.generate(prompts(7, [40], llama_ref.vocab_size), PARAMS)
    second, _ = engine.stop_profile()
    assert _steps(second) == ["step[prefill 1x40]"] + ["step[decode 1]"] * 5


def test_a_session_that_never_recorded_writes_nothing(llama_ref: Reference, tmp_path):
    engine = LLMEngine(engine_config(llama_ref.path))
    engine.start_profile(ProfilerConfig(str(tmp_path)), ProfileSession(delay_iterations=5))
    assert engine.profiler.active and not engine.profiler.recording
    assert engine.stop_profile() == [] and not list(tmp_path.iterdir())


def test_an_unwritable_directory_is_named(llama_ref: Reference, tmp_path):
    (tmp_path / "file").write_text("")
    engine = LLMEngine(engine_config(llama_ref.path))
    with pytest.raises(HalfmoonError, match="profiler directory .*file/traces"):
        engine.start_profile(ProfilerConfig(str(tmp_path / "file" / "traces")), ProfileSession())
    assert not engine.profiler.active
