"""The child processes of a local cluster (Conductor, workers): started with the cluster's
secret in their environment, dying with the launcher, and restarted with exponential
backoff when they crash (:class:`ProcessGroup`); the launcher and the Ray node actors
both use it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.serve.runtime import SECRET_ENV, die_with_parent
from halfmoon.serve.worker.main import REFUSED_EXIT_CODE
from halfmoon.store.shm import sweep_orphan_segments

log = logging.getLogger("serve")


@dataclass
class Child:
    """One supervised child process and its restart bookkeeping."""

    name: str
    argv: tuple[str, ...]
    proc: subprocess.Popen
    started_s: float = field(default_factory=time.monotonic)
    num_restarts: int = 0
    restart_at_s: float | None = None
    #: Told to leave (a drain): its exit is expected, so it is not restarted.
    retiring: bool = False


class ProcessGroup:
    """The child processes of one cluster, restarted with backoff when they crash."""

    #: Restart delays double from this up to ``MAX_BACKOFF_S``; a child that stayed up
    #: for ``STABLE_S`` starts over at the first delay.
    FIRST_BACKOFF_S = 0.5
    MAX_BACKOFF_S = 30.0
    STABLE_S = 60.0

    def __init__(self, secret: str) -> None:
        self.env = {**os.environ, SECRET_ENV: secret}
        self.children: list[Child] = []

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """(name, process) of every child."""
        return [(c.name, c.proc) for c in self.children]

    def _popen(self, argv: tuple[str, ...]) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "halfmoon.cli", *argv]
        return subprocess.Popen(cmd, env=self.env, preexec_fn=die_with_parent)  # noqa: PLW1509

    def spawn(self, name: str, *argv: str) -> subprocess.Popen:
        """Start ``halfmoon ARGV...`` as a child."""
        child = Child(name, tuple(argv), self._popen(tuple(argv)))
        self.children.append(child)
        return child.proc

    def check_alive(self) -> None:
        """Raise if any child has exited (used while the cluster starts)."""
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise HalfmoonError(f"{name} exited with code {proc.returncode}")

    def supervise(
        self, now_s: float | None = None, on_exit: Callable[[str], None] | None = None
    ) -> list[str]:
        """Restart children that died, each after its backoff; returns who restarted.
        ``on_exit(name)`` is called once for each death, when it is first seen (a child
        told to leave is not a death)."""
        now_s = time.monotonic() if now_s is None else now_s
        restarted = []
        for child in self.children:
            if child.retiring:
                continue
            if child.proc.poll() is None:
                if now_s - child.started_s > self.STABLE_S:
                    child.num_restarts = 0
                continue
            if child.proc.returncode == REFUSED_EXIT_CODE:
                if child.restart_at_s != float("inf"):  # said once; never restarted
                    child.restart_at_s = float("inf")
                    if on_exit is not None:
                        on_exit(child.name)
                    log.error("%s was refused by the Conductor (see its log): not restarted",
                              child.name)  # fmt: skip
                continue
            if child.restart_at_s is None:
                delay = min(self.MAX_BACKOFF_S, self.FIRST_BACKOFF_S * 2**child.num_restarts)
                child.restart_at_s = now_s + delay
                log.warning("%s exited with code %s; restarting in %.1fs",
                            child.name, child.proc.returncode, delay)  # fmt: skip
                if on_exit is not None:
                    on_exit(child.name)
            elif now_s >= child.restart_at_s:
                child.proc = self._popen(child.argv)
                child.started_s, child.restart_at_s = now_s, None
                child.num_restarts += 1
                restarted.append(child.name)
        return restarted

    def retire(self, name: str) -> Child:
        """Expect ``name`` to exit (it was told to drain): it is no longer restarted, and
        :meth:`forget` drops it once gone. Raises HalfmoonError for an unknown name."""
        for child in self.children:
            if child.name == name:
                child.retiring = True
                return child
        raise HalfmoonError(f"no child process named {name!r}")

    def forget(self, name: str) -> None:
        """Drop the retired child ``name`` from the group (SIGKILL it if still running)."""
        for child in list(self.children):
            if child.name == name and child.retiring:
                if child.proc.poll() is None:
                    child.proc.kill()
                    child.proc.wait()
                self.children.remove(child)

    def states(self) -> dict[str, dict[str, Any]]:
        """Each child's process state by name (for the live cluster page): ``running``,
        ``restarting`` (exited; restarted once its backoff is over), ``draining`` (told
        to leave, still finishing) or ``stopped`` (refused by the Conductor, or gone after
        a drain: never restarted), with its pid and restart count."""
        out = {}
        for c in self.children:
            if c.retiring:
                state = "draining" if c.proc.poll() is None else "stopped"
            elif c.proc.poll() is None:
                state = "running"
            else:
                state = "stopped" if c.restart_at_s == float("inf") else "restarting"
            out[c.name] = {"state": state, "pid": c.proc.pid, "num_restarts": c.num_restarts}
        return out

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every child, then SIGKILL the ones still running after ``timeout_s``."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for _, proc in self.procs:
            try:
                proc.wait(max(0.05, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        sweep_orphan_segments()  # of the children killed with their resource trackers
        from halfmoon.serve.vllm.server import sweep_stale_rpc_dirs

        sweep_stale_rpc_dirs()  # of vLLM workers killed before they could remove them
