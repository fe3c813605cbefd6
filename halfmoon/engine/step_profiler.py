"""torch's profiler over an engine's steps (vLLM's ``/start_profile`` and
``/stop_profile``; the config is :class:`halfmoon.core.profiling.ProfilerConfig`).

A session starts, skips ``delay_iterations`` steps, then records every step (each one a
``step[...]`` range naming what it computed: prompt tokens and decoding sequences) until
it is stopped or has recorded ``max_iterations`` of them; then one Chrome trace is
written, atomically, into the config's directory, and beside it a table of the ops by
their own time (``.profiler_out.txt``, as vLLM writes). Nothing is recorded between
sessions.
As vLLM's, a start while a session is on and a stop while none is are no-ops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.profiling import ProfilerConfig, ProfileSession
from halfmoon.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)
#: Rows of the summary table written beside each trace.
SUMMARY_ROWS = 40


class StepProfiler:
    """One engine's profiling sessions."""

    def __init__(self) -> None:
        #: What the session's trace file is named after (a worker's instance id).
        self.name = "engine"
        self._config: ProfilerConfig | None = None
        self._prefix = ""
        self._delay = 0
        self._most = 0
        self._profile: profile | None = None
        self._recorded = 0
        #: The traces written since the last :meth:`stop` (a session that reached its
        #: ``max_iterations`` wrote its own already).
        self._written: list[str] = []

    @property
    def active(self) -> bool:
        """Whether a session is on (recording, or counting steps until it does)."""
        return self._config is not None

    @property
    def recording(self) -> bool:
        return self._profile is not None

    def start(self, config: ProfilerConfig, session: ProfileSession, name: str) -> None:
        """Start a session, its trace named after ``name``; nothing while one is on (as
        vLLM); HalfmoonError when the directory cannot be made."""
        if self.active:
            log.info("a profiling session is on already: the start is ignored")
            return
        try:
            os.makedirs(config.torch_profiler_dir, exist_ok=True)
        except OSError as exc:
            raise HalfmoonError(f"profiler directory {config.torch_profiler_dir}: {exc}") from None
        self._config, self.name = config, name
        self._delay, self._most = session.bounds(config)
        self._prefix = session.profile_prefix or "halfmoon"
        self._recorded = 0
        if self._delay == 0:
            self._begin()

    def _begin(self) -> None:
        config = self._config
        assert config is not None
        names = config.torch_profiler_activities
        if names is None:
            names = ("CPU", "CUDA") if torch.cuda.is_available() else ("CPU",)
        activities = [ProfilerActivity.CPU if n == "CPU" else ProfilerActivity.CUDA
                      for n in names]  # fmt: skip
        self._profile = profile(
            activities=activities, record_shapes=config.torch_profiler_record_shapes,
            with_stack=config.torch_profiler_with_stack, with_flops=config.torch_profiler_with_flops,
            profile_memory=config.torch_profiler_with_memory,
        )  # fmt: skip
        self._profile.start()

    @contextlib.contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Around one engine step: a ``label``-named range while recording; afterwards the
        step counts toward the session's bounds."""
        if self._profile is None:
            yield
        else:
            with record_function(label):
                yield
        self._after_step()

    def _after_step(self) -> None:
        if self._config is None:
            return
        if self._profile is None:
            self._delay -= 1
            if self._delay <= 0:
                self._begin()
            return
        self._recorded += 1
        if self._most and self._recorded >= self._most:  # the session ends, its trace written
            try:
                self._finish()
            finally:
                self._config = None

    def _finish(self) -> None:
        """Stop recording and write the trace."""
        prof, self._profile = self._profile, None
        if prof is None:
            return
        prof.stop()
        config = self._config
        assert config is not None
        stamp = time.strftime("%Y%m%d-%H%M%S") + f"-{int(time.time() * 1000) % 1000:03d}"
        base = Path(config.torch_profiler_dir) / f"{self._prefix}.{self.name}.{stamp}"
        suffix = ".pt.trace.json.gz" if config.torch_profiler_use_gzip else ".pt.trace.json"
        path, summary = Path(f"{base}{suffix}"), Path(f"{base}.profiler_out.txt")
        partial = path.with_name(f".{path.name}.partial{suffix}")  # (torch gzips by suffix)
        try:
            prof.export_chrome_trace(str(partial))
            os.replace(partial, path)
            summary.write_text(_summary(prof))
        except OSError as exc:
            with contextlib.suppress(OSError):
                partial.unlink()
            raise HalfmoonError(f"the trace could not be written to {path}: {exc}") from None
        log.info("profiler trace of %d engine steps written to %s", self._recorded, path)
        self._written += [str(path), str(summary)]

    def stop(self) -> list[str]:
        """End the session (if one is on); the traces written since the last stop."""
        try:
            self._finish()
        finally:
            self._config = None
            written, self._written = self._written, []
        return written


def _summary(prof: profile) -> str:
    """What a trace holds, as a table to read without a trace viewer (as vLLM writes
    beside its traces): the ops and step ranges by their own time, most first."""
    timed_on_gpu = any(a == ProfilerActivity.CUDA for a in prof.activities)
    key = "self_cuda_time_total" if timed_on_gpu else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=SUMMARY_ROWS) + "\n"


def step_label(chunks: Sequence[ScheduledChunk]) -> str:
    """A step's range name in a trace: the prompt tokens it computed (for how many
    requests) and the sequences it decoded, as ``step[prefill 3x412, decode 8]``."""
    prefill = [c.num_tokens for c in chunks if c.start < c.seq.num_prompt_tokens]
    decode = len(chunks) - len(prefill)
    parts = [f"prefill {len(prefill)}x{sum(prefill)}"] if prefill else []
    parts += [f"decode {decode}"] if decode else []
    return f"step[{', '.join(parts)}]"
