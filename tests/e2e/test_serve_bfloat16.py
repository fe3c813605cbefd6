"""A disaggregated cluster in bfloat16 (vLLM's CPU default dtype), asked for as vLLM users
do (``--dtype auto``: the tiny preset's config says float32, served in bfloat16): the
prefill worker's KV reaches the decode worker and the prefix store in bfloat16, and the
answers are the offline engine's in bfloat16, token for token, the first time and from
the cache."""

from __future__ import annotations

import openai
import pytest

PROMPT = [(i * 29) % 3000 + 7 for i in range(75)]  # 4 full blocks and a partial one


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    return cluster_factory("--dtype", "auto", "--kv-cache-mb", "16")


def _complete(cluster, prompt: list[int], max_tokens: int):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                    temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    details = out.usage.prompt_tokens_details
    return out.choices[0].text, 0 if details is None else details.cached_tokens or 0


def test_bfloat16_answers_are_the_offline_engines(cluster) -> None:
    from halfmoon.core.request import SamplingParams
    from halfmoon.engine import EngineConfig, LLMEngine

    offline = LLMEngine(EngineConfig(model=str(cluster.cache / "presets" / "tiny-seed0"),
                                     dtype="bfloat16", kv_cache_mb=16))  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    (expected,) = offline.generate([PROMPT], params)
    first, cached = _complete(cluster, PROMPT, 16)
    assert (first, cached) == (expected.text, 0)
    again, cached = _complete(cluster, PROMPT, 16)
    assert again == expected.text and cached == 64  # the 4 full blocks, from the cache
    health = cluster.ping_conductor().cluster
    assert health is not None and health.dtype == "bfloat16"
