"""Frozen configs as one JSON document: what a launcher hands its child processes."""

from __future__ import annotations

import json
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
