"""``halfmoon serve --mode coupled`` end to end, with the official openai client."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

import openai
import pytest

from .conftest import alive, children_of, processes_mentioning


@pytest.fixture(scope="module")
def coupled(cluster_factory):
    return cluster_factory("--mode", "coupled", "--instances", "1", "--kv-cache-mb", "64")


def _client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)


def _post(cluster, path, body):
    req = urllib.request.Request(
        cluster.base_url + path, data=body if isinstance(body, bytes) else json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_completions_and_chat(coupled):
    client = _client(coupled)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    out = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6,
                                    temperature=0)  # fmt: skip
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6
    again = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6,
                                      temperature=0)  # fmt: skip
    assert again.choices[0].text == out.choices[0].text  # greedy is deterministic
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 4


def test_streaming_matches_non_streaming(coupled):
    client = _client(coupled)
    full = client.completions.create(model="tiny", prompt="stream me", max_tokens=8,
                                     temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    pieces, usage = [], None
    for chunk in client.completions.create(
        model="tiny", prompt="stream me", max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ):  # fmt: skip
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == full.choices[0].text
    assert usage.completion_tokens == 8


@pytest.mark.parametrize(
    "body,status,fragment",
    [
        (b"{not json", 400, ""),
        ({"model": "nope", "prompt": "x"}, 404, "does not exist"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 10**6}, 400, "limit"),
        ({"model": "tiny", "prompt": [10**9]}, 400, "token ids"),
        ({"model": "tiny", "messages": []}, 400, "messages"),
    ],
)
def test_bad_input_is_a_clear_4xx(coupled, body, status, fragment):
    path = (
        "/v1/chat/completions"
        if isinstance(body, dict) and "messages" in body
        else "/v1/completions"
    )
    code, reply = _post(coupled, path, body)
    assert code == status, reply
    assert fragment in reply["error"]["message"]


def test_metrics_and_health(coupled):
    with urllib.request.urlopen(coupled.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert "halfmoon:time_to_first_token_seconds_count" in text
    assert "halfmoon:prefix_cache_queries_total" in text
    decisions = re.search(
        r'^halfmoon:conductor_decision_seconds_count\{[^}]*role="gateway"[^}]*\} ([0-9.e+]+)$',
        text, re.M,
    )  # fmt: skip
    assert decisions and float(decisions.group(1)) > 0  # timed by the Conductor itself
    assert "halfmoon:conductor_rtt_seconds_count" in text


def test_stop_leaves_no_process(cluster_factory):
    cluster = cluster_factory("--mode", "coupled", "--instances", "1", "--kv-cache-mb", "32")
    children = children_of(cluster.proc.pid)
    assert len(children) == 2  # conductor + worker
    cluster.proc.terminate()
    cluster.proc.wait(30)
    assert [pid for pid in children if alive(pid)] == []
    assert processes_mentioning(str(cluster.cache)) == []


def test_cache_salt_isolates_the_coupled_cache(coupled):
    client = _client(coupled)
    prompt = " ".join(f"coupled{i}" for i in range(200))

    def cached(**extra):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=2,
                                        temperature=0, extra_body=extra)  # fmt: skip
        return out.usage.prompt_tokens_details.cached_tokens, out.usage.prompt_tokens

    assert cached(cache_salt="a")[0] == 0
    hit, prompt_tokens = cached(cache_salt="a")
    assert hit >= prompt_tokens - 32
    assert cached(cache_salt="b")[0] == 0
    assert cached()[0] == 0
