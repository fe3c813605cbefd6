"""Fixtures that start a real ``halfmoon serve`` cluster on 127.0.0.1 and always stop it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from halfmoon.serve.local import LocalCluster, alive, children_of  # noqa: F401 - re-exported

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


class Cluster(LocalCluster):
    """A started ``halfmoon serve`` with the test secret and a cache dir under ``tmp``;
    the tiny random-weight preset unless ``args`` name a ``--model``."""

    def __init__(self, tmp: Path, *args: str) -> None:
        if "--model" not in args:
            args = ("--model", "tiny", *args)
        super().__init__(args, tmp / "cache", SECRET, tmp / "serve.log")
        self.start()

    def stop(self) -> None:
        super().stop()
        for pid in processes_mentioning(str(self.cache)):
            os.kill(pid, 9)


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
