"""Request ids a client chooses (halfmoon.serve.gateway.request_ids): ``X-Request-Id`` or
``request_id`` name the response as on vLLM, the cluster keeps ids of its own, and
``--enable-request-id-headers`` puts the id on every response. In-process (ASGI)."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from halfmoon.serve.gateway.access_log import ACCESS_LOGGER
from tests.serve.fakes import RecordingBackend


@pytest.fixture(scope="module")
def served(gateways):
    backend = RecordingBackend()
    with TestClient(gateways.app(backend, "m", request_id_headers=True)) as c:
        yield c, backend


@pytest.fixture(scope="module")
def plain(gateways):
    with TestClient(gateways.app(RecordingBackend(), "m")) as c:
        yield c


COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 2}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_the_header_names_the_response_and_comes_back(served):
    client, backend = served
    r = client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "trace-7"})
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cmpl-trace-7"
    assert r.headers["x-request-id"] == "trace-7"
    assert backend.request_ids[-1] != "trace-7"  # the cluster's own id, unique


def test_the_body_field_names_a_chat_and_the_header_wins_over_it(served):
    client, _ = served
    r = client.post("/v1/chat/completions", json={**CHAT, "request_id": "body-1"})
    assert (r.json()["id"], r.headers["x-request-id"]) == ("chatcmpl-body-1", "chatcmpl-body-1")
    r = client.post("/v1/chat/completions", json={**CHAT, "request_id": "body-1"},
                    headers={"X-Request-Id": "head-1"})  # fmt: skip
    assert (r.json()["id"], r.headers["x-request-id"]) == ("chatcmpl-head-1", "head-1")


def test_two_clients_may_choose_the_same_id(served):
    client, backend = served
    for _ in range(2):
        r = client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "same"})
        assert r.json()["id"] == "cmpl-same"
    assert backend.request_ids[-1] != backend.request_ids[-2]


def test_every_streamed_chunk_and_every_choice_carries_the_id(served):
    client, _ = served
    body = {**COMPLETION, "n": 2, "stream": True, "max_tokens": 3}
    r = client.post("/v1/completions", json=body, headers={"X-Request-Id": "s-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "s-1"
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert len(chunks) >= 6 and {c["id"] for c in chunks} == {"cmpl-s-1"}
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}


def test_without_a_client_id_the_header_is_the_response_s_id(served):
    client, _ = served
    r = client.post("/v1/completions", json=COMPLETION)
    assert r.headers["x-request-id"] == r.json()["id"]
    ids = {client.get("/health").headers["x-request-id"] for _ in range(2)}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)  # fresh ones


def test_refusals_carry_the_header_too(served):
    client, _ = served
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "a"},
                    headers={"X-Request-Id": "bad-model"})  # fmt: skip
    assert (r.status_code, r.headers["x-request-id"]) == (404, "bad-model")


@pytest.mark.parametrize(
    "headers,body,message",
    [
        ({"X-Request-Id": "x" * 257}, {}, "X-Request-Id header must have 1 to 256"),
        ({}, {"request_id": ""}, "request_id must have 1 to 256"),
        ({}, {"request_id": "tab\there"}, "request_id must be printable ASCII"),
        ({}, {"request_id": "caf\u00e9"}, "request_id must be printable ASCII"),
    ],
)
def test_odd_ids_are_refused_with_a_400_that_names_them(served, headers, body, message):
    client, _ = served
    r = client.post("/v1/completions", json={**COMPLETION, **body}, headers=headers)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_without_the_option_no_header_but_the_id_still_names_the_response(plain):
    r = plain.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "t-2"})
    assert r.json()["id"] == "cmpl-t-2" and "x-request-id" not in r.headers
    assert "x-request-id" not in plain.post("/v1/completions", json=COMPLETION).headers


def test_the_access_line_names_both_ids(served, caplog):
    client, backend = served
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    client.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "log-1"})
    r = client.post("/v1/completions", json=COMPLETION)
    lines = [x.getMessage() for x in caplog.records if x.name == ACCESS_LOGGER]
    assert lines[0].endswith(f" id=cmpl-log-1 internal_id={backend.request_ids[-2]}")
    assert lines[1].endswith(f" id={r.json()['id']}")
