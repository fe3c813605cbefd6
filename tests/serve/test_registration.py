"""The registration handshake: a worker whose block size, model, dtype or KV compression
disagrees with the cluster's is refused, and says so."""

from __future__ import annotations

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
    ClusterIdentity,
    ConductorPong,
    Error,
    Message,
    Ping,
    PlacementDecision,
    Refused,
    Register,
    Registered,
    Schedule,
    decode_message,
    encode_message,
)
from halfmoon.serve.control.protocol import hashes_to_wire
from halfmoon.serve.runtime import free_port
from halfmoon.serve.worker.conductor_link import ConductorLink, RegistrationRefused, WorkerIdentity

SECRET = b"registration-test-secret"
MODEL = "smollm2-135m-instruct#0123456789ab"


@pytest.fixture
def service():
    conductor = Conductor(ConductorConfig(block_size_tokens=16), load_cost_model(None, 16384),
                          WallClock(), random.Random(0))  # fmt: skip
    svc = ConductorService(conductor, SECRET, "tcp://127.0.0.1:*")
    yield svc
    svc.close()


class Client:
    """Sends one message and lets the service handle it (no thread)."""

    def __init__(self, svc: ConductorService) -> None:
        self.svc = svc
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(svc.endpoint)
        self.ids = itertools.count()

    def call(self, msg: Message) -> Message:
        msg = dataclasses.replace(msg, msg_id=next(self.ids))
        self.sock.send_multipart(encode_message(msg, SECRET))
        self.svc.handle_one()
        assert self.sock.poll(2000)
        reply = decode_message(self.sock.recv_multipart(), SECRET)
        assert reply.msg_id == msg.msg_id
        return reply

    def register(self, iid: str, role: str = "decode", **declared) -> Message:
        return self.call(Register(instance_id=iid, role=role, command_endpoint=f"tcp://h:1/{iid}",
                                  transfer_endpoint="h:2", kv_capacity_tokens=1000, **declared))  # fmt: skip


def test_the_first_worker_sets_model_and_dtype_and_others_must_agree(service):
    client = Client(service)
    ok = {"block_size": 16, "model": MODEL, "dtype": "float32", "kv_compression": "int8"}
    assert isinstance(client.register("p0", "prefill", **ok), Registered)
    assert service.cluster == ClusterIdentity(
        block_size=16, model=MODEL, dtype="float32", kv_compression="int8"
    )
    for iid, change, named in [
        ("d0", {"block_size": 32}, "block size 32 (the cluster's is 16)"),
        ("d1", {"model": "other#ffffffffffff"}, "model 'other#ffffffffffff'"),
        ("d2", {"dtype": "bfloat16"}, "dtype 'bfloat16' (the cluster's is 'float32')"),
        ("d4", {"kv_compression": "none"}, "KV compression 'none' (the cluster's is 'int8')"),
    ]:
        reply = client.register(iid, **{**ok, **change})
        assert isinstance(reply, Refused), reply
        assert reply.error.startswith(f"{iid} disagrees with the cluster: ")
        assert named in reply.error
    assert isinstance(client.register("d3", **ok), Registered)
    pong = client.call(Ping())
    assert isinstance(pong, ConductorPong)
    assert pong.instances == {"p0": "prefill", "d3": "decode"}  # no refused one
    assert pong.cluster == service.cluster


def test_the_block_size_is_the_conductors_even_for_the_first_worker(service):
    reply = Client(service).register("p0", "prefill", block_size=64, model=MODEL, dtype="float32")
    assert isinstance(reply, Refused) and "block size 64 (the cluster's is 16)" in reply.error
    assert service.cluster.model is None  # a refused worker sets nothing


def test_a_placement_hashed_with_another_block_size_is_an_error(service):
    client = Client(service)
    client.register("p0", "prefill")
    client.register("d0", "decode")
    msg = Schedule(request_id="r", input_length=64, output_length=4, block_size=32,
                   hashes=hashes_to_wire([1, 2]))  # fmt: skip
    reply = client.call(msg)
    assert isinstance(reply, Error) and "32-token blocks; the cluster uses 16" in reply.error
    reply = client.call(dataclasses.replace(msg, input_length=32, block_size=16))
    assert isinstance(reply, PlacementDecision) and reply.accepted


def test_a_refused_worker_gets_an_error_naming_the_mismatch(service):
    stop = threading.Event()
    thread = threading.Thread(target=service.serve_forever, kwargs={"poll_ms": 20,
                                                                    "stop": stop.is_set})  # fmt: skip
    thread.start()
    try:
        first = ConductorLink(service.endpoint, SECRET, WorkerIdentity("prefill", "p0", "c"))
        first.register(1000, block_size=16, model=MODEL, dtype="float32", timeout_s=5)
        link = ConductorLink(service.endpoint, SECRET, WorkerIdentity("decode", "d0", "c"))
        with pytest.raises(RegistrationRefused, match="dtype 'float16'.*'float32'"):
            link.register(1000, block_size=16, model=MODEL, dtype="float16", timeout_s=5)
        for each in (first, link):
            each.close()
    finally:
        stop.set()
        thread.join(5)


def test_a_worker_process_with_another_block_size_exits_naming_it(spawn, port, tmp_path,
                                                                  monkeypatch):  # fmt: skip
    from halfmoon.costmodel.profile import fit_profile
    from halfmoon.serve.worker.main import REFUSED_EXIT_CODE

    secret = "registration-process-secret"
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path))
    profile = tmp_path / "profile.json"  # given: the worker measures nothing
    prefill = [(n, 0, n / 1000.0 + 0.01) for n in (100, 400, 1600)]
    decode = [(b, ctx, 0.02 + 1e-8 * ctx) for b, ctx in ((1, 100), (8, 6400), (32, 50000))]
    fit_profile(prefill, decode, "tiny", "test", created="2026-01-01").save(profile)
    spawn("conductor", "--port", str(port), "--block-size", "16", secret=secret)
    worker = spawn("worker", "--role", "decode", "--port", str(free_port()),
                   "--conductor", f"tcp://127.0.0.1:{port}", "--model", "tiny",
                   "--block-size", "32", "--kv-cache-mb", "4", "--profile", str(profile),
                   "--attention", "reference",  # no kernel built for a worker refused anyway
                   secret=secret)  # fmt: skip
    out, _ = worker.communicate(timeout=180)
    assert worker.returncode == REFUSED_EXIT_CODE, out.decode()[-2000:]
    assert b"disagrees with the cluster: block size 32 (the cluster's is 16)" in out
