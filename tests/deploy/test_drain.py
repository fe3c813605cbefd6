"""Draining: the Conductor service stops placing on an instance but keeps it known, and a
worker told to drain exits only once idle."""

import dataclasses
import itertools
import random
import threading

import pytest
import zmq

from halfmoon.conductor import Conductor, ConductorConfig
from halfmoon.core.clock import WallClock
from halfmoon.serve.control.conductor_main import load_cost_model
from halfmoon.serve.control.conductor_service import ConductorService
from halfmoon.serve.control.messages import (
    ConductorPong,
    Drain,
    Draining,
    Error,
    Heartbeat,
    Message,
    Ping,
    PlacementDecision,
    Register,
    Registered,
    Schedule,
    decode_message,
    encode_message,
)
from halfmoon.serve.control.protocol import hashes_to_wire
from halfmoon.serve.worker.conductor_link import WorkerIdentity
from halfmoon.serve.worker.process import DRAIN_QUIET_S, Worker

SECRET = b"drain-test-secret"


class InProcess:
    """A ConductorService on a free port, driven one message at a time."""

    def __init__(self) -> None:
        conductor = Conductor(ConductorConfig(block_size_tokens=16),  # the requests' blocks
                              load_cost_model(None, 16384), WallClock(), random.Random(0))  # fmt: skip
        self.service = ConductorService(conductor, SECRET, "tcp://127.0.0.1:*")
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.service.endpoint)
        self.ids = itertools.count()

    def call(self, msg: Message) -> Message | None:
        msg = dataclasses.replace(msg, msg_id=next(self.ids))
        self.sock.send_multipart(encode_message(msg, SECRET))
        self.service.handle_one()
        if not self.sock.poll(200):
            return None
        return decode_message(self.sock.recv_multipart(), SECRET)

    def register(self, iid: str, role: str, incarnation: str = "1", **extra) -> None:
        reply = self.call(Register(instance_id=iid, role=role,
                                   command_endpoint=f"tcp://127.0.0.1:1/{iid}",
                                   transfer_endpoint="", kv_capacity_tokens=100_000,
                                   incarnation=incarnation, **extra))  # fmt: skip
        assert isinstance(reply, Registered)

    def schedule(self, rid: str) -> PlacementDecision:
        reply = self.call(Schedule(request_id=rid, input_length=32, output_length=4,
                                   block_size=16, hashes=hashes_to_wire([1, 2])))  # fmt: skip
        assert isinstance(reply, PlacementDecision)
        return reply

    def pong(self) -> ConductorPong:
        reply = self.call(Ping())
        assert isinstance(reply, ConductorPong)
        return reply

    def close(self) -> None:
        self.sock.close(0)
        self.service.close()


@pytest.fixture
def svc():
    s = InProcess()
    yield s
    s.close()


def test_a_draining_instance_gets_no_placement_but_stays_known(svc):
    svc.register("p0", "prefill")
    svc.register("d0", "decode")
    svc.register("d1", "decode")
    assert isinstance(svc.call(Drain(instance_id="d1")), Draining)
    decodes = {svc.schedule(f"r{i}").decode.instance_id for i in range(20)}
    assert decodes == {"d0"}
    pong = svc.pong()
    # still known with its incarnation, so gateways do not fail its requests over
    assert pong.incarnations["d1"] == "1" and pong.draining == ["d1"]
    # its heartbeats say "drain"; the others' get no answer
    drain = svc.call(Heartbeat(instance_id="d1"))
    assert isinstance(drain, Drain) and drain.instance_id == "d1"
    assert svc.call(Heartbeat(instance_id="d0")) is None
    # draining twice is harmless; an unknown instance is an error
    assert isinstance(svc.call(Drain(instance_id="d1")), Draining)
    unknown = svc.call(Drain(instance_id="zz"))
    assert isinstance(unknown, Error) and "unknown instance" in unknown.error


def test_draining_the_last_decode_rejects_new_work(svc):
    svc.register("p0", "prefill")
    svc.register("d0", "decode")
    svc.call(Drain(instance_id="d0"))
    reply = svc.schedule("r")
    assert reply.accepted is False and "available" in reply.reject_reason


def test_a_draining_worker_registering_again_stays_out(svc):
    svc.register("p0", "prefill")
    svc.register("d0", "decode")
    svc.register("d1", "decode", draining=True)  # e.g. after a Conductor restart
    assert svc.pong().draining == ["d1"]
    assert {svc.schedule(f"r{i}").decode.instance_id for i in range(10)} == {"d0"}


def test_a_restarted_worker_is_placeable_at_once(svc):
    """A new incarnation registering before the old one expired replaces it (and is not
    removed along with the old one's state)."""
    svc.register("p0", "prefill")
    svc.register("d0", "decode", incarnation="a")
    svc.call(Drain(instance_id="d0"))
    svc.register("d0", "decode", incarnation="b")
    assert svc.pong().draining == []
    assert svc.schedule("r").decode.instance_id == "d0"


class _Engine:
    def __init__(self) -> None:
        self.busy = True

    def has_unfinished_requests(self) -> bool:
        return self.busy

    def close(self) -> None:
        self.busy = False


class _Role:
    def __init__(self) -> None:
        self.expected = 0

    def num_pending(self) -> int:
        return self.expected

    def close(self) -> None:
        self.expected = 0


class _Link:
    def __init__(self) -> None:
        self.draining = False

    def mark_draining(self) -> None:
        self.draining = True

    def close(self) -> None:
        self.draining = False


class _Beat:
    def __init__(self) -> None:
        self.drain = threading.Event()

    def close(self) -> None:
        self.drain.clear()


def test_worker_exits_only_after_its_requests_and_a_quiet_period():
    engine, role, link, beat = _Engine(), _Role(), _Link(), _Beat()
    worker = Worker(WorkerIdentity("decode", "d0", ""), engine, SECRET, link,
                    "tcp://127.0.0.1:*")  # fmt: skip
    try:
        worker.role, worker.heartbeat = role, beat
        engine.stats = lambda: type("S", (), {"num_running": 1})()
        engine.busy = False
        assert not worker.drained(0.0) and not link.draining  # not asked to drain
        beat.drain.set()
        engine.busy = True
        assert not worker.drained(10.0) and link.draining
        engine.busy, role.expected = False, 1  # a request still waits for its KV
        assert not worker.drained(20.0)
        role.expected = 0
        assert not worker.drained(30.0)
        assert not worker.drained(30.0 + DRAIN_QUIET_S / 2)
        assert worker.drained(30.0 + DRAIN_QUIET_S)
    finally:
        worker.close()
