"""Sampling defaults from the served model (halfmoon.serve.gateway.generation): read from
its generation_config.json, overridden, checked, and given to the requests that leave an
option out, in-process over a backend that records what it was asked."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from halfmoon.cli import build_parser, main
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.serve.gateway.backend import GenerationChunk
from halfmoon.serve.gateway.generation import (
    defaults_from_args,
    describe,
    generation_defaults,
    parse_override,
    startup_line,
)


class RecordingBackend:
    """Generates one token per request and keeps every request's sampling parameters."""

    def __init__(self) -> None:
        self.params: list[SamplingParams] = []

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.params.append(params)
        yield GenerationChunk((65,), "length", 0)

    async def abort(self, request_id: str) -> None:
        return None

    async def health(self) -> dict[str, Any]:
        return {"mode": "recording"}


def _model_dir(tmp_path: Path, config: dict[str, Any]) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_models_sampling_fields_are_read_and_overridden(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, {"eos_token_id": [2], "temperature": 0.6, "top_p": 0.9,
                                  "top_k": -1, "max_new_tokens": 64, "do_sample": True})  # fmt: skip
    assert generation_defaults(model) == {
        "temperature": 0.6, "top_p": 0.9, "top_k": 0, "max_new_tokens": 64,
    }  # fmt: skip
    assert generation_defaults(model, "vllm") == {}  # the API's own defaults
    override = parse_override('{"temperature": 0.2, "repetition_penalty": 1.1}')
    assert generation_defaults(model, "vllm", override) == override
    assert generation_defaults(model, "auto", override)["temperature"] == 0.2
    assert generation_defaults(tmp_path / "none") == {}  # no file: no defaults
    assert describe({"temperature": 0.2, "top_p": 0.9}) == "temperature 0.2, top_p 0.9"
    line = startup_line({"temperature": 0.2}, "auto")
    assert "temperature 0.2" in line and "override" not in line
    assert "none" in startup_line({}, "vllm")
    assert "with --override-generation-config" in startup_line({"top_k": 5}, "vllm", True)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"temperature": 3.0}, "temperature must be at least 0.0 and at most 2.0"),
        ({"top_p": 0}, "top_p must be above 0.0"),
        ({"top_k": 1.5}, "top_k must be a whole number"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
    ],
)
def test_bad_values_name_the_field_and_the_file(tmp_path: Path, config, message) -> None:
    model = _model_dir(tmp_path, config)
    with pytest.raises(HalfmoonError, match=message) as caught:
        generation_defaults(model)
    assert "generation_config.json" in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{temperature: 1}", "is not JSON"),
        ("[0.5]", "must be a JSON object"),
        ('{"temp": 0.5}', "unknown fields \\['temp'\\]"),
        ('{"top_p": 2}', "top_p must be above 0.0 and at most 1.0"),
    ],
)
def test_a_bad_override_is_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(HalfmoonError, match=message):
        parse_override(text)


def test_serves_options_give_the_defaults(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, {"temperature": 0.6, "top_p": 0.9})
    args = build_parser().parse_args(["serve", "--override-generation-config", '{"top_k": 5}'])
    assert defaults_from_args(args, model) == {"temperature": 0.6, "top_p": 0.9, "top_k": 5}
    args = build_parser().parse_args(["serve", "--generation-config", "vllm"])
    assert defaults_from_args(args, model) == {}


def test_serve_refuses_a_bad_override_before_starting_anything(capsys) -> None:
    code = main(["serve", "--model", "tiny", "--override-generation-config", '{"temp": 1}'])
    assert code != 0
    err = capsys.readouterr().err
    assert "--override-generation-config: unknown fields ['temp']" in err


@pytest.fixture
def served(gateways):
    backend = RecordingBackend()
    defaults = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1}
    app = gateways.app(backend, "m", max_model_len=256, sampling_defaults=defaults)
    with TestClient(app) as client:
        yield client, backend


def _chat(client: TestClient, **extra: Any) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_request_that_leaves_options_out_gets_the_models(served) -> None:
    client, backend = served
    _chat(client)
    p = backend.params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.2, 0.9, 40, 1.1)
    assert (p.presence_penalty, p.frequency_penalty) == (0.0, 0.0)  # no default: the API's
    client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert backend.params[-1].temperature == 0.2  # completions too


def test_an_option_the_request_sets_is_its_own_even_at_the_apis_default(served) -> None:
    client, backend = served
    _chat(client, temperature=1.0, top_p=1.0, top_k=0)
    p = backend.params[-1]
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, 0, 1.1)
    _chat(client, temperature=0)  # greedy, as asked
    assert backend.params[-1].temperature == 0.0


def test_a_chat_without_an_output_limit_runs_to_the_end_of_the_context(gateways) -> None:
    """As vLLM: the rest of the served context, or the model's max_new_tokens; a
    completion keeps the API's 16."""
    backend = RecordingBackend()
    with TestClient(gateways.app(backend, "m", max_model_len=256)) as client:
        _chat(client)
        prompt = client.post("/tokenize", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}]}).json()["count"]  # fmt: skip
        assert backend.params[-1].max_tokens == 256 - prompt
        _chat(client, max_tokens=5)
        assert backend.params[-1].max_tokens == 5
        client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
        assert backend.params[-1].max_tokens == 16
    app = gateways.app(backend, "m", max_model_len=256, max_tokens_limit=32,
                       sampling_defaults={"max_new_tokens": 100})  # fmt: skip
    with TestClient(app) as client:
        _chat(client)
        assert backend.params[-1].max_tokens == 32  # the server's limit is lower
    app = gateways.app(backend, "m", max_model_len=256, max_tokens_limit=8)
    with TestClient(app) as client:  # a completion's default of 16, within the limit
        assert (
            client.post("/v1/completions", json={"model": "m", "prompt": "hi"}).status_code == 200
        )
        assert backend.params[-1].max_tokens == 8
        asked = client.post(
            "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 16}
        )
        assert asked.status_code == 400 and "limit of 8" in asked.text  # (asked for: refused)
    app = gateways.app(backend, "m", max_model_len=256, sampling_defaults={"max_new_tokens": 8})
    with TestClient(app) as client:
        _chat(client)
        assert backend.params[-1].max_tokens == 8
