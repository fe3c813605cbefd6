"""L2 model engine: Llama-family model, paged KV pool, prefix cache, chunked prefill,
continuous-batching decode, per-layer KV hooks, KV export/import, and the connector
serving roles use (:mod:`halfmoon.engine.connector`). All of halfmoon's torch code lives
in this package.

Importing the package itself is cheap (``halfmoon.engine.cli`` must stay torch-free until
a command runs); the public names below load their modules on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLMEngine": "halfmoon.engine.engine",
    "RequestOutput": "halfmoon.engine.engine",
    "KVHandoff": "halfmoon.engine.engine",
    "EngineStats": "halfmoon.engine.engine",
    "EngineConnector": "halfmoon.engine.connector",
    "LocalConnector": "halfmoon.engine.connector",
    "StageConnector": "halfmoon.engine.connector",
    "HandoffState": "halfmoon.engine.connector",
    "EngineConfig": "halfmoon.engine.config",
    "ModelConfig": "halfmoon.engine.config",
    "EngineSamplingParams": "halfmoon.engine.sampling",
    "KVLayout": "halfmoon.engine.kv_cache",
    "KV_LAYOUT_VERSION": "halfmoon.engine.kv_cache",
    "KVCache": "halfmoon.engine.kv_cache",
    "export_to_bytes": "halfmoon.engine.kv_cache",
    "BlockManager": "halfmoon.engine.block_manager",
    "LayerKV": "halfmoon.engine.attention",
    "LayerHook": "halfmoon.engine.attention",
    "load_model": "halfmoon.engine.loader",
    "create_preset_dir": "halfmoon.engine.loader",
    "PRESETS": "halfmoon.engine.loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'halfmoon.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
