"""halfmoon's KV connector for vLLM, the parts that run without vLLM: the paged-layout view
and its refusals, the decode inbox, and the ``kv_transfer_params`` contract
(tests/e2e/test_vllm_pd.py runs the connector inside real vLLM servers)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from halfmoon.serve.vllm.pd import (
    ConnectorSettings,
    PrefillResult,
    kv_transfer_config,
    prefill_params,
)
from halfmoon.transfer.inbox import Inbox
from halfmoon.vllm_kv.layout import (
    PagedLayout,
    UnsupportedLayout,
    check_config,
    read_block,
    write_block,
    write_blocks,
)

NUM_BLOCKS, HEADS, BS, HEAD = 7, 3, 32, 8


def _cpu_caches(dtype=torch.float32) -> dict[str, torch.Tensor]:
    # vLLM's CPU attention: [num_blocks, kv_heads, block_size, 2 * head_size]; names out of order
    return {f"model.layers.{i}.self_attn.attn": torch.randn(NUM_BLOCKS, HEADS, BS, 2 * HEAD).to(dtype)
            for i in (2, 0, 1)}  # fmt: skip


def test_layout_orders_layers_and_moves_a_block_byte_for_byte() -> None:
    caches = _cpu_caches()
    layout = PagedLayout.of(caches, NUM_BLOCKS, BS)
    assert layout.layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in range(3))
    assert layout.block_dim == 0 and layout.layer_block_bytes == HEADS * BS * 2 * HEAD * 4
    assert layout.block_bytes == 3 * layout.layer_block_bytes
    src = caches["model.layers.1.self_attn.attn"]
    data = bytes(read_block(src, layout, 4))
    dst = torch.zeros_like(src)
    write_block(dst, layout, 2, data)
    assert torch.equal(dst[2], src[4]) and dst[[0, 1, 3, 4, 5, 6]].abs().sum() == 0
    with pytest.raises(ValueError, match="expected"):
        write_block(dst, layout, 2, data[:-4])


def test_a_strided_block_dimension_round_trips_too() -> None:
    # FlashAttention's [2, num_blocks, block_size, kv_heads, head_size]: a block is two halves
    caches = {f"layers.{i}.attn": torch.randn(2, NUM_BLOCKS, BS, HEADS, HEAD, dtype=torch.bfloat16)
              for i in range(2)}  # fmt: skip
    layout = PagedLayout.of(caches, NUM_BLOCKS, BS)
    assert layout.block_dim == 1 and layout.block_shape == (2, BS, HEADS, HEAD)
    src = caches["layers.0.attn"]
    dst = torch.zeros_like(src)
    write_block(dst, layout, 5, read_block(src, layout, 3))
    assert torch.equal(dst[:, 5], src[:, 3])


def test_several_blocks_of_a_layer_go_in_with_one_copy() -> None:
    for caches in (_cpu_caches(), {f"layers.{i}.attn": torch.randn(2, NUM_BLOCKS, BS, HEADS, HEAD)
                                   for i in range(2)}):  # fmt: skip
        layout = PagedLayout.of(caches, NUM_BLOCKS, BS)
        src = next(iter(caches.values()))
        data = b"".join(bytes(read_block(src, layout, b)) for b in (1, 2, 3))
        dst = torch.zeros_like(src)
        write_blocks(dst, layout, [6, 0, 4], data)
        for want, got in ((1, 6), (2, 0), (3, 4)):
            assert torch.equal(
                dst.select(layout.block_dim, got), src.select(layout.block_dim, want)
            )
        assert dst.select(layout.block_dim, 5).abs().sum() == 0
        with pytest.raises(ValueError, match="bytes for 2 blocks"):
            write_blocks(dst, layout, [0, 1], data)


def test_fingerprints_tell_layouts_apart() -> None:
    a = PagedLayout.of(_cpu_caches(), NUM_BLOCKS, BS)
    b = PagedLayout.of(_cpu_caches(torch.bfloat16), NUM_BLOCKS, BS)
    assert a.fingerprint != b.fingerprint and a.store_version != b.store_version
    assert a.fingerprint == PagedLayout.of(_cpu_caches(), NUM_BLOCKS, BS).fingerprint
    assert a.store_version & 0x8000 and a.store_version != 1  # never halfmoon's own layout


def test_layers_of_different_shapes_are_refused() -> None:
    caches = _cpu_caches()
    caches["model.layers.0.self_attn.attn"] = torch.zeros(NUM_BLOCKS, HEADS, BS, HEAD)
    with pytest.raises(UnsupportedLayout, match="differ across layers"):
        PagedLayout.of(caches, NUM_BLOCKS, BS)
    with pytest.raises(UnsupportedLayout, match="no dimension"):
        PagedLayout.of(_cpu_caches(), NUM_BLOCKS + 5, BS)


def _config(*, mla=False, cache_dtype="auto", block_size=32, groups=("FullAttentionSpec",), tp=1):
    spec_types = {name: type(name, (), {}) for name in set(groups)}
    return (
        SimpleNamespace(
            model_config=SimpleNamespace(use_mla=mla),
            cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=block_size),
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1),
        ),
        SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec_types[g]()) for g in groups]
        ),
    )


def test_unsupported_configurations_are_refused_by_name() -> None:
    check_config(*_config(), hash_block_size=16)
    cases = [
        (_config(mla=True), "MLA"),
        (_config(cache_dtype="fp8"), "--kv-cache-dtype fp8"),
        (
            _config(block_size=40),
            "block size 40 is not a multiple of halfmoon's hash block size 16",
        ),
        (_config(groups=("FullAttentionSpec", "SlidingWindowSpec")), "2 KV-cache groups"),
        (_config(groups=("MambaSpec",)), "MambaSpec"),
        (_config(tp=2), "tensor/pipeline parallel size 2/1"),
    ]
    for (vllm_config, kv_config), message in cases:
        with pytest.raises(UnsupportedLayout, match=message):
            check_config(vllm_config, kv_config, hash_block_size=16)


def test_inbox_hands_out_first_fit_ranges_and_takes_them_back() -> None:
    inbox = Inbox(100)
    a, b, c = inbox.alloc(40), inbox.alloc(40), inbox.alloc(30)
    assert (a, b, c) == (0, 40, None)
    inbox.free(a)
    assert inbox.alloc(30) == 0 and inbox.alloc(10) == 30 and inbox.alloc(21) is None
    assert inbox.alloc(20) == 80 and inbox.used_bytes == 100
    inbox.free(40)
    inbox.free(40)  # twice is harmless
    assert inbox.alloc(40) == 40
    with pytest.raises(ValueError):
        inbox.alloc(0)


def test_settings_and_params_round_trip_and_name_what_is_wrong() -> None:
    settings = ConnectorSettings(host="127.0.0.1", port=7000, inbox_mb=8)
    config = json.loads(kv_transfer_config(settings))
    assert config["kv_connector_module_path"] == "halfmoon.vllm_kv.connector"
    assert config["kv_load_failure_policy"] == "recompute" and config["kv_role"] == "kv_both"
    assert ConnectorSettings.from_extra(config["kv_connector_extra_config"]) == settings
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['port'\]"):
        ConnectorSettings.from_extra({})
    with pytest.raises(ValueError, match="out of range"):
        ConnectorSettings.from_extra({"port": 70000})
    params = prefill_params("r1", "127.0.0.1:7001", source="127.0.0.1:7002", cached_tokens=64)
    assert params["do_remote_decode"] and params["halfmoon"]["cached_tokens"] == 64
    assert (
        "source"
        not in prefill_params("r1", "127.0.0.1:7001", source="x", cached_tokens=0)["halfmoon"]
    )
    answer = {
        "do_remote_prefill": True,
        "halfmoon": {"session": "r1", "num_tokens": 90, "streamed": True},
    }
    result = PrefillResult.from_params(answer)
    assert result.decode_params() == {
        "do_remote_prefill": True, "do_remote_decode": False,
        "halfmoon": {"session": "r1", "num_tokens": 90},
    }  # fmt: skip
    with pytest.raises(ValueError, match="is the vLLM server running halfmoon's connector"):
        PrefillResult.from_params({"remote_prefill_cached_tokens": 0})
