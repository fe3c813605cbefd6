"""The torch profiler as the serving side names it (no torch): vLLM's ``--profiler-config``
and the body of its ``POST /start_profile``.

``{"profiler": "torch", "torch_profiler_dir": "/abs/dir"}`` turns it on: the gateway then
serves ``/start_profile`` and ``/stop_profile``, and each worker records its engine's steps
with torch's profiler between the two, writing one Chrome trace
(``<prefix>.<worker>.<time>.pt.trace.json.gz``, for Perfetto or ``chrome://tracing``)
into the directory. The keys, their defaults and the prefix's rule are vLLM's, so one
flag serves halfmoon's engine and vLLM-backed workers (whose servers are started with it).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.jsonconfig import json_object_option

#: The profilers served (vLLM's ``profiler`` names; its ``cuda`` and ``proton`` are not).
PROFILERS = ("torch",)
#: What ``torch_profiler_activities`` may name.
ACTIVITIES = ("CPU", "CUDA")
#: How long a worker may take to stop its profiler (it writes its trace first: seconds
#: for a long session with stacks).
STOP_TIMEOUT_S = 120.0
#: vLLM's rule for a trace's file-name prefix.
_PREFIX = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_BOOLS = ("torch_profiler_with_stack", "torch_profiler_with_flops", "torch_profiler_use_gzip",
          "torch_profiler_record_shapes", "torch_profiler_with_memory")  # fmt: skip


@dataclass(frozen=True)
class ProfilerConfig:
    """Where the traces go and what they record (vLLM's ``ProfilerConfig`` keys; the
    iteration bounds are those of a session that names none of its own)."""

    torch_profiler_dir: str
    profiler: str = "torch"
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    #: None: the host's (CPU, and CUDA where there is a GPU).
    torch_profiler_activities: tuple[str, ...] | None = None
    delay_iterations: int = 0
    max_iterations: int = 0

    def __post_init__(self) -> None:
        if self.profiler not in PROFILERS:
            raise HalfmoonError(f"profiler {self.profiler!r} is not served; use "
                                f"{', '.join(PROFILERS)}")  # fmt: skip
        if not isinstance(self.torch_profiler_dir, str) or not self.torch_profiler_dir:
            raise HalfmoonError("profiler config: torch_profiler_dir names the directory the "
                                "traces are written to")  # fmt: skip
        if "://" in self.torch_profiler_dir:
            raise HalfmoonError(f"profiler config: torch_profiler_dir must be a local "
                                f"directory, not {self.torch_profiler_dir!r}")  # fmt: skip
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise HalfmoonError(f"profiler config: {name} must be true or false")
        if self.torch_profiler_activities is not None:
            bad = [a for a in self.torch_profiler_activities if a not in ACTIVITIES]
            if bad or not self.torch_profiler_activities:
                raise HalfmoonError(f"profiler config: torch_profiler_activities must list "
                                    f"some of {', '.join(ACTIVITIES)}")  # fmt: skip
        check_iterations(self.delay_iterations, self.max_iterations)

    def to_json(self) -> str:
        """The config as vLLM's ``--profiler-config`` takes it."""
        data = asdict(self)
        if self.torch_profiler_activities is None:
            del data["torch_profiler_activities"]
        else:
            data["torch_profiler_activities"] = list(self.torch_profiler_activities)
        return json.dumps(data, sort_keys=True)

    def for_directory(self, directory: str) -> ProfilerConfig:
        """The same config writing into ``directory`` (a worker's own vLLM server's)."""
        return replace(self, torch_profiler_dir=directory)


@dataclass(frozen=True)
class ProfileSession:
    """What one ``/start_profile`` asks: the traces' file-name prefix and iteration bounds
    (None: the config's)."""

    profile_prefix: str | None = None
    delay_iterations: int | None = None
    max_iterations: int | None = None

    def __post_init__(self) -> None:
        if self.profile_prefix is not None and (
            not isinstance(self.profile_prefix, str)
            or not self.profile_prefix.isascii()
            or not _PREFIX.fullmatch(self.profile_prefix)
        ):
            raise HalfmoonError("profile_prefix must be 1-128 ASCII characters, start with a "
                                "letter or number, and hold only letters, numbers, '.', '_' "
                                "or '-'")  # fmt: skip
        check_iterations(self.delay_iterations, self.max_iterations)

    def bounds(self, config: ProfilerConfig) -> tuple[int, int]:
        """(steps to skip before recording, most steps recorded; 0: until stopped)."""
        delay = config.delay_iterations if self.delay_iterations is None else self.delay_iterations
        most = config.max_iterations if self.max_iterations is None else self.max_iterations
        return delay, most


def check_iterations(delay: int | None, most: int | None) -> None:
    """HalfmoonError unless both are None or whole numbers >= 0 (vLLM's check)."""
    for name, value in (("delay_iterations", delay), ("max_iterations", most)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 0):  # fmt: skip
            raise HalfmoonError(f"{name} must be a whole number >= 0, got {value!r}")


def parse_profiler_config(value: str | Mapping[str, Any] | None) -> ProfilerConfig | None:
    """vLLM's ``--profiler-config`` (a JSON object, or the parsed mapping) as a
    :class:`ProfilerConfig`; None for None, an empty value or ``"profiler": null`` (vLLM's
    default: off). A relative directory is made absolute. HalfmoonError names the problem
    (bad JSON, a key halfmoon does not serve, a bad value)."""
    value = json_object_option(value, "--profiler-config",
                               '{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}')  # fmt: skip
    data = dict(value or {})
    if data.get("profiler") is None:
        return None
    known = {f for f in ProfilerConfig.__dataclass_fields__}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HalfmoonError(f"--profiler-config: {', '.join(unknown)} not served by halfmoon "
                            f"(it takes {', '.join(sorted(known))})")  # fmt: skip
    if "torch_profiler_dir" not in data:
        raise HalfmoonError('--profiler-config: "torch_profiler_dir" names the directory the '
                            "traces are written to")  # fmt: skip
    if isinstance(data.get("torch_profiler_activities"), list):
        data["torch_profiler_activities"] = tuple(data["torch_profiler_activities"])
    config = ProfilerConfig(**data)
    return config.for_directory(os.path.abspath(config.torch_profiler_dir))


def parse_profile_session(body: Mapping[str, Any] | None) -> ProfileSession:
    """The body of ``POST /start_profile`` (vLLM's: ``profile_prefix``,
    ``delay_iterations``, ``max_iterations``, all optional; other keys are ignored, as
    vLLM does); HalfmoonError names a bad value."""
    if body is None:
        return ProfileSession()
    if not isinstance(body, Mapping):
        raise HalfmoonError("the body of /start_profile must be a JSON object")
    keys = ("profile_prefix", "delay_iterations", "max_iterations")
    return ProfileSession(**{k: body[k] for k in keys if body.get(k) is not None})
