"""The live decode worker's TBT guard (``--decode-guard``): the same decisions as the
simulator's decode instance, taken where a handed-off request joins the engine's batch."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

import pytest

from halfmoon.core.clock import ManualClock, WallClock
from halfmoon.core.config import SLOConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import Request, SamplingParams
from halfmoon.costmodel.decode_guard import ADMIT, REJECT, WAIT
from halfmoon.costmodel.profile import CostProfile, ProfileCostModel, fit_profile
from halfmoon.costmodel.serving import ServingTerms
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates
from halfmoon.engine.engine import RequestOutput
from halfmoon.metrics.records import RequestRecord
from halfmoon.serve.control.messages import Error, Expect, Handoff, WireParams
from halfmoon.serve.worker.decode import DecodeRole
from halfmoon.serve.worker.decode_guard import DecodeGuard, Held
from halfmoon.serve.worker.metrics import WorkerMetrics
from halfmoon.sim.config import ClusterSpec, InstanceSpec, SimConfig
from halfmoon.sim.decode import DecodeInstance
from halfmoon.sim.job import Job

SERVING = ServingTerms(decode_step_overhead_s=0.001, decode_per_seq_overhead_s=0.0005)


def _profile() -> CostProfile:
    """A step of ``0.01 + 0.002 * batch + 1e-6 * context`` seconds (fitted exactly)."""
    prefill = [(n, 0, n / 1000.0 + 0.01) for n in (100, 400, 1600)]
    decode = [(b, ctx, 0.01 + 0.002 * b + 1e-6 * ctx)
              for b, ctx in ((1, 100), (8, 6400), (32, 50000), (4, 900))]  # fmt: skip
    fitted = fit_profile(prefill, decode, "tiny", "test", created="2026-01-01")
    return fitted.with_serving(SERVING)


# -- the same decisions as the simulator ---------------------------------------------------------
def _sim_decode(
    guard: str, tbt_slo_s: float, profile: CostProfile, speculation=NO_SPECULATION
) -> tuple[DecodeInstance, list]:
    config = SimConfig(ClusterSpec.parse("1P1D"), slo=SLOConfig(ttft_s=30.0, tbt_s=tbt_slo_s),
                       decode_tbt_guard=guard, serving=profile.serving,
                       speculation=speculation)  # fmt: skip
    model = ProfileCostModel(profile, kv_bytes_per_token=1, link_bytes_per_s=1e9,
                             kv_capacity_tokens=1_000_000)  # fmt: skip
    spec = InstanceSpec(config=config, cost_model=model, kv_capacity_tokens=1_000_000)
    events: list = []
    return DecodeInstance("decode-0", spec, clock=ManualClock(), notify=events.append), events


def _job(rid: str, prompt: int) -> Job:
    request = Request(rid, 0.0, prompt, 50)
    return Job(request, RequestRecord(rid, 0.0, prompt, 50))


@pytest.mark.parametrize("guard", ["reject", "wait", "off"])
@pytest.mark.parametrize("tbt_slo_s", [0.001, 0.015, 0.025, 0.03, 1.0])
@pytest.mark.parametrize("rows", [1.0, 2.5])
def test_live_and_simulated_guards_decide_alike(guard, tbt_slo_s, rows):
    """One request decoding, a second one's KV arrives: the simulator's decode instance
    and the worker's guard estimate the same step and give the same verdict (the live
    request's context counts its prompt and the first token, as the simulator's does).
    Joined, the step is ~20 ms; alone ~14.5 ms; speculating (2.5 rows a sequence) ~32 and
    ~21 ms."""
    profile = _profile()
    rates = SpeculationRates(rows, 1.0 + (rows - 1.0) / 2)
    sim, _ = _sim_decode(guard, tbt_slo_s, profile, rates)
    live = DecodeGuard(guard, profile, lambda: tbt_slo_s, lambda: rates)
    assert live.check(1000 + 1)[0] == ADMIT  # a lone request always joins
    (step,) = sim.kv_arrived(_job("a", 1000))
    live.joined("a", 1000 + 1)
    assert sim.num_running == 1
    second = _job("b", 3000)
    assert live.step_estimate_s((3000 + 1,)) == pytest.approx(sim.step_estimate_s((second,)))
    verdict, _ = live.check(3000 + 1)
    sim.kv_arrived(second)
    step.action()  # the step boundary, where the simulator admits what waits
    outcome = {1: REJECT} if sim.num_refused else {1: WAIT, 2: ADMIT}
    assert verdict == outcome[sim.num_running]


def test_an_unknown_guard_is_named_and_a_guard_needs_a_profile():
    with pytest.raises(HalfmoonError, match="unknown --decode-guard 'maybe'"):
        DecodeGuard("maybe", _profile(), lambda: 1.0)
    with pytest.raises(HalfmoonError, match="needs the worker's cost profile"):
        DecodeGuard("reject", None, lambda: 1.0)
    from halfmoon.serve.worker.main import EngineOptions

    with pytest.raises(HalfmoonError, match="unknown --decode-guard 'maybe'"):
        EngineOptions(decode_guard="maybe")


def test_held_requests_join_in_arrival_order_and_expire():
    guard = DecodeGuard("wait", _profile(), lambda: 0.001)
    guard.joined("a", 100)
    assert guard.check(50)[0] == WAIT
    guard.hold(Held("b", 50, deadline_s=10.0, payload=None))
    assert guard.check(10)[0] == WAIT  # behind b, however small
    guard.hold(Held("c", 10, deadline_s=20.0, payload=None))
    assert guard.ready() is None  # a still decodes
    guard.advanced("a", 3)
    assert guard.context_tokens == {"a": 103}
    assert [h.request_id for h in guard.expired(now_s=15.0)] == ["b"]
    guard.left("a")
    ready = guard.ready()
    assert ready is not None and ready.request_id == "c"
    assert guard.stats() == {"guard_refused": 0, "guard_waited": 2, "guard_waiting": 0,
                             "guard_wait_expired": 1}  # fmt: skip


# -- the decode role: where the guard sits -------------------------------------------------------
class _Region:
    def __init__(self, size: int) -> None:
        self.size_bytes = size
        self.view = memoryview(bytearray(size))


class _Receiver:
    """A KV stream's receiving end: done (the handoff comes after it) unless a test
    says it is still arriving."""

    def __init__(self, done: bool) -> None:
        self.done = done
        self.error = None
        self.cancelled = False

    def wait(self, timeout_s: float) -> None:
        """Nothing arrives meanwhile."""

    def cancel(self) -> None:
        self.cancelled = True


class _Transfer:
    """What the decode role uses of its transfer engine: regions and stream receivers."""

    transport = "tcp"

    def __init__(self) -> None:
        self.regions = SimpleNamespace(get=lambda name: self.registered[name])
        self.registered: dict[str, _Region] = {}
        self.streams_done = True  # whether new streams have ended by their handoff
        self.receivers: list[_Receiver] = []

    def register_region(self, name: str, size: int, shared: bool = False) -> _Region:
        self.registered[name] = _Region(size)
        return self.registered[name]

    def unregister_region(self, name: str) -> None:
        del self.registered[name]

    def expect_stream(self, session, region, layout, decode=None) -> _Receiver:
        self.receivers.append(_Receiver(self.streams_done))
        return self.receivers[-1]

    def close(self) -> None:
        """Nothing to close."""


class _Engine:
    layout = SimpleNamespace(bytes_per_block=2 * 3 * 64, num_layers=3)
    config = SimpleNamespace(block_size=16)

    def __init__(self) -> None:
        self.imported: list[str] = []

    def import_request(self, state, params, kv) -> None:
        self.imported.append(state.request_id)

    def abort_request(self, request_id: str) -> bool:
        return request_id in self.imported

    def has_unfinished_requests(self) -> bool:
        return bool(self.imported)


class _Worker:
    def __init__(self) -> None:
        self.engine = _Engine()
        self.kv_codec = None
        self.metrics = WorkerMetrics()
        self.me = SimpleNamespace(instance_id="decode-0")
        self.sent: list[tuple[bytes, object]] = []
        self.events: list[tuple[str, str]] = []
        self.conductor = SimpleNamespace(event=lambda kind, **f: self.events.append(
            (kind, f["request_id"])))  # fmt: skip

    def send(self, identity: bytes, msg: object) -> None:
        self.sent.append((identity, msg))


def _role(guard: str, tbt_slo_s: float = 0.001) -> tuple[DecodeRole, _Worker, _Transfer]:
    worker, transfer = _Worker(), _Transfer()
    role = DecodeRole(worker, transfer, guard=DecodeGuard(guard, _profile(), lambda: tbt_slo_s))
    return role, worker, transfer


def _hand_off(role: DecodeRole, rid: str, prompt: int = 40) -> None:
    params = WireParams.of(SamplingParams(max_tokens=8))
    role._on_expect(b"gw", Expect(msg_id=1, request_id=rid, params=params,
                                  num_prompt_tokens=prompt))  # fmt: skip
    role._on_handoff(b"prefill", Handoff(request_id=rid, token_ids=list(range(prompt + 1)),
                                         num_prompt_tokens=prompt, num_computed_tokens=prompt,
                                         seed=0))  # fmt: skip


def _finish(role: DecodeRole, rid: str) -> None:
    out = RequestOutput(request_id=rid, new_token_ids=(7,), token_ids=(7,), text="",
                        finished=True, finish_reason="length", num_prompt_tokens=1,
                        num_cached_tokens=0)  # fmt: skip
    role.on_outputs([out])


def test_reject_refuses_a_request_that_would_slow_the_batch_and_tells_both_sides():
    role, worker, transfer = _role("reject")
    _hand_off(role, "a")  # alone: joins whatever its step
    _hand_off(role, "b")
    assert worker.engine.imported == ["a"]
    ((identity, error),) = [(i, m) for i, m in worker.sent if isinstance(m, Error)]
    assert identity == b"gw" and error.request_id == "b" and not error.retryable
    assert "decode-0 refused the request after its prefill" in error.error
    assert "1ms TBT SLO (decode guard 'reject')" in error.error
    assert ("request_finished", "b") in worker.events  # the Conductor's booking released
    assert list(transfer.registered) == []  # both landings given back
    assert role.stats()["guard_refused"] == 1


def test_the_metrics_count_the_guard_the_worker_set_after_the_profile_loaded():
    """The worker builds its role with the guard off and sets the real one once its cost
    profile is known: ``/metrics`` reads that one."""
    worker, transfer = _Worker(), _Transfer()
    role = DecodeRole(worker, transfer)
    role.guard = DecodeGuard("reject", _profile(), lambda: 0.001)
    _hand_off(role, "a")
    _hand_off(role, "b")
    get = worker.metrics.registry.get_sample_value
    assert get("halfmoon:decode_guard_refused_total") == 1
    assert get("halfmoon:decode_guard_waiting") == 0


def test_wait_holds_a_request_until_the_batch_has_room():
    role, worker, transfer = _role("wait")
    _hand_off(role, "a")
    _hand_off(role, "b")
    assert worker.engine.imported == ["a"] and role.num_pending() == 1
    assert list(transfer.registered) == ["kv-b"]  # its KV stays landed
    role.tick()
    assert worker.engine.imported == ["a"]  # a still decodes
    _finish(role, "a")
    role.tick()
    assert worker.engine.imported == ["a", "b"] and role.num_pending() == 0
    assert ("decode_started", "b") in worker.events and "b" in role.clients
    assert not [m for _, m in worker.sent if isinstance(m, Error)]
    assert list(transfer.registered) == []
    assert role.stats()["guard_waited"] == 1 and role.stats()["guard_waiting"] == 0


def test_a_request_held_past_its_deadline_or_aborted_ends_cleanly(monkeypatch):
    from halfmoon.serve.worker import decode_guard

    role, worker, transfer = _role("wait")
    _hand_off(role, "a")
    _hand_off(role, "b")
    _hand_off(role, "c")
    role.on_abort("c")  # the client went away while it waited
    assert ("request_finished", "c") in worker.events and role.num_pending() == 1
    later = decode_guard.time.monotonic() + 3600
    monkeypatch.setattr(decode_guard.time, "monotonic", lambda: later)
    role.tick()
    (error,) = [m for _, m in worker.sent if isinstance(m, Error)]
    assert error.request_id == "b" and "decode guard 'wait'" in error.error
    assert ("request_finished", "b") in worker.events
    assert list(transfer.registered) == [] and role.num_pending() == 0
    assert role.stats()["guard_wait_expired"] == 1


def test_off_admits_everything():
    role, worker, _ = _role("off")
    for rid in "abc":
        _hand_off(role, rid)
    assert worker.engine.imported == ["a", "b", "c"]
    assert role.stats()["guard_refused"] == role.stats()["guard_waited"] == 0


def test_a_worker_learns_the_clusters_tbt_slo_when_it_registers():
    from halfmoon.conductor import Conductor, ConductorConfig
    from halfmoon.serve.control.conductor_main import load_cost_model
    from halfmoon.serve.control.conductor_service import ConductorService
    from halfmoon.serve.worker.conductor_link import ConductorLink, WorkerIdentity

    secret = b"decode-guard-test-secret"
    config = ConductorConfig(block_size_tokens=16, slo=SLOConfig(ttft_s=5.0, tbt_s=0.25))
    conductor = Conductor(config, load_cost_model(None, 16384), WallClock(), random.Random(0))
    service = ConductorService(conductor, secret, "tcp://127.0.0.1:*")
    stop = threading.Event()
    thread = threading.Thread(target=service.serve_forever,
                              kwargs={"poll_ms": 20, "stop": stop.is_set})  # fmt: skip
    thread.start()
    try:
        link = ConductorLink(service.endpoint, secret, WorkerIdentity("decode", "d0", "c"))
        assert link.tbt_slo_s == 0.0
        link.register(1000, block_size=16, timeout_s=5)
        assert link.tbt_slo_s == 0.25
        link.close()
    finally:
        stop.set()
        thread.join(5)
        service.close()


def test_a_handoff_before_every_stream_ended_waits_outside_the_loop(monkeypatch):
    """A CPP group's last stage hands off while another stage's KV stream may still be
    arriving: the request waits among the expected ones (the loop goes on; it used to
    block up to 10 s in the handoff), joins once its streams ended, and fails, giving
    its landing back, if they do not end in time."""
    from halfmoon.serve.worker import decode

    role, worker, transfer = _role("off")
    transfer.streams_done = False
    _hand_off(role, "a")
    assert worker.engine.imported == [] and role.has_work() and role.num_pending() == 1
    role.tick()
    assert worker.engine.imported == []  # still arriving
    transfer.receivers[-1].done = True
    role.tick()
    assert worker.engine.imported == ["a"] and not role.has_work()
    assert ("decode_started", "a") in worker.events
    _hand_off(role, "b")
    monkeypatch.setattr(decode, "STREAM_AFTER_HANDOFF_S", 0.0)
    role.tick()
    (error,) = [m for _, m in worker.sent if isinstance(m, Error)]
    assert error.request_id == "b" and "not done" in error.error
    assert ("request_finished", "b") in worker.events and role.num_pending() == 0
    assert "kv-b" not in transfer.registered and not role.has_work()
