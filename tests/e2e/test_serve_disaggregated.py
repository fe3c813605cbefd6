"""``halfmoon serve`` (disaggregated, 1 prefill + 1 decode) end to end on 127.0.0.1."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog " * 4, "1 2 3 4 5 6 7 8 9 10"]


@pytest.fixture(scope="module")
def disagg(cluster_factory):
    # (every request here but one has priority 0: the priority policy orders them by arrival)
    return cluster_factory("--kv-cache-mb", "64", "--tool-call-parser", "hermes",
                           "--scheduling-policy", "priority")  # fmt: skip


@pytest.fixture(scope="module")
def coupled(cluster_factory):
    """One coupled worker, started as a vLLM command line would start it (the model first;
    vLLM's flags, some done here, others accepted; a second served name), with qwen3's
    reasoning parser (which reads nothing of a completion, nor of a chat not opened)."""
    return cluster_factory("tiny", "--mode", "coupled", "--instances", "1",
                           "--kv-cache-mb", "32", "--reasoning-parser", "qwen3",
                           "--max-num-batched-tokens", "128", "--trust-remote-code",
                           "--enable-force-include-usage", "--disable-log-requests",
                           "--served-model-name", "tiny", "thinker")  # fmt: skip


def _client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)


def _greedy(cluster, prompt, n=8):
    out = _client(cluster).completions.create(
        model="tiny", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text, out.usage


def _metric(cluster, name):
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    # The gateway's own series (labelled role="gateway", worker, model_name).
    m = re.search(rf'^{re.escape(name)}\{{[^}}]*role="gateway"[^}}]*\}} ([0-9.e+]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_greedy_identical_across_disaggregated_coupled_and_offline(disagg, coupled):
    from halfmoon.core.request import SamplingParams
    from halfmoon.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(disagg.cache / "presets" / "tiny-seed0")))
    offline = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for prompt, ref in zip(PROMPTS, offline, strict=True):
        assert _greedy(disagg, prompt)[0] == ref.text
        assert _greedy(coupled, prompt)[0] == ref.text
    # return_token_ids: the ids the offline engine generated, and the prompt's
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    choice = httpx.post(disagg.base_url + "/v1/completions", json=body, timeout=60).json()
    choice = choice["choices"][0]
    assert choice["token_ids"] == list(offline[0].token_ids)
    assert choice["prompt_token_ids"] == engine.tokenizer.encode(PROMPTS[0])


def test_chat_and_streaming(disagg):
    client = _client(disagg)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.usage.completion_tokens == 5
    pieces = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        if c.choices
    ]
    assert "".join(pieces) == chat.choices[0].message.content


def _ttft(cluster, prompt):
    start = time.monotonic()
    stream = _client(cluster).completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for _ in stream:
        ttft = time.monotonic() - start
        break
    for _ in stream:
        pass
    return ttft


def test_shared_prefix_hits_the_cache(disagg):
    prefix = " ".join(f"word{i}" for i in range(700))  # well over a thousand tokens
    hits_before = _metric(disagg, "halfmoon:prefix_cache_hits_total")
    first = _ttft(disagg, prefix + " first question")
    second = _ttft(disagg, prefix + " second question")
    hits = _metric(disagg, "halfmoon:prefix_cache_hits_total") - hits_before
    _, usage = _greedy(disagg, prefix + " third", n=1)
    assert usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 32
    assert hits >= 1000  # the second request's prefill skipped the shared prefix
    assert second < first


def test_concurrent_requests_all_complete(disagg):
    def one(i):
        return _greedy(disagg, f"request number {i} " * (1 + i % 5), n=6)[1].completion_tokens

    with ThreadPoolExecutor(32) as pool:
        counts = list(pool.map(one, range(32)))
    assert counts == [6] * 32
    pongs = disagg.ping_workers()
    assert {p.role for p in pongs} == {"prefill", "decode"}
    assert all(p.integrity == "ok" for p in pongs)


def _wait_idle(cluster):
    """Wait (up to 30 s) until no worker runs or queues a request; assert it. The
    workers' last answers."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pongs = cluster.ping_workers()
        if all(p.num_running == 0 and p.num_waiting == 0 for p in pongs):
            break
        time.sleep(0.2)
    assert all(p.num_running == 0 for p in pongs), pongs
    return pongs


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_frees_kv(disagg, n):
    # with n > 1 every choice is its own request in the cluster: all of them must end
    body = {"model": "tiny", "prompt": "disconnect me", "max_tokens": 400, "stream": True,
            "ignore_eos": True, "temperature": 0, "n": n}  # fmt: skip
    with httpx.stream("POST", disagg.base_url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # got a token: hang up mid-stream
    assert all(p.integrity == "ok" for p in _wait_idle(disagg))


def test_impossible_slo_is_rejected_with_429(cluster_factory):
    strict = cluster_factory("--kv-cache-mb", "32", "--ttft-slo", "0.000001")
    req = urllib.request.Request(
        strict.base_url + "/v1/completions",
        data=json.dumps({"model": "tiny", "prompt": "hello " * 50, "max_tokens": 4}).encode(),
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    assert info.value.code == 429
    assert int(info.value.headers["Retry-After"]) >= 1
    assert "TTFT" in json.loads(info.value.read())["error"]["message"]


def test_prefix_caching_can_be_switched_off(cluster_factory):
    off = cluster_factory("--kv-cache-mb", "32", "--no-prefix-caching")
    prompt = " ".join(f"again{i}" for i in range(200))
    first = _greedy(off, prompt, n=2)[1]
    second = _greedy(off, prompt, n=2)[1]
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == 0
    assert all(p.stats.get("store_blocks", 0) == 0 for p in off.ping_workers())


def offline_logprobs(engine, prompt, params):
    """Per generated token, the offline engine's (token id, TokenLogprob)."""
    engine.add_request("offline-logprobs", prompt, params)
    out = []
    while engine.has_unfinished_requests():
        for step in engine.step():
            out += zip(step.new_token_ids, step.new_logprobs, strict=True)
    return out


def test_logprobs_penalties_and_n_equal_an_offline_engine(disagg):
    # The first token's log-probability comes from the prefill worker, the rest from the
    # decode worker after the KV handoff: both must be the model's own.
    from halfmoon.core.request import SamplingParams
    from halfmoon.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(disagg.cache / "presets" / "tiny-seed0")))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=2)
    ref = offline_logprobs(engine, PROMPTS[1], params)
    out = _client(disagg).completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert len(lp.token_logprobs) == len(ref) == 5
    for ours, (_, theirs), top in zip(lp.token_logprobs, ref, lp.top_logprobs, strict=True):
        assert abs(ours - theirs.logprob) < 1e-3
        assert max(top.values()) == pytest.approx(ours, abs=1e-6)  # greedy: the top token
    chat = _client(disagg).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    # Penalties: prefill worker (first token) and decode worker (the rest) apply them alike.
    penalised = SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, frequency_penalty=1.5,
        repetition_penalty=1.4,
    )  # fmt: skip
    (ref_text,) = engine.generate([PROMPTS[1]], penalised)
    out = _client(disagg).completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0, frequency_penalty=1.5,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.4},
    )  # fmt: skip
    assert out.choices[0].text == ref_text.text
    # logit_bias: both workers force the biased token
    biased = _client(disagg).completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=4, temperature=0, logit_bias={"300": 100},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    forced = SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, logit_bias=((300, 100.0),)
    )
    assert biased.choices[0].text == engine.generate([PROMPTS[1]], forced)[0].text
    assert list(engine.generate([PROMPTS[1]], forced)[0].token_ids) == [300] * 4
    # bad_words: both workers ban them (a word the free run writes, so the ban matters)
    free = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0,
                                                         ignore_eos=True))[0]  # fmt: skip
    word = engine.tokenizer.decode(list(free.token_ids[1:3]))
    banned = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, bad_words=(word,))
    out = _client(disagg).completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "bad_words": [word]},
    )  # fmt: skip
    assert out.choices[0].text == engine.generate([PROMPTS[1]], banned)[0].text != free.text
    # n = 2: two requests in the cluster, seeds 5 and 6, each as an offline engine samples it
    out = _client(disagg).completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=5, n=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, choice in enumerate(sorted(out.choices, key=lambda c: c.index)):
        seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=5 + i, ignore_eos=True)
        assert choice.text == engine.generate([PROMPTS[0]], seeded)[0].text
    assert out.usage.completion_tokens == 12


@pytest.mark.parametrize(
    ("path", "body", "words"),
    [
        ("completions", {"prompt": "hi", "seed": 2**70}, "seed"),
        ("completions", {"prompt": "a \ud800 b"}, "lone surrogate"),
        ("completions", {"prompt": "hi", "stop": ["\udfff"]}, "lone surrogate"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x \ud800"}]},
         "lone surrogate"),
        ("chat/completions", {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]},
         "image_url"),
    ],
)  # fmt: skip
def test_hostile_inputs_get_a_400_and_the_connection_keeps_serving(disagg, path, body, words):
    """Each of these was an HTTP 500 in plain text, and after the image_url one the next
    request on the same keep-alive connection was reset."""
    with httpx.Client(base_url=disagg.base_url, timeout=30, trust_env=False) as http:
        raw = json.dumps({"model": "tiny", "max_tokens": 4, **body}, ensure_ascii=True)
        bad = http.post(f"/v1/{path}", content=raw, headers={"Content-Type": "application/json"})
        assert bad.status_code == 400, bad.text
        assert words in bad.json()["error"]["message"]
        ok = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_a_chunked_body_over_the_limit_is_refused_while_read(disagg):
    """Transfer-Encoding: chunked over a real socket: refused at the limit (4 MiB), not
    read whole (a 50 MB one drove the gateway to 11.7 GiB)."""
    sent = 0

    def body():
        nonlocal sent
        yield b'{"model": "tiny", "max_tokens": 2, "prompt": "'
        for _ in range(50 * 16):  # 50 MiB in 64 KiB pieces, if all were read
            sent += 65536
            yield b"x" * 65536
        yield b'"}'

    with httpx.Client(base_url=disagg.base_url, timeout=60, trust_env=False) as http:
        try:
            r = http.post("/v1/completions", content=body(),
                          headers={"Content-Type": "application/json"})  # fmt: skip
            assert r.status_code == 413, r.text
        except httpx.HTTPError:
            pass  # the server may close the connection while the body is still going out
    assert sent < 20 * 2**20, f"{sent} bytes went out before the refusal"
    assert _greedy(disagg, "Hello")[1].completion_tokens == 8


def _cached_tokens(cluster, prompt, **extra):
    out = _client(cluster).completions.create(
        model="tiny", prompt=prompt, max_tokens=2, temperature=0,
        extra_body={"ignore_eos": True, **extra},
    )  # fmt: skip
    return out.usage.prompt_tokens_details.cached_tokens, out.usage.prompt_tokens


def test_cache_salt_isolates_the_cluster_cache(disagg):
    """Different salts share no block: not in the gateway's placement hashes and the
    Conductor's index, nor in the prefill worker's engine pool and block store."""
    prompt = " ".join(f"tenant{i}" for i in range(300))
    assert _cached_tokens(disagg, prompt, cache_salt="a")[0] == 0
    hit, prompt_tokens = _cached_tokens(disagg, prompt, cache_salt="a")
    assert hit >= prompt_tokens - 32  # the same salt: the whole prefix
    assert _cached_tokens(disagg, prompt, cache_salt="b")[0] == 0
    assert _cached_tokens(disagg, prompt)[0] == 0
    assert _cached_tokens(disagg, prompt)[0] == hit
    reply = httpx.post(disagg.base_url + "/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "hi", "cache_salt": ""})  # fmt: skip
    assert reply.status_code == 400 and "cache_salt" in reply.json()["error"]["message"]


def offline_prompt_logprobs(engine, prompt, k):
    """The offline engine's prompt log-probabilities (of prompt tokens 1..)."""
    from halfmoon.core.request import SamplingParams

    engine.add_request("offline-prompt", prompt, SamplingParams(max_tokens=1, prompt_logprobs=k))
    first = None
    while engine.has_unfinished_requests():
        for step in engine.step():
            first = first or step
    return first.prompt_logprobs


def test_beam_search_equals_the_same_search_over_an_offline_engine(disagg):
    """``use_beam_search`` through the cluster (each step a one-token request per beam,
    answered by the prefill worker from its prefix cache) returns the beams the same
    search finds over an offline engine's log-probabilities; a beam of one is greedy."""
    import asyncio

    from halfmoon.core.request import SamplingParams
    from halfmoon.engine import EngineConfig, LLMEngine
    from halfmoon.serve.gateway.backend import GenerationChunk
    from halfmoon.serve.gateway.beam_search import beam_search
    from halfmoon.serve.gateway.responses import Prepared

    engine = LLMEngine(EngineConfig(model=str(disagg.cache / "presets" / "tiny-seed0")))
    ids = engine.tokenizer.encode(PROMPTS[2])

    async def offline(p):
        ((token, logprob),) = offline_logprobs(engine, p.prompt_ids, p.params)
        yield GenerationChunk((token,), "length", 0, logprobs=(logprob,))

    body = {"model": "tiny", "prompt": ids, "max_tokens": 6, "n": 3, "use_beam_search": True,
            "length_penalty": 0.5}  # fmt: skip
    answer = httpx.post(disagg.base_url + "/v1/completions", json=body, timeout=120).json()
    params = SamplingParams(max_tokens=6)
    prepared = Prepared("ref", ids, params, (), False, False, n=3)
    ref = asyncio.run(beam_search(prepared, offline, engine.eos_token_ids, 0.5))
    assert [c["text"] for c in answer["choices"]] == [
        engine.tokenizer.decode(list(b.tokens)) for b in ref.beams
    ]
    assert [c["finish_reason"] for c in answer["choices"]] == [b.finish for b in ref.beams]
    assert len({c["text"] for c in answer["choices"]}) == 3
    assert answer["usage"]["completion_tokens"] == sum(len(b.tokens) for b in ref.beams)
    one = httpx.post(disagg.base_url + "/v1/completions", timeout=120, json={
        **body, "n": 1, "ignore_eos": True, "length_penalty": 0.0}).json()  # fmt: skip
    assert one["choices"][0]["text"] == _client(disagg).completions.create(
        model="tiny", prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip


def test_prompt_logprobs_equal_an_offline_engine(disagg):
    """What lm-evaluation-harness sends for a log-likelihood (token ids, ``echo``,
    ``logprobs: 1``, ``max_tokens: 1``) and vLLM's ``prompt_logprobs``: computed by the
    prefill worker (the prompt is in the cluster's cache from an earlier request, and is
    computed again), the model's own values."""
    from halfmoon.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(disagg.cache / "presets" / "tiny-seed0")))
    ids = engine.tokenizer.encode(PROMPTS[1])
    _greedy(disagg, ids, 2)  # now cached in the cluster
    ref = offline_prompt_logprobs(engine, ids, 1)
    assert len(ref) == len(ids) - 1
    body = {"model": "tiny", "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1,
            "temperature": 0}  # fmt: skip
    answer = httpx.post(disagg.base_url + "/v1/completions", json=body, timeout=60).json()
    lp = answer["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    for ours, theirs in zip(lp["token_logprobs"][1 : len(ids)], ref, strict=True):
        assert abs(ours - theirs.logprob) < 1e-3
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed again
    vllm_style = httpx.post(disagg.base_url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": PROMPTS[1], "max_tokens": 2, "prompt_logprobs": 2,
    }).json()  # fmt: skip
    field = vllm_style["choices"][0]["prompt_logprobs"]
    assert field[0] is None and len(field) == len(ids)
    for entry, token, theirs in zip(field[1:], ids[1:], ref, strict=True):
        assert entry[str(token)]["rank"] == theirs.rank
        assert abs(entry[str(token)]["logprob"] - theirs.logprob) < 1e-3


#: A schema a random-weight model completes within 40 tokens (bounded values only).
SMALL_SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


def test_structured_outputs_equal_an_offline_engine(disagg):
    """A JSON schema through the cluster: the prefill worker draws the first token under
    the grammar, the decode worker follows it and goes on; seeded, the text equals an
    offline engine's token for token, and it is JSON the schema admits. Chat with
    OpenAI's ``response_format`` streams it; a bad regex is a 400."""
    from halfmoon.core.request import SamplingParams, StructuredOutput
    from halfmoon.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=str(disagg.cache / "presets" / "tiny-seed0")))
    structured = StructuredOutput("json", json.dumps(SMALL_SCHEMA), compact=True)
    client = _client(disagg)
    for seed in (1, 2, 3):
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured=structured)
        (ref,) = engine.generate([PROMPTS[1]], params)
        out = client.completions.create(
            model="tiny", prompt=PROMPTS[1], max_tokens=40, temperature=1.0, seed=seed,
            extra_body={"structured_outputs": {"json": SMALL_SCHEMA,
                                               "disable_any_whitespace": True}},
        )  # fmt: skip
        assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "stop"
        value = json.loads(out.choices[0].text)
        assert set(value) == {"ok", "n", "tag"} and value["tag"] in ("red", "green")
    stream = client.chat.completions.create(
        # (room for the whitespace the schema allows between tokens: a random model
        # writes much of it, and 60 tokens once ran out mid-string)
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=200, seed=5,
        stream=True,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "small", "schema": SMALL_SCHEMA}},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert json.loads(text)["tag"] in ("red", "green")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    with pytest.raises(openai.BadRequestError, match="unclosed group"):
        client.completions.create(model="tiny", prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "a(b"})  # fmt: skip


def test_forced_tool_calls_through_the_cluster(disagg):
    """``tool_choice`` a named function or ``required``: the output, held to the
    function's parameters (or to an array of calls), comes back as OpenAI's
    ``tool_calls``, whole and streamed; the conversation goes on with the call's result;
    ``auto`` is read by the cluster's ``--tool-call-parser``."""
    client = _client(disagg)
    tools = [{"type": "function", "function": {"name": "paint", "parameters": SMALL_SCHEMA}}]
    messages = [{"role": "user", "content": "Paint something."}]
    named = client.chat.completions.create(
        model="tiny", messages=messages, tools=tools, max_tokens=60, seed=3,
        tool_choice={"type": "function", "function": {"name": "paint"}},
    )  # fmt: skip
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "paint" and named.choices[0].finish_reason == "stop"
    assert json.loads(call.function.arguments)["tag"] in ("red", "green")
    required = client.chat.completions.create(
        # (room for the whitespace the array of calls allows, as above)
        model="tiny", messages=messages, tools=tools, max_tokens=200, seed=4, stream=True,
        tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    chunks = [c for c in required if c.choices]
    (streamed,) = [d for c in chunks for d in c.choices[0].delta.tool_calls or ()]
    assert streamed.function.name == "paint" and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert json.loads(streamed.function.arguments)["tag"] in ("red", "green")
    after = client.chat.completions.create(
        model="tiny", tools=tools, tool_choice="none", max_tokens=4, messages=[
            *messages, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "done"},
        ],
    )  # fmt: skip
    assert after.choices[0].message.tool_calls is None
    # tool_choice "auto" (this cluster reads hermes calls): the random model writes none
    auto = client.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                          max_tokens=4, temperature=0)  # fmt: skip
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].message.content


def test_a_request_priority_reaches_a_cluster_that_schedules_by_it(disagg):
    """``--scheduling-policy priority``: a request's ``priority`` is taken (the prefill
    and decode engines order their queues by it), and the answer is the same."""
    client = _client(disagg)
    answers = [client.completions.create(model="tiny", prompt="Order matters", max_tokens=6,
                                         temperature=0.8, seed=4,
                                         extra_body={"priority": priority}).choices[0].text
               for priority in (0, 5, -2)]  # fmt: skip
    assert answers[0] == answers[1] == answers[2]


def test_the_responses_api_through_the_cluster(disagg):
    """The ``openai`` client's ``responses.create`` (OpenAI's Responses API): seeded text
    equal to the same chat request's, streamed deltas adding up to the final text, and a
    forced function call."""
    client = _client(disagg)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=12,
        temperature=0.8, seed=9,
    )  # fmt: skip
    answer = client.responses.create(
        model="tiny", input="Hello", max_output_tokens=12, temperature=0.8,
        extra_body={"seed": 9},
    )  # fmt: skip
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    events = list(client.responses.create(model="tiny", input="Hello", max_output_tokens=12,
                                          temperature=0.8, extra_body={"seed": 9},
                                          stream=True))  # fmt: skip
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].type == "response.completed" and deltas == answer.output_text
    tools = [{"type": "function", "name": "paint", "parameters": SMALL_SCHEMA}]
    called = client.responses.create(model="tiny", input="Paint.", tools=tools,
                                     tool_choice={"type": "function", "name": "paint"},
                                     max_output_tokens=60)  # fmt: skip
    (call,) = called.output
    assert call.type == "function_call" and json.loads(call.arguments)["tag"] in ("red", "green")


def test_anthropics_messages_api_through_the_cluster(disagg):
    """The ``anthropic`` client against the cluster (Anthropic's Messages API): seeded text
    equal to the same chat request's, streamed text adding up to it, a repeated prompt's
    tokens read from the prefix cache (``cache_read_input_tokens``), a forced tool call,
    and ``count_tokens`` equal to the prompt the chat request gets."""
    chat = _client(disagg).chat.completions.create(
        model="tiny", max_tokens=12, temperature=0.8, seed=9,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Hello " * 40}],
    )  # fmt: skip
    client = anthropic.Anthropic(base_url=disagg.base_url, api_key="none", max_retries=0)
    ask = {"model": "tiny", "max_tokens": 12, "system": "Be brief.",
           "messages": [{"role": "user", "content": "Hello " * 40}],
           "extra_body": {"seed": 9, "temperature": 0.8}}  # (the SDK's 2.x leaves sampling out)  # fmt: skip
    message = client.messages.create(**ask)
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.output_tokens == chat.usage.completion_tokens
    # the same prompt again: its tokens come from the prefix cache, as Anthropic counts them
    use = message.usage
    assert use.cache_read_input_tokens > 0
    assert use.input_tokens + use.cache_read_input_tokens == chat.usage.prompt_tokens
    with client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == message.content[0].text
    counted = client.messages.count_tokens(model="tiny", system="Be brief.",
                                           messages=ask["messages"])  # fmt: skip
    assert counted.input_tokens == chat.usage.prompt_tokens
    tools = [{"name": "paint", "input_schema": SMALL_SCHEMA}]
    called = client.messages.create(model="tiny", max_tokens=60, tools=tools,
                                    tool_choice={"type": "tool", "name": "paint"},
                                    messages=[{"role": "user", "content": "Paint."}])  # fmt: skip
    (use_block,) = called.content
    assert use_block.type == "tool_use" and use_block.input["tag"] in ("red", "green")
    assert called.stop_reason == "tool_use"


def test_stored_responses_continue_through_the_cluster(disagg):
    """``previous_response_id`` with the ``openai`` client: the second turn's seeded text
    equals the chat answer to the whole conversation, and the first turn's prompt is
    found in the prefix cache; the stored response is retrieved, its input items listed,
    and deleted; a background turn is polled until done, another streamed and streamed
    again from its third event."""
    client = _client(disagg)
    first = client.responses.create(model="tiny", input="Hello " * 40, max_output_tokens=8,
                                    temperature=0)  # fmt: skip
    second = client.responses.create(
        model="tiny", input="Tell me more.", previous_response_id=first.id,
        max_output_tokens=10, temperature=0.8, extra_body={"seed": 5},
    )  # fmt: skip
    chat = client.chat.completions.create(
        model="tiny", max_tokens=10, temperature=0.8, seed=5,
        messages=[{"role": "user", "content": "Hello " * 40},
                  {"role": "assistant", "content": first.output_text},
                  {"role": "user", "content": "Tell me more."}],
    )  # fmt: skip
    assert second.previous_response_id == first.id
    # the first turn's prompt is the second's prefix: its KV came from the prefix cache
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert client.responses.retrieve(second.id).output_text == second.output_text
    (item,) = client.responses.input_items.list(second.id).data
    assert item.type == "message" and item.content[0].text == "Tell me more."
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    # in the background: polled until done, the same seeded text
    queued = client.responses.create(
        model="tiny", input="Tell me more.", previous_response_id=second.id, background=True,
        max_output_tokens=10, temperature=0.8, extra_body={"seed": 5},
    )  # fmt: skip
    assert queued.status in ("queued", "in_progress")
    deadline = time.monotonic() + 60
    while (polled := client.responses.retrieve(queued.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    direct = client.responses.create(
        model="tiny", input="Tell me more.", previous_response_id=second.id,
        max_output_tokens=10, temperature=0.8, extra_body={"seed": 5},
    )  # fmt: skip
    assert polled.status == direct.status and polled.output_text == direct.output_text
    # in the background and streamed; streamed again from an event on (a client resuming)
    events = list(client.responses.create(
        model="tiny", input="Tell me more.", previous_response_id=second.id, background=True,
        stream=True, max_output_tokens=10, temperature=0.8, extra_body={"seed": 5},
    ))  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "queued" and events[-1].type == "response.completed"
    assert events[-1].response.output_text == direct.output_text
    resumed = list(client.responses.retrieve(events[-1].response.id, stream=True,
                                             starting_after=2))  # fmt: skip
    assert [e.sequence_number for e in resumed] == [e.sequence_number for e in events[3:]]


def test_token_in_token_out_through_the_cluster(disagg):
    """vLLM's token-in, token-out API: a rendered chat generated through the cluster is
    the chat's answer (seeded: the same tokens, the same text), whole and streamed; a
    running generation ended by ``/abort_requests`` answers ``abort`` and frees its
    workers."""
    base = disagg.base_url
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 12, "temperature": 0.8, "seed": 9, "return_token_ids": True}  # fmt: skip
    said = httpx.post(base + "/v1/chat/completions", json=chat, timeout=60).json()["choices"][0]
    rendered = httpx.post(base + "/v1/chat/completions/render", json=chat, timeout=60).json()
    whole = httpx.post(base + "/inference/v1/generate", timeout=60,
                       json={**rendered, "output_mode": "text"}).json()  # fmt: skip
    (choice,) = whole["choices"]
    assert choice["token_ids"] == said["token_ids"] and choice["text"] == said["message"]["content"]
    assert whole["usage"]["completion_tokens"] == len(said["token_ids"])
    streamed = httpx.post(base + "/inference/v1/generate", timeout=60,
                          json={**rendered, "stream": True}).text  # fmt: skip
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == said["token_ids"]
    # a long generation, ended from outside
    body = {"token_ids": rendered["token_ids"], "request_id": "endless",
            "sampling_params": {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, base + "/inference/v1/generate", json=body, timeout=120)
        time.sleep(1.0)
        ended = httpx.post(base + "/abort_requests", json={"request_ids": ["endless"]}, timeout=10)
        out = running.result().json()
    assert ended.json() == {"status": "aborted", "aborted": 1}
    assert out["choices"][0]["finish_reason"] == "abort"
    assert 0 < len(out["choices"][0]["token_ids"]) < 2000
    _wait_idle(disagg)


def test_reasoning_through_the_cluster(coupled):
    """``--reasoning-parser qwen3`` (the coupled worker): a chat whose prompt opens
    ``<think>`` (the final assistant message continued) answers the model's output as its
    ``reasoning``, the same text as a completion of the same rendered prompt, whole and
    streamed; the same chat not opened answers content, as without a parser; a choice
    held after the reasoning leaves the reasoning as free, and holds from the start
    where the prompt closed the reasoning. The vLLM flags it started with hold: both
    served names, usage forced into a stream."""
    base = coupled.base_url
    names = [m["id"] for m in httpx.get(base + "/v1/models", timeout=10).json()["data"]]
    assert names == ["tiny", "thinker"]
    hello = {"model": "thinker", "messages": [{"role": "user", "content": "Hi"}],
             "max_tokens": 3, "stream": True}  # fmt: skip
    events = httpx.post(base + "/v1/chat/completions", json=hello, timeout=60).text
    last = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")][-1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3  # (forced usage)
    opened = {"model": "tiny", "messages": [{"role": "user", "content": "Why?"},
                                            {"role": "assistant", "content": "<think>\n"}],
              "add_generation_prompt": False, "continue_final_message": True,
              "max_tokens": 8, "temperature": 0, "ignore_eos": True}  # fmt: skip
    ids = httpx.post(base + "/tokenize", json=opened, timeout=60).json()["tokens"]
    raw = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
    }).json()["choices"][0]["text"]  # fmt: skip
    assert "</think>" not in raw
    message = httpx.post(base + "/v1/chat/completions", json=opened, timeout=60).json()
    message = message["choices"][0]["message"]
    assert message["reasoning"] == raw and message["content"] is None
    streamed = httpx.post(base + "/v1/chat/completions", json={**opened, "stream": True},
                          timeout=60).text  # fmt: skip
    deltas = [json.loads(line[6:])["choices"] for line in streamed.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert "".join(c[0]["delta"].get("reasoning", "") for c in deltas if c) == raw
    plain = {**opened, "messages": [{"role": "user", "content": "Why?"}],
             "add_generation_prompt": True, "continue_final_message": False}  # fmt: skip
    said = httpx.post(base + "/v1/chat/completions", json=plain, timeout=60).json()
    assert "reasoning" not in said["choices"][0]["message"]
    assert said["choices"][0]["message"]["content"]
    # a structured output holds after the reasoning: the reasoning as free as before ...
    choices = {"choice": ["yes", "no"]}
    held = {**opened, "structured_outputs": choices}
    message = httpx.post(base + "/v1/chat/completions", json=held, timeout=60).json()
    assert message["choices"][0]["message"]["reasoning"] == raw
    # ... and where the prompt closed it (as Qwen3's template without thinking), the
    # choice holds from the start
    closed = [{"role": "user", "content": "Why?"},
              {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]  # fmt: skip
    said = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        **held, "messages": closed, "max_tokens": 30}).json()  # fmt: skip
    assert said["choices"][0]["message"]["content"] in choices["choice"], said["choices"]
    assert "reasoning" not in said["choices"][0]["message"]
    # a thinking budget: the worker's engine ends the reasoning after 4 tokens (the
    # prompt's one after <think> counts), and the rest of the answer is its content
    budgeted = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        **opened, "max_tokens": 16, "thinking_token_budget": 4}).json()  # fmt: skip
    message, usage = budgeted["choices"][0]["message"], budgeted["usage"]
    assert raw.startswith(message["reasoning"]) and message["content"], message
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 3, usage


def test_sglangs_generate_through_the_cluster(disagg):
    """SGLang's native ``/generate``: greedy text and ids equal to the same completion's,
    streamed cumulatively to the same text, the prompt's log-probabilities from
    ``logprob_start_len`` (the first token's null), a prompt scored alone
    (``max_new_tokens`` 0, as RL trainers score), and a batch whose prompts differ in
    options."""
    base = disagg.base_url
    completion = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 8, "temperature": 0,
                  "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    ref = httpx.post(base + "/v1/completions", json=completion, timeout=60).json()["choices"][0]
    body = {"text": PROMPTS[2],
            "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    out = httpx.post(base + "/generate", json=body, timeout=60).json()
    assert out["text"] == ref["text"] and out["output_ids"] == ref["token_ids"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    streamed = httpx.post(base + "/generate", json={**body, "stream": True}, timeout=60).text
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["text"] == ref["text"] and chunks[-1]["output_ids"] == ref["token_ids"]
    scored = {"input_ids": ref["prompt_token_ids"], "return_logprob": True,
              "logprob_start_len": 0, "top_logprobs_num": 1,
              "sampling_params": {"max_new_tokens": 0}}  # fmt: skip
    meta = httpx.post(base + "/generate", json=scored, timeout=60).json()["meta_info"]
    prompt = meta["input_token_logprobs"]
    assert [t for _, t, _ in prompt] == ref["prompt_token_ids"] and prompt[0][0] is None
    assert all(lp <= 0 for lp, _, _ in prompt[1:]) and meta["output_token_logprobs"] == []
    # a batch whose prompts have their own sampling_params: each its own completion's
    mixed = {"text": [PROMPTS[2], PROMPTS[0]],
             "sampling_params": [body["sampling_params"], {**body["sampling_params"],
                                                           "max_new_tokens": 3}]}  # fmt: skip
    first, second = httpx.post(base + "/generate", json=mixed, timeout=60).json()
    assert (first["index"], first["output_ids"]) == (0, ref["token_ids"])
    short = httpx.post(base + "/v1/completions", timeout=60,
                       json={**completion, "prompt": PROMPTS[0], "max_tokens": 3}).json()  # fmt: skip
    assert (second["index"], second["output_ids"]) == (1, short["choices"][0]["token_ids"])
    info = httpx.get(base + "/server_info", timeout=60).json()  # (its benchmarks read it)
    (state,) = info["internal_states"]  # the decode worker's
    assert state["role"] == "decode" and state["memory_usage"]["token_capacity"] > 0
    assert state["effective_max_running_requests_per_dp"] == info["max_running_requests"] > 0
    assert info["disaggregation_mode"] == "decode" and info["context_length"] > 0
    deep = httpx.get(base + "/health_generate", timeout=60)  # (SGLang's router polls it)
    assert deep.status_code == 200


def test_batched_chat_completions_through_the_cluster(disagg):
    """vLLM's ``/v1/chat/completions/batch``: each conversation's choice is what the same
    chat request answers alone (greedy), in the batch's order."""
    conversations = [[{"role": "user", "content": "Hello"}],
                     [{"role": "user", "content": "1 2 3 4"}]]  # fmt: skip
    common = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    alone = [httpx.post(disagg.base_url + "/v1/chat/completions", timeout=60,
                        json={**common, "messages": c}).json() for c in conversations]  # fmt: skip
    batch = httpx.post(disagg.base_url + "/v1/chat/completions/batch", timeout=60,
                       json={**common, "messages": conversations}).json()  # fmt: skip
    assert [c["message"]["content"] for c in batch["choices"]] == [
        a["choices"][0]["message"]["content"] for a in alone
    ]
    assert batch["usage"]["completion_tokens"] == sum(
        a["usage"]["completion_tokens"] for a in alone
    )
