"""Token synthesis from block ids: shared ids give shared tokens and shared hash chains."""

from __future__ import annotations

import numpy as np
import pytest

from halfmoon.core.hashing import hash_blocks
from halfmoon.core.request import Request
from halfmoon.workload.tokens import TokenSynthesizer, scale_length, scale_request


def test_shared_hash_ids_give_shared_token_prefixes_and_hash_chains() -> None:
    synth = TokenSynthesizer(vocab_size=32000, tokens_per_block=16)
    a = synth.prompt_tokens([10, 11, 12, 13], 60)
    b = synth.prompt_tokens([10, 11, 99, 100], 64)
    assert np.array_equal(a[:32], b[:32])
    assert not np.array_equal(a[32:48], b[32:48])
    chain_a = hash_blocks(a, 16)
    chain_b = hash_blocks(b, 16)
    assert chain_a.hashes[:2] == chain_b.hashes[:2]
    assert chain_a.hashes[2] != chain_b.hashes[2]
    assert chain_a.last_is_partial and not chain_b.last_is_partial


def test_partial_last_block_is_a_prefix_of_its_full_block() -> None:
    synth = TokenSynthesizer(vocab_size=1000, tokens_per_block=8)
    full = synth.prompt_tokens([3, 4], 16)
    partial = synth.prompt_tokens([3, 4], 11)
    assert len(partial) == 11
    assert np.array_equal(partial, full[:11])
    assert np.array_equal(full[8:], synth.block_tokens(4))


def test_deterministic_across_instances_and_cache_sizes() -> None:
    ids = [0, 5, 2**64 + 3, 123456789]
    cached = TokenSynthesizer(vocab_size=50000, tokens_per_block=32, max_cached_blocks=2)
    uncached = TokenSynthesizer(vocab_size=50000, tokens_per_block=32, max_cached_blocks=0)
    first = cached.prompt_tokens(ids, 128)
    again = cached.prompt_tokens(ids, 128)  # mostly evicted from the 2-entry cache by now
    assert np.array_equal(first, again)
    assert np.array_equal(first, uncached.prompt_tokens(ids, 128))


def test_salt_and_ids_change_tokens() -> None:
    plain = TokenSynthesizer(vocab_size=50000, tokens_per_block=64)
    salted = TokenSynthesizer(vocab_size=50000, tokens_per_block=64, salt=1)
    assert not np.array_equal(plain.block_tokens(7), salted.block_tokens(7))
    assert not np.array_equal(plain.block_tokens(7), plain.block_tokens(8))


def test_tokens_stay_in_vocabulary() -> None:
    synth = TokenSynthesizer(vocab_size=10, tokens_per_block=512, min_token_id=3)
    tokens = np.concatenate([synth.block_tokens(i) for i in range(50)])
    assert tokens.min() == 3 and tokens.max() == 9
    assert set(np.unique(tokens)) == set(range(3, 10))


def test_blocks_are_read_only() -> None:
    block = TokenSynthesizer(vocab_size=100, tokens_per_block=4).block_tokens(1)
    with pytest.raises(ValueError):
        block[0] = 0


@pytest.mark.parametrize(
    ("length", "expected"),
    [(1, 1), (16, 1), (17, 2), (512, 32), (513, 33), (1000, 63), (191378, 11962)],
)
def test_scale_length_is_ceil_and_at_least_one(length: int, expected: int) -> None:
    assert scale_length(length, 512, 32) == expected


def test_scale_request_keeps_block_count_and_full_blocks() -> None:
    original = Request("r", 1.0, 1024 + 100, 229, (1, 2, 3))
    scaled = scale_request(original, 32)
    assert scaled.block_size_tokens == 32
    assert scaled.input_length == 64 + 7  # ceil(100 * 32 / 512) = 7 tokens in the last block
    assert scaled.output_length == 15  # ceil(229 / 16)
    assert scaled.block_hashes == original.block_hashes
    assert scaled.num_full_blocks == original.num_full_blocks == 2
    assert scale_request(original, 512) is original


def test_request_tokens_and_with_tokens() -> None:
    synth = TokenSynthesizer(vocab_size=32000, tokens_per_block=32)
    a = Request("a", 0.0, 2048, 10, (1, 2, 3, 4))
    b = Request("b", 1.0, 1500, 10, (1, 2, 9))
    tokens_a = synth.request_tokens(a)
    tokens_b = synth.request_tokens(b)
    assert len(tokens_a) == 128 and len(tokens_b) == 94
    assert np.array_equal(tokens_a[:64], tokens_b[:64])
    filled = synth.with_tokens(b)
    assert filled.prompt_token_ids == tuple(tokens_b.tolist())
    assert filled.input_length == 94 and filled.block_size_tokens == 32
    assert (
        hash_blocks(filled.prompt_token_ids, 32).hashes[:2] == hash_blocks(tokens_a, 32).hashes[:2]
    )


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match="min_token_id < vocab_size"):
        TokenSynthesizer(vocab_size=10, min_token_id=10)
    with pytest.raises(ValueError, match="tokens_per_block"):
        TokenSynthesizer(vocab_size=10, tokens_per_block=0)
    synth = TokenSynthesizer(vocab_size=10, tokens_per_block=4)
    with pytest.raises(ValueError, match="expected 2"):
        synth.prompt_tokens([1], 5)
    with pytest.raises(ValueError, match="block ids must be >= 0"):
        synth.block_tokens(-1)
    with pytest.raises(ValueError, match="no block ids"):
        synth.request_tokens(Request("x", 0.0, 4, 1))
