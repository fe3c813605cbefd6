"""``POST /v1/embeddings`` through live clusters (1 prefill + 1 decode, and coupled): each
input's vector equals an in-process engine's (normalized), whichever encoding; a cached
prefix is reused; bad input is a clear 4xx; generation runs on beside it."""

from __future__ import annotations

import math
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from halfmoon.core.request import SamplingParams
from halfmoon.engine import EngineConfig, LLMEngine

TEXTS = ["Hello", "The quick brown fox jumps over the lazy dog " * 6, "1 2 3 4 5 6 7 8 9 10"]
EMBED = SamplingParams(max_tokens=1, embed=True)


@pytest.fixture(scope="module")
def disagg(cluster_factory):
    # (no early rejection: a context-long input's estimated TTFT may pass the SLO on a
    # loaded machine, and this module checks answers, not admission)
    return cluster_factory("--kv-cache-mb", "64", "--early-reject", "none")


@pytest.fixture(scope="module")
def reference(disagg):
    """An in-process engine on the cluster's weights."""
    return LLMEngine(EngineConfig(model=str(disagg.cache / "presets" / "tiny-seed0")))


def _expected(engine: LLMEngine, prompts: list) -> list[torch.Tensor]:
    outs = engine.generate(prompts, EMBED)
    return [torch.nn.functional.normalize(torch.tensor(o.embedding), dim=0) for o in outs]


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)


def _post(cluster, body: dict) -> httpx.Response:
    return httpx.post(cluster.base_url + "/v1/embeddings", json=body, timeout=120)


def _assert_same(got: list[float], expected: torch.Tensor) -> None:
    vector = torch.tensor(got)
    assert math.isclose(float(vector.norm()), 1.0, rel_tol=1e-5)
    torch.testing.assert_close(vector, expected, rtol=0, atol=1e-5)


def _prefix_hits(cluster) -> float:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r'^halfmoon:prefix_cache_hits_total\{[^}]*role="gateway"[^}]*\} ([0-9.e+]+)$',
                  text, re.M)  # fmt: skip
    return float(m.group(1)) if m else 0.0


def test_embeddings_equal_the_engine(disagg, reference, cluster_factory):
    tokenizer = reference.tokenizer
    expected = _expected(reference, [tokenizer.encode(t) for t in TEXTS])
    # the OpenAI client asks for base64 and decodes it
    out = _client(disagg).embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in out.data] == [0, 1, 2]
    for datum, want in zip(out.data, expected, strict=True):
        _assert_same(datum.embedding, want)
    counts = [len(tokenizer.encode(t)) for t in TEXTS]
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(counts)
    assert out.id.startswith("embd-")
    # floats, token ids, one text; a coupled cluster answers the same
    coupled = cluster_factory("--mode", "coupled", "--instances", "1", "--kv-cache-mb", "32")
    ids = tokenizer.encode(TEXTS[1])
    for cluster in (disagg, coupled):
        r = _post(cluster, {"model": "tiny", "input": ids, "encoding_format": "float"})
        assert r.status_code == 200, r.text
        _assert_same(r.json()["data"][0]["embedding"], expected[1])
        r = _post(cluster, {"input": TEXTS[2]})
        _assert_same(r.json()["data"][0]["embedding"], expected[2])
    # unnormalized (use_activation false): the engine's state itself
    raw = _post(disagg, {"input": ids, "use_activation": False}).json()["data"][0]["embedding"]
    (state,) = reference.generate([ids], EMBED)
    torch.testing.assert_close(torch.tensor(raw), torch.tensor(state.embedding), rtol=0,
                               atol=1e-4)  # fmt: skip


def test_chat_messages_embed_their_template(disagg, reference):
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    ids = httpx.post(disagg.base_url + "/tokenize", json={
        "messages": messages, "add_generation_prompt": False}, timeout=30).json()["tokens"]  # fmt: skip
    r = _post(disagg, {"model": "tiny", "messages": messages})
    assert r.status_code == 200, r.text
    _assert_same(r.json()["data"][0]["embedding"], _expected(reference, [ids])[0])
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_cached_prefix_is_reused(disagg, reference):
    ids = [(7 * i + 3) % 400 + 4 for i in range(96)]  # six 16-token blocks
    hits = _prefix_hits(disagg)
    first = _post(disagg, {"input": ids}).json()["data"][0]["embedding"]
    second = _post(disagg, {"input": ids}).json()["data"][0]["embedding"]
    assert _prefix_hits(disagg) - hits >= 80  # the second computed its last block alone
    expected = _expected(reference, [ids])[0]
    _assert_same(first, expected)
    _assert_same(second, expected)


def test_generation_runs_beside_embeddings(disagg, reference):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (greedy,) = reference.generate([TEXTS[1]], params)
    client = _client(disagg)

    def generate(_: int) -> str:
        return client.completions.create(model="tiny", prompt=TEXTS[1], max_tokens=8,
                                         temperature=0, extra_body={"ignore_eos": True}
                                         ).choices[0].text  # fmt: skip

    def embed(_: int) -> list[float]:
        return client.embeddings.create(model="tiny", input=TEXTS[1]).data[0].embedding

    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(generate, range(4)))
        vectors = list(pool.map(embed, range(8)))
    assert texts == [greedy.text] * 4
    expected = _expected(reference, [reference.tokenizer.encode(TEXTS[1])])[0]
    for vector in vectors:
        _assert_same(vector, expected)


def test_score_and_rerank_by_the_engines_embeddings(disagg, reference):
    query, docs = TEXTS[0], TEXTS
    expected = _expected(reference, [reference.tokenizer.encode(t) for t in docs])
    cosines = [float(expected[0] @ e) for e in expected]
    r = httpx.post(disagg.base_url + "/score", json={"text_1": query, "text_2": docs},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(cosines, abs=1e-5)
    r = httpx.post(disagg.base_url + "/v1/rerank", json={"query": query, "documents": docs,
                                                         "top_n": 2}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -cosines[i])[:2]
    assert results[0]["index"] == 0 and results[0]["relevance_score"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"input": []}, 400, "input must not be empty"),
        ({"input": "", "add_special_tokens": False}, 400, "input 0 has no tokens"),
        ({"input": "hi", "dimensions": 8}, 400, "matryoshka"),
        ({"input": [10**7]}, 400, "input token ids must be integers"),
        ({"input": "hi", "model": "nope"}, 404, "nope"),
        ({"input": "hi", "messages": [{"role": "user", "content": "x"}]}, 400, "either"),
        ({"input": "hi", "encoding_format": "bytes"}, 400, "encoding_format"),
    ],
)
def test_bad_input_is_a_clear_4xx(disagg, body, status, fragment):
    r = _post(disagg, body)
    assert r.status_code == status, r.text
    assert fragment in r.text


def test_an_input_longer_than_the_context_is_refused(disagg):
    limit = httpx.post(disagg.base_url + "/tokenize", json={"prompt": "x"},
                       timeout=30).json()["max_model_len"]  # fmt: skip
    r = _post(disagg, {"input": [5] * limit})
    assert r.status_code == 400 and f"embeds at most {limit - 1}" in r.text, r.text
    # (that the longest input is embedded is checked in process, where the context is
    # short: tests/serve/test_embeddings_api.py; here it took 25 s of the suite)
