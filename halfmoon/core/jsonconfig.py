"""Frozen configs as one JSON document: what a launcher hands its child processes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any

from halfmoon.core.errors import HalfmoonError


def config_to_json(config: Any) -> str:
    """A dataclass instance as one JSON document (sorted keys)."""
    return json.dumps(asdict(config), sort_keys=True)


def config_fields(cls: type, text: str, what: str) -> dict[str, Any]:
    """The fields of dataclass ``cls`` in a document :func:`config_to_json` wrote; a key
    ``cls`` lacks is a :class:`HalfmoonError` naming it (no silent drift between a
    launcher and its child)."""
    data = json.loads(text)
    if not isinstance(data, dict):
        raise HalfmoonError(f"{what}: expected a JSON object")
    unknown = set(data) - {f.name for f in fields(cls)}
    if unknown:
        raise HalfmoonError(f"unknown {what}: {', '.join(sorted(unknown))}")
    return data


def json_object_option(value: str | Mapping[str, Any] | None, flag: str,
                       example: str) -> Mapping[str, Any] | None:  # fmt: skip
    """A command-line flag's JSON object (vLLM's ``--speculative-config``,
    ``--profiler-config``), given as text or already parsed; None for None or an empty
    value. A :class:`HalfmoonError` names ``flag`` (and shows ``example``) for bad JSON or
    anything but an object."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise HalfmoonError(
                f"{flag} must be a JSON object such as '{example}': {exc}"
            ) from None
    if not isinstance(value, Mapping):
        raise HalfmoonError(f"{flag} must be a JSON object, got {value!r}")
    return value
