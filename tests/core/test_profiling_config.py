"""vLLM's ``--profiler-config`` and ``/start_profile`` body as halfmoon reads them
(halfmoon.core.profiling): vLLM's keys and defaults, its prefix rule, clear refusals."""

from __future__ import annotations

import json

import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.profiling import (
    ProfilerConfig,
    ProfileSession,
    parse_profile_session,
    parse_profiler_config,
)


def test_the_config_reads_as_vllms_and_round_trips(tmp_path):
    text = json.dumps({"profiler": "torch", "torch_profiler_dir": str(tmp_path),
                       "torch_profiler_with_stack": False, "torch_profiler_activities": ["CPU"],
                       "delay_iterations": 2, "max_iterations": 5})  # fmt: skip
    config = parse_profiler_config(text)
    assert config is not None
    assert (config.torch_profiler_dir, config.torch_profiler_with_stack) == (str(tmp_path), False)
    assert config.torch_profiler_activities == ("CPU",)
    assert config.torch_profiler_use_gzip and not config.torch_profiler_record_shapes  # defaults
    assert parse_profiler_config(config.to_json()) == config
    assert parse_profiler_config({"profiler": "torch", "torch_profiler_dir": "/t"}).to_json() \
        == ProfilerConfig("/t").to_json()  # fmt: skip


def test_off_unless_a_profiler_is_named(tmp_path, monkeypatch):
    assert parse_profiler_config(None) is None
    assert parse_profiler_config("  ") is None
    assert parse_profiler_config('{"profiler": null, "torch_profiler_dir": "/t"}') is None
    monkeypatch.chdir(tmp_path)  # a relative directory is the server's working directory's
    config = parse_profiler_config({"profiler": "torch", "torch_profiler_dir": "traces"})
    assert config is not None and config.torch_profiler_dir == str(tmp_path / "traces")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("[1]", "must be a JSON object"),
        ('{"profiler": "torch"', "must be a JSON object such as"),
        ({"profiler": "proton", "torch_profiler_dir": "/t"}, "'proton' is not served"),
        ({"profiler": "torch", "torch_profiler_dir": "s3://bucket/t"}, "a local directory"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "wait_iterations": 1},
         "wait_iterations not served"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_with_stack": "yes"},
         "torch_profiler_with_stack must be true or false"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "torch_profiler_activities": ["TPU"]},
         "torch_profiler_activities must list"),
        ({"profiler": "torch", "torch_profiler_dir": "/t", "max_iterations": -1},
         "max_iterations must be a whole number >= 0"),
    ],
)  # fmt: skip
def test_bad_configs_are_named(value, message):
    with pytest.raises(HalfmoonError, match=message):
        parse_profiler_config(value)


def test_a_sessions_bounds_default_to_the_configs():
    config = ProfilerConfig("/t", delay_iterations=3, max_iterations=7)
    assert parse_profile_session(None).bounds(config) == (3, 7)
    session = parse_profile_session({"profile_prefix": "run-1.a_b", "max_iterations": 0,
                                     "unknown": 1})  # fmt: skip
    assert session == ProfileSession(profile_prefix="run-1.a_b", max_iterations=0)
    assert session.bounds(config) == (3, 0)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"profile_prefix": "-x"}, "profile_prefix must be 1-128 ASCII"),
        ({"profile_prefix": "a/b"}, "profile_prefix must be"),
        ({"profile_prefix": "x" * 129}, "profile_prefix must be"),
        ({"profile_prefix": "café"}, "profile_prefix must be"),
        ({"delay_iterations": -2}, "delay_iterations must be a whole number"),
        ({"max_iterations": True}, "max_iterations must be a whole number"),
        ([1], "must be a JSON object"),
    ],
)
def test_bad_sessions_are_named(body, message):
    with pytest.raises(HalfmoonError, match=message):
        parse_profile_session(body)
