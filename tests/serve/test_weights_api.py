"""The weight-update routes (halfmoon.serve.gateway.weights_api), in process: generation
pauses around an update (running requests finish first or are aborted, new ones wait),
the version label moves, SGLang's refusals and answers; only under the dev switch."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx

from halfmoon.serve.control.messages import WeightsRecord
from halfmoon.serve.gateway.backend import BackendError

from .test_token_generation import CountingBackend, generation_of


class UpdatingBackend(CountingBackend):
    """Counts tokens, and takes weight updates as the cluster's backend does: each
    records what ran meanwhile; a path containing ``bad`` fails."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.record: WeightsRecord | None = None
        self.updates: list[tuple[str, str]] = []
        self.running_at_update: list[int] = []
        self.gateway: Any = None
        self.resets: list[bool] = []
        self.busy = False

    async def update_weights(self, path: str, version: str) -> None:
        self.running_at_update.append(self.gateway._generating)
        await asyncio.sleep(0.1)
        if "bad" in path:
            raise BackendError(f"p0: {path} is not the served model's architecture")
        self.updates.append((path, version))
        self.record = WeightsRecord(path=path, version=version)

    async def weights(self) -> WeightsRecord | None:
        return self.record

    async def reset_prefix_cache(self, external: bool) -> dict[str, str]:
        self.resets.append(external)
        return {"p0": "", "d0": "running requests hold KV blocks" if self.busy else ""}

    async def record_weights_version(self, version: str) -> None:
        path = "" if self.record is None else self.record.path
        self.record = WeightsRecord(path=path, version=version)


def updating_app(gateways, pace_s: float = 0.0):
    """An app over an :class:`UpdatingBackend` with the development switch on; (backend,
    app)."""
    backend = UpdatingBackend(gateways.tokenizer)
    backend.pace_s = pace_s
    app = gateways.app(backend, "m", dev_endpoints=True)
    backend.gateway = app.state.gateway
    return backend, app


def test_update_waits_for_running_requests_and_holds_new_ones(gateways) -> None:
    backend, app = updating_app(gateways, pace_s=0.02)

    async def scenario() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            out: dict[str, Any] = {}
            out["info_before"] = (await client.get("/weight_info")).json()
            out["model_info_before"] = (await client.get("/model_info")).json()
            running = generation_of(client, 10)
            await asyncio.sleep(0.05)
            update = asyncio.ensure_future(client.post(
                "/update_weights_from_disk", json={"model_path": "/ckpt/step-1",
                                                   "weight_version": "1"}))  # fmt: skip
            await asyncio.sleep(0.05)
            held = generation_of(client, 2)  # arrives while the update waits: held until it is done
            out["finished"] = (await running).json()["choices"][0]["finish_reason"]
            out["update"] = (await update).json()
            out["held"] = (await held).json()["choices"][0]["finish_reason"]
            out["info"] = (await client.get("/weight_info")).json()
            out["model_info"] = (await client.get("/model_info")).json()
            sglang = await client.post("/generate", json={
                "input_ids": [5], "sampling_params": {"max_new_tokens": 2}})  # fmt: skip
            out["meta_version"] = sglang.json()["meta_info"]["weight_version"]

            running = generation_of(client, 200)
            await asyncio.sleep(0.05)
            aborting = await client.post("/update_weights_from_disk", json={
                "model_path": "/ckpt/step-2", "abort_all_requests": True})  # fmt: skip
            out["aborting"] = aborting.json()
            out["aborted"] = (await running).json()["choices"][0]["finish_reason"]
            out["version_kept"] = (await client.get("/weight_info")).json()
            failed = await client.post("/update_weights_from_disk",
                                       json={"model_path": "/ckpt/bad"})  # fmt: skip
            out["failed"] = (failed.status_code, failed.json())
            out["paused_after_failure"] = (await client.get("/is_paused")).json()
            label = await client.post("/update_weight_version", json={"new_version": "v9"})
            out["label"] = label.json()
            out["info_after_label"] = (await client.get("/weight_info")).json()
            out["metrics"] = (await client.get("/metrics")).text
            return out

    out = asyncio.run(scenario())
    assert out["info_before"] == {"weight_version": "default"}
    assert out["model_info_before"]["weight_version"] == "default"
    assert out["model_info_before"]["model_path"] == "m"
    assert out["finished"] == "length"  # the running request finished first...
    assert backend.running_at_update == [0, 0, 0]  # ...and none ran during any update
    assert out["update"]["success"] is True, out["update"]
    assert out["update"]["num_paused_requests"] == 1  # the held one
    assert "Weight version updated to 1" in out["update"]["message"]
    assert out["held"] == "length"
    assert out["info"] == {"weight_version": "1"}
    assert out["model_info"]["weight_version"] == "1"
    assert out["model_info"]["model_path"] == "/ckpt/step-1"
    assert out["meta_version"] == "1"  # SGLang's answers name the weights' version
    assert out["aborting"]["success"] is True and out["aborted"] == "abort"
    assert out["version_kept"] == {"weight_version": "1"}  # no weight_version: label stays
    assert backend.updates == [("/ckpt/step-1", "1"), ("/ckpt/step-2", "1")]
    status, body = out["failed"]
    assert status == 400 and body["success"] is False
    assert "not the served model's architecture" in body["message"]
    assert out["paused_after_failure"] == {"is_paused": False}
    assert out["label"] == {"success": True, "message": "Weight version updated to v9",
                            "new_version": "v9"}  # fmt: skip
    assert out["info_after_label"] == {"weight_version": "v9"}
    counts = dict(re.findall(r'^halfmoon:rl_weight_update_duration_seconds_count\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$',
                             out["metrics"], re.M))  # fmt: skip
    assert counts == {"ok": "2.0", "failed": "1.0"}


def test_refusals_and_keep_pause(gateways) -> None:
    backend, app = updating_app(gateways)

    async def scenario() -> dict[str, Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            out: dict[str, Any] = {}
            for name, body in {
                "flush": {"model_path": "/c", "flush_cache": False},
                "format": {"model_path": "/c", "load_format": "gguf"},
                "empty": {"model_path": " "},
                "missing": {},
                "manifest": {"model_path": "/c", "manifest": {"a": 1}},
            }.items():
                r = await client.post("/update_weights_from_disk", json=body)
                out[name] = (r.status_code, r.json())
            kept = await client.post("/update_weights_from_disk",
                                     json={"model_path": "/c", "keep_pause": True})  # fmt: skip
            out["kept"] = kept.json()["success"]
            out["paused"] = (await client.get("/is_paused")).json()
            out["continue"] = (await client.post("/continue_generation")).json()
            out["resumed"] = (await client.get("/is_paused")).json()
            out["pause_generation"] = (await client.post("/pause_generation", json={})).json()
            out["paused_again"] = (await client.get("/is_paused")).json()
            bad = await client.post("/pause_generation", json={"mode": "in_place"})
            out["in_place"] = bad.status_code
            await client.post("/continue_generation")
            return out

    out = asyncio.run(scenario())
    assert out["flush"][0] == 400 and "flush_cache" in out["flush"][1]["error"]["message"]
    assert out["format"][0] == 400 and "load_format" in out["format"][1]["error"]["message"]
    assert out["empty"][0] == 400 and out["missing"][0] == 400
    assert out["manifest"][0] == 400
    assert backend.updates == [("/c", "default")]  # only the one allowed ran
    assert out["kept"] is True and out["paused"] == {"is_paused": True}
    assert out["continue"]["status"] == "ok" and out["resumed"] == {"is_paused": False}
    assert out["pause_generation"]["status"] == "ok"
    assert out["paused_again"] == {"is_paused": True}
    assert out["in_place"] == 400


def test_routes_need_the_dev_switch_and_a_capable_backend(gateways) -> None:
    plain = gateways.app(CountingBackend(gateways.tokenizer), "m")
    incapable = gateways.app(CountingBackend(gateways.tokenizer), "m", dev_endpoints=True)

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, app in {"plain": plain, "incapable": incapable}.items():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                r = await client.post("/update_weights_from_disk", json={"model_path": "/c"})
                out[name] = (r.status_code, r.json())
                out[name + "_info"] = (await client.get("/weight_info")).status_code
        return out

    out = asyncio.run(scenario())
    assert out["plain"][0] == 404 and out["plain_info"] == 404
    assert out["incapable"][0] == 400 and "cannot update" in out["incapable"][1]["message"]
    assert out["incapable_info"] == 200  # ("default": the weights it started with)


def test_the_routes_are_documented(gateways) -> None:
    from fastapi.testclient import TestClient

    with TestClient(gateways.app(CountingBackend(gateways.tokenizer), "m",
                                 dev_endpoints=True)) as client:  # fmt: skip
        paths = client.get("/openapi.json").json()["paths"]
    update = paths["/update_weights_from_disk"]["post"]["responses"]
    ok = update["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/UpdateWeightsResponse"}
    for path in ("/update_weights_from_disk", "/update_weight_version", "/pause_generation"):
        bad = paths[path]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
        assert bad == {"$ref": "#/components/schemas/ErrorResponse"}, path
    assert "/weight_info" in paths and "/continue_generation" in paths


def test_flush_cache_resets_every_tier_and_names_where_it_could_not(gateways) -> None:
    backend, app = updating_app(gateways)

    async def scenario() -> list[tuple[int, str]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            out = []
            for method in ("GET", "POST"):
                r = await client.request(method, "/flush_cache")
                out.append((r.status_code, r.text))
            backend.busy = True
            r = await client.post("/flush_cache")
            out.append((r.status_code, r.text))
            return out

    out = asyncio.run(scenario())
    assert out[:2] == [(200, "Cache flushed.\n")] * 2
    assert out[2][0] == 400 and "d0: running requests hold KV blocks" in out[2][1]
    assert backend.resets == [True, True, True]  # pools and block stores alike


def test_an_update_runs_to_its_end_when_its_caller_gives_up(gateways) -> None:
    """A client that disconnects mid-update does not cut it in two: it completes (every
    worker and the Conductor's record alike), and generation resumes after it."""
    backend, app = updating_app(gateways)
    gw = backend.gateway

    async def scenario() -> tuple[bool, bool, list]:
        caller = asyncio.ensure_future(gw.update_weights("/ckpt/step-3", "3", False))
        await asyncio.sleep(0.03)  # (the backend's update takes 0.1 s)
        caller.cancel()
        paused_meanwhile = gw.paused
        await asyncio.sleep(0.2)
        return paused_meanwhile, gw.paused, list(backend.updates)

    paused_meanwhile, paused_after, updates = asyncio.run(scenario())
    assert paused_meanwhile and not paused_after
    assert updates == [("/ckpt/step-3", "3")]
