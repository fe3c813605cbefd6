"""vLLM's sleep mode routes (halfmoon.serve.gateway.sleep_mode), in process over a
counting backend that sleeps as the cluster's does: generation pauses, the workers'
KV pools are released at level 1, requests sent meanwhile wait and run once fully awake
(``weights`` then ``kv_cache``, as a trainer wakes them); vLLM's refusals; a failed sleep
leaves the server serving; only under the dev switch."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from halfmoon.serve.gateway.backend import BackendError, BackendRefused

from .test_token_generation import CountingBackend, generation_of, started


class SleepingBackend(CountingBackend):
    """Counts tokens; ``sleep_workers`` / ``wake_workers`` as the cluster's (64 MiB
    released), refusing or failing when told to."""

    def __init__(self, tokenizer, fail: BackendError | None = None) -> None:
        super().__init__(tokenizer)
        self.calls: list[str] = []
        self.fail = fail

    async def sleep_workers(self) -> int:
        self.calls.append("sleep")
        if self.fail is not None:
            raise self.fail
        return 64 * 2**20

    async def wake_workers(self) -> None:
        self.calls.append("wake")


def _run(app, scenario) -> Any:
    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await scenario(client)

    return asyncio.run(main())


def test_sleep_releases_and_a_request_waits_until_fully_awake(gateways):
    backend = SleepingBackend(gateways.tokenizer)
    backend.pace_s = 0.02
    app = gateways.app(backend, "m", dev_endpoints=True)

    async def scenario(client: httpx.AsyncClient) -> dict[str, Any]:
        out: dict[str, Any] = {}
        running = generation_of(client, 200)
        await started(backend, 1)
        out["slept"] = (await client.post("/sleep", params={"level": 1})).json()
        out["aborted"] = (await running).json()["choices"][0]["finish_reason"]
        out["sleeping"] = (await client.get("/is_sleeping")).json()
        held = generation_of(client, 3)
        await asyncio.sleep(0.3)
        out["held"] = not held.done()
        out["again"] = (await client.post("/sleep")).json()  # (asleep: nothing released again)
        out["weights"] = (await client.post("/wake_up", params={"tags": "weights"})).json()
        await asyncio.sleep(0.1)
        out["still_held"] = not held.done()
        out["kv"] = (await client.post("/wake_up", params=[("tags", "kv_cache")])).json()
        out["after"] = (await held).json()["choices"][0]["finish_reason"]
        out["awake"] = (await client.get("/is_sleeping")).json()
        await client.post("/sleep")
        out["resume"] = await client.post("/resume")  # (memory asleep: wake it up instead)
        await client.post("/wake_up")
        return out

    out = _run(app, scenario)
    assert out["slept"] == {"status": "sleeping", "level": 1} and out["aborted"] == "abort"
    assert out["sleeping"] == {"is_sleeping": True} and out["held"]
    assert out["weights"] == {"status": "sleeping", "tags": ["weights"]} and out["still_held"]
    assert out["kv"] == {"status": "awake", "tags": ["kv_cache"]}
    assert out["after"] == "length" and out["awake"] == {"is_sleeping": False}
    assert out["resume"].status_code == 400 and "/wake_up" in out["resume"].text
    assert backend.calls == ["sleep", "wake", "sleep", "wake"]


def test_level_0_pauses_only_and_release_kv_cache_memory_needs_a_pause(gateways):
    backend = SleepingBackend(gateways.tokenizer)
    app = gateways.app(backend, "m", dev_endpoints=True)

    async def scenario(client: httpx.AsyncClient) -> list[Any]:
        early = await client.post("/release_kv_cache_memory")
        level0 = (await client.post("/sleep", params={"level": 0, "mode": "wait"})).json()
        calls = list(backend.calls)
        released = (await client.post("/release_kv_cache_memory")).json()
        scheduling = (await client.post("/wake_up", params={"tags": "scheduling"})).json()
        woken = (await client.post("/wake_up")).json()
        return [early.status_code, early.text, level0, calls, released, scheduling, woken]

    early, text, level0, calls, released, scheduling, woken = _run(app, scenario)
    assert early == 400 and "paused" in text
    assert level0 == {"status": "sleeping", "level": 0} and calls == []
    assert released == {"status": "kv_cache_released"} and backend.calls == ["sleep", "wake"]
    assert scheduling == {"status": "sleeping", "tags": ["scheduling"]}  # kv_cache sleeps
    assert woken == {"status": "awake", "tags": None}


def test_what_cannot_be_done_is_a_400(gateways):
    backend = SleepingBackend(gateways.tokenizer)
    app = gateways.app(backend, "m", dev_endpoints=True)

    async def scenario(client: httpx.AsyncClient) -> list[httpx.Response]:
        return [
            await client.post("/sleep", params={"level": 2}),
            await client.post("/sleep", params={"mode": "keep"}),
            await client.post("/wake_up", params={"tags": "gpu"}),
            await client.get("/is_sleeping"),
        ]

    level2, keep, tag, sleeping = _run(app, scenario)
    assert level2.status_code == 400 and "level 2" in level2.text
    assert keep.status_code == 400 and "'keep'" in keep.text
    assert tag.status_code == 400 and "'gpu'" in tag.text
    assert sleeping.json() == {"is_sleeping": False} and backend.calls == []


def test_a_failed_sleep_leaves_the_server_serving(gateways):
    for fail, status in ((BackendRefused("p0: no sleep mode here"), 400),
                         (BackendError("p0: no answer within 60s"), 503)):  # fmt: skip
        backend = SleepingBackend(gateways.tokenizer, fail=fail)
        app = gateways.app(backend, "m", dev_endpoints=True)

        async def scenario(client: httpx.AsyncClient) -> list[Any]:
            refused = await client.post("/sleep")
            sleeping = (await client.get("/is_sleeping")).json()
            served = (await generation_of(client, 2)).json()["choices"][0]["finish_reason"]
            return [refused, sleeping, served]

        refused, sleeping, served = _run(app, scenario)
        assert refused.status_code == status and str(fail) in refused.text
        assert sleeping == {"is_sleeping": False} and served == "length"


def test_the_routes_exist_only_under_the_dev_switch(gateways):
    app = gateways.app(SleepingBackend(gateways.tokenizer), "m")

    async def scenario(client: httpx.AsyncClient) -> list[int]:
        return [(await client.post("/sleep")).status_code,
                (await client.get("/is_sleeping")).status_code,
                (await client.post("/release_memory_occupation")).status_code]  # fmt: skip

    assert _run(app, scenario) == [404, 404, 404]


def test_sglangs_memory_occupation_routes(gateways):
    """SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` (what RL
    frameworks driving SGLang call): a release waits for the running request, releases the
    KV pools with ``kv_cache`` and holds new requests; the resume that wakes the last tag
    resumes generation."""
    backend = SleepingBackend(gateways.tokenizer)
    backend.pace_s = 0.02
    app = gateways.app(backend, "m", dev_endpoints=True)

    async def scenario(client: httpx.AsyncClient) -> dict[str, Any]:
        out: dict[str, Any] = {}
        running = generation_of(client, 20)
        await started(backend, 1)
        out["released"] = (await client.post("/release_memory_occupation", json={})).json()
        out["finished"] = (await running).json()["choices"][0]["finish_reason"]  # not aborted
        out["sleeping"] = (await client.get("/is_sleeping")).json()
        held = generation_of(client, 3)
        await asyncio.sleep(0.3)
        out["held"] = not held.done()
        resumed = await client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
        out["kv"] = resumed.json()
        await asyncio.sleep(0.1)
        out["still_held"] = not held.done()  # (the weights' tag still sleeps)
        out["all"] = (await client.get("/resume_memory_occupation")).json()
        out["after"] = (await held).json()["choices"][0]["finish_reason"]
        # only the weights: no pool released, generation held and resumed all the same
        out["weights"] = (
            await client.post(
                "/release_memory_occupation", json={"tags": ["weights", "cuda_graph"]}
            )
        ).json()
        out["weights_back"] = (
            await client.post("/resume_memory_occupation", json={"tags": ["weights"]})
        ).json()
        out["bad"] = await client.post("/release_memory_occupation", json={"tags": ["gpu"]})
        return out

    out = _run(app, scenario)
    assert out["released"] == {"status": "released", "tags": None,
                               "released_bytes": 64 * 2**20}  # fmt: skip
    assert out["finished"] == "length" and out["sleeping"] == {"is_sleeping": True}
    assert out["held"] and out["still_held"]
    assert out["kv"] == {"status": "sleeping", "tags": ["kv_cache"]}
    assert out["all"] == {"status": "awake", "tags": None} and out["after"] == "length"
    assert out["weights"]["released_bytes"] == 0
    assert out["weights_back"] == {"status": "awake", "tags": ["weights"]}
    assert out["bad"].status_code == 400 and "'gpu'" in out["bad"].text
    assert backend.calls == ["sleep", "wake"]


def test_a_pause_before_the_release_outlasts_the_resume(gateways):
    """Generation paused before a release (SGLang's ``/pause_generation``) stays paused
    after the resume: ``/continue_generation`` resumes it."""
    backend = SleepingBackend(gateways.tokenizer)
    app = gateways.app(backend, "m", dev_endpoints=True)

    async def scenario(client: httpx.AsyncClient) -> list[Any]:
        await client.post("/pause_generation", json={"mode": "abort"})
        await client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        resumed = (await client.post("/resume_memory_occupation", json={})).json()
        paused = (await client.get("/is_sleeping")).json()
        await client.post("/continue_generation")
        served = (await generation_of(client, 2)).json()["choices"][0]["finish_reason"]
        return [resumed, paused, served]

    resumed, paused, served = _run(app, scenario)
    assert resumed == {"status": "awake", "tags": None}
    assert paused == {"is_sleeping": True} and served == "length"  # (paused, not asleep)
    assert backend.calls == ["sleep", "wake"]
