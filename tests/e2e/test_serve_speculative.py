"""``halfmoon serve --speculative-config``: the decode worker checks prompt-lookup drafts;
answers (whole, streamed, sampled with a seed) are the offline engine's without drafts,
and the cluster's metrics count the drafts checked and accepted."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}  # fmt: skip
PROMPTS = [
    "one two three one two three one two three one two",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
]


@pytest.fixture(scope="module")
def spec_cluster(cluster_factory):
    return cluster_factory("--kv-cache-mb", "64", "--speculative-config", json.dumps(SPEC))


@pytest.fixture(scope="module")
def offline(spec_cluster):
    from halfmoon.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(spec_cluster.cache / "presets" / "tiny-seed0")))


def test_answers_are_those_of_decoding_without_drafts(spec_cluster, offline) -> None:
    from halfmoon.core.request import SamplingParams

    client = openai.OpenAI(base_url=spec_cluster.base_url + "/v1", api_key="x", max_retries=0)
    for prompt in PROMPTS:
        for temperature, seed in ((0.0, None), (0.8, 5)):
            params = SamplingParams(max_tokens=24, temperature=temperature, seed=seed,
                                    ignore_eos=True)  # fmt: skip
            (expected,) = offline.generate([prompt], params)
            body = {"ignore_eos": True, "return_token_ids": True}
            served = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=24, temperature=temperature, seed=seed,
                extra_body=body,
            )  # fmt: skip
            assert served.choices[0].text == expected.text
            assert served.choices[0].token_ids == list(expected.token_ids)
            assert served.usage.completion_tokens == 24
            stream = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=24, temperature=temperature, seed=seed,
                extra_body=body, stream=True,
            )  # fmt: skip
            ids = [t for chunk in stream for c in chunk.choices for t in (c.token_ids or [])]
            assert ids == list(expected.token_ids)


def test_the_metrics_count_drafts(spec_cluster) -> None:
    client = openai.OpenAI(base_url=spec_cluster.base_url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                              extra_body={"ignore_eos": True})  # fmt: skip
    text = httpx.get(spec_cluster.base_url + "/metrics", timeout=30).text
    by_role: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("halfmoon:spec_decode_"):
                key = (s.name + s.labels.get("position", ""), s.labels.get("role", ""))
                by_role[key] = by_role.get(key, 0.0) + s.value
    drafts = by_role[("halfmoon:spec_decode_num_draft_tokens_total", "decode")]
    accepted = by_role[("halfmoon:spec_decode_num_accepted_tokens_total", "decode")]
    assert drafts >= accepted > 0
    assert by_role[("halfmoon:spec_decode_num_drafts_total", "decode")] > 0
    assert by_role[("halfmoon:spec_decode_num_accepted_tokens_per_pos_total0", "decode")] > 0
    # the prefill worker computes prompts and a first token: it never drafts
    assert by_role.get(("halfmoon:spec_decode_num_draft_tokens_total", "prefill"), 0) == 0


def test_the_conductor_hears_the_decode_workers_speculation(spec_cluster) -> None:
    """The decode worker's load reports carry its recent rows and tokens per sequence and
    step (what its guard's and the Conductor's step estimates use): over 1 once it has
    drafted for a prompt it copies; the prefill worker's stay 1."""
    import time

    client = openai.OpenAI(base_url=spec_cluster.base_url + "/v1", api_key="x", max_retries=0)
    client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=32, temperature=0,
                              extra_body={"ignore_eos": True})  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        workers = httpx.get(spec_cluster.base_url + "/dashboard/state", timeout=30).json()[
            "workers"
        ]
        decode = [w for w in workers if w["role"] == "decode"]
        if decode and decode[0].get("spec_rows_per_seq", 1.0) > 1.0:
            break
        assert time.monotonic() < deadline, f"no speculation in the load reports: {workers}"
        time.sleep(0.25)
    rows, tokens = decode[0]["spec_rows_per_seq"], decode[0]["spec_tokens_per_step"]
    assert rows >= tokens > 1.0
    assert all(w.get("spec_rows_per_seq", 1.0) == 1.0 for w in workers if w["role"] == "prefill")
