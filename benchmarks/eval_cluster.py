"""A ``halfmoon serve`` cluster for the evaluation scripts, always stopped.

The launcher runs in a session of its own, so stopping it can also reach any worker it
left behind (by that process group's id, never by name).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from halfmoon.serve.runtime import SECRET_ENV, free_port


def _children(pid: int) -> list[int]:
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


class ServeCluster:
    """``with ServeCluster(args, cache_dir, secret, log) as cluster: cluster.url``"""

    def __init__(self, args: Sequence[str], cache_dir: Path, secret: str, log_path: Path):
        self.args = list(args)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "HALFMOON_CACHE": str(cache_dir), SECRET_ENV: secret}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServeCluster:
        log = self.log_path.open("wb")
        argv = [sys.executable, "-m", "halfmoon.cli", "serve", "--port", str(self.port)]
        self.proc = subprocess.Popen(
            [*argv, *self.args], env=self.env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_ready(self, timeout_s: float = 300.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if json.loads(response.read()).get("status") == "ok":
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"cluster not ready: {self.log_path.read_text()[-2000:]}")

    def conductor_endpoint(self) -> str:
        """``tcp://127.0.0.1:PORT`` of the Conductor process (from its command line)."""
        assert self.proc is not None
        for pid in _children(self.proc.pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if "conductor" in argv and "--port" in argv:
                return f"tcp://127.0.0.1:{argv[argv.index('--port') + 1]}"
        raise RuntimeError("no conductor process found")

    def stop(self) -> None:
        """SIGTERM the launcher (it stops its children); SIGKILL the group if needed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of this session only
        except ProcessLookupError:
            pass
        self.proc = None
