"""Chained content hashes of KV blocks.

Block i of a prompt covers tokens ``[i*B, (i+1)*B)``; its hash chains on its parent's::

    h_0 = xxh3_128(NONE_HASH || tokens[0:B])
    h_i = xxh3_128(h_{i-1}  || tokens[i*B:(i+1)*B])      (16 bytes || 4*B bytes, little-endian u32)

so two prompts share ``h_0..h_k`` exactly when they share their first ``(k+1)*B`` tokens.
A partial last block is hashed the same way over its shorter slice but marked partial:
only full blocks are cacheable.

Per-tenant isolation (vLLM's ``cache_salt``): a request with a salt chains its first block
on :func:`chain_root` of that salt instead of ``NONE_HASH``, so every one of its hashes
differs from those of the same tokens under another salt or none, and no cache anywhere
(gateway placement, Conductor index, engine pools, stores) shares a block between them.
Unsalted requests hash exactly as before.

A request run with a LoRA adapter computes other KV from the same tokens, so its salt
carries the adapter (:func:`adapter_salt`, applied where a request enters: the gateway,
the engine's ``add_request``): its chain is its adapter's (and tenant's) alone.

Speed: the token ids are converted to little-endian u32 bytes once with numpy; the loop
then does one 16+4*B-byte concatenation and one hash call per block (a 128k-token prompt
with 16-token blocks takes ~3 ms; see benchmarks/micro/hashing.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

#: Parent of the first block. A different root (e.g. per model or LoRA) gives disjoint chains.
NONE_HASH = 0
_DIGEST_BYTES = 16
#: Domain label of salted roots (a root is never the hash of token bytes).
_SALT_LABEL = b"halfmoon/cache_salt/v1\0"
#: Separates an adapter's mark from the rest of a salt; no request's own salt holds it.
_ADAPTER_SEP = "\x1f"


@dataclass(frozen=True)
class BlockHashes:
    """The hash chain of one prompt.

    ``hashes[i]`` is block i's hash; when ``last_is_partial`` the final entry covers fewer
    than ``block_size`` tokens and must not be cached or matched.
    """

    hashes: tuple[int, ...]
    block_size: int
    num_tokens: int
    last_is_partial: bool

    @property
    def num_full_blocks(self) -> int:
        """Blocks holding exactly ``block_size`` tokens (the cacheable ones)."""
        return len(self.hashes) - int(self.last_is_partial)

    @property
    def full(self) -> tuple[int, ...]:
        """Hashes of the full (cacheable) blocks only."""
        return self.hashes[: self.num_full_blocks]


def chain_root(cache_salt: str | None) -> int:
    """The parent of block 0 for a request with ``cache_salt``: ``NONE_HASH`` without one,
    else 128 bits of SHA-256 over a fixed label and the salt's UTF-8 bytes (a
    cryptographic hash: no salt can be chosen to land on another salt's chain)."""
    if cache_salt is None:
        return NONE_HASH
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError("cache_salt must be a non-empty string or None")
    digest = hashlib.sha256(_SALT_LABEL + cache_salt.encode("utf-8")).digest()
    return int.from_bytes(digest[:_DIGEST_BYTES], "little")


def adapter_salt(cache_salt: str | None, lora: str | None) -> str | None:
    """The salt a request's blocks hash under when it runs with LoRA adapter ``lora``
    (None: ``cache_salt`` itself): ``cache_salt`` behind a mark naming the adapter.
    Idempotent (a salt already marked for ``lora`` comes back as it is), so each place a
    request enters may apply it. ValueError for a salt holding the separator U+001F
    other than as ``lora``'s own mark: no request can borrow an adapter's chain, or
    lose it."""
    mark = "" if lora is None else f"{_ADAPTER_SEP}lora:{lora}{_ADAPTER_SEP}"
    if cache_salt is not None and _ADAPTER_SEP in cache_salt:
        if mark and cache_salt.startswith(mark) and _ADAPTER_SEP not in cache_salt[len(mark) :]:
            return cache_salt
        raise ValueError("cache_salt must not contain the control character U+001F")
    if not mark:
        return cache_salt
    return mark + (cache_salt or "")


def _token_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must lie in [0, 2**32)")
    return np.ascontiguousarray(arr, dtype="<u4")


def hash_blocks(
    token_ids: Sequence[int] | np.ndarray, block_size: int, parent: int = NONE_HASH
) -> BlockHashes:
    """Chained xxh3_128 hashes of ``token_ids`` cut into blocks of ``block_size`` tokens.

    ``parent`` is the hash the first block chains on (continue a chain by passing the last
    full block's hash of the previous segment).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    tokens = _token_array(token_ids)
    num_tokens = int(tokens.size)
    num_full = num_tokens // block_size
    data = tokens.tobytes()
    step_bytes = 4 * block_size
    digest = xxhash.xxh3_128_digest
    digests: list[bytes] = []
    append = digests.append
    prev = parent.to_bytes(_DIGEST_BYTES, "little")
    for offset in range(0, num_full * step_bytes, step_bytes):
        prev = digest(prev + data[offset : offset + step_bytes])
        append(prev)
    partial = num_tokens > num_full * block_size
    if partial:
        digests.append(digest(prev + data[num_full * step_bytes :]))
    hashes = tuple(int.from_bytes(d, "little") for d in digests)
    return BlockHashes(hashes, block_size, num_tokens, partial)
