"""Fixtures that start a real ``halfmoon serve`` cluster on 127.0.0.1 and always stop it."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import pytest

from halfmoon.serve.launch.local import (  # noqa: F401 - alive is re-exported
    LocalCluster,
    alive,
    argv_of,
    children_of,
)

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


def wait_for_log(cluster: LocalCluster, pattern: str, timeout_s: float = 10.0) -> re.Match:
    """The first match of ``pattern`` (multi-line) in the cluster's log, waiting for it to
    appear: a line the launcher writes just after ``/health`` answers may lag it a little."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = cluster.log_path.read_text()
        match = re.search(pattern, log, re.M)
        if match or time.monotonic() > deadline:
            assert match, f"{pattern!r} not in:\n{log[-3000:]}"
            return match
        time.sleep(0.1)


def link_shared_cache(
    cache: Path, shared: Path, names: tuple[str, ...] = ("presets", "profiles")
) -> None:
    """Make ``cache/presets`` and ``cache/profiles`` (or the given ``names``) links into
    ``shared``.

    Starting a cluster on a fresh cache writes the tiny preset and measures its cost
    profile (~13 s of a ~20 s start here). The profile's key is the model's resolved path
    and engine shape, so clusters whose links point into one ``shared`` dir measure once.
    The cache dir itself stays per cluster: its path in the workers' command lines is how
    :meth:`Cluster.stop` finds them.
    """
    cache.mkdir(parents=True, exist_ok=True)
    for name in names:
        (shared / name).mkdir(parents=True, exist_ok=True)
        (cache / name).symlink_to(shared / name, target_is_directory=True)


def vllm_groups(root_pid: int) -> set[int]:
    """Process groups of the vLLM servers under ``root_pid`` (each server leads its own;
    its engine-core and worker processes, renamed ``VLLM::...``, are in it)."""
    groups, todo = set(), [root_pid]
    while todo:
        pid = todo.pop()
        if "vllm.entrypoints.launchers.api_server.entry" in argv_of(pid):
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(pid))
        todo += children_of(pid)
    return groups


def healthy_vllm(urls: Callable[[], Iterable[str]], timeout_s: float = 600.0) -> str:
    """The first of ``urls()`` (asked again each round) whose vLLM server answers
    ``/health``: a killed server is restarted by its worker, which takes a while, so a
    test that asks a server directly after the kill tests (any order) waits for one."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            candidates = list(urls())
        except (OSError, ValueError):  # a process read from /proc went away meanwhile
            candidates = []
        for url in candidates:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
        assert time.monotonic() < end, "no vLLM server answers /health"
        time.sleep(1)


@pytest.fixture(scope="session")
def smollm2_adapter(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LoRA adapter of SmolLM2 in PEFT's format (rank 8, every linear; strong
    enough to change greedy answers), for the clusters of vLLM servers (``sql=PATH``)."""
    from halfmoon.engine.config import ModelConfig
    from halfmoon.engine.lora import write_random_adapter

    config = ModelConfig.from_hf(json.loads((smollm2_dir / "config.json").read_text()))
    return write_random_adapter(config, tmp_path_factory.mktemp("adapters") / "sql", std=0.05)


def vllm_greedy(url: str, token_ids: list[int], max_tokens: int, **extra: Any) -> list[int]:
    """vLLM's own greedy answer (token ids), asked of the server at ``url`` directly: no
    transfer parameters, so a KV connector inside it stays idle and vLLM prefills and
    decodes by itself. ``extra``: more fields of the body (``structured_outputs``)."""
    body = {"model": "smollm2-135m-instruct", "prompt": token_ids, "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True, **extra}  # fmt: skip
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    return out["choices"][0]["token_ids"]


def kill_groups(groups: set[int]) -> None:
    """SIGKILL whatever is left of these process groups."""
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)


def stop_vllm_cluster(cluster: Cluster, model_dir: Path) -> None:
    """Stop a cluster of vLLM workers and whatever of its servers outlived them (a server's
    engine core and workers included, and any process still naming the model)."""
    groups = vllm_groups(cluster.proc.pid)
    cluster.stop()
    kill_groups(groups)
    for pid in processes_mentioning(str(model_dir)):
        os.kill(pid, signal.SIGKILL)


class Cluster(LocalCluster):
    """A started ``halfmoon serve`` with the test secret and a cache dir under ``tmp``;
    the tiny random-weight preset unless ``args`` name a ``--model``.

    With ``shared``, a tiny-model cluster reuses the preset and cost profile measured by
    an earlier one with the same ``--kv-cache-mb`` (the pool size bounds the contexts the
    profiler measures, so only those agree); a named model starts from scratch, but for
    the cost profiles in ``shared_profiles`` when given (the clusters of vLLM servers: a
    server's profile takes ~15-25 s to measure here, and one of the same shape is read).
    """

    def __init__(
        self, tmp: Path, *args: str, shared: Path | None = None,
        shared_profiles: Path | None = None,
    ) -> None:  # fmt: skip
        if shared_profiles is not None:
            link_shared_cache(tmp / "cache", shared_profiles, names=("profiles",))
        if "--model" not in args:
            if shared is not None:
                kv_mb = args[args.index("--kv-cache-mb") + 1] if "--kv-cache-mb" in args else ""
                link_shared_cache(tmp / "cache", shared / f"tiny-kv{kv_mb or 'default'}")
            args = ("--model", "tiny", *args)
        super().__init__(args, tmp / "cache", SECRET, tmp / "serve.log")
        self.start()

    def stop(self) -> None:
        super().stop()
        for pid in processes_mentioning(str(self.cache)):
            os.kill(pid, 9)


@pytest.fixture(scope="module")
def cluster_factory(tmp_path_factory, shared_cache):
    """Start clusters with the given ``halfmoon serve`` arguments; stop them at the end."""
    started: list[Cluster] = []

    def start(*args: str, timeout_s: float = 300.0) -> Cluster:
        cluster = Cluster(tmp_path_factory.mktemp("serve"), *args, shared=shared_cache)
        started.append(cluster)
        cluster.wait_ready(timeout_s)
        return cluster

    yield start
    for cluster in started:
        cluster.stop()
