"""``POST /v1/embeddings`` in process, over a backend that answers each prompt with a
vector made from its tokens: inputs' shapes, order and usage, normalization and base64,
the request's options reaching the backend, limits and failures as clear answers."""

from __future__ import annotations

import asyncio
import base64
import math
import struct
from collections.abc import AsyncIterator, Sequence

import httpx
import pytest
from fastapi.testclient import TestClient

from halfmoon.core.request import SamplingParams
from halfmoon.serve.gateway.backend import (
    BackendError,
    BackendRefused,
    GenerationChunk,
    Rejected,
)


class VectorBackend:
    """Answers an embedding request with ``[len, first token, last token]`` (not unit
    length); ``fail``: raise it instead; ``pace_s``: wait that long first."""

    def __init__(self) -> None:
        self.seen: list[tuple[list[int], SamplingParams, str | None]] = []
        self.fail: Exception | None = None
        self.pace_s = 0.0
        self.aborted: set[str] = set()

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:  # fmt: skip
        assert params.embed and params.max_tokens == 1
        self.seen.append((list(prompt_token_ids), params, cache_salt))
        if self.fail is not None:
            raise self.fail
        end = asyncio.get_running_loop().time() + self.pace_s
        while asyncio.get_running_loop().time() < end:
            if request_id in self.aborted:
                yield GenerationChunk((), "abort")
                return
            await asyncio.sleep(0.01)
        ids = list(prompt_token_ids)
        vector = (float(len(ids)), float(ids[0]), float(ids[-1]))
        yield GenerationChunk((), "stop", cached_tokens=0, embedding=vector)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def health(self) -> dict:
        return {}


@pytest.fixture
def backend() -> VectorBackend:
    return VectorBackend()


@pytest.fixture
def client(gateways, backend) -> TestClient:
    return TestClient(gateways.app(backend, "m", lora_modules=(("ad", "/x"),)))


def _unit(vector: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in vector))
    return [v / norm for v in vector]


def test_inputs_in_order_normalized_with_usage(client, backend, gateways):
    texts = ["abc", "hello there", "z"]
    r = client.post("/v1/embeddings", json={"model": "m", "input": texts})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "list" and out["model"] == "m" and out["id"].startswith("embd-")
    ids = [gateways.tokenizer.encode(t) for t in texts]
    for i, (datum, prompt) in enumerate(zip(out["data"], ids, strict=True)):
        assert datum == {"object": "embedding", "index": i,
                         "embedding": pytest.approx(_unit([len(prompt), prompt[0], prompt[-1]]))}  # fmt: skip
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == sum(map(len, ids))
    assert sorted(seen[0] for seen in backend.seen) == sorted(ids)


def test_token_ids_one_or_many_and_raw_values(client, backend):
    one = client.post("/v1/embeddings", json={"input": [7, 8, 9], "use_activation": False})
    assert one.json()["data"][0]["embedding"] == [3.0, 7.0, 9.0]
    many = client.post("/v1/embeddings", json={"input": [[5], [6, 7]], "use_activation": False})
    assert [d["embedding"] for d in many.json()["data"]] == [[1.0, 5.0, 5.0], [2.0, 6.0, 7.0]]
    no_bos = client.post("/v1/embeddings", json={"input": "a", "add_special_tokens": False,
                                                 "use_activation": False})  # fmt: skip
    with_bos = client.post("/v1/embeddings", json={"input": "a", "use_activation": False})
    assert (
        no_bos.json()["data"][0]["embedding"][0] + 1 == with_bos.json()["data"][0]["embedding"][0]
    )


@pytest.mark.parametrize("endianness, fmt", [("native", "=3f"), ("little", "<3f"), ("big", ">3f")])
def test_base64_is_float32_in_the_asked_byte_order(client, endianness, fmt):
    r = client.post("/v1/embeddings", json={"input": [7, 8, 9], "encoding_format": "base64",
                                            "endianness": endianness})  # fmt: skip
    values = struct.unpack(fmt, base64.b64decode(r.json()["data"][0]["embedding"]))
    assert list(values) == pytest.approx(_unit([3.0, 7.0, 9.0]), rel=1e-6)


def test_options_reach_the_backend(client, backend, gateways):
    r = client.post("/v1/embeddings", json={"model": "ad", "input": list(range(4, 40)),
                                            "truncate_prompt_tokens": 5, "cache_salt": "s1"})  # fmt: skip
    assert r.status_code == 200, r.text
    prompt, params, salt = backend.seen[-1]
    assert prompt == list(range(35, 40)) and params.lora == "ad"
    assert salt is not None and salt != "s1"  # (the adapter marks it)
    assert r.json()["usage"]["prompt_tokens"] == 5
    # chat messages: their template's tokens, no generation prompt unless asked
    messages = [{"role": "user", "content": "hi"}]
    ids = client.post("/tokenize", json={"messages": messages,
                                         "add_generation_prompt": False}).json()["tokens"]  # fmt: skip
    client.post("/v1/embeddings", json={"messages": messages})
    assert backend.seen[-1][0] == ids
    client.post("/v1/embeddings", json={"messages": messages, "add_generation_prompt": True})
    assert len(backend.seen[-1][0]) > len(ids)


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"input": []}, 400, "input must not be empty"),
        ({"input": [[]]}, 400, "input 0 has no tokens"),
        ({"input": "x" * 300}, 400, "embeds at most 255"),
        ({"input": [600]}, 400, "input token ids must be integers in [0, 512)"),
        ({"input": "x", "dimensions": 2}, 400, "matryoshka"),
        ({"input": "x", "model": "other"}, 404, "other"),
        ({}, 400, "either input or messages"),
        ({"input": "x", "priority": 3}, 400, "priority"),
        ({"input": "x", "truncate_prompt_tokens": 999}, 400, "truncate_prompt_tokens"),
        ({"input": "x", "cache_salt": ""}, 400, "cache_salt"),
        ({"input": "x", "embed_dtype": "float16"}, 400, "embed_dtype"),
        ({"input": ["x"] * 2049}, 400, "at most 2048 inputs"),
    ],
)
def test_bad_requests_are_clear_4xx(client, backend, body, status, fragment):
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == status, r.text
    assert fragment in r.text
    assert not backend.seen


def test_refusals_and_failures(client, backend):
    backend.fail = Rejected("no room", retry_after_s=3.0)
    r = client.post("/v1/embeddings", json={"input": "x"})
    assert r.status_code == 429 and r.headers["retry-after"] == "3" and "no room" in r.text
    backend.fail = BackendError("worker gone")
    r = client.post("/v1/embeddings", json={"input": ["x", "y"]})
    assert r.status_code == 503 and "worker gone" in r.text
    backend.fail = BackendRefused("embeddings are served by halfmoon's engine")
    r = client.post("/v1/embeddings", json={"input": "x"})
    assert r.status_code == 400 and "not supported by this cluster" in r.text


def test_abort_requests_ends_an_embedding_by_its_id(gateways, backend):
    backend.pace_s = 5.0
    app = gateways.app(backend, "m")

    async def scenario() -> tuple[httpx.Response, dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            body = {"input": ["x", "y"], "request_id": "emb-1"}
            running = asyncio.ensure_future(http.post("/v1/embeddings", json=body))
            for _ in range(500):
                if len(backend.seen) == 2:
                    break
                await asyncio.sleep(0.01)
            ended = await http.post("/abort_requests", json={"request_ids": ["emb-1"]})
            return await running, ended.json()

    answer, ended = asyncio.run(scenario())
    assert ended["aborted"] == 2
    assert answer.status_code == 503 and "without a vector (abort)" in answer.text


def test_metrics_count_embeddings(client):
    client.post("/v1/embeddings", json={"input": ["ab", "cd"]})
    text = client.get("/metrics").text
    assert 'halfmoon:request_success_total{finished_reason="stop"' in text
    assert "halfmoon:prompt_tokens_total" in text


@pytest.mark.parametrize("path, raw", [
    ("/v1/embeddings", '{"input": ["ok", "\\ud800"]}'),
    ("/score", '{"text_1": "ok", "text_2": ["\\ud800"]}'),
    ("/rerank", '{"query": "\\ud800", "documents": ["ok"]}'),
])  # fmt: skip
def test_text_that_is_not_unicode_is_a_400(client, backend, path, raw):
    # (a lone surrogate parses from JSON but cannot be tokenized)
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid Unicode" in r.text, r.text
    assert not backend.seen


def _vector(gateways, text: str) -> list[float]:
    ids = gateways.tokenizer.encode(text)
    return [float(len(ids)), float(ids[0]), float(ids[-1])]


def _cos(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b)
    )


@pytest.mark.parametrize("path, first, second", [("/score", "text_1", "text_2"),
                                                  ("/v1/score", "queries", "documents"),
                                                  ("/score", "data_1", "data_2"),
                                                  ("/score", "queries", "items")])  # fmt: skip
def test_score_is_the_cosine_of_the_embeddings(client, backend, gateways, path, first, second):
    docs = ["zz", "hello", "query text"]
    r = client.post(path, json={"model": "m", first: "query text", second: docs})
    assert r.status_code == 200, r.text
    out = r.json()
    q = _vector(gateways, "query text")
    assert [d["index"] for d in out["data"]] == [0, 1, 2]
    for datum, doc in zip(out["data"], docs, strict=True):
        assert datum["object"] == "score"
        assert datum["score"] == pytest.approx(_cos(q, _vector(gateways, doc)))
    assert out["data"][2]["score"] == pytest.approx(1.0)
    # each distinct text embedded once, counted once
    assert len(backend.seen) == 3
    used = sum(len(gateways.tokenizer.encode(t)) for t in docs)
    assert out["usage"]["prompt_tokens"] == used and out["id"].startswith("score-")
    # pairwise: as many first texts as second ones
    pairs = client.post("/score", json={"text_1": ["a", "bb"], "text_2": ["ab", "bb"]}).json()
    assert pairs["data"][0]["score"] == pytest.approx(_cos(_vector(gateways, "a"),
                                                           _vector(gateways, "ab")))  # fmt: skip
    assert pairs["data"][1]["score"] == pytest.approx(1.0)


def test_rerank_orders_documents_most_relevant_first(client, gateways):
    docs = ["x", "apple pie", "apple", "zebra crossing"]
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = client.post(path, json={"query": "apple", "documents": docs, "top_n": 3})
        assert r.status_code == 200, r.text
        out = r.json()
        q = _vector(gateways, "apple")
        want = sorted(range(4), key=lambda i: -_cos(q, _vector(gateways, docs[i])))[:3]
        assert [res["index"] for res in out["results"]] == want
        assert out["results"][0] == {"index": 2, "relevance_score": pytest.approx(1.0),
                                     "document": {"text": "apple"}}  # fmt: skip
        assert out["usage"]["prompt_tokens"] == sum(len(gateways.tokenizer.encode(t)) for t in docs)
    bare = client.post("/rerank", json={"query": "apple", "documents": docs,
                                        "return_documents": False}).json()  # fmt: skip
    assert len(bare["results"]) == 4 and "document" not in bare["results"][0]


@pytest.mark.parametrize(
    "path, body, fragment",
    [
        ("/score", {"text_1": "a", "text_2": []}, "text_2 must not be empty"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "give one, or as many"),
        ("/score", {"text_1": "a"}, "give one pair"),
        ("/score", {"text_1": "a", "text_2": "b", "queries": "c", "items": "d"}, "give one pair"),
        ("/rerank", {"query": "a", "documents": ["b"], "instruction": "judge"}, "instruction"),
        ("/rerank", {"query": "a", "documents": ["b", "x" * 300]}, "documents 1 has 301 tokens"),
        ("/rerank", {"query": "a", "documents": ["b"], "model": "x"}, "x"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
    ],
)
def test_bad_scoring_requests_are_clear_4xx(client, backend, path, body, fragment):
    r = client.post(path, json=body)
    assert 400 <= r.status_code < 500 and fragment in r.text, r.text
    assert not backend.seen


def test_scoring_routes_need_the_api_key(gateways, backend):
    keyed = TestClient(gateways.app(backend, "m", api_key="k"))
    for path, body in (("/score", {"text_1": "a", "text_2": "b"}),
                       ("/rerank", {"query": "a", "documents": ["b"]}),
                       ("/v2/rerank", {"query": "a", "documents": ["b"]}),
                       ("/v1/embeddings", {"input": "a"})):  # fmt: skip
        assert keyed.post(path, json=body).status_code == 401
        ok = keyed.post(path, json=body, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200, ok.text


def test_scoring_truncation_options(client, backend, gateways):
    long = "abcdefghij"
    r = client.post("/score", json={"text_1": long, "text_2": [long + "k"],
                                    "max_tokens_per_query": 3, "max_tokens_per_doc": 5})  # fmt: skip
    assert r.status_code == 200, r.text
    lengths = sorted(len(prompt) for prompt, _, _ in backend.seen)
    assert lengths == [3, 5]


def test_the_longest_input_the_context_holds_is_embedded(client, backend):
    # a 256-token context: 255 tokens and the one computed position
    r = client.post("/v1/embeddings", json={"input": [7] * 255})
    assert r.status_code == 200, r.text
    assert len(backend.seen[-1][0]) == 255
    assert client.post("/v1/embeddings", json={"input": [7] * 256}).status_code == 400
