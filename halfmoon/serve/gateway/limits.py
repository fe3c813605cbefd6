"""The context limit a gateway serves, and where it comes from.

A request runs only when its prompt and all its output tokens fit one worker's KV pool
at once (a decode or coupled worker holds the whole context; a prefill worker the whole
prompt), and within the model's own context. So the served ``max_model_len`` is::

    min(model's context, tokens one worker's KV pool holds, --max-model-len if given)

and ``max_tokens`` is capped at that same limit unless ``--max-tokens-limit`` says
otherwise. ``halfmoon serve`` computes it before the gateway opens, from the same
``--kv-cache-mb``, ``--block-size`` and ``--dtype`` every worker sizes its pool with
(``KVCache.from_budget``), so nothing waits on the workers; ``/v1/models`` advertises it.
Pure Python: no torch (the gateway process never loads it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from halfmoon.core.errors import HalfmoonError

#: Bytes of one K or V element for each ``--dtype`` (as torch stores them).
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ContextLimit:
    """The served context in tokens and a phrase saying what set it (for the log)."""

    max_model_len: int
    source: str


def model_context_tokens(model_dir: Path) -> int:
    """The model's own context (its position limit, or sliding window when smaller), from
    ``config.json``; ``max_position_embeddings`` (2048 when absent) for a model the
    engine's parser does not know (a vLLM-served architecture)."""
    from halfmoon.engine.config import ModelConfig

    config = json.loads((model_dir / "config.json").read_text())
    try:
        return ModelConfig.from_hf(config).max_context_tokens
    except HalfmoonError:
        return int(config.get("max_position_embeddings") or 2048)


def kv_pool_tokens(model_dir: Path, kv_cache_mb: float, block_size: int, dtype: str) -> int:
    """Tokens one worker's KV pool of ``kv_cache_mb`` MiB holds (whole blocks)."""
    from halfmoon.engine.config import ModelConfig

    if dtype not in DTYPE_BYTES:
        raise HalfmoonError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPE_BYTES)}")
    config = ModelConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    per_token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    block_bytes = per_token_bytes * DTYPE_BYTES[dtype] * block_size
    return int(kv_cache_mb * 2**20) // block_bytes * block_size


def served_context(
    model_dir: Path,
    requested: int | None,
    kv_cache_mb: float | None,
    block_size: int,
    dtype: str,
) -> ContextLimit:
    """The served ``max_model_len`` (see the module docstring); ``kv_cache_mb`` None:
    the engine sizes its own pool (vLLM: ``requested`` already fits it)."""
    own = model_context_tokens(model_dir)
    candidates = [(own, f"the model's context ({own} tokens)")]
    if kv_cache_mb is not None:
        pool = kv_pool_tokens(model_dir, kv_cache_mb, block_size, dtype)
        candidates.append((pool, f"one worker's KV pool ({pool} tokens in "
                                 f"--kv-cache-mb {kv_cache_mb:g})"))  # fmt: skip
    if requested is not None:
        candidates.append((requested, f"--max-model-len {requested}"))
    limit, source = min(candidates, key=lambda c: c[0])
    if limit < 2:
        raise HalfmoonError(f"the served context would be {limit} tokens, set by {source}")
    return ContextLimit(limit, source)
