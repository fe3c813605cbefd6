"""Default sampling options from the served model (vLLM's ``--generation-config``).

A request that leaves a sampling option out gets the model's default for it, as vLLM
serves it: the sampling fields of the model directory's ``generation_config.json`` with
``halfmoon serve --generation-config auto`` (the default), none of them with ``vllm``
(the API's own defaults: temperature 1, top_p 1, ...), and ``--override-generation-config
JSON`` on top of either. An option the request sets, even to the API's default value,
is the request's.

The fields: ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
``presence_penalty``, ``frequency_penalty`` and ``max_new_tokens`` (the output limit of
a request that sets no ``max_tokens``; a chat request without one otherwise runs to the
end of the served context, a completion to 16 tokens). A value outside what the API
accepts is an error naming the field and the file or flag it came from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from halfmoon.core.errors import HalfmoonError

#: ``--generation-config`` choices.
SOURCES = ("auto", "vllm")
GENERATION_CONFIG = "generation_config.json"
#: field -> (type, lowest allowed, lowest exclusive?, highest allowed), as the API checks
#: a request's own value (halfmoon.serve.gateway.openai_api).
FIELDS: dict[str, tuple[type, float, bool, float | None]] = {
    "temperature": (float, 0.0, False, 2.0),
    "top_p": (float, 0.0, True, 1.0),
    "top_k": (int, 0, False, None),
    "min_p": (float, 0.0, False, 1.0),
    "repetition_penalty": (float, 0.0, True, 2.0),
    "presence_penalty": (float, -2.0, False, 2.0),
    "frequency_penalty": (float, -2.0, False, 2.0),
    "max_new_tokens": (int, 1, False, None),
}

Defaults = dict[str, float | int]


def checked(values: Mapping[str, Any], where: str) -> Defaults:
    """The sampling fields of ``values`` (others ignored, as in a generation config that
    also names token ids), each checked; ``where`` names their source in errors. A
    ``top_k`` of -1 or 0 means no limit, as in vLLM and HF (kept as 0)."""
    out: Defaults = {}
    for name, (kind, low, exclusive, high) in FIELDS.items():
        if name not in values or values[name] is None:
            continue
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HalfmoonError(f"{where}: {name} must be a number, not {value!r}")
        if kind is int and value != int(value):
            raise HalfmoonError(f"{where}: {name} must be a whole number, not {value!r}")
        if name == "top_k" and value == -1:
            value = 0
        too_low = value <= low if exclusive else value < low
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            bound = f"above {low}" if exclusive else f"at least {low}"
            bounds = bound + (f" and at most {high}" if high is not None else "")
            raise HalfmoonError(f"{where}: {name} must be {bounds}, not {value!r}")
        out[name] = kind(value)
    return out


def parse_override(text: str) -> Defaults:
    """``--override-generation-config``'s JSON object, checked (unknown fields are an
    error here: a typo must not pass silently)."""
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise HalfmoonError(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise HalfmoonError("--override-generation-config must be a JSON object")
    unknown = sorted(set(values) - set(FIELDS))
    if unknown:
        raise HalfmoonError(
            f"--override-generation-config: unknown fields {unknown}; use {', '.join(FIELDS)}"
        )
    return checked(values, "--override-generation-config")


def generation_defaults(
    model_dir: Path, source: str = "auto", override: Mapping[str, float | int] | None = None
) -> Defaults:
    """The sampling defaults for ``model_dir``: its generation config's (``auto``) or
    none (``vllm``), then ``override``."""
    if source not in SOURCES:
        raise HalfmoonError(f"unknown --generation-config {source!r}; use {' or '.join(SOURCES)}")
    out: Defaults = {}
    path = Path(model_dir) / GENERATION_CONFIG
    if source == "auto" and path.is_file():
        try:
            values = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise HalfmoonError(f"cannot read {path}: {exc}") from None
        if isinstance(values, dict):
            out = checked(values, str(path))
    out.update(override or {})
    return out


def end_token_ids(model_dir: Path) -> tuple[int, ...]:
    """The model's end-of-sequence token ids as its ``config.json`` and generation
    config name them (the engine stops on these; the tokenizer's own is added by the
    gateway), read without loading the model."""
    ids: list[int] = []
    for name in ("config.json", GENERATION_CONFIG):
        path = Path(model_dir) / name
        try:
            value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        except (OSError, ValueError, AttributeError):
            continue  # (its loader reports a broken file)
        values = value if isinstance(value, list) else [value]
        ids += [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    return tuple(sorted(set(ids)))


def describe(defaults: Mapping[str, float | int]) -> str:
    """``temperature 0.2, top_p 0.9`` (``none`` when empty), for the start-up log."""
    return ", ".join(f"{k} {v:g}" for k, v in defaults.items()) or "none"


def defaults_from_args(args: Any, model_dir: Path) -> Defaults:
    """The defaults ``halfmoon serve``'s ``--generation-config`` and
    ``--override-generation-config`` give for ``model_dir``."""
    text = getattr(args, "override_generation_config", None)
    override = parse_override(text) if text else None
    return generation_defaults(model_dir, getattr(args, "generation_config", "auto"), override)


def startup_line(defaults: Mapping[str, float | int], source: str, overridden: bool = False) -> str:
    """The start-up log line that says which defaults requests get."""
    origin = "the model's generation_config.json" if source == "auto" else "the API's own"
    more = " with --override-generation-config" if overridden else ""
    return (
        f"sampling defaults for options a request leaves out: {describe(defaults)} "
        f"(--generation-config {source}: {origin}{more})"
    )
