"""A local two-node Ray cluster on this machine, always stopped (even when a test fails).

Every process it starts carries a marker in its environment (Ray passes its environment
on to the actors, and they to the halfmoon processes they start), which is how the
fixture finds what is left, by pid, without touching anybody else's processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from halfmoon.engine.catalog import cache_dir
from halfmoon.serve.runtime import free_port

MARK = "HALFMOON_TEST_RAY_MARK"


def marked_processes(mark: str) -> list[int]:
    """PIDs (not zombies) whose environment has ``MARK=mark``."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


@dataclass
class RayNodes:
    """A head with ``{"prefill": 1}`` and a second raylet with ``{"decode": 2}``."""

    address: str
    env: dict[str, str]
    mark: str
    root: Path

    def ray(self, *argv: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        """``ray ARGV`` with the cluster's environment."""
        ray_bin = str(Path(sys.executable).with_name("ray"))
        return subprocess.run([ray_bin, *argv], env=self.env, capture_output=True, text=True,
                              timeout=timeout_s)  # fmt: skip

    def halfmoon(self, *argv: str, log: Path) -> subprocess.Popen:
        """``halfmoon ARGV`` in a session of its own, output to ``log``."""
        with log.open("wb") as out:
            return subprocess.Popen([sys.executable, "-m", "halfmoon.cli", *argv], env=self.env,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip

    def stop(self) -> None:
        """``ray stop --force``, then SIGKILL whatever still carries the marker."""
        try:
            self.ray("stop", "--force", timeout_s=60)
        finally:
            deadline = time.monotonic() + 10
            while (left := marked_processes(self.mark)) and time.monotonic() < deadline:
                for pid in left:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass  # exited meanwhile
                time.sleep(0.2)


def _node_argv(root: Path, name: str, resources: str, num_cpus: int) -> list[str]:
    return [
        "--num-cpus", str(num_cpus), "--resources", resources,
        "--object-store-memory", "100000000", "--node-ip-address", "127.0.0.1",
        "--temp-dir", str(root / name), "--disable-usage-stats",
        "--node-manager-port", str(free_port()), "--object-manager-port", str(free_port()),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def ray_nodes():
    """Start the two nodes; stop them and everything they started at the end."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'halfmoon[ray]')")
    root = Path(tempfile.mkdtemp(prefix="hmray-", dir="/tmp"))  # short: Ray's socket paths
    mark = uuid.uuid4().hex
    port = free_port()
    # RAY_AUTH_MODE: a ~/.ray/auth_token (left by any local ray.init()) would switch the head
    # to token auth but not the second node, which then cannot join
    # The compiled kernels stay shared (a fresh cache would rebuild them, ~25 s a shape).
    kernels = os.environ.get("HALFMOON_KERNEL_CACHE") or str(cache_dir() / "kernels")
    env = {**os.environ, MARK: mark, "HALFMOON_CACHE": str(root / "cache"),
           "HALFMOON_KERNEL_CACHE": kernels,
           "RAY_DEDUP_LOGS": "0", "PYTHONWARNINGS": "ignore::DeprecationWarning",
           "RAY_AUTH_MODE": "disabled"}  # fmt: skip
    nodes = RayNodes(f"127.0.0.1:{port}", env, mark, root)
    try:
        head = nodes.ray("start", "--head", "--port", str(port), "--include-dashboard=false",
                         *_node_argv(root, "head", '{"prefill": 1}', 1))  # fmt: skip
        assert head.returncode == 0, head.stdout + head.stderr
        second = nodes.ray("start", "--address", nodes.address,
                           *_node_argv(root, "second", '{"decode": 2}', 2))  # fmt: skip
        assert second.returncode == 0, second.stdout + second.stderr
        yield nodes
    finally:
        nodes.stop()
        shutil.rmtree(root, ignore_errors=True)
