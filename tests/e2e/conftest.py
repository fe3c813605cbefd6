"""Fixtures that start a real ``halfmoon serve`` cluster on 127.0.0.1 and always stop it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from halfmoon.serve.protocol import decode, encode
from halfmoon.serve.runtime import SECRET_ENV, free_port

SECRET = "e2e-test-secret-0123456789abcdef"


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and int(entry.name) != os.getpid():
            pids.append(int(entry.name))
    return pids


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


class Cluster:
    """A running ``halfmoon serve`` process."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.port = free_port()
        self.cache = tmp / "cache"
        env = {**os.environ, "HALFMOON_CACHE": str(self.cache), SECRET_ENV: SECRET}
        self.log = (tmp / "serve.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "halfmoon.cli", "serve", "--port", str(self.port), *args],
            env=env, stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "serve.log"

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if json.loads(r.read()).get("status") == "ok":
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"cluster not ready: {self.log_path.read_text()[-3000:]}")

    def worker_ports(self) -> list[int]:
        """Command ports of the worker processes (read from their command lines)."""
        ports = []
        for pid in children_of(self.proc.pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "worker" in argv:
                ports.append(int(argv[argv.index("--port") + 1]))
        return ports

    def ping_workers(self) -> list[dict]:
        """Each worker's pong (load, integrity), over the signed control plane."""
        import zmq

        pongs = []
        for port in self.worker_ports():
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            sock.send_multipart(encode({"type": "ping"}, SECRET.encode()))
            assert sock.poll(10_000), f"worker on port {port} did not answer"
            pongs.append(decode(sock.recv_multipart(), SECRET.encode()))
            sock.close(0)
        return pongs

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in processes_mentioning(str(self.cache)):
            os.kill(pid, 9)
        self.log.close()


@pytest.fixture(scope="module")
def cluster_factory(tmp_path_factory):
    """Start clusters with the given ``halfmoon serve`` arguments; stop them at the end."""
    started: list[Cluster] = []

    def start(*args: str) -> Cluster:
        cluster = Cluster(tmp_path_factory.mktemp("serve"), *args)
        started.append(cluster)
        cluster.wait_ready()
        return cluster

    yield start
    for cluster in started:
        cluster.stop()
