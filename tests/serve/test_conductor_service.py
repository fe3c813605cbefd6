"""The Conductor service as a real process on 127.0.0.1."""

import itertools

import zmq

from halfmoon.serve.protocol import decode, encode, hashes_to_wire

from .conftest import SECRET


class Client:
    def __init__(self, port: int, secret: str = SECRET) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.secret = secret.encode()
        self.ids = itertools.count()

    def send(self, msg):
        self.sock.send_multipart(encode(msg, self.secret))

    def call(self, msg, timeout_ms=10_000):
        msg = {**msg, "msg_id": next(self.ids)}
        self.send(msg)
        if not self.sock.poll(timeout_ms):
            return None
        reply = decode(self.sock.recv_multipart(), self.secret)
        assert reply["msg_id"] == msg["msg_id"]
        return reply


def _register(client, iid, role):
    reply = client.call(
        {
            "type": "register",
            "instance_id": iid,
            "role": role,
            "command_endpoint": f"tcp://127.0.0.1:1/{iid}",
            "transfer_endpoint": f"127.0.0.1:2/{iid}",
            "kv_capacity_tokens": 100_000,
        }
    )
    assert reply == {"type": "registered", "instance_id": iid, "msg_id": reply["msg_id"]}


def test_register_events_schedule(spawn, port):
    spawn("conductor", "--port", str(port), "--early-reject", "snapshot", "--ttft-slo", "60")
    client = Client(port)
    assert client.call({"type": "ping"}, timeout_ms=20_000)["type"] == "pong"
    _register(client, "p0", "prefill")
    _register(client, "p1", "prefill")
    _register(client, "d0", "decode")
    client.send(
        {
            "type": "events",
            "instance_id": "p1",
            "events": [{"kind": "stored", "hashes": hashes_to_wire([11, 12, 13]), "tier": "dram"}],
        }
    )
    reply = client.call(
        {
            "type": "schedule",
            "request_id": "r1",
            "input_length": 64,
            "output_length": 4,
            "block_size": 16,
            "hashes": hashes_to_wire([11, 12, 13, 14]),
        }
    )
    assert reply["accepted"], reply
    assert reply["prefill"]["instance_id"] == "p1"
    assert reply["prefill"]["command"] == "tcp://127.0.0.1:1/p1"
    assert reply["cached_tokens"] == 48
    assert reply["decode"]["instance_id"] == "d0"
    assert client.call({"type": "ping"})["instances"] == {
        "p0": "prefill",
        "p1": "prefill",
        "d0": "decode",
    }


def test_wrong_secret_is_ignored_and_bad_messages_answered(spawn, port):
    spawn("conductor", "--port", str(port))
    good = Client(port)
    assert good.call({"type": "ping"}, timeout_ms=20_000)["type"] == "pong"
    assert Client(port, secret="wrong").call({"type": "ping"}, timeout_ms=500) is None
    assert good.call({"type": "nonsense"})["type"] == "error"
    bad = good.call(
        {
            "type": "register",
            "instance_id": "x",
            "role": "chef",
            "command_endpoint": "",
            "transfer_endpoint": "",
        }
    )
    assert bad["type"] == "error" and "role" in bad["error"]
    reply = good.call(
        {
            "type": "schedule",
            "request_id": "r",
            "input_length": 16,
            "output_length": 1,
            "block_size": 16,
            "hashes": hashes_to_wire([1]),
        }
    )
    assert reply["accepted"] is False and "no prefill" in reply["reject_reason"]


def test_missing_secret_is_a_clear_error(spawn, port):
    proc = spawn("conductor", "--port", str(port), secret="")
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert b"HALFMOON_SECRET is not set" in out


def test_cpp_group_decision_names_every_stage(spawn, port):
    spawn("conductor", "--port", str(port), "--cpp-stages", "2", "--cpp-chunk-tokens", "64",
          "--cpp-min-tokens", "100", "--cpp-hidden-bytes-per-token", "1024")  # fmt: skip
    client = Client(port)
    assert client.call({"type": "ping"}, timeout_ms=20_000)["type"] == "pong"
    for iid, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode")):
        _register(client, iid, role)
    msg = {"type": "schedule", "output_length": 4, "block_size": 16}
    long = client.call({**msg, "request_id": "long", "input_length": 20_000,
                        "hashes": hashes_to_wire(list(range(1250)))})  # fmt: skip
    assert long["accepted"], long
    assert [m["instance_id"] for m in long["group"]] == ["p0", "p1"]
    assert long["group"][1]["transfer"] == "127.0.0.1:2/p1"
    assert long["cpp_chunk_tokens"] == 64 and long["prefill"]["instance_id"] == "p0"
    short = client.call({**msg, "request_id": "short", "input_length": 64,
                         "hashes": hashes_to_wire([7, 8, 9, 10])})  # fmt: skip
    assert short["accepted"] and "group" not in short
