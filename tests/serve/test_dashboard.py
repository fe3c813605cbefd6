"""The live cluster page: its routes, its state document, the gateway's time series, and
the Conductor's ``status_query`` answer built from a real ConductorService.

In-process: the page in a real browser over a real cluster is tests/e2e/test_dashboard.py."""

from __future__ import annotations

import dataclasses
import random
import re
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
import zmq
from fastapi.testclient import TestClient

from halfmoon.conductor import Conductor, ConductorConfig
from halfmoon.core.clock import WallClock
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import SamplingParams
from halfmoon.serve.control.conductor_main import load_cost_model
from halfmoon.serve.control.conductor_service import ConductorService
from halfmoon.serve.control.messages import (
    ClusterStatus,
    Drain,
    Events,
    InstanceStatus,
    Message,
    PlacementDecision,
    Register,
    Schedule,
    StatusQuery,
    decode_message,
    encode_message,
    event_entry,
)
from halfmoon.serve.control.protocol import hashes_to_wire
from halfmoon.serve.control.status import SILENT_AFTER_S, instance_state
from halfmoon.serve.gateway.backend import GenerationChunk, Rejected
from halfmoon.serve.gateway.cluster_client import ClusterBackend
from halfmoon.serve.gateway.dashboard import finite, merge_workers
from halfmoon.serve.gateway.timeseries import TimeSeries, percentiles
from halfmoon.serve.launch.processes import ProcessGroup
from halfmoon.serve.worker.main import REFUSED_EXIT_CODE

SECRET = b"dashboard-secret"
REJECTED = [7, 7, 7]


class FixedBackend:
    """Generates 3 tokens in one chunk per request (``cached_tokens`` 2, 100 KV bytes);
    the prompt ``REJECTED`` is refused as the Conductor would."""

    def __init__(self) -> None:
        self.aborted: list[str] = []  # request ids the gateway aborted

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        if list(prompt_token_ids) == REJECTED:
            raise Rejected("estimated TTFT above the SLO")
        yield GenerationChunk((65, 66, 67), "length", 2, kv_transfer_bytes=100)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def health(self) -> dict[str, Any]:
        return {"mode": "fixed"}


class StatusBackend(FixedBackend):
    """A FixedBackend whose Conductor reports one worker and one decision."""

    async def cluster_status(self, num_decisions: int, timeout_s: float) -> ClusterStatus:
        row = InstanceStatus(instance_id="prefill-0", role="prefill", state="healthy",
                             kv_capacity_tokens=64)  # fmt: skip
        conductor = {"slo": {"ttft_s": 2.0, "tbt_s": 0.1}, "balancing": {"threshold": float("inf")}}
        decision = {"request_id": "r1", "accepted": True, "explain": "request r1 ..."}
        return ClusterStatus(instances=[row], conductor=conductor, decisions=[decision])


def _complete(client: TestClient, prompt: Any, **headers: str):
    body = {"model": "m", "prompt": prompt, "max_tokens": 3}
    return client.post("/v1/completions", json=body, headers=headers)


# -- routes ----------------------------------------------------------------------------------
def test_root_redirects_to_the_page_which_loads_only_its_own_files(gateways):
    with TestClient(gateways.app(FixedBackend(), "m")) as client:
        root = client.get("/", follow_redirects=False)
        assert root.status_code == 307 and root.headers["location"] == "/dashboard"
        page = client.get("/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert sorted(assets) == ["dashboard/assets/dashboard.css", "dashboard/assets/dashboard.js"]
        for path, kind in (("dashboard.js", "text/javascript"), ("dashboard.css", "text/css")):
            served = client.get(f"/dashboard/assets/{path}")
            assert served.status_code == 200 and served.headers["content-type"].startswith(kind)
            assert not re.search(r"https?://", served.text), f"{path} names another server"
        assert client.get("/dashboard/assets/secrets.txt").status_code == 404


def test_state_of_an_in_process_backend_has_the_gateways_series(gateways):
    with TestClient(gateways.app(FixedBackend(), "m")) as client:
        assert _complete(client, "hello").status_code == 200
        assert _complete(client, REJECTED).status_code == 429
        state = client.get("/dashboard/state").json()
    assert state["model"] == "m" and state["clustered"] is False
    assert state["workers"] == [] and state["decisions"] == [] and state["slo"] is None
    assert state["conductor"]["reachable"] is False
    assert state["gateway"]["paused"] is False and state["gateway"]["weight_version"] == "default"
    series = state["series"]
    assert sum(series["num_finished"]) == 1 and sum(series["num_rejected"]) == 1
    assert series["bucket_s"] == 5.0 and len(series["t_s"]) == len(series["ttft_p50_s"])
    num_prompt_tokens = len(gateways.tokenizer.encode("hello"))
    assert [v for v in series["prefix_hit_ratio"] if v is not None] == [2 / num_prompt_tokens]
    assert any(v for v in series["kv_bytes_per_s"])


def test_state_needs_the_api_key_but_the_page_does_not(gateways):
    with TestClient(gateways.app(FixedBackend(), "m", api_key="sk-1")) as client:
        assert client.get("/dashboard").status_code == 200
        assert client.get("/dashboard/assets/dashboard.js").status_code == 200
        assert client.get("/dashboard/state").status_code == 401
        wrong = client.get("/dashboard/state", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = client.get("/dashboard/state", headers={"Authorization": "Bearer sk-1"})
        assert ok.status_code == 200 and ok.json()["model"] == "m"


def test_state_merges_the_conductors_view_with_the_launchers_processes(gateways):
    from halfmoon.serve.gateway.app import GatewayConfig, create_app

    processes = {
        "conductor": {"state": "running", "pid": 1, "num_restarts": 0},
        "prefill-0": {"state": "restarting", "pid": 2, "num_restarts": 1},
        "decode-0": {"state": "running", "pid": 3, "num_restarts": 0},
    }
    app = create_app(StatusBackend(), gateways.tokenizer, GatewayConfig("m", 256),
                     process_states=lambda: processes)  # fmt: skip
    with TestClient(app) as client:
        state = client.get("/dashboard/state").json()
    workers = {w["instance_id"]: w for w in state["workers"]}
    assert workers["prefill-0"]["state"] == "restarting"  # its process, not the last report
    assert workers["prefill-0"]["registered"] and workers["prefill-0"]["kv_capacity_tokens"] == 64
    assert workers["decode-0"]["state"] == "starting" and not workers["decode-0"]["registered"]
    assert workers["decode-0"]["role"] == "decode"
    assert state["conductor"]["process"]["pid"] == 1 and state["conductor"]["reachable"]
    assert state["conductor"]["balancing"]["threshold"] is None  # inf: not JSON
    assert state["slo"] == {"ttft_s": 2.0, "tbt_s": 0.1}
    assert state["decisions"][0]["request_id"] == "r1"


def test_merge_and_finite_helpers():
    assert finite({"a": [1.0, float("nan"), -float("inf")], "b": "x"}) == {
        "a": [1.0, None, None],
        "b": "x",
    }
    assert merge_workers(None, {"coupled-1": {"state": "stopped"}}) == [
        {"instance_id": "coupled-1", "role": "coupled", "state": "stopped",
         "process": {"state": "stopped"}, "registered": False}
    ]  # fmt: skip


# -- the time series -------------------------------------------------------------------------
class FakeClock:
    def __init__(self, now_s: float = 1000.0) -> None:
        self.now_s = now_s

    def __call__(self) -> float:
        return self.now_s


def test_percentiles_interpolate_linearly():
    assert percentiles([]) == [None, None, None]
    assert percentiles([3.0]) == [3.0, 3.0, 3.0]
    values = [float(v) for v in range(1, 101)]  # 1..100
    p50, p90, p99 = percentiles(values)
    assert p50 == pytest.approx(50.5) and p90 == pytest.approx(90.1)
    assert p99 == pytest.approx(99.01)


def test_series_buckets_percentiles_and_rates():
    clock = FakeClock(1000.0)  # bucket 200 starts at 1000 s
    series = TimeSeries(bucket_s=5.0, window_s=30.0, clock=clock)
    for ttft_s in (0.1, 0.2, 0.3, 0.4):
        series.finished(ttft_s, [0.01, 0.03], 100, 25, 3)
    series.rejected()
    series.kv_moved(500)
    clock.now_s = 1007.0  # the next bucket, 2 s into it
    series.finished(None, [], 10, 0, 0)  # no token came
    series.failed()
    snap = series.snapshot()
    assert snap["t_s"] == [-7.0, -2.0]
    assert snap["num_finished"] == [4, 1] and snap["num_rejected"] == [1, 0]
    assert snap["requests_per_s"] == [4 / 5.0, 1 / 2.0]  # the current bucket: over 2 s
    assert snap["errors_per_s"] == [0.0, 0.5]
    assert snap["kv_bytes_per_s"] == [100.0, 0.0]
    assert snap["prefix_hit_ratio"] == [0.25, 0.0]
    assert snap["ttft_p50_s"] == [pytest.approx(0.25), None]
    assert snap["ttft_p90_s"][0] == pytest.approx(0.37)
    assert snap["itl_p50_s"][0] == pytest.approx(0.02) and snap["itl_p99_s"][1] is None


def test_series_forgets_what_left_the_window_and_fills_gaps():
    clock = FakeClock(0.0)
    series = TimeSeries(bucket_s=5.0, window_s=20.0, clock=clock)  # 4 buckets
    series.finished(1.0, [], 1, 0, 1)
    clock.now_s = 12.0
    series.finished(2.0, [], 1, 0, 1)
    snap = series.snapshot()
    assert snap["num_finished"] == [1, 0, 1]  # an empty bucket in between
    clock.now_s = 31.0  # bucket 6: buckets 3..6 are the window
    snap = series.snapshot()
    assert snap["t_s"] == [-16.0, -11.0, -6.0, -1.0]
    assert snap["num_finished"] == [0, 0, 0, 0] and snap["ttft_p50_s"] == [None] * 4


def test_series_memory_is_bounded():
    clock = FakeClock(0.0)
    series = TimeSeries(bucket_s=1.0, window_s=10.0, max_samples=8, clock=clock,
                        rng=random.Random(1))  # fmt: skip
    for step in range(100):
        clock.now_s = step * 0.5
        series.finished(float(step), [0.001] * 50, 10, 5, 50)
    buckets = series._buckets  # noqa: SLF001 - the bound is the point of this test
    assert len(buckets) == 10
    assert all(len(b.ttft.values) <= 8 and len(b.itl.values) == 8 for b in buckets)
    assert buckets[-1].itl.num_seen == 100  # two requests' gaps in the last bucket
    with pytest.raises(ValueError):
        TimeSeries(bucket_s=0)


# -- the Conductor's side --------------------------------------------------------------------
class Peer:
    """A DEALER speaking typed messages to the service, which this thread serves."""

    def __init__(self, service: ConductorService) -> None:
        self.service = service
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(service.endpoint)

    def send(self, msg: Message) -> None:
        self.sock.send_multipart(encode_message(msg, SECRET))
        self.service.handle_one()

    def call(self, msg: Message) -> Message:
        self.send(dataclasses.replace(msg, msg_id=7))
        assert self.sock.poll(5000)
        return decode_message(self.sock.recv_multipart(), SECRET)


def _register(peer: Peer, iid: str, role: str) -> None:
    peer.call(Register(instance_id=iid, role=role, command_endpoint=f"tcp://127.0.0.1:1/{iid}",
                       transfer_endpoint=f"127.0.0.1:2/{iid}", kv_capacity_tokens=4096))  # fmt: skip


def _schedule(peer: Peer, request_id: str, hashes: list[int]) -> PlacementDecision:
    reply = peer.call(Schedule(request_id=request_id, input_length=64, output_length=4,
                               block_size=16, hashes=hashes_to_wire(hashes)))  # fmt: skip
    assert isinstance(reply, PlacementDecision)
    return reply


@pytest.fixture
def service():
    config = ConductorConfig(block_size_tokens=16, slo=SLOConfig(ttft_s=5.0, tbt_s=0.2))
    core = Conductor(config, load_cost_model(None, 16384), WallClock(), random.Random(0))
    service = ConductorService(core, SECRET, "tcp://127.0.0.1:*")
    yield service
    service.close()


def test_cluster_status_from_a_real_service(service):
    peer = Peer(service)
    _register(peer, "p0", "prefill")
    assert not _schedule(peer, "r1", [1, 2, 3, 4]).accepted  # no decode instance yet
    _register(peer, "d0", "decode")
    _register(peer, "d1", "decode")
    load = event_entry(
        "load",
        num_running=2,
        num_waiting=1,
        kv_used_tokens=32,
        kv_capacity_tokens=4096,
        queued_prefill_tokens=48,
        store={"misses": 3},
    )
    stored = event_entry("stored", hashes=hashes_to_wire([1, 2]), tier="dram")
    peer.send(Events(instance_id="p0", events=[stored, load]))
    assert _schedule(peer, "r2", [1, 2, 3, 4]).accepted
    peer.call(Drain(instance_id="d1"))

    status = peer.call(StatusQuery(num_decisions=2))
    assert isinstance(status, ClusterStatus)
    rows = {r.instance_id: r for r in status.instances}
    assert sorted(rows) == ["d0", "d1", "p0"]
    p0 = rows["p0"]
    assert (p0.role, p0.state, p0.num_running, p0.num_waiting) == ("prefill", "healthy", 2, 1)
    assert (p0.kv_used_tokens, p0.queued_prefill_tokens, p0.index_blocks) == (32, 48, 2)
    assert p0.store == {"misses": 3} and p0.seen_s_ago < 1.0
    assert rows["d1"].state == "draining" and rows["d0"].kv_capacity_tokens == 0  # no report
    c = status.conductor
    assert c["slo"]["ttft_s"] == 5.0 and c["slo"]["tbt_s"] == 0.2
    assert c["num_placements"] == 1 and c["integrity"] == "ok" and c["draining"] == ["d1"]
    assert c["recent_rejections"] == {"no_instance": 1} and c["num_recent_decisions"] == 2

    newest, oldest = status.decisions  # newest first
    assert newest["request_id"] == "r2" and newest["accepted"] and newest["decode"] == "d0"
    assert newest["prefill"] == "p0" and newest["cached_tokens"] == 32
    chosen = [c for c in newest["candidates"] if c["chosen"]]
    assert [c["instance"] for c in chosen] == ["p0"] and chosen[0]["ttft_s"] > 0
    assert newest["est_ttft_s"] == pytest.approx(chosen[0]["ttft_s"])
    assert [d["instance"] for d in newest["decode_candidates"] if d["chosen"]] == ["d0"]
    assert newest["explain"].startswith("request r2 policy=") and "*p0" in newest["explain"]
    assert newest["decision_s"] >= 0 and newest["at_s"] >= oldest["at_s"]
    assert oldest["request_id"] == "r1" and not oldest["accepted"]
    assert oldest["reject_code"] == "no_instance" and "REJECTED" in oldest["explain"]
    assert len(peer.call(StatusQuery(num_decisions=0)).decisions) == 0
    peer.sock.close(0)


def test_instance_state():
    assert instance_state(False, 0.1) == "healthy"
    assert instance_state(False, SILENT_AFTER_S + 0.1) == "silent"
    assert instance_state(True, 0.0) == "draining"


def test_the_page_state_over_a_cluster_backend(service, gateways):
    peer = Peer(service)
    _register(peer, "p0", "prefill")
    _register(peer, "d0", "decode")
    _schedule(peer, "r1", [5, 6, 7, 8])
    peer.sock.close(0)
    stop = threading.Event()
    thread = threading.Thread(target=service.serve_forever, args=(20, stop.is_set), daemon=True)
    thread.start()
    backend = ClusterBackend(service.endpoint, SECRET, 16)
    try:
        with TestClient(gateways.app(backend, "m")) as client:
            state = client.get("/dashboard/state", params={"decisions": 5}).json()
            client.portal.call(backend.close)
    finally:
        stop.set()
        thread.join(5)
    assert state["clustered"] and state["conductor"]["reachable"]
    assert [w["instance_id"] for w in state["workers"]] == ["d0", "p0"]
    assert state["slo"]["ttft_s"] == 5.0
    assert [d["request_id"] for d in state["decisions"]] == ["r1"]


# -- the launcher's side ---------------------------------------------------------------------
class _Group(ProcessGroup):
    """Children are ``python -c CODE`` (the argv's first item)."""

    def _popen(self, argv: tuple[str, ...]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", argv[0]])


def test_process_states_tell_restarting_from_stopped():
    group = _Group("dashboard-secret-0123456789abcdef")
    group.spawn("decode-0", "import time; time.sleep(60)")
    group.spawn("prefill-0", "raise SystemExit(1)").wait(30)
    group.spawn("prefill-1", f"raise SystemExit({REFUSED_EXIT_CODE})").wait(30)
    try:
        group.supervise(now_s=100.0)  # notices both exits; prefill-0 waits out its backoff
        states = group.states()
        assert {name: s["state"] for name, s in states.items()} == {
            "decode-0": "running", "prefill-0": "restarting", "prefill-1": "stopped",
        }  # fmt: skip
        assert states["decode-0"]["pid"] == group.procs[0][1].pid
        assert all(s["num_restarts"] == 0 for s in states.values())
    finally:
        group.stop(timeout_s=5)


class ChunkedBackend(FixedBackend):
    """Four tokens in three chunks: one, two together (one engine step's, as accepted
    draft tokens come), one."""

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        yield GenerationChunk((65,), None, 2)
        yield GenerationChunk((66, 67), None)
        yield GenerationChunk((68,), "length")


def test_tokens_that_arrive_together_are_one_inter_token_gap(gateways):
    from halfmoon.metrics.latency import tbt_gaps_s

    assert tbt_gaps_s([1.0, 2.0, 2.0, 2.5]) == [1.0, 0.5]
    assert tbt_gaps_s([3.0, 3.0, 3.0]) == [] and tbt_gaps_s([]) == []

    def itl_count(backend) -> float:
        with TestClient(gateways.app(backend, "m")) as client:
            body = {"model": "m", "prompt": "hello", "max_tokens": 4}
            assert client.post("/v1/completions", json=body).status_code == 200
            text = client.get("/metrics").text
        (line,) = [ln for ln in text.splitlines()
                   if ln.startswith("halfmoon:inter_token_latency_seconds_count")]  # fmt: skip
        return float(line.rsplit(" ", 1)[1])

    assert itl_count(ChunkedBackend()) == 2  # three arrivals
    assert itl_count(FixedBackend()) == 0  # all three tokens at once
