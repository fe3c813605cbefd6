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


def test_a_crashed_child_is_restarted_and_a_refused_worker_is_not():
    group = _Group("supervise-secret-0123456789abcdef")
    crashed = group.spawn("crashes", "1")
    refused = group.spawn("refused", str(REFUSED_EXIT_CODE))
    crashed.wait(30)
    refused.wait(30)
    assert group.supervise(now_s=100.0) == []  # both noticed; the crash waits its backoff
    assert group.supervise(now_s=100.0 + ProcessGroup.FIRST_BACKOFF_S) == ["crashes"]
    for later in (200.0, 500.0, 10_000.0):
        assert "refused" not in group.supervise(now_s=later)
    for _, proc in group.procs:
        proc.wait(30)
