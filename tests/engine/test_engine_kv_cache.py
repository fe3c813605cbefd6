"""The KV pool's export layout (version 1), byte round trips, sizing and the host side
of its boundary (zero copy on the CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.attention import LayerKV
from halfmoon.engine.kv_cache import (
    KV_LAYOUT_VERSION,
    KVCache,
    KVLayout,
    export_to_bytes,
    from_bytes,
    host_bytes,
    to_host,
)
from halfmoon.engine.stage import LayerSlice, StageKVCache

LAYOUT = KVLayout(num_layers=3, block_size=4, num_kv_heads=2, head_dim=5, dtype="float32")


def filled_cache(num_blocks: int = 6) -> KVCache:
    cache = KVCache(LAYOUT, num_blocks)
    cache.pool.copy_(torch.arange(cache.pool.numel(), dtype=torch.float32).view(cache.pool.shape))
    return cache


def test_bytes_per_block_and_budget_sizing() -> None:
    assert LAYOUT.bytes_per_block == 3 * 2 * 4 * 2 * 5 * 4
    assert KVLayout(3, 4, 2, 5, "bfloat16").bytes_per_block == LAYOUT.bytes_per_block // 2
    cache = KVCache.from_budget(LAYOUT, kv_cache_mb=10 * LAYOUT.bytes_per_block / 2**20)
    assert cache.num_blocks == 10
    with pytest.raises(HalfmoonError, match="holds no block"):
        KVCache.from_budget(LAYOUT, kv_cache_mb=1e-6)


def test_export_is_layer_major_k_then_v_blocks_in_order() -> None:
    cache = filled_cache()
    block_ids = [4, 1, 2]
    data = cache.export_blocks(block_ids)
    assert data.shape == (3, 2, 3, 4, 2, 5) and data.is_contiguous()
    flat = data.reshape(-1)
    per_block = 4 * 2 * 5
    # Walk the documented order: layer, kind (K, V), block in table order.
    offset = 0
    for layer in range(3):
        for kind in range(2):
            for block in block_ids:
                expected = cache.pool[layer, kind, block].reshape(-1)
                assert torch.equal(flat[offset : offset + per_block], expected)
                offset += per_block


def test_bytes_round_trip_into_other_blocks() -> None:
    source = filled_cache()
    raw = export_to_bytes(source.export_blocks([0, 3]))
    assert raw.nbytes == 2 * LAYOUT.bytes_per_block
    target = KVCache(LAYOUT, 6)
    target.import_blocks([5, 2], bytes(raw))
    assert torch.equal(target.pool[:, :, 5], source.pool[:, :, 0])
    assert torch.equal(target.pool[:, :, 2], source.pool[:, :, 3])
    assert torch.count_nonzero(target.pool[:, :, [0, 1, 3, 4]]) == 0


def test_layer_blocks_are_views_when_consecutive() -> None:
    cache = filled_cache()
    key, _ = cache.layer_blocks(1, [2, 3])
    assert key.data_ptr() == cache.pool[1, 0, 2].data_ptr()
    gathered, _ = cache.layer_blocks(1, [3, 1])
    assert torch.equal(gathered[0], cache.pool[1, 0, 3])
    assert gathered.data_ptr() != cache.pool[1, 0, 3].data_ptr()


def test_import_rejects_bad_buffers_and_layouts() -> None:
    cache = filled_cache()
    with pytest.raises(HalfmoonError, match="blocks need"):
        cache.import_blocks([0, 1], b"\x00" * LAYOUT.bytes_per_block)
    with pytest.raises(HalfmoonError, match="dtype"):
        # Right byte count, wrong element type.
        cache.import_blocks([0], torch.zeros(LAYOUT.bytes_per_block // 8, dtype=torch.float64))
    with pytest.raises(HalfmoonError, match="out of range"):
        cache.export_blocks([6])
    other = KVLayout.from_dict({**LAYOUT.to_dict(), "head_dim": 6})
    with pytest.raises(HalfmoonError, match="head_dim"):
        LAYOUT.check_compatible(other)
    assert LAYOUT.to_dict()["version"] == KV_LAYOUT_VERSION
    LAYOUT.check_compatible(KVLayout.from_dict(LAYOUT.to_dict()))


def _floats(raw: memoryview) -> torch.Tensor:
    return torch.tensor(raw.cast("f").tolist())


def test_host_side_is_zero_copy_on_the_cpu() -> None:
    cache = filled_cache()
    assert to_host(cache.pool) is cache.pool
    keys, values = cache.layer_bytes(1, [2, 3])
    assert [k.nbytes for k in keys] == [4 * 2 * 5 * 4] * 2 and len(values) == 2
    assert torch.equal(_floats(keys[1]), cache.pool[1, 0, 3].reshape(-1))
    cache.pool[1, 1, 2, 0, 0, 0] = -7.0  # views of the pool see it: nothing was copied
    assert _floats(values[0])[0] == -7.0
    gathered, _ = cache.layer_bytes(0, [4, 1])
    assert torch.equal(_floats(gathered[0]), cache.pool[0, 0, 4].reshape(-1))
    view = host_bytes(cache.pool[2])
    assert view.nbytes == cache.pool[2].numel() * 4
    assert torch.equal(_floats(view), cache.pool[2].reshape(-1))
    assert bytes(cache.export_bytes([4, 1])) == bytes(export_to_bytes(cache.export_blocks([4, 1])))


def test_from_bytes_views_buffers_quietly() -> None:
    raw = bytearray(8)
    floats = from_bytes(raw, torch.float32)
    raw[4:8] = memoryview(torch.tensor([2.5]).numpy()).cast("B")
    assert floats.tolist() == [0.0, 2.5]  # a view, not a copy
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_bytes(b"\x00" * 8, torch.float32).tolist() == [0.0, 0.0]  # read-only
    assert from_bytes(b"", torch.float32).numel() == 0


def test_payloads_fill_whole_blocks_or_a_layer_slice() -> None:
    source = filled_cache()
    payloads = [bytes(source.export_bytes([b])) for b in (4, 0)]
    target = KVCache(LAYOUT, 6)
    target.import_payloads([1, 5], payloads)
    assert torch.equal(target.pool[:, :, 1], source.pool[:, :, 4])
    assert torch.equal(target.pool[:, :, 5], source.pool[:, :, 0])
    assert torch.count_nonzero(target.pool[:, :, [0, 2, 3, 4]]) == 0
    sliced = StageKVCache(LAYOUT, LayerSlice(1, 3, 3), 3)
    sliced.import_payloads([2], payloads[:1])
    assert torch.equal(sliced.pool[:, :, 2], source.pool[1:3, :, 4])
    with pytest.raises(HalfmoonError, match="2 KV payloads for 1 blocks"):
        target.import_payloads([0], payloads)
    with pytest.raises(HalfmoonError, match="out of range"):
        target.import_payloads([6], payloads[:1])
    with pytest.raises(HalfmoonError, match="a block of the 3-layer model has"):
        sliced.import_payloads([0], [payloads[0][: 2 * LAYOUT.bytes_per_block // 3]])


def test_layer_kv_reads_the_pool_only_when_asked() -> None:
    reads = []

    def read() -> tuple[torch.Tensor, torch.Tensor]:
        reads.append(1)
        return torch.zeros(1), torch.ones(1)

    kv = LayerKV(0, 16, read)
    assert not reads  # a hook that ignores the K/V costs no copy (on a GPU, no transfer)
    assert kv.key.item() == 0.0 and kv.value.item() == 1.0 and kv.key.item() == 0.0
    assert len(reads) == 1
