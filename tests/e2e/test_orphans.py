"""A process that started a cluster with ``LocalCluster`` and died without stopping it
(SIGKILL: a killed test run or benchmark) leaves no process behind: the launcher gets
SIGTERM from the kernel (``PR_SET_PDEATHSIG``) and stops its children."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from .conftest import SECRET, alive, children_of, kill_groups, link_shared_cache

pytestmark = pytest.mark.slow

#: The owner: starts a tiny cluster, prints the launcher's pid once it is ready, waits.
OWNER = """
import sys, time
from pathlib import Path
from halfmoon.serve.launch.local import LocalCluster
tmp = Path(sys.argv[1])
cluster = LocalCluster(["--model", "tiny", "--kv-cache-mb", "64"], tmp / "cache", sys.argv[2],
                       tmp / "serve.log")
cluster.__enter__()
print(cluster.proc.pid, flush=True)
time.sleep(600)
"""


def test_a_cluster_whose_owner_is_killed_stops_by_itself(tmp_path, shared_cache):
    link_shared_cache(tmp_path / "cache", shared_cache / "tiny-kv64")
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path), SECRET], stdout=subprocess.PIPE, text=True
    )
    launcher = 0
    try:
        launcher = int(owner.stdout.readline() or 0)  # once the cluster answers /health
        assert launcher, (tmp_path / "serve.log").read_text()[-3000:]
        workers = children_of(launcher)
        assert len(workers) >= 3  # the Conductor, a prefill and a decode worker
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 60
        while any(alive(p) for p in (launcher, *workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in (launcher, *workers) if alive(p)]
    finally:
        owner.kill()
        owner.wait()
        if launcher:
            kill_groups({launcher})
