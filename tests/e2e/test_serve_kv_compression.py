"""``halfmoon serve --kv-compression``: the prefill -> decode KV streams compressed on the
wire, end to end on 127.0.0.1 (1 prefill + 1 decode, tiny preset)."""

from __future__ import annotations

import openai
import pytest

PROMPTS = ["The quick brown fox jumps over the lazy dog " * 6, "1 2 3 4 5 6 7 8 9 10 " * 5]


def _greedy(cluster, prompt: str, n: int = 8):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text, out.usage


def _streamed(cluster) -> tuple[int, int, float]:
    """The prefill worker's (wire bytes, raw KV bytes, encode seconds) streamed so far."""
    (stats,) = [p.stats for p in cluster.ping_workers() if p.role == "prefill"]
    return stats["kv_bytes_streamed"], stats["kv_raw_bytes_streamed"], stats["kv_encode_s"]


@pytest.fixture(scope="module")
def offline(cluster_factory):
    """Greedy texts of the offline engine, and the KV layout of the tiny preset."""
    from halfmoon.core.request import SamplingParams
    from halfmoon.engine import EngineConfig, LLMEngine

    cluster = cluster_factory("--kv-cache-mb", "64", "--kv-compression", "zstd")
    engine = LLMEngine(EngineConfig(model=str(cluster.cache / "presets" / "tiny-seed0")))
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    return cluster, [o.text for o in outs], engine.kv_layout


def test_lossless_compression_keeps_every_token_and_sends_fewer_bytes(offline):
    cluster, texts, _ = offline
    for prompt, text in zip(PROMPTS, texts, strict=True):
        assert _greedy(cluster, prompt)[0] == text
    wire, raw, encode_s = _streamed(cluster)
    assert 0 < wire < raw and encode_s > 0


def test_int8_sends_a_byte_per_value_plus_a_scale_per_token_and_head(offline, cluster_factory):
    _, texts, layout = offline
    cluster = cluster_factory("--kv-cache-mb", "64", "--kv-compression", "int8")
    expected_wire = expected_raw = 0
    for prompt in PROMPTS:
        text, usage = _greedy(cluster, prompt)
        assert usage.completion_tokens == 8 and text
        blocks = -(-usage.prompt_tokens // layout.block_size)
        groups = blocks * layout.block_size * layout.num_kv_heads  # per stream layer
        expected_wire += 2 * layout.num_layers * groups * (layout.head_dim + 4)
        expected_raw += blocks * layout.bytes_per_block
    wire, raw, _ = _streamed(cluster)
    assert (wire, raw) == (expected_wire, expected_raw)
    # The first token is the prefill worker's own (uncompressed KV): it always agrees.
    first = [_greedy(cluster, p, n=1)[0] for p in PROMPTS]
    assert first == [_greedy(offline[0], p, n=1)[0] for p in PROMPTS]
