"""What happened to one request, and how to save it.

A :class:`RequestRecord` is filled in by whoever watches the request: the simulator
(simulated seconds) or the benchmark client (monotonic wall seconds). Every timestamp of a
record, and of all records compared together, must come from the same clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from halfmoon.metrics.latency import tbt_gaps_s


@dataclass
class RequestRecord:
    """What happened to one request, in seconds on one clock.

    Mutable on purpose: the simulator and the benchmark client append to
    ``token_times_s`` and set ``finish_s`` as the request runs. The constructor checks
    the values it is given (so loaded or hand-made records are sane); later appends are
    checked when gaps are computed.

    - ``token_times_s[i]`` is when output token ``i`` was emitted; ``[0]`` is the first.
    - ``finish_s`` is None while running or when the request never finished (``error``).
    - ``rejected`` requests were refused by admission (``reject_reason`` says why); they
      may still carry ``prefill_done_s`` when the rejection came after prefill.
    - ``prefill_done_s`` is when its prefill finished; used to count wasted prefill.
    - ``cached_tokens`` prompt tokens were served from a cache instead of recomputed.
    """

    request_id: str
    arrival_s: float
    input_length: int
    output_length: int
    token_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    rejected: bool = False
    reject_reason: str = ""
    error: str = ""
    prefill_done_s: float | None = None
    cached_tokens: int = 0

    def __post_init__(self) -> None:
        where = f"request {self.request_id!r}"
        if self.input_length < 0 or self.output_length < 0:
            raise ValueError(
                f"{where}: lengths must be >= 0, got input_length={self.input_length} "
                f"output_length={self.output_length}"
            )
        if not 0 <= self.cached_tokens <= max(self.input_length, 0):
            raise ValueError(
                f"{where}: cached_tokens={self.cached_tokens} outside "
                f"[0, input_length={self.input_length}]"
            )
        self._check_times(where)

    def _check_times(self, where: str) -> None:
        """Timestamps must be finite and never precede the arrival."""
        named = [
            ("arrival_s", self.arrival_s),
            ("finish_s", self.finish_s),
            ("prefill_done_s", self.prefill_done_s),
        ]
        named += [(f"token_times_s[{i}]", t) for i, t in enumerate(self.token_times_s)]
        for name, value in named:
            if value is not None and not math.isfinite(value):
                raise ValueError(f"{where}: {name} is not a finite number ({value})")
        for name, value in named[1:]:
            if value is not None and value < self.arrival_s:
                raise ValueError(f"{where}: {name}={value} is before arrival_s={self.arrival_s}")
        tbt_gaps_s(self.token_times_s)  # raises if the token times go backwards

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: first token time minus arrival; None if no token came."""
        if not self.token_times_s:
            return None
        return self.token_times_s[0] - self.arrival_s

    @property
    def tbt_gaps_s(self) -> list[float]:
        """Gaps between consecutive output tokens (empty with fewer than two tokens)."""
        return tbt_gaps_s(self.token_times_s)

    @property
    def e2e_s(self) -> float | None:
        """End-to-end latency: finish minus arrival; None if it never finished."""
        if self.finish_s is None:
            return None
        return self.finish_s - self.arrival_s

    @property
    def completed(self) -> bool:
        """Finished normally: not rejected, no error, has a finish time and a first token."""
        return (
            not self.rejected
            and not self.error
            and self.finish_s is not None
            and bool(self.token_times_s)
        )


_FIELD_NAMES = tuple(f.name for f in fields(RequestRecord))
_REQUIRED = ("request_id", "arrival_s", "input_length", "output_length")


def records_to_json(records: Iterable[RequestRecord]) -> list[dict[str, Any]]:
    """Records as plain dicts (one per record, every field), ready for ``json.dumps``."""
    return [asdict(r) for r in records]


def records_from_json(items: Iterable[Mapping[str, Any]]) -> list[RequestRecord]:
    """Rebuild records from :func:`records_to_json` output.

    Raises ValueError naming the item index and the problem (not a dict, a missing
    required field, an unknown field, an invalid value).
    """
    records = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"record {index}: expected an object, got {type(item).__name__}")
        missing = [name for name in _REQUIRED if name not in item]
        if missing:
            raise ValueError(f"record {index}: missing field(s) {', '.join(missing)}")
        unknown = sorted(set(item) - set(_FIELD_NAMES))
        if unknown:
            raise ValueError(f"record {index}: unknown field(s) {', '.join(unknown)}")
        kwargs = dict(item)
        kwargs["token_times_s"] = list(kwargs.get("token_times_s", []))
        try:
            records.append(RequestRecord(**kwargs))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"record {index}: {exc}") from exc
    return records
