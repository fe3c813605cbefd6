"""``POST /reset_prefix_cache``, vLLM's development endpoint, at the gateway: served only
with ``VLLM_SERVER_DEV_MODE=1`` (``GatewayConfig.dev_endpoints``), behind the API key,
vLLM's query parameters and answer. In-process (ASGI) over a backend that records."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from halfmoon.core.flags import dev_mode
from halfmoon.serve.gateway.backend import BackendError
from tests.serve.fakes import RecordingBackend


class ResettingBackend(RecordingBackend):
    """Answers ``reasons`` (per instance) to a reset, and records what it was asked."""

    def __init__(self, reasons: dict[str, str] | None = None) -> None:
        super().__init__()
        self.reasons = reasons if reasons is not None else {"prefill-0": "", "decode-0": ""}
        self.asked: list[bool] = []

    async def reset_prefix_cache(self, external: bool) -> dict[str, str]:
        self.asked.append(external)
        if self.reasons is None:
            raise BackendError("the Conductor is away")
        return self.reasons


def test_the_switch_is_vllm_s():
    assert dev_mode({"VLLM_SERVER_DEV_MODE": "1"}) and not dev_mode({})
    assert not dev_mode({"VLLM_SERVER_DEV_MODE": "0"})
    assert not dev_mode({"VLLM_SERVER_DEV_MODE": "yes"})  # (vLLM reads an integer)


def test_every_worker_is_asked_and_the_answer_is_vllm_s(gateways):
    backend = ResettingBackend()
    with TestClient(gateways.app(backend, "m", dev_endpoints=True)) as client:
        assert client.post("/reset_prefix_cache").json() == {"success": True}
        r = client.post("/reset_prefix_cache", params={"reset_external": "true"})
        assert r.json() == {"success": True}
        assert backend.asked == [False, True]
        r = client.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
        assert r.status_code == 400 and "reset_running_requests" in r.json()["error"]["message"]
        assert backend.asked == [False, True]  # refused before asking anyone


def test_a_worker_that_could_not_is_named(gateways):
    backend = ResettingBackend({"prefill-0": "", "decode-0": "running requests hold KV blocks"})
    with TestClient(gateways.app(backend, "m", dev_endpoints=True)) as client:
        assert client.post("/reset_prefix_cache").json() == {
            "success": False, "failed": {"decode-0": "running requests hold KV blocks"}
        }  # fmt: skip
        backend.reasons = None  # the cluster cannot be asked: a 503
        r = client.post("/reset_prefix_cache")
        assert r.status_code == 503 and "Conductor is away" in r.json()["error"]["message"]


def test_without_the_switch_there_is_no_such_endpoint(gateways):
    with TestClient(gateways.app(ResettingBackend(), "m")) as client:
        assert client.post("/reset_prefix_cache").status_code == 404


def test_it_needs_the_api_key_when_the_server_has_one(gateways):
    backend = ResettingBackend()
    app = gateways.app(backend, "m", dev_endpoints=True, api_key="k")
    with TestClient(app) as client:
        assert client.post("/reset_prefix_cache").status_code == 401
        ok = client.post("/reset_prefix_cache", headers={"Authorization": "Bearer k"})
        assert ok.json() == {"success": True} and backend.asked == [False]


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_a_bad_flag_is_a_400(gateways, value):
    with TestClient(gateways.app(ResettingBackend(), "m", dev_endpoints=True)) as client:
        r = client.post("/reset_prefix_cache", params={"reset_external": value})
        assert r.status_code == 400, r.text
