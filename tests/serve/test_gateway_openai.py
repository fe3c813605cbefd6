"""OpenAI response details of the gateway: log-probabilities, echo, refused options.

In-process (ASGI) over a backend that emits fixed tokens with log-probabilities; the
real cluster path is covered in tests/e2e."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from halfmoon.core.request import SamplingParams, StructuredOutput, TokenLogprob
from halfmoon.serve.gateway.backend import GenerationChunk

OUTPUT = (65, 66, 67, 68)  # token ids the backend "generates", two per chunk


class LogprobBackend:
    """Generates ``OUTPUT``; when asked, token t has logprob -t/100 and alternatives
    t, t+1, ... (as many as requested); prompt token i (from 1) has logprob -t/1000,
    rank i and alternatives 7, 8, ... (as many as requested)."""

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []
        self.aborted: list[str] = []

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.params.append(params)
        out = OUTPUT[: params.max_tokens]
        for i in range(0, len(out), 2):
            tokens = out[i : i + 2]
            entries = ()
            if params.logprobs is not None:
                entries = tuple(
                    TokenLogprob(
                        -t / 100, tuple((t + j, -(t + j) / 100) for j in range(params.logprobs))
                    )
                    for t in tokens
                )
            last = i + 2 >= len(out)
            prompt = None
            if i == 0 and params.prompt_logprobs is not None:
                k = params.prompt_logprobs
                prompt = tuple(
                    TokenLogprob(-t / 1000, tuple((7 + j, -(j + 1) / 10) for j in range(k)), i)
                    for i, t in enumerate(prompt_token_ids[1:], start=1)
                )
            yield GenerationChunk(
                tokens, "length" if last else None, 0 if i == 0 else None, logprobs=entries,
                prompt_logprobs=prompt,
            )  # fmt: skip

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> dict[str, Any]:
        return {"mode": "logprobs"}


@pytest.fixture(scope="module")
def served(gateways):
    backend = LogprobBackend()
    with TestClient(gateways.app(backend, "m", max_tokens_limit=64)) as client:
        yield client, backend, gateways.tokenizer


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_completion_logprobs(served):
    client, backend, tok = served
    body = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "logprobs": 2}).json()
    assert backend.params[-1].logprobs == 2
    lp = body["choices"][0]["logprobs"]
    texts = [tok.decode([t], skip_special_tokens=False) for t in OUTPUT]
    assert lp["tokens"] == texts and "".join(texts) == body["choices"][0]["text"]
    assert lp["token_logprobs"] == [-t / 100 for t in OUTPUT]
    assert lp["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    first_top = lp["top_logprobs"][0]
    assert first_top == {texts[0]: -0.65, tok.decode([66], skip_special_tokens=False): -0.66}
    # Not asked: no log-probabilities computed or returned.
    plain = client.post("/v1/completions", json={"model": "m", "prompt": "hi"}).json()
    assert backend.params[-1].logprobs is None and plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_streamed_and_whole(served):
    client, backend, tok = served
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "logprobs": True,
        "top_logprobs": 1,
    }
    whole = client.post("/v1/chat/completions", json=request).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-t / 100 for t in OUTPUT]
    first = content[0]
    assert first["bytes"] == list(first["token"].encode()) and len(first["top_logprobs"]) == 1
    assert first["top_logprobs"][0]["logprob"] == -0.65
    streamed = _events(client.post("/v1/chat/completions", json={**request, "stream": True}).text)
    items = [c for e in streamed for c in (e["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [c["logprob"] for c in items] == [c["logprob"] for c in content]
    # top_logprobs alone is a client error, as on OpenAI's API
    bad = client.post("/v1/chat/completions", json={**request, "logprobs": False})
    assert bad.status_code == 400 and "top_logprobs needs logprobs" in bad.text


def test_streamed_completion_logprobs_keep_offsets(served):
    client, _, tok = served
    events = _events(
        client.post(
            "/v1/completions", json={"model": "m", "prompt": "hi", "logprobs": 0, "stream": True}
        ).text
    )
    tokens, offsets = [], []
    for event in events:
        lp = event["choices"][0]["logprobs"]
        if lp:
            tokens += lp["tokens"]
            offsets += lp["text_offset"]
    texts = [tok.decode([t], skip_special_tokens=False) for t in OUTPUT]
    assert tokens == texts
    assert offsets == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]


def test_echo_puts_the_prompt_before_the_output(served):
    client, _, tok = served
    out_text = tok.decode(list(OUTPUT))
    whole = client.post("/v1/completions", json={"model": "m", "prompt": "hello", "echo": True})
    assert whole.json()["choices"][0]["text"] == "hello" + out_text
    events = _events(
        client.post(
            "/v1/completions", json={"model": "m", "prompt": "hello", "echo": True, "stream": True}
        ).text
    )
    assert "".join(e["choices"][0]["text"] for e in events) == "hello" + out_text
    assert events[0]["choices"][0]["text"].startswith("hello")


@pytest.mark.parametrize(
    ("path", "extra", "named"),
    [
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs with stream"),
        ("/v1/chat/completions", {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_unimplemented_options_are_refused_by_name(served, path, extra, named):
    client, _, _ = served
    base = {"model": "m", "prompt": "hi"} if "chat" not in path else {
        "model": "m", "messages": [{"role": "user", "content": "hi"}]
    }  # fmt: skip
    response = client.post(path, json={**base, **extra})
    assert response.status_code == 400
    assert "not supported by this server" in response.text and named in response.text
    # the defaults of the same options are fine
    defaults = {"logit_bias": {}, "best_of": 1, "prompt_logprobs": None}
    assert client.post(path, json={**base, **defaults}).status_code == 200


def test_echo_of_a_token_prompt_and_of_a_one_item_list(served):
    client, _, tok = served
    out_text = tok.decode(list(OUTPUT))
    ids = tok.encode("abc", add_special_tokens=False)
    by_ids = client.post("/v1/completions", json={"model": "m", "prompt": ids, "echo": True})
    assert by_ids.json()["choices"][0]["text"] == tok.decode(ids) + out_text
    listed = client.post("/v1/completions", json={"model": "m", "prompt": ["xy"], "echo": True})
    assert listed.json()["choices"][0]["text"] == "xy" + out_text


def test_penalties_reach_the_backend_and_are_bounded(served):
    client, backend, _ = served
    body = {"model": "m", "prompt": "hi", "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.3}  # fmt: skip
    assert client.post("/v1/completions", json=body).status_code == 200
    params = backend.params[-1]
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
        0.5, -1.0, 1.3
    )  # fmt: skip
    body = {"model": "m", "prompt": "hi", "min_p": 0.1}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert backend.params[-1].min_p == 0.1
    for bad in ({"presence_penalty": 2.5}, {"frequency_penalty": -3}, {"repetition_penalty": 0},
                {"min_p": 1.5}):  # fmt: skip
        response = client.post("/v1/completions", json={"model": "m", "prompt": "hi", **bad})
        assert response.status_code == 400 and next(iter(bad)) in response.text


def test_n_choices_are_separate_requests_with_consecutive_seeds(served):
    client, backend, tok = served
    body = {"model": "m", "prompt": "hi", "n": 3, "seed": 40, "logprobs": 0}
    whole = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2]
    assert sorted(p.seed for p in backend.params[-3:]) == [40, 41, 42]
    assert all(c["text"] == tok.decode(list(OUTPUT)) for c in whole["choices"])
    assert all(len(c["logprobs"]["tokens"]) == len(OUTPUT) for c in whole["choices"])
    usage = whole["usage"]
    assert usage["completion_tokens"] == 3 * len(OUTPUT)
    assert usage["total_tokens"] == usage["prompt_tokens"] + 3 * len(OUTPUT)
    events = _events(
        client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2,
                  "stream": True, "stream_options": {"include_usage": True}},
        ).text
    )  # fmt: skip
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == {0: tok.decode(list(OUTPUT)), 1: tok.decode(list(OUTPUT))}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    finished = [e["choices"][0]["index"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    too_many = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "n": 17})
    assert too_many.status_code == 400


def test_stop_token_ids_and_including_the_stop_string(served):
    client, backend, tok = served
    assert (
        client.post(
            "/v1/completions", json={"model": "m", "prompt": "hi", "stop_token_ids": [3, 9]}
        ).status_code
        == 200
    )
    assert backend.params[-1].stop_token_ids == (3, 9)
    bad = client.post(
        "/v1/completions", json={"model": "m", "prompt": "hi", "stop_token_ids": [-1]}
    )
    assert bad.status_code == 400 and "stop_token_ids must be integers" in bad.text
    full = tok.decode(list(OUTPUT))
    first_chunk = tok.decode(list(OUTPUT[:2]))  # the backend sends two tokens a chunk
    stop = first_chunk[-1]  # ends in the first chunk, so the request is cut upstream too
    cut = full.find(stop)
    assert 0 < cut < len(first_chunk)
    for include, expected in ((False, full[:cut]), (True, full[: cut + len(stop)])):
        body = {"model": "m", "prompt": "hi", "stop": stop, "include_stop_str_in_output": include}
        response = client.post("/v1/completions", json=body).json()
        choice = response["choices"][0]
        assert (choice["text"], choice["finish_reason"]) == (expected, "stop")
        assert response["id"].removeprefix("cmpl-") in backend.aborted


def test_tokenize_and_detokenize(served):
    client, _, tok = served
    out = client.post("/tokenize", json={"model": "m", "prompt": "hello there"}).json()
    assert out["tokens"] == tok.encode("hello there") and out["count"] == len(out["tokens"])
    assert out["max_model_len"] == 256
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tok.apply_chat_template([{"role": "user", "content": "hi"}])
    back = client.post("/detokenize", json={"model": "m", "tokens": out["tokens"]}).json()
    assert back["prompt"] == tok.decode(out["tokens"])
    assert client.post("/tokenize", json={"model": "m"}).status_code == 400
    assert client.post("/tokenize", json={"model": "x", "prompt": "a"}).status_code == 404
    assert client.post("/detokenize", json={"tokens": [10**9]}).status_code == 400


def test_tokenizer_info_is_the_tokenizers_config(served):
    client, _, tok = served
    info = client.get("/tokenizer_info").json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["chat_template"] == tok.chat_template and info["eos_token"] == tok.eos_token
    assert info == {**tok.config, "chat_template": tok.chat_template}


def test_tokenize_needs_the_api_key_when_the_server_has_one(gateways):
    with TestClient(gateways.app(LogprobBackend(), "m", api_key="k")) as client:
        assert client.post("/tokenize", json={"prompt": "a"}).status_code == 401
        assert client.get("/tokenizer_info").status_code == 401
        ok = client.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200


def test_logit_bias_reaches_the_backend_as_token_ids(served):
    client, backend, _ = served
    body = {"model": "m", "prompt": "hi", "logit_bias": {"7": 100, "12": -100}}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert backend.params[-1].logit_bias == ((7, 100.0), (12, -100.0))
    for bad, says in (({"x": 1}, "not a token id"), ({"100000": 1}, "logit_bias keys"),
                      ({"7": 101}, "[-100, 100]")):  # fmt: skip
        response = client.post("/v1/completions", json={**body, "logit_bias": bad})
        assert response.status_code == 400 and says in response.text


@pytest.mark.parametrize(
    ("option", "name"),
    [({"use_beam_search": True, "stream": True}, "stream"),
     ({"structured_outputs": {"structural_tag": '{"type": "structural_tag", "format": {}}'}},
      "structured_outputs")],
)  # fmt: skip
def test_vllm_options_this_server_cannot_honour_are_refused_by_name(served, option, name):
    client, _, _ = served
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
        response = client.post(path, json={"model": "m", **body, **option})
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert error["param"] == name and next(iter(option)) in error["message"]


def test_add_special_tokens_and_priority_as_vllm_takes_them(served):
    """Completions' ``add_special_tokens: false`` tokenizes a text prompt without BOS;
    on chat, where the template writes them, true is refused; a ``priority`` other than
    0 is refused, as vLLM's first-come-first-served default does."""
    client, _, tokenizer = served
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    with_bos = client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"]
    plain = client.post("/v1/completions", json={**body, "add_special_tokens": False}).json()
    assert with_bos == len(tokenizer.encode("hi")) == 3
    assert plain["usage"]["prompt_tokens"] == len(tokenizer.encode("hi", False)) == 2
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert client.post("/v1/chat/completions", json={**chat, "add_special_tokens": False}
                       ).status_code == 200  # fmt: skip
    for path, request, extra, param in (
        ("/v1/chat/completions", chat, {"add_special_tokens": True}, "add_special_tokens"),
        ("/v1/completions", body, {"priority": 1}, "priority"),
        ("/v1/chat/completions", chat, {"priority": -5}, "priority"),
    ):
        refused = client.post(path, json={**request, **extra})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert client.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
    assert "scheduling-policy priority" in client.post(
        "/v1/completions", json={**body, "priority": 1}).json()["error"]["message"]  # fmt: skip


def test_priority_reaches_the_engines_under_the_priority_policy(gateways):
    backend = LogprobBackend()
    app = gateways.app(backend, "m", max_tokens_limit=64, scheduling_policy="priority")
    with TestClient(app) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 2}
        for priority in (-5, 0, 7):
            assert client.post("/v1/completions", json={**body, "priority": priority}
                               ).status_code == 200  # fmt: skip
            assert backend.params[-1].priority == priority
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "priority": 3}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        assert backend.params[-1].priority == 3
        response = {"model": "m", "input": "hi", "priority": -4, "max_output_tokens": 2}
        assert client.post("/v1/responses", json=response).status_code == 200
        assert backend.params[-1].priority == -4
        huge = client.post("/v1/completions", json={**body, "priority": 2**40})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "priority"
    with pytest.raises(ValueError, match="scheduling policy"):
        gateways.app(backend, "m", scheduling_policy="lifo")


def test_return_token_ids_whole_and_streamed(served):
    """vLLM's ``return_token_ids``: completions carry each choice's ``token_ids`` and
    ``prompt_token_ids`` (streamed: every chunk its tokens, a choice's first chunk its
    prompt's), chat each choice's ``token_ids`` and the ``prompt_token_ids`` at the top
    (streamed: in the first chunk only); without it, neither field."""
    client, _, tokenizer = served
    prompts = ["hi", "hello there"]
    body = {"model": "m", "prompt": prompts, "max_tokens": 4, "n": 2, "return_token_ids": True}
    whole = client.post("/v1/completions", json=body).json()
    for choice in whole["choices"]:
        assert choice["token_ids"] == list(OUTPUT)
        assert choice["prompt_token_ids"] == tokenizer.encode(prompts[choice["index"] // 2])
    events = _events(client.post("/v1/completions", json={**body, "stream": True}).text)
    for index in range(4):
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == index]
        assert sum((c["token_ids"] for c in mine), []) == list(OUTPUT)
        assert mine[0]["prompt_token_ids"] == tokenizer.encode(prompts[index // 2])
        assert all("prompt_token_ids" not in c for c in mine[1:])
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "return_token_ids": True}  # fmt: skip
    answer = client.post("/v1/chat/completions", json=chat).json()
    assert answer["choices"][0]["token_ids"] == list(OUTPUT)
    assert len(answer["prompt_token_ids"]) == answer["usage"]["prompt_tokens"]
    events = _events(client.post("/v1/chat/completions", json={**chat, "stream": True}).text)
    assert events[0]["prompt_token_ids"] == answer["prompt_token_ids"]
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == list(OUTPUT)
    plain = client.post("/v1/completions", json={**body, "return_token_ids": False}).json()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(served):
    client, _, _ = served
    body = {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": 1,
            "return_tokens_as_token_ids": True}  # fmt: skip
    lp = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:65", "token_id:66"]
    assert [list(top) for top in lp["top_logprobs"]] == [["token_id:65"], ["token_id:66"]]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
    content = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"]
    assert [c["token"] for c in content["content"]] == ["token_id:65", "token_id:66"]


def test_neutral_values_of_refused_options_pass(served):
    client, _, _ = served
    body = {"model": "m", "prompt": "hi", "use_beam_search": False, "guided_json": None,
            "allowed_token_ids": None, "bad_words": []}  # fmt: skip
    assert client.post("/v1/completions", json=body).status_code == 200


def test_allowed_token_ids_reach_the_backend_checked(served):
    client, backend, _ = served
    body = {"model": "m", "prompt": "hi", "allowed_token_ids": [65, 66]}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert backend.params[-1].allowed_token_ids == (65, 66)
    for bad in ([], [10**9], [-1]):
        response = client.post("/v1/completions", json={**body, "allowed_token_ids": bad})
        assert response.status_code == 400 and "allowed_token_ids" in response.text


def test_chat_template_options_shape_the_prompt(served):
    """add_generation_prompt, continue_final_message and chat_template_kwargs reach the
    template, on chat completions and /tokenize alike; contradictions are 400s."""
    client, backend, tok = served
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, it is"}]

    def tokens(**options) -> list[int]:
        body = {"model": "m", "messages": chat, **options}
        response = client.post("/tokenize", json=body)
        assert response.status_code == 200, response.text
        return response.json()["tokens"]

    open_turn = tok.decode(tokens(add_generation_prompt=False, continue_final_message=True),
                           skip_special_tokens=False)  # fmt: skip
    assert open_turn.endswith("Sure, it is")
    closed = tok.decode(tokens(add_generation_prompt=False), skip_special_tokens=False)
    assert closed.startswith(open_turn) and len(closed) > len(open_turn)
    body = {"model": "m", "messages": chat, "add_generation_prompt": False,
            "continue_final_message": True, "max_tokens": 2}  # fmt: skip
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    both = {"model": "m", "messages": chat, "continue_final_message": True}
    response = client.post("/v1/chat/completions", json=both)
    assert response.status_code == 400 and "add_generation_prompt" in response.text
    reserved = {"model": "m", "messages": chat, "chat_template_kwargs": {"messages": []}}
    response = client.post("/v1/chat/completions", json=reserved)
    assert response.status_code == 400 and "cannot set messages" in response.text
    response = client.post("/v1/chat/completions", json={"model": "m", "messages": chat,
                                                          "functions": [{"name": "f"}]})  # fmt: skip
    assert response.status_code == 400 and "functions" in response.text
    # vLLM's chat echo: the final assistant message's text leads the answer
    echoed = client.post("/v1/chat/completions", json={**body, "echo": True}).json()
    expected = "Sure, it is" + tok.decode(list(OUTPUT[:2]))
    assert echoed["choices"][0]["message"]["content"] == expected
    streamed = client.post("/v1/chat/completions", json={**body, "echo": True, "stream": True})
    deltas = [e["choices"][0]["delta"] for e in _events(streamed.text) if e["choices"]]
    assert "".join(d.get("content", "") for d in deltas) == expected
    user_last = {"model": "m", "messages": chat[:1], "echo": True, "max_tokens": 2}
    plain = client.post("/v1/chat/completions", json=user_last).json()
    assert plain["choices"][0]["message"]["content"] == tok.decode(list(OUTPUT[:2]))


def test_a_batch_of_prompts_gets_n_choices_each(served):
    """OpenAI's and vLLM's batched completions: choices ``prompt * n + i``, each its own
    request seeded ``seed + i``; every prompt counted once in the usage."""
    client, backend, tok = served
    before = len(backend.params)
    body = {"model": "m", "prompt": ["ab", "cde"], "n": 2, "seed": 7, "echo": True}
    whole = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    generated = tok.decode(list(OUTPUT))
    texts = [c["text"] for c in whole["choices"]]
    assert texts == ["ab" + generated] * 2 + ["cde" + generated] * 2
    assert sorted(p.seed for p in backend.params[before:]) == [7, 7, 8, 8]
    prompt_tokens = len(tok.encode("ab")) + len(tok.encode("cde"))
    assert whole["usage"]["prompt_tokens"] == prompt_tokens
    assert whole["usage"]["completion_tokens"] == 4 * len(OUTPUT)
    # token-id prompts, streamed: every choice ends once, usage at the end
    body = {"model": "m", "prompt": [[65, 66], [67]], "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    events = _events(client.post("/v1/completions", json=body).text)
    finished = sorted(c["index"] for e in events for c in e["choices"] if c["finish_reason"])
    assert finished == [0, 1] and events[-1]["usage"]["prompt_tokens"] == 3


def test_bad_batches_are_refused(served):
    client, _, _ = served
    for prompt, message in ((["a", ""], "no prompt of a batch may be empty"),
                            ([[1], []], "no prompt of a batch may be empty"),
                            (["x"] * 65, "at most 64 prompts"),
                            ([[1], [10**9]], "prompt token ids")):  # fmt: skip
        response = client.post("/v1/completions", json={"model": "m", "prompt": prompt})
        assert response.status_code == 400 and message in response.text, response.text


def test_a_batch_that_can_never_fit_the_server_is_a_400_not_a_429(gateways):
    backend = LogprobBackend()
    with TestClient(gateways.app(backend, "m", max_concurrent_requests=8)) as client:
        body = {"model": "m", "prompt": ["a", "b", "c"], "n": 3}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 400 and "asks for 9 choices" in response.text
        assert client.post("/v1/completions", json={**body, "n": 2}).status_code == 200


def _text(tok, tid: int) -> str:
    return tok.decode([tid], skip_special_tokens=False)


def test_echo_with_logprobs_puts_the_prompt_tokens_first(served):
    """What lm-evaluation-harness sends for a log-likelihood (token ids, ``echo``,
    ``logprobs: 1``, ``max_tokens: 1``): the prompt's tokens lead the log-probabilities,
    the first with nulls, and the offsets count from the prompt's start; streamed too."""
    client, backend, tok = served
    prompt = [40, 41, 42, 43]
    body = {"model": "m", "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0}  # fmt: skip
    whole = client.post("/v1/completions", json=body).json()
    assert backend.params[-1].prompt_logprobs == 1 and backend.params[-1].logprobs == 1
    lp = whole["choices"][0]["logprobs"]
    ids = prompt + [OUTPUT[0]]
    texts = [_text(tok, t) for t in ids]
    assert lp["tokens"] == texts
    assert lp["token_logprobs"] == [None, -0.041, -0.042, -0.043, -0.65]
    assert lp["top_logprobs"][0] is None
    assert lp["top_logprobs"][1] == {texts[1]: -0.041, _text(tok, 7): -0.1}
    assert lp["text_offset"] == [sum(len(x) for x in texts[:i]) for i in range(len(texts))]
    assert "prompt_logprobs" not in whole["choices"][0]  # vLLM's field only when asked
    assert whole["choices"][0]["text"] == tok.decode(prompt) + texts[-1]
    events = _events(client.post("/v1/completions", json={**body, "stream": True}).text)
    streamed = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert streamed[0]["tokens"][:4] == texts[:4]
    assert [v for part in streamed for v in part["token_logprobs"]] == lp["token_logprobs"]
    assert [v for part in streamed for v in part["text_offset"]] == lp["text_offset"]


def test_prompt_logprobs_field_as_vllm_returns_it(served):
    client, backend, tok = served
    body = {"model": "m", "prompt": [[40, 41, 42], [50]], "prompt_logprobs": 2, "max_tokens": 2}
    answer = client.post("/v1/completions", json=body).json()
    assert backend.params[-1].prompt_logprobs == 2 and backend.params[-1].logprobs is None
    first, second = (c["prompt_logprobs"] for c in answer["choices"])
    assert first[0] is None and len(first) == 3
    assert first[1] == {
        "41": {"logprob": -0.041, "rank": 1, "decoded_token": _text(tok, 41)},
        "7": {"logprob": -0.1, "rank": 1, "decoded_token": _text(tok, 7)},
        "8": {"logprob": -0.2, "rank": 2, "decoded_token": _text(tok, 8)},
    }
    assert first[2]["42"]["rank"] == 2
    assert second == [None]  # a one-token prompt: nothing to predict it from
    assert answer["choices"][0]["logprobs"] is None
    chat = client.post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 0,
        "max_tokens": 2, "n": 2,
    }).json()  # fmt: skip
    prompt_len = chat["usage"]["prompt_tokens"]
    assert len(chat["prompt_logprobs"]) == prompt_len and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in chat["choices"][0]
    # Out of range: a 400 naming the field.
    bad = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "prompt_logprobs": 21})
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text


def test_max_tokens_zero_with_echo_answers_the_prompt_alone(served):
    """vLLM's ``echo`` with ``max_tokens: 0`` (prompt scoring): the prompt and its
    log-probabilities are the answer; one token is computed upstream and not sent."""
    client, backend, tok = served
    prompt = [40, 41, 42]
    body = {"model": "m", "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 0}
    answer = client.post("/v1/completions", json=body).json()
    assert backend.params[-1].max_tokens == 1
    choice = answer["choices"][0]
    assert choice["text"] == tok.decode(prompt) and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [_text(tok, t) for t in prompt]
    assert choice["logprobs"]["token_logprobs"] == [None, -0.041, -0.042]
    assert answer["usage"]["completion_tokens"] == 0
    events = _events(client.post("/v1/completions", json={**body, "stream": True}).text)
    assert "".join(e["choices"][0]["text"] for e in events) == tok.decode(prompt)
    streamed = [v for e in events if e["choices"][0]["logprobs"]
                for v in e["choices"][0]["logprobs"]["token_logprobs"]]  # fmt: skip
    assert streamed == [None, -0.041, -0.042]
    refused = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 0})
    assert refused.status_code == 400 and "max_tokens" in refused.text


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


#: vLLM's structural tag (its structures-and-triggers form).
TAG = {"structures": [{"begin": "<f=w>", "schema": SCHEMA, "end": "</f>"}], "triggers": ["<f="]}


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
         StructuredOutput("json", json.dumps(SCHEMA))),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         StructuredOutput("json", json.dumps(SCHEMA), compact=True)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}},
         StructuredOutput("json", json.dumps(SCHEMA))),
        ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True,
                                 "whitespace_pattern": "[ ]"}},
         StructuredOutput("json", json.dumps(SCHEMA), closed=True, whitespace="[ ]")),
        ({"structured_outputs": {"regex": "[ab]+"}}, StructuredOutput("regex", "[ab]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}},
         StructuredOutput("choice", '["yes", "no"]')),
        ({"structured_outputs": {"grammar": 'root ::= "a"+'}},
         StructuredOutput("grammar", 'root ::= "a"+')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        ({"guided_json": SCHEMA}, StructuredOutput("json", json.dumps(SCHEMA))),
        ({"guided_regex": "a+"}, StructuredOutput("regex", "a+")),
        ({"guided_choice": ["a"]}, StructuredOutput("choice", '["a"]')),
        ({"guided_grammar": "start: /[0-9]+/"}, StructuredOutput("grammar", "start: /[0-9]+/")),
        ({"response_format": {"type": "structural_tag", **TAG}},
         StructuredOutput("structural_tag", json.dumps(TAG))),
        ({"structured_outputs": {"structural_tag": json.dumps({"type": "structural_tag", **TAG}),
                                 "disable_any_whitespace": True}},
         StructuredOutput("structural_tag", json.dumps(TAG), compact=True)),
    ],
)  # fmt: skip
def test_structured_outputs_reach_the_backend(served, option, expected):
    """vLLM's ``structured_outputs``, its older ``guided_*`` fields and OpenAI's
    ``response_format`` all become one :class:`StructuredOutput`, on both endpoints."""
    client, backend, _ = served
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):  # fmt: skip
        response = client.post(path, json={"model": "m", **body, **option})
        assert response.status_code == 200, (path, response.text)
        assert backend.params[-1].structured == expected


@pytest.mark.parametrize(
    ("option", "param", "says"),
    [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        ({"guided_json": "{bad"}, "guided_json", "structured output (json)"),
        ({"guided_json": [1, 2]}, "guided_json", "takes a JSON schema"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "non-empty list"),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs", "list of strings"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs", "grammar"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs", "non-empty string"),
        ({"structured_outputs": {"json": SCHEMA}, "guided_regex": "a"}, "structured_outputs",
         "only one structured output"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
         "only one structured output"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
         "response_format", "only one"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "json_tag"}}, "response_format", "not supported"),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "triggers"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "triggers"),
        ({"structured_outputs": {"structural_tag": "{nope"}}, "structured_outputs", "as JSON"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<f="],
                              "structures": [{"begin": "<g=", "schema": {}, "end": ">"}]}},
         "response_format", "none of the triggers"),
        ({"response_format": {"type": "structural_tag", "triggers": ["<f="],
                              "structures": [{"begin": "<f=", "end": ">"}]}},
         "response_format", "schema"),
        ({"response_format": {"type": "structural_tag", "format": {"type": "any_text"}}},
         "response_format", "'format' form"),
        ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": 5}},
         "structured_outputs", "whitespace_pattern takes a regex"),
    ],
)  # fmt: skip
def test_bad_structured_outputs_are_400s_naming_them(served, option, param, says):
    client, backend, _ = served
    before = len(backend.params)
    response = client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "hi"}], **option},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert len(backend.params) == before  # nothing reached the cluster


def test_bad_words_reach_the_backend_checked(served):
    client, backend, _ = served
    body = {"model": "m", "prompt": "hi", "bad_words": ["hello", " world"]}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert backend.params[-1].bad_words == ("hello", " world")
    for bad, says in (([" "], "no token"), ([5], "bad_words"), (["x"] * 65, "bad_words")):
        response = client.post("/v1/completions", json={**body, "bad_words": bad})
        assert response.status_code == 400 and says in response.text, response.text


def test_truncate_prompt_tokens_keeps_the_last_ones(served):
    client, backend, tok = served
    ids = tok.encode("one two three four five six seven", add_special_tokens=False)
    body = {"model": "m", "prompt": ids, "max_tokens": 2, "truncate_prompt_tokens": 3,
            "echo": True}  # fmt: skip
    answer = client.post("/v1/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] == 3
    assert answer["choices"][0]["text"].startswith(tok.decode(ids[-3:]))
    chat = {"model": "m", "messages": [{"role": "user", "content": "a b c d e f g h"}],
            "max_tokens": 2, "truncate_prompt_tokens": 4}  # fmt: skip
    assert client.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == 4
    whole = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": -1}).json()
    assert whole["usage"]["prompt_tokens"] == len(ids)  # it fits: nothing cut
    for bad in (256, -2):
        response = client.post("/v1/completions", json={**body, "truncate_prompt_tokens": bad})
        assert response.status_code == 400 and "truncate_prompt_tokens" in response.text


def test_skip_special_tokens_false_keeps_their_text(gateways):
    """vLLM's ``skip_special_tokens``: special tokens (here EOS) stay out of the text by
    default, and are in it with ``false``; the token that stopped the request, though,
    only with ``include_stop_str_in_output`` too (vLLM leaves it out otherwise)."""
    tok = gateways.tokenizer
    eos = tok.eos_token_id

    class Eos:
        async def generate(self, request_id, prompt_token_ids, params):
            yield GenerationChunk((65, eos), "stop", 0)

        async def abort(self, request_id):
            return None

        async def health(self):
            return {}

    with TestClient(gateways.app(Eos(), "m")) as client:
        body = {"model": "m", "prompt": "hi", "max_tokens": 4}
        skipped = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        unskipped = {**body, "skip_special_tokens": False}
        stopped = client.post("/v1/completions", json=unskipped).json()["choices"][0]["text"]
        kept = client.post(
            "/v1/completions", json={**unskipped, "include_stop_str_in_output": True}
        )
        assert skipped == stopped == tok.decode([65])
        assert kept.json()["choices"][0]["text"] == tok.decode([65, eos], skip_special_tokens=False)
        assert tok.eos_token in kept.json()["choices"][0]["text"]


class StoppingBackend:
    """Generates 70, 71, ... and ends as the engine does: ``stop`` with a token of the
    request's ``stop_token_ids`` or the end-of-sequence token 75 (kept in the output),
    ``length`` at ``max_tokens``."""

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        for i in range(params.max_tokens):
            token = 70 + i
            stop = token in params.stop_token_ids or token == 75
            last = stop or i + 1 == params.max_tokens
            yield GenerationChunk(
                (token,), ("stop" if stop else "length") if last else None, 0 if i == 0 else None
            )
            if last:
                return

    async def abort(self, request_id: str) -> None:
        return None

    async def health(self) -> dict[str, Any]:
        return {"mode": "stopping"}


@pytest.mark.parametrize("chat", [False, True])
def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(gateways, chat):
    """vLLM's ``stop_reason``: the matched stop string, the ``stop_token_ids`` entry that
    ended the output, None for the end-of-sequence token and for ``length``; in whole
    responses and on the streamed chunk that carries the finish reason."""
    app = gateways.app(StoppingBackend(), "m", end_token_ids=(75,))
    tok = gateways.tokenizer
    text = tok.decode([70, 71, 72])
    stop_string = text[-1]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    cases = [
        ({"stop_token_ids": [72]}, "stop", 72),
        ({"stop_token_ids": [75]}, "stop", None),  # an end-of-sequence token: None
        ({}, "stop", None),  # the end-of-sequence token
        ({"max_tokens": 3}, "length", None),
        ({"stop": [stop_string]}, "stop", stop_string),
    ]
    with TestClient(app) as client:
        for extra, finish, reason in cases:
            body = {"model": "m", "max_tokens": 8, **prompt, **extra}
            choice = client.post(path, json=body).json()["choices"][0]
            assert (choice["finish_reason"], choice["stop_reason"]) == (finish, reason), extra
            content = choice["message"]["content"] if chat else choice["text"]
            if "stop_token_ids" in extra:  # the stop token's text is left out, as on vLLM
                assert content == tok.decode(list(range(70, extra["stop_token_ids"][0])))
            streamed = _events(client.post(path, json={**body, "stream": True}).text)
            choices = [e["choices"][0] for e in streamed if e["choices"]]
            assert all("stop_reason" in c for c in choices)
            assert [(c["finish_reason"], c["stop_reason"]) for c in choices if c["finish_reason"]
                    ] == [(finish, reason)], extra  # fmt: skip
