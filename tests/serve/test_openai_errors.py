"""Every error is OpenAI-shaped, also those raised before a route runs (404, 405, 400 for
bodies); ``/v1/models/{id}``, ``/version``; the limits ``/v1/models`` advertises are the
enforced ones; a model without a chat template answers 400."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.serve.test_gateway_fuzz import EchoBackend


@pytest.fixture(scope="module")
def client(gateways):
    with TestClient(gateways.app(EchoBackend(), "echo"), raise_server_exceptions=False) as c:
        yield c


def _error(reply, status: int) -> dict:
    assert reply.status_code == status, reply.text
    body = reply.json()
    assert set(body) == {"error"}, body  # never FastAPI's {"detail": ...}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return body["error"]


def test_unknown_path_is_an_openai_404(client):
    err = _error(client.get("/v1/nothing-here"), 404)
    assert err["type"] == "NotFoundError" and "/v1/nothing-here" in err["message"]


def test_wrong_method_is_an_openai_405_with_allow(client):
    reply = client.delete("/v1/models")
    err = _error(reply, 405)
    assert err["type"] == "MethodNotAllowed"
    assert reply.headers["allow"] == "GET"
    assert "POST" in client.get("/v1/completions").headers["allow"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"model": "echo", "prompt": "hi", "temperature": 5}, "temperature"),
        ({"model": "echo", "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"prompt": "hi"}, "model"),
        ({"model": "echo"}, "prompt"),
    ],
)
def test_invalid_completion_names_the_field(client, body, param):
    err = _error(client.post("/v1/completions", json=body), 400)
    assert err["param"] == param and err["message"].startswith(f"{param}:")


def test_invalid_chat_message_names_the_message_field(client):
    body = {"model": "echo", "messages": [{"role": "user", "content": 3}]}
    err = _error(client.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "messages.[0].content"  # not pydantic's union member (".str")
    assert _error(client.post("/v1/chat/completions", json={"model": "echo", "messages": []}),
                  400)["param"] == "messages"  # fmt: skip


@pytest.mark.parametrize(
    "content,message",
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"), (b"", "required")],
)
def test_bodies_that_are_not_json_objects_are_400(client, content, message):
    headers = {"content-type": "application/json"}
    err = _error(client.post("/v1/completions", content=content, headers=headers), 400)
    assert message in err["message"] and err["type"] == "BadRequestError"


def test_models_retrieve_and_version(client):
    card = client.get("/v1/models/echo").json()
    assert card == client.get("/v1/models").json()["data"][0]
    assert card["id"] == "echo" and card["object"] == "model"
    err = _error(client.get("/v1/models/org/other"), 404)
    assert "'org/other'" in err["message"]
    import halfmoon

    assert client.get("/version").json() == {"version": halfmoon.__version__}


def test_the_advertised_limits_are_enforced(gateways):
    """No hidden cap: ``max_tokens`` may go up to ``max_model_len`` unless a smaller
    ``max_tokens_limit`` is set, and /v1/models says which."""
    with TestClient(gateways.app(EchoBackend(), "m", max_model_len=200)) as c:
        card = c.get("/v1/models/m").json()
        assert card["max_model_len"] == card["max_tokens_limit"] == 200
        ok = c.post("/v1/completions", json={"model": "m", "prompt": [5], "max_tokens": 199})
        assert ok.status_code == 200, ok.text
        too_long = c.post(
            "/v1/completions", json={"model": "m", "prompt": [5, 6], "max_tokens": 199}
        )
        assert "maximum context length is 200" in _error(too_long, 400)["message"]
    with TestClient(gateways.app(EchoBackend(), "m", max_model_len=200, max_tokens_limit=8)) as c:
        assert c.get("/v1/models").json()["data"][0]["max_tokens_limit"] == 8
        reply = c.post("/v1/completions", json={"model": "m", "prompt": [5], "max_tokens": 9})
        assert "limit of 8" in _error(reply, 400)["message"]


def test_a_model_without_chat_template_is_a_400():
    from halfmoon.engine.tokenizer import Tokenizer, build_preset_tokenizer
    from halfmoon.serve.gateway.app import GatewayConfig, create_app

    tok = Tokenizer(build_preset_tokenizer(512), {})  # no chat template
    app = create_app(EchoBackend(), tok, GatewayConfig("m", 64))
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(app, raise_server_exceptions=False) as c:
        err = _error(c.post("/v1/chat/completions", json=body), 400)
        assert "--chat-template" in err["message"]
        assert "--chat-template" in _error(c.post("/tokenize", json=body), 400)["message"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"model": "echo", "prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
        ("/v1/chat/completions", {"model": "echo", "max_completion_tokens": 10**6,
                                  "messages": [{"role": "user", "content": "hi"}]},
         "max_completion_tokens"),
        ("/v1/completions", {"model": "other", "prompt": "hi"}, "model"),
        ("/v1/completions", {"model": "echo", "prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"model": "echo", "prompt": "hi", "logit_bias": {"x": 1}},
         "logit_bias"),
        ("/v1/completions", {"model": "echo", "prompt": "hi", "best_of": 3}, "best_of"),
    ],
)  # fmt: skip
def test_the_gateways_own_refusals_name_the_field(client, path, body, param):
    status = 404 if param == "model" else 400
    assert _error(client.post(path, json=body), status)["param"] == param
