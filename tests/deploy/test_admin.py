"""The gateway's /admin routes: API key required, validation, errors as 4xx."""

import pytest
from fastapi.testclient import TestClient

from halfmoon.core.errors import HalfmoonError
from halfmoon.deploy.admin import admin_router


class NoBackend:
    """The admin routes never generate."""

    async def generate(self, request_id, prompt_token_ids, params):
        raise AssertionError("admin routes must not generate")
        yield

    async def abort(self, request_id: str) -> None:
        raise AssertionError("nothing to abort")

    async def health(self) -> dict:
        return {"mode": "none"}


class FakeController:
    def __init__(self) -> None:
        self.calls: list[dict] = []

    async def scale(self, targets: dict) -> dict:
        if targets.get("coupled"):
            raise HalfmoonError("a disaggregated deployment has no coupled pool")
        self.calls.append(targets)
        return {"added": [], "draining": ["decode-1"], "sizes": targets}

    async def status(self) -> dict:
        return {"sizes": {"prefill": 1, "decode": 1}}


def _client(api_key: str | None) -> tuple[TestClient, FakeController]:
    from halfmoon.engine.tokenizer import Tokenizer, build_preset_tokenizer, preset_tokenizer_config
    from halfmoon.serve.gateway.app import GatewayConfig, create_app

    tok = Tokenizer(build_preset_tokenizer(512), preset_tokenizer_config(256))
    ctl = FakeController()
    app = create_app(NoBackend(), tok, GatewayConfig("echo", 256, api_key=api_key),
                     [admin_router(ctl.scale, ctl.status)])  # fmt: skip
    return TestClient(app), ctl


def test_scale_needs_the_api_key():
    client, ctl = _client("sekret")
    assert client.post("/admin/scale", json={"decode": 1}).status_code == 401
    bad = client.post("/admin/scale", json={"decode": 1}, headers={"Authorization": "Bearer x"})
    assert bad.status_code == 401
    ok = client.post("/admin/scale", json={"decode": 1, "prefill": 2},
                     headers={"Authorization": "Bearer sekret"})  # fmt: skip
    assert ok.status_code == 200 and ok.json()["draining"] == ["decode-1"]
    assert ctl.calls == [{"prefill": 2, "decode": 1}]
    status = client.get("/admin/status", headers={"Authorization": "Bearer sekret"})
    assert status.json() == {"sizes": {"prefill": 1, "decode": 1}}


def test_admin_is_refused_without_a_configured_key():
    client, ctl = _client(None)
    reply = client.post("/admin/scale", json={"decode": 1})
    assert reply.status_code == 403 and "api key" in reply.json()["error"]["message"].lower()
    assert ctl.calls == []


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "at least one pool"),
        ({"decode": 0}, "decode"),
        ({"decode": "many"}, "decode"),
        ({"gpus": 3}, "gpus"),
        ({"instances": 2}, "no coupled pool"),
    ],
)
def test_bad_scale_bodies_are_400(body, message):
    client, ctl = _client("k")
    reply = client.post("/admin/scale", json=body, headers={"Authorization": "Bearer k"})
    assert reply.status_code == 400, reply.text
    assert message in reply.json()["error"]["message"]
    assert ctl.calls == []
