"""vLLM's ``/start_profile`` and ``/stop_profile`` over a cluster
(halfmoon.serve.gateway.profiling, ClusterOperations.start_profile / stop_profile):
against scripted workers, all or none at the start and every trace at the stop; the
routes in process (only with a profiler config; vLLM's body and its refusals)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from halfmoon.core.profiling import ProfilerConfig, ProfileSession, parse_profiler_config
from halfmoon.serve.control.messages import (
    ConductorPong,
    Error,
    Message,
    Ping,
    Profile,
    ProfileState,
)
from halfmoon.serve.gateway.backend import BackendError, BackendRefused
from halfmoon.serve.gateway.cluster_ops import DRAINING_ANSWER_S, ClusterOperations

from .test_token_generation import CountingBackend

CONFIG = ProfilerConfig("/traces", max_iterations=50)


class Scripted(ClusterOperations):
    """Workers p0, d0 (and draining d1, profiling since before it was told to drain);
    ``refuse`` maps an endpoint to its refusal of a start."""

    def __init__(self, refuse: dict[str, Error] | None = None) -> None:
        self._conductor_endpoint = "conductor"
        self.refuse = refuse or {}
        self.sent: list[tuple[str, Profile]] = []
        self.on = {"tcp://d1"}
        self.gone: set[str] = set()
        self.timeouts: dict[str, float] = {}

    async def _call(self, endpoint: str, msg: Message, timeout_s: float) -> Message:
        if isinstance(msg, Ping):
            return ConductorPong(endpoints={i: f"tcp://{i}" for i in ("p0", "d0", "d1")},
                                 draining=["d1"])  # fmt: skip
        assert isinstance(msg, Profile)
        self.sent.append((endpoint, msg))
        self.timeouts[endpoint] = timeout_s
        if endpoint in self.gone:
            raise BackendError(f"{endpoint} did not answer within {timeout_s:g}s")
        if msg.op == "start":
            if endpoint in self.refuse:
                return self.refuse[endpoint]
            self.on.add(endpoint)
            return ProfileState(active=True)
        if endpoint == "tcp://d0" and endpoint in self.on and self.refuse.get("stop"):
            return self.refuse["stop"]
        was_on = endpoint in self.on
        self.on.discard(endpoint)
        return ProfileState(active=False, traces=[f"/traces/x.{endpoint[6:]}.json.gz"] * was_on)


def test_every_serving_worker_starts_and_every_worker_stops():
    ops = Scripted()
    session = ProfileSession(profile_prefix="run", max_iterations=4)
    assert asyncio.run(ops.start_profile(CONFIG, session)) == ["d0", "p0"]
    starts = {e: m for e, m in ops.sent if m.op == "start"}
    assert set(starts) == {"tcp://p0", "tcp://d0"}  # (not the draining worker)
    msg = starts["tcp://p0"]
    assert parse_profiler_config(msg.config) == CONFIG
    assert (msg.prefix, msg.delay_iterations, msg.max_iterations) == ("run", -1, 4)
    traces, errors = asyncio.run(ops.stop_profile())
    assert errors == {} and not ops.on
    # the draining worker's trace too: it recorded until it was told to drain
    assert traces == {"p0": ["/traces/x.p0.json.gz"], "d0": ["/traces/x.d0.json.gz"],
                      "d1": ["/traces/x.d1.json.gz"]}  # fmt: skip


@pytest.mark.parametrize(
    ("refusal", "kind"),
    [(Error(error="d0: VllmConnector has no profiler", unsupported=True), BackendRefused),
     (Error(error="d0: profiler directory /traces: read-only file system"), BackendError)],
)  # fmt: skip
def test_one_that_cannot_start_stops_the_others(refusal, kind):
    ops = Scripted(refuse={"tcp://d0": refusal})
    with pytest.raises(kind, match=refusal.error):
        asyncio.run(ops.start_profile(CONFIG, ProfileSession()))
    assert ops.on == {"tcp://d1"}  # p0 stopped again (d1 was never asked)
    assert ("tcp://p0", Profile(op="stop")) in ops.sent


def test_a_draining_worker_that_has_exited_is_not_waited_for():
    ops = Scripted()
    ops.gone = {"tcp://d1"}
    traces, errors = asyncio.run(ops.stop_profile())
    assert set(traces) == {"p0", "d0"} and errors == {}
    assert ops.timeouts["tcp://d1"] == DRAINING_ANSWER_S < ops.timeouts["tcp://p0"]


def test_a_worker_that_fails_to_stop_is_named_beside_the_others_traces():
    ops = Scripted(refuse={"stop": Error(error="d0: the trace could not be written")})
    asyncio.run(ops.start_profile(CONFIG, ProfileSession()))
    traces, errors = asyncio.run(ops.stop_profile())
    assert set(traces) == {"p0", "d1"} and errors == {"d0": "d0: the trace could not be written"}


class ProfilingBackend(CountingBackend):
    """Counts tokens; starts and stops the profiler as the cluster's does."""

    def __init__(self, tokenizer, fail: BackendError | None = None) -> None:
        super().__init__(tokenizer)
        self.calls: list[Any] = []
        self.fail = fail

    async def start_profile(self, config: ProfilerConfig, session: ProfileSession) -> list[str]:
        self.calls.append(("start", config, session))
        if self.fail is not None:
            raise self.fail
        return ["d0", "p0"]

    async def stop_profile(self) -> tuple[dict[str, list[str]], dict[str, str]]:
        self.calls.append("stop")
        return {"p0": ["/traces/a.p0.gz"], "d0": []}, {}


def _posts(app, *requests: tuple[str, Any]) -> list[httpx.Response]:
    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return [await client.post(path, json=body) for path, body in requests]

    return asyncio.run(main())


def test_the_routes_take_vllms_body_and_list_the_traces(gateways):
    backend = ProfilingBackend(gateways.tokenizer)
    app = gateways.app(backend, "m", profiler=CONFIG)
    started, bare, stopped = _posts(
        app, ("/start_profile", {"profile_prefix": "run2", "delay_iterations": 1, "x": 1}),
        ("/start_profile", None), ("/stop_profile", None),
    )  # fmt: skip
    assert started.status_code == 200, started.text
    assert started.json() == {"status": "profiling", "workers": ["d0", "p0"]}
    assert backend.calls[0] == ("start", CONFIG, ProfileSession("run2", delay_iterations=1))
    assert bare.status_code == 200 and backend.calls[1] == ("start", CONFIG, ProfileSession())
    assert stopped.json() == {"status": "stopped", "traces": {"p0": ["/traces/a.p0.gz"]},
                              "errors": {}}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "fail", "status", "message"),
    [
        ({"profile_prefix": "../x"}, None, 400, "profile_prefix must be"),
        ({"max_iterations": -1}, None, 400, "max_iterations must be a whole number"),
        ({"max_iterations": "3"}, None, 400, "max_iterations"),  # (strict, as vLLM's)
        (None, BackendRefused("VllmConnector has no profiler"), 400, "has no profiler"),
        (None, BackendError("d0 did not answer"), 503, "the profiler did not start: d0"),
    ],
)  # fmt: skip
def test_refusals(gateways, body, fail, status, message):
    backend = ProfilingBackend(gateways.tokenizer, fail=fail)
    (answer,) = _posts(gateways.app(backend, "m", profiler=CONFIG), ("/start_profile", body))
    assert answer.status_code == status and message in answer.text, answer.text


def test_no_routes_without_a_profiler_config(gateways):
    backend = ProfilingBackend(gateways.tokenizer)
    answers = _posts(gateways.app(backend, "m"), ("/start_profile", None), ("/stop_profile", None))
    assert [a.status_code for a in answers] == [404, 404] and not backend.calls


def test_the_routes_need_the_api_key_when_the_server_has_one(gateways):
    backend = ProfilingBackend(gateways.tokenizer)
    app = gateways.app(backend, "m", profiler=CONFIG, api_key="sesame")
    answers = _posts(app, ("/start_profile", None), ("/stop_profile", None))
    assert [a.status_code for a in answers] == [401, 401] and not backend.calls


def test_the_schema_describes_the_routes(gateways):
    from fastapi.testclient import TestClient

    app = gateways.app(ProfilingBackend(gateways.tokenizer), "m", profiler=CONFIG)
    with TestClient(app) as client:
        paths = client.get("/openapi.json").json()["paths"]
    for path, body, errors in (("/start_profile", "ProfileStarted", {"400", "413", "503"}),
                               ("/stop_profile", "ProfileStopped", {"503"})):  # fmt: skip
        responses = paths[path]["post"]["responses"]
        assert errors <= set(responses) and "422" not in responses, (path, responses)
        ok = responses["200"]["content"]["application/json"]["schema"]
        assert ok == {"$ref": f"#/components/schemas/{body}"}
