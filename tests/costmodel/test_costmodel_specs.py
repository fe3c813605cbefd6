"""Model and GPU specs: the paper's KV sizes, parameter counts, registries and errors."""

from __future__ import annotations

import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel import GPUS, MODELS, GPUSpec, ModelSpec, get_gpu, get_model

KIB = 1024
GIB = 1024**3


@pytest.mark.parametrize(
    ("name", "kv_bytes"),
    [
        ("llama2-70b", 320 * KIB),
        ("llama3-70b", 320 * KIB),
        ("llama3-8b", 128 * KIB),
        ("qwen2.5-7b", 56 * KIB),
    ],
)
def test_kv_bytes_per_token_match_the_paper(name: str, kv_bytes: int) -> None:
    assert get_model(name).kv_bytes_per_token == kv_bytes


def test_llama2_70b_kv_is_327680_bytes_and_128k_tokens_take_40_gib() -> None:
    spec = get_model("llama2-70b")
    assert spec.kv_bytes_per_token == 327_680
    assert 128 * 1024 * spec.kv_bytes_per_token == 40 * GIB


@pytest.mark.parametrize(
    ("name", "billions"),
    [
        ("llama2-70b", 68.98),  # Meta's card: 69B
        ("llama3-70b", 70.55),  # "70.6B"
        ("llama3-8b", 8.03),
        ("qwen2.5-7b", 7.61),  # Qwen's card: 7.61B total, 6.53B non-embedding
        ("small", 0.103),
    ],
)
def test_parameter_counts_match_published_sizes(name: str, billions: float) -> None:
    assert get_model(name).num_params / 1e9 == pytest.approx(billions, rel=0.005)


def test_qwen_non_embedding_params_and_weight_bytes() -> None:
    spec = get_model("qwen2.5-7b")
    assert spec.num_non_embedding_params / 1e9 == pytest.approx(6.53, rel=0.005)
    assert spec.weight_bytes == 2 * spec.num_params


def test_engine_presets_are_exactly_as_specified() -> None:
    tiny = get_model("tiny")
    assert (tiny.num_layers, tiny.hidden_size, tiny.num_heads, tiny.num_kv_heads) == (4, 256, 4, 2)
    assert (tiny.head_dim, tiny.intermediate_size, tiny.vocab_size) == (64, 1024, 4096)
    assert tiny.tie_embeddings and tiny.max_position == 32768 and tiny.dtype_bytes == 4
    small = get_model("small")
    assert (small.num_layers, small.hidden_size, small.num_heads, small.num_kv_heads) == (
        12,
        768,
        12,
        4,
    )
    assert (small.head_dim, small.intermediate_size, small.vocab_size) == (64, 2816, 8192)
    assert small.tie_embeddings and small.max_position == 32768
    # Tied: the embedding is counted once.
    assert small.num_params == small.num_non_embedding_params + 8192 * 768


@pytest.mark.parametrize(
    ("alias", "canonical"),
    [
        ("llama-3-70b", "llama3-70b"),
        ("Meta-Llama-3-70B-Instruct", "llama3-70b"),
        ("meta-llama/Llama-2-70b-chat-hf", "llama2-70b"),
        ("LLAMA3-8B", "llama3-8b"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
        (" tiny ", "tiny"),
    ],
)
def test_model_aliases(alias: str, canonical: str) -> None:
    assert get_model(alias) is MODELS[canonical]


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(HalfmoonError, match=r"unknown model 'gpt-5'.*llama2-70b.*tiny"):
        get_model("gpt-5")


def test_model_spec_validation() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelSpec("bad", 2, 64, num_heads=6, num_kv_heads=4, head_dim=16,
                  intermediate_size=128, vocab_size=100)  # fmt: skip
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        ModelSpec("bad", 0, 64, num_heads=4, num_kv_heads=4, head_dim=16,
                  intermediate_size=128, vocab_size=100)  # fmt: skip


def test_gpu_registry_uses_dense_figures() -> None:
    assert set(GPUS) == {"a800", "a100", "h100", "h800", "h200"}
    assert get_gpu("a800").peak_flops_per_s == 312e12
    assert get_gpu("A100").hbm_bytes_per_s == 2.0e12
    for name in ("h100", "h800", "h200"):
        assert get_gpu(name).bf16_dense_tflops == 989  # never the 1,979 sparse figure
    assert get_gpu("h100").hbm_tbps == 3.35
    h200 = get_gpu("NVIDIA H200")
    assert (h200.hbm_tbps, h200.memory_gb) == (4.8, 141)
    assert get_gpu("a100-80gb").memory_bytes == 80e9


def test_nic_bandwidth_per_node_matches_the_paper() -> None:
    # 800 Gbps per 8-GPU A800 node ~ 100 GB/s; H800 nodes have 8x400 Gbps.
    assert 8 * get_gpu("a800").nic_bytes_per_s == 100e9
    assert 8 * get_gpu("h800").nic_gbps_per_gpu == 3200


def test_unknown_gpu_lists_known_names() -> None:
    with pytest.raises(HalfmoonError, match=r"unknown GPU 'v100'; known GPUs: a100, a800, h100"):
        get_gpu("v100")


def test_gpu_spec_validation() -> None:
    with pytest.raises(ValueError, match="hbm_tbps must be > 0"):
        GPUSpec("bad", bf16_dense_tflops=1, hbm_tbps=0, memory_gb=1, nic_gbps_per_gpu=1)
