"""Real token ids from trace block ids, so that prefix sharing in a trace is real.

Each block id seeds its own random stream (``PCG64(SeedSequence((salt, block_id)))``)
which draws that block's ``tokens_per_block`` token ids uniformly in
``[min_token_id, vocab_size)``. A prompt is the concatenation of its blocks' tokens;
a partial last block takes a prefix of its block's tokens::

    hash_ids      [  7  |  8  |  9 ]          input_length = 2*B + 5
    tokens        [ T(7) | T(8) | T(9)[:5] ]   T(id) = B tokens seeded by id

So two requests whose ``hash_ids`` agree on their first k entries agree on their first
``k*B`` tokens, and :func:`halfmoon.core.hashing.hash_blocks` gives them the same first
k chained hashes. A different ``salt`` gives an unrelated token universe.

Length scaling: a Mooncake trace counts 512 tokens per block; with ``tokens_per_block``
= 32 each block shrinks 16x so long traces can drive a small model. Lengths scale as
``ceil(length * tokens_per_block / 512)`` (at least 1 token), which keeps the number of
blocks, and full blocks stay full.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from halfmoon.core.request import Request


def scale_length(length_tokens: int, from_block_tokens: int, to_block_tokens: int) -> int:
    """``ceil(length * to / from)``, at least 1: a length measured in other-sized blocks."""
    if length_tokens < 1:
        raise ValueError(f"length must be >= 1, got {length_tokens}")
    if from_block_tokens < 1 or to_block_tokens < 1:
        raise ValueError(f"block sizes must be >= 1, got {from_block_tokens} and {to_block_tokens}")
    return max(1, -(-length_tokens * to_block_tokens // from_block_tokens))


def scale_request(request: Request, tokens_per_block: int) -> Request:
    """``request`` with its block size set to ``tokens_per_block`` and both lengths scaled
    in proportion (block ids unchanged; any prompt token ids are dropped)."""
    source = request.block_size_tokens
    if tokens_per_block == source:
        return request
    return dataclasses.replace(
        request,
        input_length=scale_length(request.input_length, source, tokens_per_block),
        output_length=scale_length(request.output_length, source, tokens_per_block),
        block_size_tokens=tokens_per_block,
        prompt_token_ids=(),
    )


class TokenSynthesizer:
    """Turns block ids into token ids, deterministically for a ``(salt, vocab_size,
    min_token_id, tokens_per_block)``.

    Generated blocks are kept in a bounded LRU dict (``max_cached_blocks`` entries) since
    requests sharing a prefix ask for the same blocks again and again.
    """

    def __init__(
        self,
        vocab_size: int,
        tokens_per_block: int = 512,
        salt: int = 0,
        min_token_id: int = 0,
        max_cached_blocks: int = 4096,
    ) -> None:
        if not 0 <= min_token_id < vocab_size:
            raise ValueError(
                f"need 0 <= min_token_id < vocab_size, got {min_token_id} and {vocab_size}"
            )
        if vocab_size > 2**32:
            raise ValueError(f"vocab_size must be <= 2**32, got {vocab_size}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        if salt < 0:
            raise ValueError(f"salt must be >= 0, got {salt}")
        if max_cached_blocks < 0:
            raise ValueError(f"max_cached_blocks must be >= 0, got {max_cached_blocks}")
        self.vocab_size = vocab_size
        self.tokens_per_block = tokens_per_block
        self.salt = salt
        self.min_token_id = min_token_id
        self.max_cached_blocks = max_cached_blocks
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    def block_tokens(self, block_id: int) -> np.ndarray:
        """The ``tokens_per_block`` token ids of block ``block_id`` (read-only uint32 array)."""
        cached = self._cache.get(block_id)
        if cached is not None:
            self._cache.move_to_end(block_id)
            return cached
        if block_id < 0:
            raise ValueError(f"block ids must be >= 0, got {block_id}")
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence((self.salt, block_id))))
        tokens = rng.integers(
            self.min_token_id, self.vocab_size, size=self.tokens_per_block, dtype=np.uint32
        )
        tokens.flags.writeable = False
        if self.max_cached_blocks:
            self._cache[block_id] = tokens
            if len(self._cache) > self.max_cached_blocks:
                self._cache.popitem(last=False)
        return tokens

    def prompt_tokens(self, block_ids: Sequence[int], num_tokens: int) -> np.ndarray:
        """``num_tokens`` token ids for a prompt made of ``block_ids`` (the last possibly
        partial); ``len(block_ids)`` must be ``ceil(num_tokens / tokens_per_block)``."""
        block = self.tokens_per_block
        expected = -(-num_tokens // block)
        if num_tokens < 1 or len(block_ids) != expected:
            raise ValueError(
                f"{len(block_ids)} block ids cannot cover {num_tokens} tokens at "
                f"{block} tokens/block (expected {expected})"
            )
        out = np.empty(expected * block, dtype=np.uint32)
        for index, block_id in enumerate(block_ids):
            out[index * block : (index + 1) * block] = self.block_tokens(block_id)
        return out[:num_tokens]

    def request_tokens(self, request: Request) -> np.ndarray:
        """Prompt token ids of ``request``, after scaling it to ``tokens_per_block``."""
        scaled = scale_request(request, self.tokens_per_block)
        if not scaled.block_hashes:
            raise ValueError(f"request {request.request_id} has no block ids to expand")
        return self.prompt_tokens(scaled.block_hashes, scaled.input_length)

    def with_tokens(self, request: Request) -> Request:
        """``request`` scaled to ``tokens_per_block`` with ``prompt_token_ids`` filled in."""
        tokens = self.request_tokens(request)
        scaled = scale_request(request, self.tokens_per_block)
        return dataclasses.replace(scaled, prompt_token_ids=tuple(tokens.tolist()))
