"""Time the serving path adds outside the engine's forward passes: the named terms a
worker's cost profile may carry and the simulator charges (see :class:`ServingTerms`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from halfmoon.core.errors import HalfmoonError


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class ServingTerms:
    """Time the serving path adds outside the engine's forward passes (seconds, >= 0;
    0 = not measured). Which simulated instance pays each term:

    - ``request_overhead_s``: per request, before its prefill starts (HTTP, tokenizing,
      hashing, the Conductor round trip, messages to the workers). It delays only that
      request: no instance is busy meanwhile.
    - ``prefill_handoff_s_per_token``: per prompt token on a prefill instance
      (disaggregated only), after the forward: saving the new blocks to the store,
      streaming the prompt's KV, exporting it and handing over. It occupies the
      instance (the next prompt waits) and grows with the prompt's KV.
    - ``decode_per_seq_overhead_s``: per sequence per decode step, outside the forward
      (sampling, its share of the step's token message, bookkeeping); decode and
      coupled instances pay it.
    - ``decode_step_overhead_s``: per decode step whatever its batch, outside the
      forward (the step's message to the gateway and its wait for the CPU, the commands
      handled between steps); decode and coupled instances pay it. With only the
      per-sequence term, measured at one batch size, a small batch's steps came out too
      short.
    - ``kv_import_s_per_token``: importing a handed-off request's KV into the decode
      engine, charged to the step it joins (so every running request's gap grows).
    - ``step_jitter_sigma``: steps of the same batch are not equally long when the
      processes time-share CPUs (or a GPU with other work): each decode or mixed step's
      time is multiplied by a lognormal factor with median 1 and this log-space standard
      deviation (``ln(p90 / p50) / 1.2816`` of measured steps). Per-request TBT by
      ``top10mean`` or ``p90`` is a tail, so it depends on this spread, not only on the
      median step. Unitless (a log-ratio).
    - ``step_wait_mean_s``: each decode or mixed step also waits an exponentially
      distributed time with this mean: time slices lost to other processes on shared
      cores, an additive jitter that does not grow with the step (the live gaps' p90 -
      p50 grew from 2.8 to 6.4 ms while the step grew 5x).
    - ``background_cpu_s_per_token``: CPU seconds the rest of the serving path (gateway,
      Conductor, client) spends per output token; with a simulated host of few cores
      (``SimConfig.host_cores``) it is load that competes with the instances.
    """

    request_overhead_s: float = 0.0
    prefill_handoff_s_per_token: float = 0.0
    decode_per_seq_overhead_s: float = 0.0
    decode_step_overhead_s: float = 0.0
    kv_import_s_per_token: float = 0.0
    step_jitter_sigma: float = 0.0
    step_wait_mean_s: float = 0.0
    background_cpu_s_per_token: float = 0.0

    def __post_init__(self) -> None:
        for name in SERVING_TERM_NAMES:
            value = getattr(self, name)
            if not is_number(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")

    def decode_overhead_s(self, batch: int) -> float:
        """What a step with ``batch`` decoding sequences pays outside the forward: the
        per-step term plus ``batch`` per-sequence terms (0 without decodes)."""
        if batch <= 0:
            return 0.0
        return self.decode_step_overhead_s + batch * self.decode_per_seq_overhead_s

    def to_dict(self) -> dict[str, float]:
        """``{term name: seconds}`` for every term."""
        return {name: float(getattr(self, name)) for name in SERVING_TERM_NAMES}

    @classmethod
    def from_dict(cls, data: Any, source: str = "serving terms") -> ServingTerms:
        """Parse :meth:`to_dict` output (missing terms are 0); bad input raises a
        :class:`HalfmoonError` naming ``source`` and the term."""
        if not isinstance(data, Mapping):
            raise HalfmoonError(f"{source}: expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(SERVING_TERM_NAMES))
        if unknown:
            raise HalfmoonError(f"{source}: unknown term(s) {', '.join(unknown)}")
        try:
            return cls(**{k: data[k] for k in SERVING_TERM_NAMES if k in data})
        except ValueError as exc:
            raise HalfmoonError(f"{source}: {exc}") from None

    def replace(self, **terms: float | None) -> ServingTerms:
        """A copy with the given terms changed (None leaves a term as it is)."""
        values = self.to_dict()
        values.update({k: v for k, v in terms.items() if v is not None})
        return ServingTerms(**values)


SERVING_TERM_NAMES = (
    "request_overhead_s",
    "prefill_handoff_s_per_token",
    "decode_per_seq_overhead_s",
    "decode_step_overhead_s",
    "kv_import_s_per_token",
    "step_jitter_sigma",
    "step_wait_mean_s",
    "background_cpu_s_per_token",
)
