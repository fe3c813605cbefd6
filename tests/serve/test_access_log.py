"""The gateway's access log: one INFO line per request, with its tokens, TTFT and total
time (halfmoon.serve.gateway.access_log). In-process (ASGI) over a backend that waits
``FIRST_TOKEN_S`` before its first tokens."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from halfmoon.core.request import SamplingParams
from halfmoon.serve.gateway.access_log import ACCESS_LOGGER, RequestRecord, access_line
from halfmoon.serve.gateway.backend import GenerationChunk, Rejected

FIRST_TOKEN_S = 0.05
LINE = re.compile(
    r'^testclient:\d+ "(?P<method>\w+) (?P<path>\S+)" (?P<status>\d+) '
    r"prompt_tokens=(?P<prompt>\d+|-) completion_tokens=(?P<completion>\d+|-) "
    r"ttft=(?P<ttft>[0-9.]+s|-) total=(?P<total>[0-9.]+)s(?P<tail>.*)$"
)


class SlowBackend:
    """Emits token 65 ``max_tokens`` times, two per chunk, the first after FIRST_TOKEN_S;
    a prompt starting with token id 7 is rejected."""

    def __init__(self) -> None:
        self.aborted: list[str] = []  # request ids the gateway aborted

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        if prompt_token_ids[0] == 7:
            raise Rejected("busy", 2.0)
        await asyncio.sleep(FIRST_TOKEN_S)
        for i in range(0, params.max_tokens, 2):
            n = min(2, params.max_tokens - i)
            last = i + n >= params.max_tokens
            yield GenerationChunk((65,) * n, "length" if last else None, 0 if i == 0 else None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> dict[str, Any]:
        return {"mode": "slow"}


@pytest.fixture(scope="module")
def client(gateways):
    with TestClient(gateways.app(SlowBackend(), "m")) as c:
        yield c


def _lines(caplog) -> list[dict[str, str]]:
    """The access lines logged at INFO, parsed (each must parse)."""
    out = []
    for record in caplog.records:
        if record.name == ACCESS_LOGGER and record.levelno == logging.INFO:
            match = LINE.match(record.getMessage())
            assert match, record.getMessage()
            out.append(match.groupdict())
    return out


def _seconds(value: str) -> float:
    return float(value.rstrip("s"))


def test_a_completion_logs_its_tokens_ttft_and_total(client, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    body = client.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 5})
    assert body.status_code == 200
    use = body.json()["usage"]
    (line,) = _lines(caplog)
    assert (line["method"], line["path"], line["status"]) == ("POST", "/v1/completions", "200")
    assert int(line["prompt"]) == use["prompt_tokens"] > 0
    assert int(line["completion"]) == use["completion_tokens"] == 5
    assert FIRST_TOKEN_S <= _seconds(line["ttft"]) <= _seconds(line["total"])
    assert line["tail"] == f" id={body.json()['id']}"  # the id the answer went out under


def test_a_streamed_chat_is_logged_once_when_it_ends(client, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    body = {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")
    events = [json.loads(e[6:]) for e in response.text.split("\n\n") if e.startswith("data: {")]
    use = events[-1]["usage"]
    (line,) = _lines(caplog)
    assert (line["path"], line["status"]) == ("/v1/chat/completions", "200")
    assert (int(line["prompt"]), int(line["completion"])) == (use["prompt_tokens"], 6)
    assert FIRST_TOKEN_S <= _seconds(line["ttft"]) <= _seconds(line["total"])


def test_n_choices_count_the_prompt_once_and_every_choice_s_tokens(client, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    body = {"model": "m", "prompt": "hello", "max_tokens": 3, "n": 2}
    use = client.post("/v1/completions", json=body).json()["usage"]
    (line,) = _lines(caplog)
    assert int(line["prompt"]) == use["prompt_tokens"]
    assert int(line["completion"]) == use["completion_tokens"] == 6


def test_bad_input_and_refusals_are_logged_with_their_status(client, caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    assert client.post("/v1/completions", json={"model": "m", "max_tokens": 3}).status_code == 400
    assert client.post("/v1/completions", json={"model": "x", "prompt": "a"}).status_code == 404
    refused = client.post("/v1/completions", json={"model": "m", "prompt": [7, 8]})
    assert refused.status_code == 429
    lines = _lines(caplog)
    assert [line["status"] for line in lines] == ["400", "404", "429"]
    for line in lines:
        assert (line["prompt"], line["completion"], line["ttft"]) == ("-", "-", "-")
        assert 0 <= _seconds(line["total"]) < 5


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/invocations", {"model": "m", "prompt": "hello", "max_tokens": 3}),
        ("/inference/v1/generate", {"token_ids": [5, 6], "sampling_params": {"max_tokens": 3}}),
        ("/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}}),
    ],
)
def test_every_generation_route_logs_at_info(client, caplog, path, body):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    assert client.post(path, json=body).status_code == 200
    (line,) = _lines(caplog)
    assert line["path"] == path and line["completion"] == "3"


def test_polling_paths_log_at_debug_only(client, caplog):
    caplog.set_level(logging.DEBUG, logger=ACCESS_LOGGER)
    assert client.get("/health").status_code == 200
    assert _lines(caplog) == []
    (debug,) = [r for r in caplog.records if r.name == ACCESS_LOGGER]
    assert debug.levelno == logging.DEBUG and '"GET /health" 200' in debug.getMessage()


def test_the_option_turns_the_log_off(gateways, caplog):
    caplog.set_level(logging.DEBUG, logger=ACCESS_LOGGER)
    with TestClient(gateways.app(SlowBackend(), "m", access_log=False)) as quiet:
        body = {"model": "m", "prompt": "hello", "max_tokens": 2}
        assert quiet.post("/v1/completions", json=body).status_code == 200
        assert quiet.post("/v1/completions", json={"model": "m"}).status_code == 400
    assert [r for r in caplog.records if r.name == ACCESS_LOGGER] == []


def test_a_stream_left_early_says_so():
    record = RequestRecord(start_s=10.0, status=200)
    record.add_generation(12, 3, 0.25)
    assert access_line("GET", "/v1/x", "1.2.3.4:5", record, 11.0) == (
        '1.2.3.4:5 "GET /v1/x" 200 prompt_tokens=12 completion_tokens=3 ttft=0.250s '
        "total=1.000s (disconnected)"
    )
