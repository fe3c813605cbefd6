"""The worker loop: commands and engine steps take turns, whatever arrives."""

from __future__ import annotations

import time
from types import SimpleNamespace

import zmq

from halfmoon.engine.engine import EngineStats
from halfmoon.serve.worker.conductor_link import WorkerIdentity
from halfmoon.serve.worker.process import COMMANDS_PER_STEP, Worker
from tests.serve.fakes import RecordingLink

SECRET = b"worker-loop-secret-0123456789abc"
NUM_JUNK = 3 * COMMANDS_PER_STEP


class _Engine:
    """Always has work; records how many commands were handled before its first step."""

    def __init__(self) -> None:
        self.steps = 0
        self.handled_at_first_step: int | None = None
        self.worker: Worker | None = None
        self.config = SimpleNamespace(block_size=16)

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self) -> list:
        if self.steps == 0:
            assert self.worker is not None
            self.handled_at_first_step = self.worker.num_handled
        self.steps += 1
        return []

    def stats(self) -> EngineStats:
        return EngineStats(0, 1, 8, 8, 0, 0)

    def take_failures(self) -> list:
        return []

    def close(self) -> None:
        return None


class _Role:
    def has_work(self) -> bool:
        return False

    def on_outputs(self, outputs: list) -> None:
        assert outputs == []

    def tick(self) -> None:
        return None

    def handlers(self) -> dict:
        return {}

    def close(self) -> None:
        return None


def test_a_flood_of_junk_does_not_stop_the_engine():
    """Unsigned junk queued on the command socket is dropped a batch at a time between
    engine steps. Before, the loop drained the whole socket before stepping: a 25 s flood
    froze a worker's decoding for 25 s."""
    engine = _Engine()
    worker = Worker(WorkerIdentity("decode", "d0", ""), engine, SECRET, RecordingLink(),
                    "tcp://127.0.0.1:*")  # fmt: skip
    engine.worker = worker
    worker.set_role(_Role())
    sender = zmq.Context.instance().socket(zmq.DEALER)
    sender.setsockopt(zmq.LINGER, 0)
    sender.connect(worker.endpoint)
    try:
        for i in range(NUM_JUNK):
            sender.send_multipart([b"junk", str(i).encode()])
        deadline = time.monotonic() + 10
        while not worker._sock.poll(0) and time.monotonic() < deadline:  # noqa: SLF001
            time.sleep(0.01)
        time.sleep(0.3)  # let the whole flood arrive
        worker.run(stop=lambda: engine.steps >= 3)
        assert engine.handled_at_first_step == COMMANDS_PER_STEP
        assert worker.num_handled == 3 * COMMANDS_PER_STEP
    finally:
        sender.close(0)
        worker.close()


class _IdleEngine:
    config = SimpleNamespace(block_size=16)

    def has_unfinished_requests(self) -> bool:
        return False

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 8, 8, 0, 0)

    def check_integrity(self) -> None:
        return None

    def take_failures(self) -> list:
        return []

    def close(self) -> None:
        return None


class _Recorder(_Role):
    """A decode-like role that records what reaches it."""

    def __init__(self) -> None:
        self.expected: list[dict] = []
        self.aborted: list[str] = []

    def handlers(self) -> dict:
        return {"expect": lambda identity, msg: self.expected.append(msg)}

    def on_abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def stats(self) -> dict:
        return {"num_expected": len(self.expected)}


def test_commands_are_typed_before_the_role_sees_them():
    """A malformed command is refused with an ``error`` naming the field (the request is
    dropped), an unknown one too, a malformed complaint is not answered, and a good
    command reaches the role's handler as its typed message."""
    from halfmoon.core.request import SamplingParams
    from halfmoon.serve.control import messages as m
    from halfmoon.serve.control.protocol import encode

    role = _Recorder()
    worker = Worker(WorkerIdentity("decode", "d0", ""), _IdleEngine(), SECRET, RecordingLink(),
                    "tcp://127.0.0.1:*")  # fmt: skip
    worker.set_role(role)
    gateway = zmq.Context.instance().socket(zmq.DEALER)
    gateway.setsockopt(zmq.LINGER, 0)
    gateway.connect(worker.endpoint)
    expect = m.Expect(request_id="r2", params=m.WireParams.of(SamplingParams(max_tokens=4)),
                      num_prompt_tokens=40, msg_id=6)  # fmt: skip
    sent = [
        {"type": "expect", "request_id": "r1", "num_prompt_tokens": 40, "msg_id": 5},
        {"type": "nonsense", "msg_id": 7},
        {"type": "error", "error": 3},
        m.to_wire(expect),
        {"type": "ping", "msg_id": 8},
    ]
    try:
        for msg in sent:
            gateway.send_multipart(encode(msg, SECRET))
        worker.run(stop=lambda: worker.num_handled >= len(sent))
        replies = []
        while gateway.poll(1000) and len(replies) < 3:
            replies.append(m.decode_message(gateway.recv_multipart(), SECRET))
        refused, unknown, pong = replies
        assert isinstance(refused, m.Error) and (refused.request_id, refused.msg_id) == ("r1", 5)
        assert "malformed 'expect' message: params: missing" in refused.error
        assert isinstance(unknown, m.Error) and "unknown message type" in unknown.error
        assert isinstance(pong, m.WorkerPong) and pong.msg_id == 8
        assert pong.stats == {"num_expected": 1} and pong.integrity == "ok"
        assert role.aborted == ["r1"] and role.expected == [expect]
    finally:
        gateway.close(0)
        worker.close()
