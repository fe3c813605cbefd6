"""The package cache (halfmoon/engine/packages.py): processes building side by side,
pruning, and the torch versions it refuses. (Building and loading real packages:
test_engine_kernels.py.)"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from halfmoon.engine import packages


def _age(path: Path, days: float) -> None:
    then = time.time() - days * 86400
    os.utime(path, (then, then))


def test_packages_unused_for_two_weeks_and_dead_builds_are_pruned(tmp_path: Path) -> None:
    for name in ("old.pt2", "old.d", "fresh.pt2", "fresh.d", "unpacked-never.pt2",
                 "building.pt2", "old.4242.partial.pt2", "new.d.77.partial", "old.lock"):  # fmt: skip
        path = tmp_path / name
        path.mkdir() if name.endswith((".d", ".partial")) else path.touch()
    for name in ("old.pt2", "old.d", "unpacked-never.pt2", "old.4242.partial.pt2",
                 "new.d.77.partial", "old.lock"):  # fmt: skip
        _age(tmp_path / name, days=15)
    removed = packages.prune_unused_packages(tmp_path)
    assert sorted(removed) == ["new.d.77.partial", "old.4242.partial.pt2", "old.d",
                               "unpacked-never.pt2"]  # fmt: skip
    # the package's archive goes with its directory; the lock file stays
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "building.pt2", "fresh.d", "fresh.pt2", "old.lock"
    ]  # fmt: skip


def test_processes_starting_together_build_different_packages_side_by_side(
    tmp_path: Path,
) -> None:
    """Three loaders of the same four packages each take a missing one nobody builds
    (a build blocks until another is under way: one after another, this would time out);
    each package is built once, and a package another holds is skipped, not awaited."""
    started: dict[str, threading.Event] = {k: threading.Event() for k in "abcd"}
    built: list[str] = []

    def builder(key: str, partner: str):
        def build(path: Path) -> None:
            started[key].set()
            assert started[partner].wait(10), f"{key} built alone"
            built.append(key)
            path.write_bytes(key.encode())

        return build

    specs = [("a", builder("a", "b")), ("b", builder("b", "a")),
             ("c", builder("c", "d")), ("d", builder("d", "c"))]  # fmt: skip
    errors: list[BaseException] = []

    def run() -> None:
        try:
            packages.build_missing(specs, tmp_path)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and sorted(built) == ["a", "b", "c", "d"]
    assert {p.name for p in tmp_path.glob("*.pt2")} == {f"{k}.pt2" for k in "abcd"}
    with packages._locked(tmp_path / "e.lock"):  # another process is building "e"
        packages.build_missing([("e", builder("e", "e"))], tmp_path)  # returns at once
    assert not (tmp_path / "e.pt2").exists()


def test_a_torch_that_loads_only_archives_loads_no_package(monkeypatch, tmp_path) -> None:
    """torch 2.11's loader took no directory, and its archive path crashed a process: on a
    torch older than 2.13 no package is loaded (the engine compiles its pieces in process
    instead: test_engine_kernels.py)."""
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    assert not packages.loads_unpacked_packages()
    with pytest.raises(RuntimeError, match="torch 2.11.0"):
        packages.load_package("never", lambda path: None, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_build_succeeds_where_the_cache_cannot_be_pruned(tmp_path: Path, monkeypatch) -> None:
    def refuse(directory: Path) -> list[str]:
        raise PermissionError(13, "Permission denied", str(directory))

    monkeypatch.setattr(packages, "prune_unused_packages", refuse)
    packages.build_missing([("k", lambda path: path.write_bytes(b"package"))], tmp_path)
    assert (tmp_path / "k.pt2").read_bytes() == b"package"
