"""The OpenAPI schema says what the server does (400 not 422, errors documented, response
bodies described, /metrics as text, SSE) and /docs, /redoc load nothing from outside."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from tests.serve.test_gateway_fuzz import EchoBackend

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
ANTHROPIC_ERROR_REF = {"$ref": "#/components/schemas/AnthropicErrorResponse"}


@pytest.fixture(scope="module")
def client(gateways):
    with TestClient(gateways.app(EchoBackend(), "echo", max_tokens_limit=32)) as c:
        yield c


@pytest.fixture(scope="module")
def schema(client):
    return client.get("/openapi.json").json()


def _ops(schema):
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            yield path, method, op


def test_no_fastapi_422_anywhere(schema):
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path, method, op in _ops(schema):
        assert "422" not in op["responses"], (path, method)
        if "requestBody" in op:
            bad = op["responses"]["400"]["content"]["application/json"]["schema"]
            anthropic = path.startswith("/v1/messages")  # Anthropic's Messages API: its shape
            assert bad == (ANTHROPIC_ERROR_REF if anthropic else ERROR_REF), (path, method)


def test_errors_and_bodies_are_documented(schema):
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "429", "503"} <= set(completions)
    ok = completions["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/CompletionResponse"}
    assert "text/event-stream" in ok
    for path, body in [("/v1/models", "ModelList"), ("/v1/models/{model}", "ModelCard"),
                       ("/version", "VersionResponse"), ("/health", "HealthResponse"),
                       ("/tokenize", "TokenizeResponse"), ("/detokenize", "DetokenizeResponse"),
                       ("/v1/chat/completions", "ChatCompletionResponse"),
                       ("/v1/responses/{response_id}", "ResponseObject"),
                       ("/v1/responses/{response_id}/input_items", "InputItemList"),
                       ("/v1/messages", "MessageObject"),
                       ("/v1/messages/count_tokens", "TokenCount")]:  # fmt: skip
        op = next(iter(schema["paths"][path].values()))
        got = op["responses"]["200"]["content"]["application/json"]["schema"]
        assert got == {"$ref": f"#/components/schemas/{body}"}, path
    assert "404" in schema["paths"]["/v1/models/{model}"]["get"]["responses"]
    stored = schema["paths"]["/v1/responses/{response_id}"]
    assert "404" in stored["get"]["responses"] and "404" in stored["delete"]["responses"]
    deleted = stored["delete"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert deleted == {"$ref": "#/components/schemas/ResponseDeleted"}
    assert "503" in schema["paths"]["/health"]["get"]["responses"]
    metrics = schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]


def test_requests_pin_the_model_and_cap_max_tokens(schema):
    schemas = schema["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["model"]["enum"] == ["echo"]
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["maximum"] == 32
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["model"]["enum"] == ["echo"]
    max_completion = chat["max_completion_tokens"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "maximum": 32} in max_completion
    tokenize_model = schemas["TokenizeRequest"]["properties"]["model"]["anyOf"]
    assert {"enum": ["echo"], "type": "string"} in tokenize_model
    token_ids = schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]
    assert token_ids == {"type": "integer", "minimum": 0, "maximum": 511}  # the vocabulary


def test_401_documented_only_with_api_keys(gateways, schema):
    assert all("401" not in op["responses"] for _, _, op in _ops(schema))
    app = gateways.app(EchoBackend(), "echo", api_key="k", public=("docs",))
    with TestClient(app) as c:
        keyed = c.get("/openapi.json").json()
    assert "401" in keyed["paths"]["/v1/completions"]["post"]["responses"]
    assert "401" not in keyed["paths"]["/health"]["get"]["responses"]
    assert keyed["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_load_only_local_assets(client, page):
    html = client.get(page).text
    assert not re.search(r"https?://", html), html
    assets = re.findall(r'(?:src|href)="(/[^"]+)"', html)
    assert any(a.endswith(".js") for a in assets)
    for asset in assets:
        reply = client.get(asset)
        assert reply.status_code == 200 and len(reply.content) > 1000, asset


def test_docs_assets_follow_the_docs_access(gateways):
    """With an API key, the assets are public exactly when /docs is."""
    asset = "/docs/assets/swagger-ui-bundle.js"
    with TestClient(gateways.app(EchoBackend(), "echo", api_key="k")) as c:
        assert c.get("/docs").status_code == 401 and c.get(asset).status_code == 401
    with TestClient(gateways.app(EchoBackend(), "echo", api_key="k", public=("docs",))) as c:
        assert c.get("/docs").status_code == 200 and c.get(asset).status_code == 200
