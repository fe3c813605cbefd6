"""``halfmoon serve --ray --replan`` on a two-node local Ray cluster: when the traffic turns
from chat to long prompts, the gateway actor's re-planner resizes the pools through the
deployment's controller (1P2D -> 2P1D): a decode worker drains and leaves, a prefill
worker starts, and every request is served throughout.

The workload and the SLO are those of tests/e2e/test_replan.py (the TTFT SLO from the
preset's measured profile, measured first by a local cluster sharing the nodes' cache,
which the Ray workers then reuse)."""

from __future__ import annotations

import secrets
import signal
import subprocess
import time

import pytest
from e2e.test_replan import CHAT, SUMMARY, _phase, _profile, _ttft_slo_s

from halfmoon.serve.launch.local import LocalCluster, log_tail
from halfmoon.serve.runtime import free_port

from .conftest import RayNodes
from .test_ray_e2e import _wait_for_url

NAME = "replan"
pytestmark = pytest.mark.timeout(500)


class _Target:
    """What :func:`_phase` needs of a cluster: its base URL."""

    def __init__(self, url: str) -> None:
        self.base_url = url


def _sizes(ray, controller) -> dict[str, int]:
    return ray.get(controller.status.remote(), timeout=30)["sizes"]


def test_the_pools_follow_the_traffic(ray_nodes: RayNodes, tmp_path):
    import ray

    cache = ray_nodes.root / "cache"
    with LocalCluster(["--model", "tiny", "--kv-cache-mb", "64", "--attention", "reference"],
                      cache, secrets.token_hex(16), tmp_path / "probe.log") as probe:  # fmt: skip
        slo = _ttft_slo_s(_profile(probe))

    log = tmp_path / "serve.log"
    serve = ray_nodes.halfmoon(
        "serve", "--ray", ray_nodes.address, "--model", "tiny", "--prefill", "1", "--decode",
        "2", "--cpus-per-worker", "0.5", "--kv-cache-mb", "64", "--attention", "reference",
        "--early-reject", "none", "--ttft-slo", str(slo), "--tbt-slo", "0.5",
        "--replan", "--replan-interval", "4", "--replan-window", "12",
        "--replan-min-requests", "8", "--port", str(free_port()), "--startup-timeout", "200",
        "--deployment-name", NAME, log=log,
    )  # fmt: skip
    try:
        url = _wait_for_url(serve, log)
        ray.init(address=ray_nodes.address, namespace="halfmoon", logging_level="ERROR",
                 log_to_driver=False)  # fmt: skip
        controller = ray.get_actor(NAME, namespace="halfmoon")
        target = _Target(url)
        assert _sizes(ray, controller) == {"prefill": 1, "decode": 2}

        assert set(_phase(target, CHAT, seconds=8)) == {200}
        assert _sizes(ray, controller) == {"prefill": 1, "decode": 2}  # chat: it stays

        def moved() -> bool:
            return _sizes(ray, controller) == {"prefill": 2, "decode": 1}

        assert set(_phase(target, SUMMARY, seconds=90, stop_when=moved)) == {200}
        assert moved(), log_tail(log.read_text())
        deadline = time.monotonic() + 120  # the leaving decode worker drains, then goes
        while {w["name"] for w in ray.get(controller.status.remote(), timeout=30)["workers"]} \
                != {"prefill-0", "prefill-1", "decode-0"}:  # fmt: skip
            assert time.monotonic() < deadline
            time.sleep(0.5)
        assert set(_phase(target, SUMMARY, seconds=3)) == {200}
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if serve.poll() is None:
            serve.send_signal(signal.SIGINT)
            try:
                serve.wait(90)
            except subprocess.TimeoutExpired:
                serve.kill()
                serve.wait()
