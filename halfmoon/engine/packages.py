"""The on-disk cache of compiled (AOTInductor) packages that the engine's kernels, glue,
fused decode call and KV codecs are built into (``halfmoon.engine.kernels`` and the
modules of its ``KERNEL_SOURCES`` say what goes into a package and name it by a key that
digests their source; this module only keeps packages).

- Where: ``$HALFMOON_KERNEL_CACHE``, else ``$HALFMOON_CACHE/kernels`` (:func:`kernel_dir`).
- Building once across processes: a file lock per package; a build writes a partial file
  renamed into place, so a crash leaves no half-written package under the real name;
  processes starting together each take a package nobody builds (:func:`build_missing`),
  then wait for the rest (:func:`load_package`).
- Loading: from a directory unpacked once beside the archive (``KEY.d``), through torch's
  C++ loader (no import of inductor; a killed process leaves nothing in ``$TMPDIR``).
- Pruning: a build removes the packages no process has loaded for two weeks
  (:func:`prune_unused_packages`): each edit to the kernels' sources and each torch
  version otherwise leaves a full set behind.

Edits here change no package (this file is not among the digested sources).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def failure_reason(exc: BaseException) -> str:
    """One line naming why a build or load failed (type and first line of the message)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else 'no message'}"


def kernel_dir() -> Path:
    """Where built packages live: ``$HALFMOON_KERNEL_CACHE``, else
    ``$HALFMOON_CACHE/kernels`` (see ``catalog.cache_dir``)."""
    from halfmoon.engine.catalog import cache_dir

    return Path(os.environ.get("HALFMOON_KERNEL_CACHE") or cache_dir() / "kernels")


@contextlib.contextmanager
def _locked(path: Path, wait: bool = True):
    """Hold the file lock ``path``; yields whether it is held (``wait=False``: False at
    once when another process holds it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


#: A package to build: its cache key and the function that builds it into a path.
PackageSpec = tuple[str, Callable[[Path], None]]


def _build_locked(path: Path, build: Callable[[Path], None]) -> None:
    """Build ``path`` unless it exists (the caller holds its lock): into a partial file
    first, so a crash leaves no half-written package under the real name."""
    if path.exists():
        return
    logger.info(
        "building the compiled package %s (once per model shape; 15-40 s on a small CPU)",
        path.name,
    )
    started = time.monotonic()
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    try:
        build(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    logger.info("built %s in %.1f s", path.name, time.monotonic() - started)
    try:
        prune_unused_packages(path.parent)
    except OSError as exc:  # the package is built: a cache that cannot be pruned is no error
        logger.warning("could not prune the package cache %s: %s", path.parent, exc)


#: A package not loaded for this long is removed when another is built: every edit to
#: the kernels' sources and every torch version otherwise leaves a full set behind.
UNUSED_PACKAGE_S = 14 * 24 * 3600


def prune_unused_packages(directory: Path, max_age_s: float = UNUSED_PACKAGE_S) -> list[str]:
    """Remove from ``directory`` the packages (``KEY.pt2`` and ``KEY.d``) that no process
    has loaded for ``max_age_s`` (the time stamp of ``KEY.d``, which every load renews),
    and leftovers of builds or unpacks that died as long ago; returns what it removed.
    Lock files stay (empty; removing one another process holds would break the lock)."""
    now = time.time()

    def old(path: Path) -> bool:
        try:
            return now - path.stat().st_mtime > max_age_s
        except OSError:
            return False  # gone already

    removed = []
    for entry in sorted(directory.iterdir()):
        name = entry.name
        if name.endswith(".d") and entry.is_dir():
            if not old(entry):
                continue
            shutil.rmtree(entry, ignore_errors=True)
            (directory / f"{name[:-2]}.pt2").unlink(missing_ok=True)
        elif ".partial" in name or (
            name.endswith(".pt2") and not (directory / f"{name[:-4]}.d").exists()
        ):
            if not old(entry):
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        else:
            continue
        removed.append(name)
    if removed:
        logger.info("removed %d compiled package(s) unused for %.0f days from %s",
                    len(removed), max_age_s / 86400, directory)  # fmt: skip
    return removed


def build_missing(specs: list[PackageSpec], directory: Path | None = None) -> None:
    """Build the packages of ``specs`` that are missing and that no other process is
    building now, in order, skipping those whose lock is held.

    Workers of one cluster start together and need the same packages: without this each
    waits for the first package while one process builds it, then for the second, so the
    builds run one after another (a build uses one core: 33 s for SmolLM2's four here).
    Called first, it has each process take a different package, so they build side by
    side; :func:`load_package` then waits for the rest. Raises what a build raises."""
    directory = directory or kernel_dir()
    for key, build in specs:
        path = directory / f"{key}.pt2"
        if path.exists():
            continue
        with _locked(directory / f"{key}.lock", wait=False) as held:
            if held:
                _build_locked(path, build)


#: The first torch whose AOTI loader takes an unpacked package directory. On 2.11 (a GPU
#: machine, 2026-12-04) the directory failed ("failed finding central directory") and a
#: fallback to the archive crashed the process (SIGSEGV), so older torch runs the reference.
UNPACKED_LOADER_TORCH = (2, 13)


def loads_unpacked_packages() -> bool:
    """Whether this torch's AOTI loader takes a package directory (2.13 and later)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= UNPACKED_LOADER_TORCH


def load_package(
    key: str, build: Callable[[Path], None], directory: Path | None = None
) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """The compiled package ``key`` from the cache (``directory``, else :func:`kernel_dir`),
    built first by ``build(path)`` when missing (one process builds, concurrent ones wait
    for it); returns its runner: a list of tensors in, a list out. Raises on any failure."""
    if not loads_unpacked_packages():
        raise RuntimeError(
            f"torch {torch.__version__} loads compiled packages from archives only; halfmoon "
            f"loads them unpacked, which needs torch {'.'.join(map(str, UNPACKED_LOADER_TORCH))}+"
        )
    directory = directory or kernel_dir()
    path = directory / f"{key}.pt2"
    unpacked = directory / f"{key}.d"
    if not unpacked.exists():
        with _locked(directory / f"{key}.lock"):
            _build_locked(path, build)
            _unpack_locked(path, unpacked)
    # The C++ loader directly, not ``torch._inductor.aoti_load_package``: importing
    # inductor costs ~2 s of every engine start, loading the package 10 ms. Its ``run``
    # skips the packaged model's Python argument checks (12 us a call against 40 us).
    # From the unpacked directory: given the archive, the loader extracts it into a new
    # /tmp/aotinductor_* for every process and removes that only if the process exits
    # cleanly; killed workers had left 6,000 of them (10 GB) there.
    with contextlib.suppress(OSError):
        os.utime(unpacked)  # in use: kept by prune_unused_packages
    return torch._C._aoti.AOTIModelPackageLoader(str(unpacked), "model", False, 1, -1).run


def _unpack_locked(path: Path, unpacked: Path) -> None:
    """Extract package ``path`` into directory ``unpacked`` unless it exists (the caller
    holds the package's lock): into a partial directory first, then renamed."""
    if unpacked.exists():
        return
    partial = unpacked.with_name(f"{unpacked.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with zipfile.ZipFile(path) as archive:
            archive.extractall(partial)
        os.replace(partial, unpacked)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
