"""The worker loop: commands and engine steps take turns, whatever arrives."""

from __future__ import annotations

import time
from types import SimpleNamespace

import zmq

from halfmoon.serve.worker import COMMANDS_PER_STEP, Worker, WorkerIdentity

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

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(num_running=1, num_waiting=0, num_blocks=8, num_free_blocks=8)


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


class _Link:
    def event(self, kind: str, **fields: object) -> None:
        assert kind

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


def test_a_flood_of_junk_does_not_stop_the_engine():
    """Unsigned junk queued on the command socket is dropped a batch at a time between
    engine steps. Before, the loop drained the whole socket before stepping: a 25 s flood
    froze a worker's decoding for 25 s."""
    engine = _Engine()
    worker = Worker(WorkerIdentity("decode", "d0", ""), engine, SECRET, _Link(),
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
