"""The launcher's supervision: crashed children come back after their backoff; a worker
the Conductor refused (it disagrees with the cluster) does not."""

from __future__ import annotations

import subprocess
import sys

from halfmoon.serve.launch.processes import ProcessGroup
from halfmoon.serve.worker.main import REFUSED_EXIT_CODE


class _Group(ProcessGroup):
    """Children are ``python -c 'exit(CODE)'`` where the argv names the code."""

    def _popen(self, argv: tuple[str, ...]) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", f"raise SystemExit({argv[0]})"])


def _crashed_and_refused() -> _Group:
    """A group whose two children have exited: ``crashes`` (code 1) and ``refused``."""
    group = _Group("supervise-secret-0123456789abcdef")
    group.spawn("crashes", "1")
    group.spawn("refused", str(REFUSED_EXIT_CODE))
    for _, proc in group.procs:
        proc.wait(30)
    return group


def test_a_crashed_child_is_restarted_and_a_refused_worker_is_not():
    group = _crashed_and_refused()
    assert group.supervise(now_s=100.0) == []  # both noticed; the crash waits its backoff
    assert group.supervise(now_s=100.0 + ProcessGroup.FIRST_BACKOFF_S) == ["crashes"]
    for later in (200.0, 500.0, 10_000.0):
        assert "refused" not in group.supervise(now_s=later)
    for _, proc in group.procs:
        proc.wait(30)


def test_each_death_is_reported_once_when_first_seen():
    group = _crashed_and_refused()
    seen: list[str] = []
    group.supervise(now_s=100.0, on_exit=seen.append)
    assert sorted(seen) == ["crashes", "refused"]
    group.supervise(now_s=100.1, on_exit=seen.append)  # still waiting out its backoff
    assert group.supervise(now_s=101.0, on_exit=seen.append) == ["crashes"]
    assert len(seen) == 2
    for _, proc in group.procs:
        proc.wait(30)
    group.supervise(now_s=102.0, on_exit=seen.append)  # the restarted one died again
    assert sorted(seen) == ["crashes", "crashes", "refused"]
