"""A ``halfmoon serve`` cluster as a child process, for tests and evaluation scripts.

It runs in a session of its own, so :meth:`LocalCluster.stop` also reaches any worker the
launcher left behind (by that process group, never by name), and it reads its children's
command lines from ``/proc`` to find their ports (Linux).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from halfmoon.serve.control.messages import (
    ConductorPong,
    Message,
    Ping,
    WorkerPong,
    decode_message,
    encode_message,
)
from halfmoon.serve.runtime import SECRET_ENV, die_with_parent, free_port


def children_of(pid: int) -> list[int]:
    """PIDs whose parent is ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def argv_of(pid: int) -> list[str]:
    """The command line of ``pid`` ([] once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


#: Lines of a child's exit that say nothing about why it failed (Triton's nanobind leak
#: report and multiprocessing's leaked-resource warnings fill a log's last kilobytes).
_NOISE = re.compile(
    r"^\s*(nanobind: |- leaked |- \.\.\. skipped remainder|See https://nanobind"
    r"|warnings\.warn\(|\S*resource_tracker\.py:\d+: UserWarning)"
)


def log_tail(text: str, chars: int = 4000) -> str:
    """The last ``chars`` characters of a log without exit noise, headed by its last
    traceback where that lies further back (what a failed start's error should show)."""
    lines = [line for line in text.splitlines() if not _NOISE.match(line)]
    tail = "\n".join(lines)[-chars:]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if starts:
        block = [lines[starts[-1]]]
        for line in lines[starts[-1] + 1 :]:
            block.append(line)
            if not line.startswith((" ", "Traceback", "During handling", "The above")) and line:
                break  # the exception's own line ends the traceback
        traceback = "\n".join(block)
        if traceback not in tail:
            tail = f"{traceback}\n[...]\n{tail}"
    return tail


class LocalCluster:
    """``halfmoon serve ARGS`` on a free port of 127.0.0.1 with its own cache and secret.

    ``with LocalCluster(args, cache_dir, secret, log_path) as c: c.base_url`` — or call
    :meth:`start`, :meth:`wait_ready` and :meth:`stop` yourself.
    """

    def __init__(self, args: Sequence[str], cache_dir: Path, secret: str, log_path: Path):
        self.args = list(args)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.cache = cache_dir
        self.secret = secret
        self.log_path = log_path
        self.env = {**os.environ, "HALFMOON_CACHE": str(cache_dir), SECRET_ENV: secret}
        self.proc: subprocess.Popen | None = None

    def start(self) -> LocalCluster:
        """Spawn the launcher (output to ``log_path``). Started from the main thread, it
        gets SIGTERM if this process dies (``die_with_parent``), so a test run or a
        benchmark killed before its cleanup leaves no cluster behind (the signal follows
        the thread that started it: from another thread it is left to :meth:`stop`)."""
        main = threading.current_thread() is threading.main_thread()
        with self.log_path.open("wb") as log:
            argv = [sys.executable, "-m", "halfmoon.cli", "serve", "--port", str(self.port)]
            self.proc = subprocess.Popen(  # noqa: PLW1509 (one prctl call)
                [*argv, *self.args], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=die_with_parent if main else None,
            )  # fmt: skip
        return self

    def __enter__(self) -> LocalCluster:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Until ``/health`` says ok; raises with the log's tail if serve dies or stalls."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited: {log_tail(self.log_path.read_text())}")
            with contextlib.suppress(OSError):  # not listening yet
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return
            time.sleep(0.3)
        raise TimeoutError(f"cluster not ready: {log_tail(self.log_path.read_text())}")

    def _children_with(self, word: str) -> list[tuple[int, list[str]]]:
        assert self.proc is not None
        found = [(pid, argv_of(pid)) for pid in children_of(self.proc.pid)]
        return [(pid, argv) for pid, argv in found if word in argv]

    def worker_ports(self) -> list[int]:
        """Command ports of the worker processes."""
        return [int(a[a.index("--port") + 1]) for _, a in self._children_with("worker")]

    def conductor_endpoint(self) -> str:
        """``tcp://127.0.0.1:PORT`` of the Conductor process."""
        for _, argv in self._children_with("conductor"):
            return f"tcp://127.0.0.1:{argv[argv.index('--port') + 1]}"
        raise RuntimeError("no conductor process found")

    def ping_workers(self, timeout_ms: int = 10_000) -> list[WorkerPong]:
        """Each worker's pong (load, integrity, its role's ``stats``), over the signed
        control plane."""
        pongs = []
        for port in self.worker_ports():
            pong = self._ping(f"tcp://127.0.0.1:{port}", timeout_ms)
            assert isinstance(pong, WorkerPong), pong
            pongs.append(pong)
        return pongs

    def ping_conductor(self, timeout_ms: int = 10_000) -> ConductorPong:
        """The Conductor's pong (instances, ``num_placements``, integrity)."""
        pong = self._ping(self.conductor_endpoint(), timeout_ms)
        assert isinstance(pong, ConductorPong), pong
        return pong

    def call_conductor(self, msg: Message, timeout_ms: int = 10_000) -> Message:
        """The Conductor's answer to ``msg`` (signed with the cluster's secret)."""
        return self._call(self.conductor_endpoint(), msg, timeout_ms)

    def _ping(self, endpoint: str, timeout_ms: int) -> Message:
        return self._call(endpoint, Ping(), timeout_ms)

    def _call(self, endpoint: str, msg: Message, timeout_ms: int) -> Message:
        import dataclasses

        import zmq

        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        try:
            msg = dataclasses.replace(msg, msg_id=1)
            sock.send_multipart(encode_message(msg, self.secret.encode()))
            assert sock.poll(timeout_ms), f"{endpoint} did not answer a {msg.wire_name}"
            return decode_message(sock.recv_multipart(), self.secret.encode())
        finally:
            sock.close(0)

    def stop(self) -> None:
        """SIGTERM the launcher (it stops its children); SIGKILL its session if needed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with contextlib.suppress(ProcessLookupError):  # nothing left: the usual case
            os.killpg(self.proc.pid, signal.SIGKILL)
