"""Per-tenant prefix-cache isolation at the gateway: a request's ``cache_salt`` and
``--cache-salt-from-api-key``.

In-process (ASGI) over a backend that runs one real engine (tiny preset), so
``cached_tokens`` comes from the engine's own prefix cache; the cluster path (Conductor,
prefill and decode workers, their stores) is covered in tests/e2e.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from halfmoon.core.request import SamplingParams
from halfmoon.serve.gateway.backend import GenerationChunk

#: Long enough for several 16-token blocks with the byte-level test tokenizer.
SYSTEM = "You are a careful assistant of tenant zero; answer in one short line. " * 3


class EngineBackend:
    """The gateway over one in-process engine: generates with its real prefix cache and
    records the salt of every request (None: the gateway passed none)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.salts: list[str | None] = []

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        self.salts.append(cache_salt)
        self.engine.add_request(request_id, list(prompt_token_ids), params, cache_salt=cache_salt)
        first, done = True, False
        while not done:
            for out in self.engine.step():
                if out.request_id == request_id:
                    cached = out.num_cached_tokens if first else None
                    yield GenerationChunk(out.new_token_ids, out.finish_reason, cached)
                    first, done = False, out.finished

    async def abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)

    async def health(self) -> dict[str, Any]:
        return {"mode": "engine"}


class SaltlessBackend(EngineBackend):
    """A backend written before cache salts: its ``generate`` takes no ``cache_salt``."""

    async def generate(  # type: ignore[override]
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        async for chunk in super().generate(request_id, prompt_token_ids, params):
            yield chunk


@pytest.fixture
def engine():
    from halfmoon.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model="tiny", kv_cache_mb=8, num_threads=1))


def _cached(client: TestClient, prompt: str, key: str | None = None, chat: bool = False,
            **extra: Any) -> int:  # fmt: skip
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if chat:
        body = {"model": "m", "messages": [{"role": "system", "content": prompt},
                                           {"role": "user", "content": "hi"}]}  # fmt: skip
        path = "/v1/chat/completions"
    else:
        body, path = {"model": "m", "prompt": prompt}, "/v1/completions"
    reply = client.post(path, json={**body, "max_tokens": 2, **extra}, headers=headers)
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("chat", [False, True])
def test_request_salt_isolates_the_prefix_cache(gateways, engine, chat):
    backend = EngineBackend(engine)
    with TestClient(gateways.app(backend, "m")) as client:
        assert _cached(client, SYSTEM, chat=chat, cache_salt="tenant-a") == 0
        hit = _cached(client, SYSTEM, chat=chat, cache_salt="tenant-a")
        assert hit >= 48  # the same salt shares the cached prefix
        assert _cached(client, SYSTEM, chat=chat, cache_salt="tenant-b") == 0
        assert _cached(client, SYSTEM, chat=chat) == 0  # unsalted: a chain of its own
        assert _cached(client, SYSTEM, chat=chat) == hit
        assert _cached(client, SYSTEM, chat=chat, cache_salt="tenant-b") == hit
    assert backend.salts[:4] == ["tenant-a", "tenant-a", "tenant-b", None]
    engine.check_integrity()


def test_every_choice_carries_the_salt(gateways, engine):
    backend = EngineBackend(engine)
    with TestClient(gateways.app(backend, "m")) as client:
        reply = client.post("/v1/completions", json={
            "model": "m", "prompt": SYSTEM, "max_tokens": 2, "n": 2, "cache_salt": "s",
        })  # fmt: skip
        assert reply.status_code == 200, reply.text
    assert backend.salts == ["s", "s"]


def test_unsalted_requests_reach_a_backend_without_salts(gateways, engine):
    with TestClient(gateways.app(SaltlessBackend(engine), "m")) as client:
        assert _cached(client, SYSTEM) == 0
        assert _cached(client, SYSTEM) >= 48


@pytest.mark.parametrize(
    "salt,fragment",
    [
        ("", "non-empty string"),
        (5, "non-empty string"),
        (["a"], "non-empty string"),
        ({"a": 1}, "non-empty string"),
        (True, "non-empty string"),
        ("x" * 257, "at most 256 characters"),
        ("\ud800", "not valid Unicode"),
    ],
)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_cache_salt_is_a_400(gateways, salt, fragment, path):
    backend = EngineBackend(None)  # never reached
    body: dict[str, Any] = {"model": "m", "max_tokens": 2, "cache_salt": salt}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    with TestClient(gateways.app(backend, "m")) as client:  # (ASCII JSON: "\ud800" escaped)
        raw = json.dumps(body)
        reply = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "cache_salt" in message and fragment in message
    assert backend.salts == []  # refused before the backend saw it


def test_a_256_character_salt_is_accepted(gateways, engine):
    with TestClient(gateways.app(EngineBackend(engine), "m")) as client:
        assert _cached(client, "hi", cache_salt="s" * 256) == 0


def test_salt_from_api_key_isolates_tenants(gateways, engine):
    backend = EngineBackend(engine)
    app = gateways.app(backend, "m", api_keys=("key-1", "key-2"), cache_salt_from_api_key=True)
    with TestClient(app) as client:
        assert _cached(client, SYSTEM, key="key-1") == 0
        hit = _cached(client, SYSTEM, key="key-1")
        assert hit >= 48  # one tenant shares its own cache
        assert _cached(client, SYSTEM, key="key-2") == 0  # another does not see it
        assert _cached(client, SYSTEM, key="key-2") == hit
        # A request salt adds to the key's: a cache of its own within the tenant.
        assert _cached(client, SYSTEM, key="key-1", cache_salt="x") == 0
        assert _cached(client, SYSTEM, key="key-2", cache_salt="x") == 0
        assert _cached(client, SYSTEM, key="key-1", cache_salt="x") == hit
        for key in (None, "key-3", "key-1 "):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            reply = client.post("/v1/completions", json={"model": "m", "prompt": "hi"},
                                headers=headers)  # fmt: skip
            assert reply.status_code == 401
    # The salts are derived from the keys, never the keys themselves.
    assert len(set(backend.salts)) == 4 and not any("key-" in s for s in backend.salts)


def test_keys_share_the_cache_without_the_option(gateways, engine):
    backend = EngineBackend(engine)
    app = gateways.app(backend, "m", api_key="key-1", api_keys=("key-2",))
    with TestClient(app) as client:
        assert _cached(client, SYSTEM, key="key-1") == 0
        assert _cached(client, SYSTEM, key="key-2") >= 48  # the leak the option closes
    assert backend.salts == [None, None]


def test_tenancy_helpers():
    from halfmoon.serve.gateway.app import GatewayConfig
    from halfmoon.serve.gateway.tenancy import api_keys, effective_salt, key_salt, matching_key

    assert api_keys(None, " a, b ,,a ") == ("a", "b")
    assert api_keys(["x", "y"], "a,b") == ("x", "y")  # given keys win over the environment
    assert api_keys("k,with,commas", None) == ("k,with,commas",)  # one --api-key as it is
    assert api_keys(None, None) == ()
    assert matching_key("Bearer b", ("a", "b")) == "b"
    assert matching_key("bearer b", ("a", "b")) is None
    assert matching_key(None, ("a",)) is None
    assert key_salt("a") != key_salt("b") and len(key_salt("a")) == 64
    assert effective_salt("s", None) == "s" and effective_salt(None, None) is None
    assert effective_salt(None, "a") == key_salt("a")
    assert effective_salt("s", "a") not in (key_salt("a"), "s", effective_salt("s", "b"))
    assert GatewayConfig("m", 64, api_key="a", api_keys=("b", "a")).keys == ("a", "b")
    with pytest.raises(ValueError, match="needs at least one API key"):
        GatewayConfig("m", 64, cache_salt_from_api_key=True)


def test_workers_read_the_salt_off_the_wire():
    from halfmoon.serve.control.messages import (
        Generate,
        MalformedMessage,
        WireParams,
        from_wire,
        to_wire,
    )

    params = WireParams(max_tokens=2, temperature=0.0, top_p=1.0)
    plain = to_wire(Generate(request_id="r", token_ids=[1], params=params))
    assert "cache_salt" not in plain and from_wire(plain).cache_salt is None
    assert from_wire({**plain, "cache_salt": None}).cache_salt is None
    assert from_wire({**plain, "cache_salt": "s"}).cache_salt == "s"
    for bad in ("", 3, b"s"):
        with pytest.raises(MalformedMessage, match="cache_salt"):
            from_wire({**plain, "cache_salt": bad})
    with pytest.raises(ValueError, match="cache_salt"):
        Generate(request_id="r", token_ids=[1], params=params, cache_salt="")


def test_serve_refuses_the_option_without_api_keys(capsys, tmp_path, monkeypatch):
    from halfmoon.cli import build_parser, main

    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path))
    monkeypatch.delenv("HALFMOON_API_KEY", raising=False)
    assert main(["serve", "--cache-salt-from-api-key"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("halfmoon: error:") and "--cache-salt-from-api-key needs" in err
    assert not any(tmp_path.iterdir())  # nothing was prepared or started
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b"])
    assert args.api_key == ["a", "b"] and not args.cache_salt_from_api_key


def test_ray_gateway_spec_keeps_every_key():
    from halfmoon.cli import build_parser
    from halfmoon.deploy.options import deploy_spec

    argv = ["serve", "--ray", "auto", "--api-key", "a", "--api-key", "b",
            "--cache-salt-from-api-key"]  # fmt: skip
    spec = deploy_spec(build_parser().parse_args(argv), "{}", "{}").gateway
    assert spec.api_key == ("a", "b") and spec.cache_salt_from_api_key
    single = deploy_spec(build_parser().parse_args(["serve", "--ray", "auto"]), "{}", "{}").gateway
    assert single.api_key == () and not single.cache_salt_from_api_key
