"""The Conductor service as a real process on 127.0.0.1, spoken to in plain wire maps
(what any client must send; the typed messages are halfmoon.serve.control.messages)."""

import itertools
import threading
import time

import pytest
import zmq

from halfmoon.serve.control.protocol import decode, encode, hashes_to_wire
from halfmoon.serve.runtime import free_port

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


def _register(client, iid, role, adapters=(), loaded=()):
    """Register ``iid``, which has loaded the adapter records ``loaded``; the reply must
    give it ``adapters``."""
    reply = client.call(
        {
            "type": "register",
            "instance_id": iid,
            "role": role,
            "command_endpoint": f"tcp://127.0.0.1:1/{iid}",
            "transfer_endpoint": f"127.0.0.1:2/{iid}",
            "kv_capacity_tokens": 100_000,
            "adapters": list(loaded),
        }
    )
    # the cluster's TBT SLO comes back: a decode worker's guard holds its steps to it
    assert reply == {
        "type": "registered", "instance_id": iid, "msg_id": reply["msg_id"], "tbt_slo_s": 1.0,
        "adapters": list(adapters),
    }  # fmt: skip


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
    # More than d0's 100,000 KV tokens: rejected when new, placed when the gateway says
    # it was admitted before (placed again after its worker died).
    big = {"type": "schedule", "input_length": 100_000, "output_length": 4, "block_size": 16,
           "hashes": hashes_to_wire(list(range(1, 100_000 // 16 + 1)))}  # fmt: skip
    refused = client.call({**big, "request_id": "big"})
    assert not refused["accepted"] and refused["reject_code"] == "kv_full", refused
    placed = client.call({**big, "request_id": "big~1", "admitted": True})
    assert placed["accepted"] and placed["decode"]["instance_id"] == "d0", placed


def test_wrong_secret_is_ignored_and_bad_messages_answered(spawn, port):
    spawn("conductor", "--port", str(port))
    good = Client(port)
    assert good.call({"type": "ping"}, timeout_ms=20_000)["type"] == "pong"
    assert Client(port, secret="wrong").call({"type": "ping"}, timeout_ms=500) is None
    assert good.call({"type": "nonsense"})["type"] == "error"
    malformed = good.call({"type": "schedule", "request_id": "r", "hashes": b""})
    assert malformed["type"] == "error", malformed
    assert "malformed 'schedule' message: input_length: missing" in malformed["error"]
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
    assert reply["reject_code"] == "no_instance"  # the gateway waits on this code only


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


def test_bookings_of_requests_that_fail_after_placement_are_released(spawn, port):
    """Placed requests whose workers never answer (a timeout), that a client hangs up on,
    or that a worker refuses leave no booking behind: the idle cluster then admits a
    request that needs the whole decode KV pool. (Before, each failure's booking stayed
    and the idle cluster refused large requests with 429s.)"""
    import asyncio

    from halfmoon.core.request import SamplingParams
    from halfmoon.serve.gateway.backend import BackendError
    from halfmoon.serve.gateway.cluster_client import ClusterBackend

    spawn("conductor", "--port", str(port), "--early-reject", "snapshot", "--ttft-slo", "600")
    client = Client(port)
    assert client.call({"type": "ping"}, timeout_ms=20_000)["type"] == "pong"
    for iid, role in (("p0", "prefill"), ("d0", "decode")):  # nobody listens on their ports
        dead = f"tcp://127.0.0.1:{free_port()}"
        reply = client.call({"type": "register", "instance_id": iid, "role": role,
                             "command_endpoint": dead, "transfer_endpoint": dead,
                             "kv_capacity_tokens": 100_000})  # fmt: skip
        assert reply["type"] == "registered"

    stop = threading.Event()

    def beat() -> None:  # the workers' heartbeats (a first-token timeout outlasts 3 s)
        heart = Client(port)
        while not stop.wait(0.5):
            for iid in ("p0", "d0"):
                heart.send({"type": "heartbeat", "instance_id": iid})

    threading.Thread(target=beat, daemon=True).start()

    async def scenario() -> None:
        backend = ClusterBackend(f"tcp://127.0.0.1:{port}", SECRET.encode(), 16,
                                 token_timeout_s=0.3)  # fmt: skip
        backend.watch_interval_s = 60.0  # the workers stay registered (heartbeats below)
        params = SamplingParams(max_tokens=1000, temperature=0)
        prompt = list(range(1_000))
        for i in range(2):  # the workers never answer: each request times out
            with pytest.raises(BackendError):  # (or the Conductor, slowed by a busy host)
                async for _ in backend.generate(f"timeout-{i}", prompt, params):
                    pass
        task = asyncio.ensure_future(_drain(backend.generate("hang-up", prompt, params)))
        await asyncio.sleep(0.1)
        task.cancel()  # the client went away while the request waited for its first token
        with pytest.raises(asyncio.CancelledError):
            await task
        await backend.close()

    try:
        asyncio.run(scenario())
    finally:
        stop.set()
    pong = client.call({"type": "ping"})
    assert pong["integrity"] == "ok" and pong["num_placements"] == 0
    # 99,500 of the 100,000 KV tokens: admitted only if nothing is still booked.
    hashes = hashes_to_wire(list(range(1, -(-98_500 // 16) + 1)))
    decision = client.call({"type": "schedule", "request_id": "whole-pool", "input_length":
                            98_500, "output_length": 1_000, "block_size": 16, "hashes": hashes})  # fmt: skip
    assert decision.get("accepted"), decision
    assert client.call({"type": "ping"})["integrity"] == "ok"


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def _peak_rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_oversized_and_unsigned_floods_cost_nothing(spawn, port):
    """A 200 MB frame is dropped by ZMQ before it is buffered (it once took the Conductor
    from 55 to 772 MiB), and thousands of unsigned messages write a handful of log lines
    (a 25 s flood once wrote 2.36M), while the service keeps answering."""
    proc = spawn("conductor", "--port", str(port))
    client = Client(port)
    assert client.call({"type": "ping"}, timeout_ms=20_000)["type"] == "pong"
    before = _peak_rss_mib(proc.pid)
    junk = zmq.Context.instance().socket(zmq.DEALER)
    junk.setsockopt(zmq.LINGER, 0)
    junk.connect(f"tcp://127.0.0.1:{port}")
    junk.send(b"x" * (200 * 2**20))
    for i in range(3000):
        junk.send_multipart([b"junk", str(i).encode()])
    assert client.call({"type": "ping"})["type"] == "pong"
    time.sleep(0.5)
    assert _peak_rss_mib(proc.pid) - before < 100
    flood = Client(port, secret="wrong-secret")
    for _ in range(3000):
        flood.send({"type": "ping"})
    assert client.call({"type": "ping"})["type"] == "pong"
    junk.close(0)
    proc.terminate()
    output = proc.communicate(timeout=10)[0].decode()
    dropped = [line for line in output.splitlines() if "dropped a control message" in line]
    assert 1 <= len(dropped) <= 10, len(dropped)


def test_the_adapters_loaded_while_serving_are_kept_and_given(spawn, port):
    """A gateway's ``adapter_update``: the Conductor keeps the list, answers with it, lists
    it in its pongs and gives it to every worker that registers from then on; a worker
    registering again with adapters the Conductor does not know (it restarted) brings them
    back, but not one unloaded through it."""
    spawn("conductor", "--port", str(port), "--ttft-slo", "60")
    client = Client(port)
    assert client.call({"type": "ping"}, timeout_ms=20_000)["adapters"] == []
    sql = {"name": "sql", "path": "/adapters/sql", "tag": "0123456789ab"}
    chat = {"name": "chat", "path": "/adapters/chat", "tag": "ba9876543210"}
    for record in (sql, chat):
        reply = client.call({"type": "adapter_update", "op": "load", "adapter": record})
        assert reply["type"] == "adapters_ok"
    assert reply["adapters"] == [sql, chat]
    _register(client, "d0", "decode", adapters=[sql, chat])
    unload = {"name": "sql", "path": "", "tag": ""}
    reply = client.call({"type": "adapter_update", "op": "unload", "adapter": unload})
    assert reply["adapters"] == [chat]
    assert client.call({"type": "ping"})["adapters"] == [chat]
    _register(client, "d1", "decode", adapters=[chat])
    bad = client.call({"type": "adapter_update", "op": "swap", "adapter": chat})
    assert bad["type"] == "error" and "load or unload" in bad["error"]
    code = {"name": "code", "path": "/adapters/code", "tag": "00aa00aa00aa"}
    _register(client, "d1", "decode", adapters=[chat, code], loaded=[sql, chat, code])
    assert client.call({"type": "ping"})["adapters"] == [chat, code]
    _register(client, "d2", "decode", adapters=[chat, code])
