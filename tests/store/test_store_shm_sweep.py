"""Shared memory left by killed processes is removed (halfmoon/store/shm.py): a segment's
name carries its owner, and a sweep unlinks those whose owner is gone. Before, a day of
test runs left 14 GiB in /dev/shm and the OOM killer took vLLM workers in CI."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from halfmoon.store import shm
from halfmoon.store.shm import SHM_DIR, create_segment, sweep_orphan_segments

pytestmark = pytest.mark.skipif(shm.owner_tag() is None, reason="needs Linux /proc")

OWN_SEGMENT = """
from halfmoon.store.shm import create_segment
segment = create_segment(1 << 20, prefix="hm-test")
print(segment.name, flush=True)
import time
time.sleep(120)
"""


def _exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


def _owned_by_me(name: str) -> bool:
    return f"-o{shm.owner_tag()}-" in name


def test_the_segment_of_an_owner_killed_with_its_tracker_is_swept() -> None:
    proc = subprocess.Popen([sys.executable, "-c", OWN_SEGMENT], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        name = proc.stdout.readline().strip()
        assert name.startswith(f"hm-test-o{proc.pid}.") and _exists(name)
        assert name not in sweep_orphan_segments()  # its owner runs
        os.killpg(proc.pid, signal.SIGKILL)  # the resource tracker goes too
        proc.wait()
        assert _exists(name), "the resource tracker was not killed: nothing to sweep"
        assert name in sweep_orphan_segments()
        assert not _exists(name)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_this_processs_segments_stay() -> None:
    segment = create_segment(4096, prefix="hm-test")
    try:
        assert _owned_by_me(segment.name)
        assert segment.name not in sweep_orphan_segments() and _exists(segment.name)
    finally:
        segment.close(unlink=True)
    assert not _exists(segment.name)


def test_a_pid_that_names_another_process_now_is_an_orphan_other_namespaces_are_not() -> None:
    pid, start, namespace = shm.owner_tag().split(".")
    names = {
        "reused": f"hm-test-o{pid}.{int(start) + 1}.{namespace}-{'a' * 16}",
        "gone": f"hm-test-o{2**22 + 7}.123.{namespace}-{'b' * 16}",
        "other_namespace": f"hm-test-o{2**22 + 7}.123.{int(namespace) + 1}-{'c' * 16}",
        "no_owner": f"hm-test-{'d' * 16}",
    }
    for name in names.values():
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"x")
    try:
        removed = sweep_orphan_segments()
        assert names["reused"] in removed and names["gone"] in removed
        assert _exists(names["other_namespace"]) and _exists(names["no_owner"])
    finally:
        for name in names.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))


def test_a_segment_the_sweep_may_not_remove_is_left_alone(monkeypatch) -> None:
    """Another user's segment in the sticky /dev/shm cannot be unlinked: no error."""
    pid, start, namespace = shm.owner_tag().split(".")
    name = f"hm-test-o{2**22 + 9}.1.{namespace}-{'e' * 16}"
    with open(os.path.join(SHM_DIR, name), "wb") as f:
        f.write(b"x")

    def refuse(path: str) -> None:
        raise PermissionError(1, "Operation not permitted", path)

    try:
        monkeypatch.setattr(shm.os, "unlink", refuse)
        assert name not in sweep_orphan_segments()
        monkeypatch.undo()
        assert _exists(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
