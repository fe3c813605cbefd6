"""Transfer fixtures: engines closed after each test, peer processes always killed.

Peer processes run ``python -m halfmoon.transfer.peer`` on 127.0.0.1 (free ports) and
print JSON lines; :class:`PeerProcess` reads them on a thread so a test can wait for a
given event with a timeout instead of blocking forever.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from transfer_testing import SECRET

from halfmoon.transfer import InProcessHub, TransferEngine
from halfmoon.transfer.peer import SECRET_ENV


class PeerProcess:
    """A running peer process and the JSON lines it printed."""

    def __init__(self, args: list[str], secret: bytes = SECRET, prefix: list[str] = ()) -> None:
        """``prefix``: a command that ends by exec-ing its arguments (it keeps the pid)."""
        env = {**os.environ, SECRET_ENV: secret.hex(), "OPENBLAS_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "halfmoon.transfer.peer", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._lines: queue.Queue[dict] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(json.loads(line))

    def next_line(self, key: str, timeout_s: float = 10.0) -> dict:
        """The next printed record holding ``key`` (others are skipped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"peer printed no {key!r} line within {timeout_s} s")
            try:
                record = self._lines.get(timeout=min(remaining, 0.1))
            except queue.Empty:
                if self.proc.poll() is not None and self._lines.empty():
                    raise AssertionError(
                        f"peer exited with {self.proc.returncode} before a {key!r} line"
                    ) from None
                continue
            if key in record:
                return record

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def freeze(self, timeout_s: float = 5.0) -> None:
        """SIGSTOP the process and wait until the kernel reports it stopped."""
        self.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return
            time.sleep(0.01)
        raise AssertionError("peer did not stop")

    def kill(self) -> None:
        """Stop the process: politely (stdin EOF frees its shared memory), else SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait(timeout=10)
        self._reader.join(timeout=10)  # the pipe reaches EOF once the process is gone
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass  # stdin of a dead process: nothing left to flush


@pytest.fixture
def spawn_peer() -> Iterator[Callable[..., PeerProcess]]:
    """Start peer processes; every one is killed at the end, whatever happened."""
    started: list[PeerProcess] = []

    def spawn(*args: str, secret: bytes = SECRET, prefix: list[str] = ()) -> PeerProcess:
        peer = PeerProcess(list(args), secret, list(prefix))
        started.append(peer)
        return peer

    yield spawn
    for peer in started:
        peer.kill()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., TransferEngine]]:
    """Start in-process engines (shared secret, 127.0.0.1, free ports); all closed at the end."""
    engines: list[TransferEngine] = []

    def make(**kwargs) -> TransferEngine:
        engine = TransferEngine(kwargs.pop("secret", SECRET), **kwargs)
        engines.append(engine)
        engine.start()
        return engine

    yield make
    for engine in engines:
        engine.close()


@pytest.fixture
def hub() -> InProcessHub:
    return InProcessHub()
