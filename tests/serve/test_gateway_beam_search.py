"""Beam search (``use_beam_search``, halfmoon/serve/gateway/beam_search.py) over a
backend whose next-token log-probabilities are a fixed table: the search keeps the
better sequences greedy decoding misses, ends beams at an end token, ranks by the
length penalty, and refuses what it cannot honour.

A live cluster's beam search is checked against its own log-probabilities in
tests/e2e/test_serve_disaggregated.py."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence

import pytest
from fastapi.testclient import TestClient

from halfmoon.core.request import SamplingParams, TokenLogprob
from halfmoon.serve.gateway.backend import GenerationChunk
from halfmoon.serve.gateway.beam_search import Beam

A, B, C, D, EOS = 37, 38, 39, 40, 1  # "A".."D" and </s> in the preset tokenizer
PROMPT = [7, 7, 7]
#: Next-token log-probabilities after each generated sequence (others: after any
#: sequence not listed, D is near certain).
TABLE: dict[tuple[int, ...], dict[int, float]] = {
    (): {A: math.log(0.5), B: math.log(0.4), C: math.log(0.1)},
    (A,): {A: math.log(0.3), B: math.log(0.3), C: math.log(0.2), D: math.log(0.2)},
    (B,): {C: math.log(0.95), EOS: math.log(0.05)},
    (B, C): {EOS: math.log(0.9), D: math.log(0.1)},
}
OTHERWISE = {D: math.log(0.9), EOS: math.log(0.1)}


class TableBackend:
    """Answers a one-token request with its table's alternatives, likeliest first."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.requests.append((list(prompt_token_ids), params))
        assert params.max_tokens == 1 and list(prompt_token_ids[:3]) == PROMPT
        table = TABLE.get(tuple(prompt_token_ids[3:]), OTHERWISE)
        top = sorted(table.items(), key=lambda kv: -kv[1])[: params.logprobs]
        yield GenerationChunk((top[0][0],), "length", 2,
                              logprobs=(TokenLogprob(top[0][1], tuple(top)),))  # fmt: skip

    async def abort(self, request_id: str) -> None:
        return None

    async def health(self) -> dict:
        return {}


@pytest.fixture
def served(gateways):
    backend = TableBackend()
    app = gateways.app(backend, "m", max_tokens_limit=64)
    with TestClient(app) as client:
        yield client, backend


def _beams(client, **body):
    return client.post("/v1/completions", json={"model": "m", "prompt": PROMPT,
                                                "use_beam_search": True, **body})  # fmt: skip


def test_the_search_finds_what_greedy_misses(served):
    """Greedy takes A (0.5) and then at best 0.3; the beams keep B (0.4), whose C (0.95)
    and end token (0.9) make the likelier answer: "BC" then </s>, finished by it."""
    client, backend = served
    body = _beams(client, n=2, max_tokens=4, length_penalty=0.0).json()
    texts = [c["text"] for c in body["choices"]]
    assert texts[0] == "BC" and body["choices"][0]["finish_reason"] == "stop"
    assert len(texts) == 2 and body["choices"][1]["index"] == 1
    width1 = _beams(client, n=1, max_tokens=4, length_penalty=0.0).json()["choices"]
    assert width1[0]["text"].startswith("A")  # a beam of one is greedy decoding
    steps = [params for _, params in backend.requests]
    assert all(s.max_tokens == 1 and s.logprobs in (2, 4) for s in steps)
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] > 0
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_ignore_eos_and_max_tokens_end_beams_by_length(served):
    client, _ = served
    body = _beams(client, n=2, max_tokens=3, ignore_eos=True, length_penalty=0.0).json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    # "BC</s>" goes on past its end token (left out of the text) and still wins
    assert [c["text"] for c in body["choices"]] == ["BC", "AAD"]
    assert body["usage"]["completion_tokens"] == 6


def test_the_length_penalty_ranks_by_mean_log_probability():
    ends = frozenset({EOS})
    short = Beam((A, EOS), math.log(0.5) + math.log(0.5))
    long = Beam((B, C, D, EOS), math.log(0.4) + 3 * math.log(0.8))
    assert short.score(0.0, ends) > long.score(0.0, ends)  # the plain sum: short wins
    assert long.score(1.0, ends) > short.score(1.0, ends)  # per token: long wins
    assert short.score(1.0, ends) == pytest.approx(math.log(0.25) / 1)  # EOS not counted


def test_batched_prompts_are_searched_side_by_side(served):
    client, _ = served
    batch = _beams(client, prompt=[PROMPT, PROMPT], n=2, max_tokens=4).json()
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
    assert batch["usage"]["prompt_tokens"] == 6
    assert batch["choices"][0]["text"] == batch["choices"][2]["text"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"stream": True}, "stream"), ({"stop": ["x"]}, "stop"), ({"logprobs": 0}, "logprobs"),
     ({"echo": True}, "echo"), ({"presence_penalty": 0.5}, "presence_penalty"),
     ({"guided_regex": "a+"}, "structured"), ({"n": 11}, "n"),
     ({"length_penalty": 99}, "length_penalty")],
)  # fmt: skip
def test_what_beam_search_cannot_honour_is_a_400(served, extra, param):
    client, backend = served
    response = _beams(client, max_tokens=4, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert not backend.requests
