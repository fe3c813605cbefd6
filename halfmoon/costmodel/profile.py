"""Cost model fitted to measurements of the real engine, saved as JSON.

FAST'25 predicts prefill time with a polynomial regression over offline measurements;
halfmoon does the same with two small least-squares fits whose features follow the
roofline's shape (so a roofline-shaped engine is fitted exactly):

- prefill, ``n`` new tokens after ``c`` cached: ``[1, n, n*(n+2c)]`` — a fixed cost, the
  per-token dense work, and the causal attention pairs (``n*c + n^2/2 ~ n*(n+2c)/2``);
- decode step, ``b`` sequences holding ``ctx`` tokens: ``[1, b, ctx]`` — weights streamed
  once, per-sequence work, KV read per context token.

The fits minimise *relative* error (each row divided by its measured time), so
millisecond decode steps and multi-second prefills weigh the same. Predictions are
clamped at 0 and zero work costs zero time, as for every :class:`CostModel`.

File format (``version`` 1)::

    {"format": "halfmoon-cost-profile", "version": 1,
     "model_name": "tiny", "device": "cpu", "created": "2025-01-01T00:00:00+00:00",
     "prefill": {"features": ["1", "n", "n*(n+2c)"], "coefficients": [..3 floats..],
                 "num_points": 12, "max_rel_error": 0.01},
     "decode": {"features": ["1", "batch", "context"], ...same keys...},
     "serving": {"request_overhead_s": 0.005, ...}}   # optional: ServingTerms

The optional ``serving`` section holds :class:`ServingTerms`: time the serving path adds
around the engine's forward passes (messages, hand-over, KV import), measured by the
worker profiler (``kv_import_s_per_token``) or by a calibration run through the live
path (``benchmarks/eval/serving.py``); a file without it means all zero.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel.base import check_amount, check_count, check_counts, check_positive
from halfmoon.costmodel.roofline import RooflineCostModel
from halfmoon.costmodel.serving import ServingTerms, is_number

PROFILE_FORMAT = "halfmoon-cost-profile"
PROFILE_VERSION = 1
PREFILL_FEATURES = ("1", "n", "n*(n+2c)")
DECODE_FEATURES = ("1", "batch", "context")
_TOP_KEYS = frozenset({"format", "version", "model_name", "device", "created", "prefill", "decode"})
_OPTIONAL_TOP_KEYS = frozenset({"serving"})
_FIT_KEYS = frozenset({"features", "coefficients", "num_points", "max_rel_error"})


class PrefillPoint(NamedTuple):
    """One prefill measurement (a plain ``(new, cached, seconds)`` tuple works too)."""

    num_new_tokens: int
    num_cached_tokens: int
    seconds: float


class DecodePoint(NamedTuple):
    """One decode-step measurement (a plain ``(batch, context, seconds)`` tuple works too)."""

    batch_size: int
    total_context_tokens: int
    seconds: float


def _prefill_features(num_new_tokens: float, num_cached_tokens: float) -> list[float]:
    n, c = float(num_new_tokens), float(num_cached_tokens)
    return [1.0, n, n * (n + 2.0 * c)]


def _decode_features(batch_size: float, total_context_tokens: float) -> list[float]:
    return [1.0, float(batch_size), float(total_context_tokens)]


@dataclass(frozen=True)
class FitResult:
    """Coefficients of one fit and how well they reproduce the fitted points."""

    coefficients: tuple[float, ...]
    num_points: int
    max_rel_error: float


def _fit(rows: list[list[float]], seconds: list[float], what: str) -> FitResult:
    """Non-negative least squares on relative error, with columns scaled for conditioning.

    Every feature is a cost (a fixed overhead, per token, per attention pair), so no
    coefficient may be negative: a noisy measurement must not produce a curve that bends
    down and predicts free prefills for long prompts. Negative coefficients are pinned to
    zero one at a time (most negative first) and the rest refitted.
    """
    num_features = len(rows[0]) if rows else 0
    if len(rows) < 3 or len(rows) < num_features:
        raise ValueError(f"need at least {max(3, num_features)} {what} points, got {len(rows)}")
    x = np.asarray(rows, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    weighted = x / y[:, None]
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0  # an all-zero column (e.g. c=0 and n fixed) stays zero
    active = list(range(num_features))
    coefficients = np.zeros(num_features)
    while active:
        cols = (weighted / scale)[:, active]
        solution, *_ = np.linalg.lstsq(cols, np.ones_like(y), rcond=None)
        coefficients = np.zeros(num_features)
        coefficients[active] = solution / scale[active]
        if (coefficients >= 0).all():
            break
        active.remove(int(np.argmin(coefficients)))
    predicted = np.maximum(x @ coefficients, 0.0)
    max_rel_error = float(np.max(np.abs(predicted - y) / y))
    return FitResult(tuple(float(v) for v in coefficients), len(rows), max_rel_error)


@dataclass(frozen=True)
class CostProfile:
    """A fitted prefill model and decode-step model plus where they were measured, and
    the serving path's own terms (:class:`ServingTerms`, zero unless measured)."""

    model_name: str
    device: str
    created: str
    prefill: FitResult
    decode: FitResult
    serving: ServingTerms = field(default_factory=lambda: ServingTerms())

    def prefill_s(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """Predicted prefill seconds (0 for no new tokens)."""
        n = check_count("num_new_tokens", num_new_tokens)
        c = check_count("num_cached_tokens", num_cached_tokens)
        if n == 0:
            return 0.0
        features = _prefill_features(n, c)
        return max(
            0.0, sum(f * k for f, k in zip(features, self.prefill.coefficients, strict=True))
        )

    def decode_step_s(self, batch_size: int, total_context_tokens: int) -> float:
        """Predicted decode-step seconds (0 for an empty batch)."""
        b = check_count("batch_size", batch_size)
        ctx = check_count("total_context_tokens", total_context_tokens)
        if b == 0:
            return 0.0
        features = _decode_features(b, ctx)
        return max(0.0, sum(f * k for f, k in zip(features, self.decode.coefficients, strict=True)))

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form (see the module docstring)."""

        def fit_dict(fit: FitResult, features: Sequence[str]) -> dict[str, Any]:
            return {
                "features": list(features),
                "coefficients": list(fit.coefficients),
                "num_points": fit.num_points,
                "max_rel_error": fit.max_rel_error,
            }

        return {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "model_name": self.model_name,
            "device": self.device,
            "created": self.created,
            "prefill": fit_dict(self.prefill, PREFILL_FEATURES),
            "decode": fit_dict(self.decode, DECODE_FEATURES),
            "serving": self.serving.to_dict(),
        }

    def with_serving(self, serving: ServingTerms) -> CostProfile:
        """This profile with other serving-path terms."""
        return dataclasses.replace(self, serving=serving)

    @classmethod
    def from_dict(cls, data: Any, source: str = "cost profile") -> CostProfile:
        """Parse :meth:`to_dict` output; any problem is a :class:`HalfmoonError` naming
        ``source`` and the offending key."""
        _check_keys(data, _TOP_KEYS, source, _OPTIONAL_TOP_KEYS)
        if data["format"] != PROFILE_FORMAT:
            raise HalfmoonError(
                f"{source}: format is {data['format']!r}, expected {PROFILE_FORMAT!r}"
            )
        if data["version"] != PROFILE_VERSION:
            raise HalfmoonError(
                f"{source}: unsupported version {data['version']!r} (know {PROFILE_VERSION})"
            )
        for key in ("model_name", "device", "created"):
            if not isinstance(data[key], str):
                raise HalfmoonError(f"{source}: {key!r} must be a string, got {data[key]!r}")
        return cls(
            model_name=data["model_name"],
            device=data["device"],
            created=data["created"],
            prefill=_parse_fit(data["prefill"], PREFILL_FEATURES, f"{source}: 'prefill'"),
            decode=_parse_fit(data["decode"], DECODE_FEATURES, f"{source}: 'decode'"),
            serving=ServingTerms.from_dict(data.get("serving", {}), f"{source}: 'serving'"),
        )

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON to ``path`` (parent directories must exist)."""
        try:
            Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            raise HalfmoonError(f"cannot write cost profile {path}: {exc.strerror or exc}") from exc

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        """Read a profile written by :meth:`save`; a missing file, bad JSON or wrong keys give
        a one-line :class:`HalfmoonError` naming the file."""
        source = f"cost profile {path}"
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise HalfmoonError(f"{source}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise HalfmoonError(f"{source}: cannot read: {exc}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise HalfmoonError(
                f"{source}: not valid JSON (line {exc.lineno} column {exc.colno}: {exc.msg})"
            ) from None
        return cls.from_dict(data, source)


def _check_keys(
    data: Any, expected: frozenset[str], source: str, optional: frozenset[str] = frozenset()
) -> None:
    if not isinstance(data, Mapping):
        raise HalfmoonError(f"{source}: expected a JSON object, got {type(data).__name__}")
    missing = sorted(expected - set(data))
    unexpected = sorted(set(data) - expected - optional)
    if missing:
        raise HalfmoonError(f"{source}: missing key(s) {', '.join(missing)}")
    if unexpected:
        raise HalfmoonError(f"{source}: unexpected key(s) {', '.join(unexpected)}")


def _parse_fit(data: Any, features: Sequence[str], source: str) -> FitResult:
    _check_keys(data, _FIT_KEYS, source)
    if data["features"] != list(features):
        raise HalfmoonError(
            f"{source}: features must be {list(features)}, got {data['features']!r}"
        )
    coefficients = data["coefficients"]
    if (
        not isinstance(coefficients, list)
        or len(coefficients) != len(features)
        or not all(is_number(v) for v in coefficients)
    ):
        raise HalfmoonError(
            f"{source}: coefficients must be {len(features)} finite numbers, got {coefficients!r}"
        )
    num_points = data["num_points"]
    if isinstance(num_points, bool) or not isinstance(num_points, int) or num_points < 0:
        raise HalfmoonError(f"{source}: num_points must be an integer >= 0, got {num_points!r}")
    if not is_number(data["max_rel_error"]) or data["max_rel_error"] < 0:
        raise HalfmoonError(
            f"{source}: max_rel_error must be a number >= 0, got {data['max_rel_error']!r}"
        )
    return FitResult(
        tuple(float(v) for v in coefficients), num_points, float(data["max_rel_error"])
    )


def fit_profile(
    prefill_points: Iterable[tuple[int, int, float]],
    decode_points: Iterable[tuple[int, int, float]],
    model_name: str = "",
    device: str = "",
    created: str | None = None,
    serving: ServingTerms | None = None,
) -> CostProfile:
    """Fit a :class:`CostProfile` to measured ``(new, cached, seconds)`` prefill points and
    ``(batch, context, seconds)`` decode points (at least 3 of each, times > 0).

    ``created`` defaults to the current UTC time (ISO 8601); pass it for reproducible files.
    ``serving``: the serving path's terms measured alongside (default: all zero).
    """
    prefill_rows: list[list[float]] = []
    prefill_s: list[float] = []
    for i, (n, c, s) in enumerate(prefill_points):
        prefill_rows.append(_prefill_features(_count(n, "prefill", i), _count(c, "prefill", i)))
        prefill_s.append(_seconds(s, "prefill", i))
    decode_rows: list[list[float]] = []
    decode_s: list[float] = []
    for i, (b, ctx, s) in enumerate(decode_points):
        decode_rows.append(_decode_features(_count(b, "decode", i), _count(ctx, "decode", i)))
        decode_s.append(_seconds(s, "decode", i))
    if created is None:
        created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return CostProfile(
        model_name=model_name,
        device=device,
        created=created,
        prefill=_fit(prefill_rows, prefill_s, "prefill"),
        decode=_fit(decode_rows, decode_s, "decode"),
        serving=serving or ServingTerms(),
    )


def _count(value: int, what: str, index: int) -> int:
    return check_count(f"{what} point {index} token/batch count", value)


def _seconds(value: float, what: str, index: int) -> float:
    return check_positive(f"{what} point {index} seconds", value)


class ProfileCostModel:
    """A :class:`CostModel` whose prefill and decode times come from a :class:`CostProfile`;
    transfer and capacity come from the given link and memory figures."""

    def __init__(
        self,
        profile: CostProfile,
        kv_bytes_per_token: int,
        link_bytes_per_s: float,
        kv_capacity_tokens: int,
        link_latency_s: float = 0.0,
        hidden_bytes_per_token: int | None = None,
    ) -> None:
        self.profile = profile
        #: Bytes of hidden state per token between pipeline stages (CPP); None: unknown.
        self.hidden_bytes_per_token = hidden_bytes_per_token
        self.kv_bytes_per_token = check_count("kv_bytes_per_token", kv_bytes_per_token)
        check_positive("kv_bytes_per_token", self.kv_bytes_per_token)
        self.link_bytes_per_s = check_positive("link_bytes_per_s", link_bytes_per_s)
        # Stored privately: the public name is the protocol's method.
        self._kv_capacity_tokens = check_count("kv_capacity_tokens", kv_capacity_tokens)
        self.link_latency_s = check_amount("link_latency_s", link_latency_s)

    @classmethod
    def from_roofline(cls, profile: CostProfile, roofline: RooflineCostModel) -> ProfileCostModel:
        """Times from ``profile``; KV size, link and capacity from a
        :class:`~halfmoon.costmodel.roofline.RooflineCostModel` of the same deployment."""
        return cls(
            profile,
            kv_bytes_per_token=roofline.kv_bytes_per_token,
            link_bytes_per_s=roofline.link_bytes_per_s,
            kv_capacity_tokens=roofline.kv_capacity_tokens(),
            link_latency_s=roofline.network_latency_s,
        )

    def __repr__(self) -> str:
        return (
            f"ProfileCostModel(model={self.profile.model_name!r}, device={self.profile.device!r}, "
            f"kv_bytes_per_token={self.kv_bytes_per_token}, link_bytes_per_s={self.link_bytes_per_s}, "
            f"kv_capacity_tokens={self._kv_capacity_tokens})"
        )

    def prefill_time_s(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """The profile's prefill prediction."""
        return self.profile.prefill_s(num_new_tokens, num_cached_tokens)

    def decode_step_time_s(self, batch_size: int, total_context_tokens: int) -> float:
        """The profile's decode-step prediction."""
        return self.profile.decode_step_s(batch_size, total_context_tokens)

    def decode_step_times_s(
        self, batch_sizes: np.ndarray, total_context_tokens: np.ndarray
    ) -> np.ndarray:
        """:meth:`decode_step_time_s` of many batches at once: the profile's sum, term by
        term in the same order, so the same values."""
        b = check_counts("batch_sizes", batch_sizes)
        ctx = check_counts("total_context_tokens", total_context_tokens)
        k_one, k_batch, k_context = self.profile.decode.coefficients
        step_s = (1.0 * k_one + b * k_batch) + ctx * k_context
        return np.where(b == 0, 0.0, np.maximum(step_s, 0.0))

    def transfer_time_s(self, num_bytes: float) -> float:
        """``latency + num_bytes / link`` (0 for nothing to move)."""
        size = check_amount("num_bytes", num_bytes)
        if size == 0:
            return 0.0
        return self.link_latency_s + size / self.link_bytes_per_s

    def kv_capacity_tokens(self) -> int:
        """The configured KV capacity in tokens."""
        return self._kv_capacity_tokens
