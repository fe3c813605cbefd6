"""vLLM's batched chat completions (halfmoon/serve/gateway/batch_chat.py): one choice per
conversation, in order, each its own chat request with the model's defaults, the usage
summed; what a batch cannot do is a 400 naming it. In-process, over the token tests'
counting backend."""

from __future__ import annotations

import json

import pytest

from .test_token_generation import LETTERS, counting

CONVERSATIONS = [[{"role": "user", "content": "Hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Yo"}]]  # fmt: skip


@pytest.fixture(scope="module")
def served(gateways):
    with counting(gateways) as pair:
        yield pair


def test_one_choice_per_conversation(served):
    client, backend = served
    body = {"model": "m", "messages": CONVERSATIONS, "max_tokens": 3, "return_token_ids": True}
    answer = client.post("/v1/chat/completions/batch", json=body)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["message"]["content"] == LETTERS[:3] for c in out["choices"])
    prompts = [client.post("/tokenize", json={"model": "m", "messages": c}).json()["tokens"]
               for c in CONVERSATIONS]  # fmt: skip
    assert sorted(backend.prompts[-2:]) == sorted(prompts)
    assert [c["prompt_token_ids"] for c in out["choices"]] == prompts
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert out["usage"]["completion_tokens"] == 6
    assert {p.temperature for p in backend.params[-2:]} == {0.2}  # the model's default


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"messages": [{"role": "user", "content": "flat"}]}, "list of conversations"),
        ({"messages": []}, "list of conversations"),
        ({"messages": [CONVERSATIONS[0], [{"role": "bogus", "content": "x"}]]}, "messages.[1]"),
        ({"temperature": 9}, "temperature"),
    ],
)
def test_what_a_batch_cannot_do_is_a_400(served, change, words):
    client, _ = served
    body = {"model": "m", "messages": CONVERSATIONS, "max_tokens": 2, **change}
    answer = client.post("/v1/chat/completions/batch", json=body)
    assert answer.status_code == 400, answer.text
    assert words in json.dumps(answer.json())
