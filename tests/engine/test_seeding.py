"""Prefix reservations (halfmoon/engine/seeding.py): pool blocks held for a prefix while
its KV arrives, written from any thread, kept as cached blocks once it has."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.kv_cache import KVCache, KVLayout
from halfmoon.engine.seeding import reserve_prefix, seed_prefix

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype="float32")
PROMPT = [(i * 7) % 97 + 3 for i in range(6 * 4 + 1)]  # 6 full blocks and one token


def _pool(num_blocks: int = 10) -> tuple[BlockManager, KVCache]:
    return BlockManager(num_blocks, LAYOUT.block_size), KVCache(LAYOUT, num_blocks)


def _payload(i: int) -> bytes:
    """Block ``i``'s export bytes: distinct values per block, layer, kind and row."""
    n = LAYOUT.bytes_per_block // 4
    return (np.arange(n, dtype=np.float32) + 1000 * (i + 1)).tobytes()


def _pool_bytes(cache: KVCache, block: int) -> bytes:
    return bytes(cache.export_bytes([block]))


def test_blocks_written_from_two_threads_in_any_order_are_kept_as_cached():
    blocks, cache = _pool()
    held = reserve_prefix(blocks, cache, PROMPT, 0, 6)
    assert held is not None and held.num_blocks == 6
    assert blocks.num_free_blocks == 4 and blocks.match_prefix(PROMPT) == []  # not yet cached
    threads = [
        threading.Thread(target=lambda ks: [held.write(k, _payload(k)) for k in ks], args=(ks,))
        for ks in ([5, 3, 1], [0, 4, 2])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert held.num_written() == 6
    assert held.finish() == 6 and held.finish() == 0  # once
    ids = blocks.match_prefix(PROMPT)
    assert ids == held.block_ids
    assert [_pool_bytes(cache, b) for b in ids] == [_payload(i) for i in range(6)]
    assert blocks.num_free_blocks == 10  # free, cached, reusable
    blocks.check_integrity()
    with pytest.raises(HalfmoonError, match="finished"):
        held.write(0, _payload(0))


def test_only_the_leading_run_written_is_kept():
    blocks, cache = _pool()
    held = reserve_prefix(blocks, cache, PROMPT, 0, 6)
    for k in (0, 1, 3, 4):  # block 2 never came
        held.write(k, _payload(k))
    assert held.num_written() == 2
    assert held.finish(6) == 2
    assert len(blocks.match_prefix(PROMPT)) == 2 and blocks.num_free_blocks == 10
    blocks.check_integrity()
    rest = reserve_prefix(blocks, cache, PROMPT, 2, 4)  # blocks 2-5
    with pytest.raises(HalfmoonError, match="block 4 of a 4-block"):
        rest.write(4, _payload(6))
    rest.release()
    blocks.check_integrity()


def test_a_reservation_continues_the_cached_prefix_and_holds_it():
    """Blocks 2.. of a prompt whose blocks 0-1 are cached: the prefix is held with the
    new blocks, so filling the rest of the pool cannot evict it meanwhile."""
    blocks, cache = _pool(8)
    assert seed_prefix(blocks, cache, PROMPT, 0, [_payload(0), _payload(1)]) == 2
    assert reserve_prefix(blocks, cache, PROMPT, 1, 5) is None  # the pool holds 2, not 1
    held = reserve_prefix(blocks, cache, PROMPT, 2, 4)
    assert held is not None and blocks.num_free_blocks == 2
    other = [5000 + i for i in range(2 * 4)]
    assert blocks.admit("other", other, len(other)) == 0  # takes the last two free blocks
    assert blocks.admit("more", [6000 + i for i in range(5)], 5) is None  # none left
    assert len(blocks.match_prefix(PROMPT)) == 2  # the held prefix was not evicted
    for k in range(4):
        held.write(k, _payload(2 + k))
    assert held.finish() == 4
    ids = blocks.match_prefix(PROMPT)
    assert [_pool_bytes(cache, b) for b in ids] == [_payload(i) for i in range(6)]
    blocks.free("other")
    blocks.check_integrity()


def test_no_room_holds_nothing():
    blocks, cache = _pool(4)
    assert reserve_prefix(blocks, cache, PROMPT, 0, 6) is None
    assert reserve_prefix(blocks, cache, PROMPT, 0, 0) is None
    assert seed_prefix(blocks, cache, PROMPT, 0, [_payload(i) for i in range(6)]) == 0
    assert blocks.num_free_blocks == 4 and blocks.num_cached_blocks == 0
    blocks.check_integrity()


def test_blocks_the_pool_computed_meanwhile_keep_their_first_copy():
    """The engine computed the same prompt while its blocks were on the way: finishing
    registers none of the held copies (they go back uncached), the computed ones stay."""
    blocks, cache = _pool(16)
    held = reserve_prefix(blocks, cache, PROMPT, 0, 6)
    assert blocks.admit("computed", PROMPT, len(PROMPT)) == 0
    blocks.commit("computed", PROMPT, len(PROMPT))
    computed = blocks.block_table("computed")[:6]
    for k in range(6):
        held.write(k, _payload(k))
    assert held.finish() == 0
    assert blocks.match_prefix(PROMPT) == computed
    blocks.free("computed")
    blocks.check_integrity()


def test_a_salted_reservation_is_found_under_its_salt_only():
    blocks, cache = _pool()
    held = reserve_prefix(blocks, cache, PROMPT, 0, 3, cache_salt="tenant-a")
    for k in range(3):
        held.write(k, _payload(k))
    assert held.finish() == 3
    assert len(blocks.match_prefix(PROMPT, "tenant-a")) == 3
    assert blocks.match_prefix(PROMPT) == [] and blocks.match_prefix(PROMPT, "tenant-b") == []


def test_release_gives_every_block_back_uncached():
    blocks, cache = _pool()
    held = reserve_prefix(blocks, cache, PROMPT, 0, 4)
    held.write(0, _payload(0))
    held.release()
    assert blocks.num_free_blocks == 10 and blocks.num_cached_blocks == 0
    blocks.check_integrity()
