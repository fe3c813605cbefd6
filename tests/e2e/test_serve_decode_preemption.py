"""A decode worker whose KV pool cannot hold every admitted request's output at once.

The live Conductor books a request's prompt, not its ``max_tokens``, against a decode
pool (``--decode-kv-booking prompt``): several requests that may each grow to most of
the pool are admitted side by side, as vLLM admits them, and the decode engine preempts
one (its blocks freed, recomputed later on the decode worker itself) when the pool
fills. Each answer must still be the one it gets alone.
"""

from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

PROMPTS = [f"story number {i} begins" for i in range(4)]
MAX_TOKENS = 150  # each prompt + output ~155 tokens; four of them, one 256-token pool


@pytest.fixture(scope="module")
def small(cluster_factory):
    # --kv-cache-mb 1: 16 blocks of 16 tokens per worker (the tiny preset)
    return cluster_factory("--kv-cache-mb", "1")


def _preemptions(cluster) -> float:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^halfmoon:num_preemptions_total\{[^}]*role="decode"[^}]*\} ([0-9.e+]+)$',
                  text, re.M)  # fmt: skip
    assert m, "no decode preemption counter"
    return float(m.group(1))


def test_requests_that_outgrow_the_decode_pool_together_are_preempted_not_refused(small):
    client = openai.OpenAI(base_url=small.base_url + "/v1", api_key="none", max_retries=0)

    def generate(prompt: str) -> str:
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.usage.completion_tokens == MAX_TOKENS
        return out.choices[0].text

    alone = [generate(p) for p in PROMPTS]
    before = _preemptions(small)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(generate, PROMPTS))
    assert together == alone
    assert _preemptions(small) > before  # the pool did overflow, and was preempted
    pongs = small.ping_workers()
    assert all(p.num_running == 0 and p.integrity == "ok" for p in pongs), pongs
