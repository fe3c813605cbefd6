"""SGLang's native API (halfmoon/serve/gateway/sglang_generation.py, routes in
sglang_api.py): ``/generate`` with text or token ids, batched and with ``n``, whole and
streamed (cumulative, as SGLang streams), ``meta_info`` with SGLang's finish reasons and
log-probability triples, the model's defaults for what a request leaves out;
``/model_info``; ``/abort_request``; a 400 naming what cannot be done.

In-process (ASGI) over the token tests' counting backend; a live cluster's answers are
checked in tests/e2e/test_serve_disaggregated.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from .test_token_generation import LETTERS, CountingBackend, counting, started


@pytest.fixture(scope="module")
def served(gateways):
    with counting(gateways) as pair:
        yield pair


def test_text_in_text_and_ids_out(served, gateways):
    client, backend = served
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "rid": "mine"}  # fmt: skip
    out = client.post("/generate", json=body).json()
    assert out["text"] == LETTERS[:4] and out["output_ids"] == backend.ids[:4]
    meta = out["meta_info"]
    assert meta["id"] == "mine" and meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == len(gateways.tokenizer.encode("Hi"))  # (with BOS)
    assert meta["completion_tokens"] == 4 and meta["e2e_latency"] >= 0
    assert backend.prompts[-1] == gateways.tokenizer.encode("Hi")
    assert backend.params[-1].temperature == 0.0
    # left out: the model's defaults (SGLang's --sampling-defaults model), 128 new tokens
    client.post("/generate", json={"input_ids": [5, 6], "sampling_params": {"top_k": -1}})
    params = backend.params[-1]
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.9, 0)
    assert params.max_tokens == 128 and backend.prompts[-1] == [5, 6]


def test_a_batch_with_n_answers_a_list_prompt_by_prompt(served):
    client, backend = served
    body = {"input_ids": [[5, 6], [7]], "rid": ["a", "b"],
            "sampling_params": {"max_new_tokens": 2, "n": 2, "sampling_seed": 3}}  # fmt: skip
    out = client.post("/generate", json=body).json()
    assert [o["index"] for o in out] == [0, 1, 2, 3]
    assert [o["meta_info"]["id"] for o in out] == ["a", "a", "b", "b"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 2, 1, 1]
    assert all(o["text"] == LETTERS[:2] for o in out)
    assert sorted(p.seed for p in backend.params[-4:]) == [3, 3, 4, 4]


def test_logprobs_are_sglangs_triples(served):
    client, backend = served
    body = {"input_ids": [5], "return_logprob": True, "top_logprobs_num": 2,
            "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 2}}  # fmt: skip
    meta = client.post("/generate", json=body).json()["meta_info"]
    a, b = backend.ids[:2]
    assert meta["output_token_logprobs"] == [[-0.5, a, "a"], [-0.5, b, "b"]]
    assert meta["output_top_logprobs"][0] == [[-0.5, a, "a"], [-1.5, a, "a"]]
    assert "input_token_logprobs" not in meta  # (logprob_start_len -1: the output's only)
    plain = client.post("/generate", json={**body, "return_text_in_logprobs": False}).json()
    assert plain["meta_info"]["output_token_logprobs"][0] == [-0.5, a, None]
    assert backend.params[-1].logprobs == 2


def test_a_stream_is_cumulative_and_ends_with_the_finish(served):
    client, backend = served
    body = {"text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 3}}
    text = client.post("/generate", json=body).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert [e["text"] for e in events] == ["a", "ab", "abc"]
    assert events[-1]["output_ids"] == backend.ids[:3]
    assert [e["meta_info"]["finish_reason"] for e in events[:-1]] == [None, None]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert text.rstrip().endswith("data: [DONE]") and "index" not in events[0]


def test_a_batch_whose_prompts_differ_in_options_runs_prompt_by_prompt(served):
    """Each prompt's own ``sampling_params`` (and logprob options): one completion per
    prompt, answered as one batch in the prompts' order."""
    client, backend = served
    body = {"input_ids": [[5, 6], [7], [8, 9, 10]], "rid": ["a", "b", "c"],
            "sampling_params": [{"max_new_tokens": 2, "temperature": 0},
                                {"max_new_tokens": 3, "n": 2, "sampling_seed": 4},
                                {"max_new_tokens": 1, "temperature": 0.5}],
            "return_logprob": [True, False, False]}  # fmt: skip
    before = len(backend.params)
    out = client.post("/generate", json=body).json()
    assert [o["index"] for o in out] == [0, 1, 2, 3]
    assert [o["meta_info"]["id"] for o in out] == ["a", "b", "b", "c"]
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 3, 3, 1]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 1, 1, 3]
    assert ["output_token_logprobs" in o["meta_info"] for o in out] == [True, False, False, False]
    ran = backend.params[before:]
    assert sorted((p.max_tokens, p.temperature) for p in ran) == [
        (1, 0.5),
        (2, 0.0),
        (3, 0.2),
        (3, 0.2),
    ]  # fmt: skip (0.2: the model's default)
    assert sorted(p.seed for p in ran if p.max_tokens == 3) == [4, 5]


def test_a_batch_whose_prompts_differ_streams_one_batchs_indexes(served):
    client, _ = served
    body = {"text": ["x", "y"], "stream": True,
            "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3}]}  # fmt: skip
    text = client.post("/generate", json=body).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    last = {e["index"]: e for e in events}
    assert sorted(last) == [0, 1] and [last[i]["text"] for i in (0, 1)] == ["ab", "abc"]
    assert text.count("data: [DONE]") == 1 and text.rstrip().endswith("data: [DONE]")


def test_a_stop_string_is_matched(served):
    client, _ = served
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 8, "stop": ["cd"]}}
    out = client.post("/generate", json=body).json()
    assert out["text"] == "ab"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "cd"}
    kept = client.post("/generate", json={**body, "sampling_params": {
        **body["sampling_params"], "no_stop_trim": True}}).json()  # fmt: skip
    assert kept["text"] == "abcd"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"text": "a", "input_ids": [5]}, "either text or input_ids"),
        ({}, "either text or input_ids"),
        ({"text": "a", "image_data": "x.png"}, "image_data"),
        ({"text": "a", "sampling_params": {"beam_width": 2}}, "beam_width"),
        ({"text": "a", "sampling_params": {"bogus": 1}}, "bogus"),
        (
            {"text": ["a", "b"], "sampling_params": [{"temperature": 0}, {"temperature": 1}] * 2},
            "4 values for 2 prompts",
        ),
        ({"input_ids": [[5], [6]], "return_logprob": [True, False, True]}, "return_logprob"),
        ({"text": "a", "sampling_params": {"temperature": 9}}, "temperature"),
        ({"input_ids": [100000]}, "prompt"),
        ({"text": "a", "return_logprob": True, "top_logprobs_num": 50}, "top_logprobs_num"),
    ],
)
def test_what_cannot_be_done_is_a_400_naming_it(served, body, words):
    client, _ = served
    answer = client.post("/generate", json=body)
    assert answer.status_code == 400, answer.text
    assert words in json.dumps(answer.json())


def test_sglangs_own_benchmark_payload_is_served(served):
    """The body ``sglang.bench_serving --backend sglang`` sends (SGLang 0.5.23's
    ``async_request_sglang_generate``, its defaults), and the fields it reads back."""
    client, _ = served
    payload = {"input_ids": [5, 6, 7], "stream": True, "lora_path": None,
               "return_logprob": False, "return_routed_experts": False,
               "logprob_start_len": -1,
               "sampling_params": {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}}  # fmt: skip
    text = client.post("/generate", json=payload).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert [e["meta_info"]["completion_tokens"] for e in events] == [1, 2, 3, 4]
    assert events[-1]["text"] == LETTERS[:4] and events[-1]["meta_info"]["prompt_tokens"] == 3
    assert "cached_tokens" in events[-1]["meta_info"]
    routed = client.post("/generate", json={**payload, "return_routed_experts": True})
    assert routed.status_code == 400 and "return_routed_experts" in routed.text


def test_model_info(served):
    client, _ = served
    for path in ("/model_info", "/get_model_info"):
        info = client.get(path).json()
        assert info["model_path"] == "m" and info["is_generation"] is True
    for path in ("/server_info", "/get_server_info"):  # (no cluster: no instance states)
        info = client.get(path).json()
        assert info["served_model_name"] == "m" and info["internal_states"] == []
        assert info["context_length"] == 256 and info["frontend"] == "halfmoon"


def test_abort_request_ends_a_running_generation(gateways):
    backend = CountingBackend(gateways.tokenizer)
    backend.pace_s = 0.02
    app = gateways.app(backend, "m")

    async def scenario() -> tuple[int, dict, dict]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            body = {"input_ids": [5], "rid": "r", "sampling_params": {"max_new_tokens": 200}}
            running = asyncio.ensure_future(client.post("/generate", json=body))
            other = asyncio.ensure_future(client.post("/generate", json={**body, "rid": "s"}))
            await started(backend, 2)
            ended = await client.post("/abort_request", json={"rid": "r"})
            first = (await running).json()
            await client.post("/abort_request", json={"abort_all": True})
            return ended.status_code, first, (await other).json()

    status, first, other = asyncio.run(scenario())
    assert status == 200 and first["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < first["meta_info"]["completion_tokens"] < 200
    assert other["meta_info"]["finish_reason"]["type"] == "abort"


def test_health_generate_runs_one_token_through_the_backend(gateways, monkeypatch):
    """SGLang's deep health check: 200 once a token comes (not counted as a request),
    503 when none comes in time, 200 while generation is paused on purpose."""
    from halfmoon.serve.gateway import sglang_api

    backend = CountingBackend(gateways.tokenizer)
    app = gateways.app(backend, "m")
    gw = app.state.gateway

    class Stuck(CountingBackend):
        async def generate(self, request_id, prompt_token_ids, params):
            await asyncio.sleep(60)
            yield  # pragma: no cover

    stuck = gateways.app(Stuck(gateways.tokenizer), "m")
    monkeypatch.setattr(sglang_api, "HEALTH_GENERATE_TIMEOUT_S", 0.2)

    async def scenario() -> list[int]:
        out = []
        for each in (app, stuck):
            transport = httpx.ASGITransport(app=each)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                out.append((await client.get("/health_generate")).status_code)
                if each is stuck:
                    each.state.gateway._resumed.clear()  # (paused, as for a weight update)
                    out.append((await client.get("/health_generate")).status_code)
        return out

    assert asyncio.run(scenario()) == [200, 503, 200]
    assert backend.prompts == [[0]] and backend.params[0].max_tokens == 1
    assert gw.in_flight == 0  # (not one of the gateway's requests)
