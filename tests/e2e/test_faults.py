"""Fault injection on a live cluster: SIGKILL a prefill worker, a decode worker and the
Conductor mid-request; the supervisor restarts them, and every request completes."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import openai
import pytest

from .conftest import alive, children_of


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    return cluster_factory("--prefill", "2", "--decode", "2", "--kv-cache-mb", "128")


def _client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)  # fmt: skip


def _pids(cluster, role):
    """PIDs of the launcher's children whose command line has ``role``."""
    out = []
    for pid in children_of(cluster.proc.pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if role in argv:
            out.append(pid)
    return out


def _busy_pid(cluster, role, deadline_s=30.0):
    """The PID of a ``role`` worker that is working on something right now."""
    ports = {}
    for pid in _pids(cluster, role):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        ports[int(argv[argv.index("--port") + 1])] = pid
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for pong, port in zip(cluster.ping_workers(), cluster.worker_ports(), strict=True):
            if pong["role"] == role and (pong["num_running"] or pong["num_waiting"]):
                return ports[port]
        time.sleep(0.02)
    raise AssertionError(f"no busy {role} worker seen")


def _stream(cluster, prompt, max_tokens, out):
    text = []
    for chunk in _client(cluster).completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ):  # fmt: skip
        if chunk.choices:
            text.append(chunk.choices[0].text)
        if chunk.usage:
            out["usage"] = chunk.usage
    out["text"] = "".join(text)


def _wait_registered(cluster, count, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            if len(cluster.ping_workers()) == count and all(
                p["integrity"] == "ok" for p in cluster.ping_workers()
            ):
                import json
                import urllib.request

                with urllib.request.urlopen(cluster.base_url + "/health", timeout=5) as r:
                    if len(json.loads(r.read())["instances"]) == count:
                        return
        except (AssertionError, OSError, ValueError):
            pass
        time.sleep(0.3)
    raise AssertionError("workers did not come back")


def test_decode_worker_killed_mid_stream(cluster):
    prompt = "the decode worker will die " * 3
    reference = _client(cluster).completions.create(
        model="tiny", prompt=prompt, max_tokens=200, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    out: dict = {}
    t = threading.Thread(target=_stream, args=(cluster, prompt, 200, out))
    t.start()
    victim = _busy_pid(cluster, "decode")
    os.kill(victim, signal.SIGKILL)
    t.join(120)
    assert not t.is_alive()
    assert out["usage"].completion_tokens == 200
    assert out["text"] == reference  # greedy: re-prefilled elsewhere, same continuation
    _wait_registered(cluster, 4)
    assert not alive(victim)


def test_prefill_worker_killed_mid_prefill(cluster):
    prompt = " ".join(f"long{i}" for i in range(2500))
    out: dict = {}
    t = threading.Thread(target=_stream, args=(cluster, prompt, 4, out))
    t.start()
    victim = _busy_pid(cluster, "prefill")
    os.kill(victim, signal.SIGKILL)
    t.join(120)
    assert not t.is_alive()
    assert out["usage"].completion_tokens == 4
    _wait_registered(cluster, 4)


def test_conductor_restart_keeps_requests_and_rebuilds_index(cluster):
    prefix = " ".join(f"kept{i}" for i in range(300))
    client = _client(cluster)
    client.completions.create(model="tiny", prompt=prefix + " one", max_tokens=2)
    out: dict = {}
    t = threading.Thread(target=_stream, args=(cluster, "in flight " * 5, 150, out))
    t.start()
    time.sleep(0.3)
    (conductor,) = _pids(cluster, "conductor")
    os.kill(conductor, signal.SIGKILL)
    t.join(120)
    assert out["usage"].completion_tokens == 150  # the in-flight request was not lost
    after = client.completions.create(model="tiny", prompt=prefix + " two", max_tokens=2)
    assert after.usage.prompt_tokens_details.cached_tokens >= 600  # index came back
    (new_conductor,) = _pids(cluster, "conductor")
    assert new_conductor != conductor
    _wait_registered(cluster, 4)
    assert all(p["integrity"] == "ok" for p in cluster.ping_workers())
    # Each worker registers again once, not once a second for several seconds (its beats
    # queued while the Conductor was away each used to draw a register_again).
    time.sleep(3)
    log = cluster.log_path.read_text()
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        again = [line for line in log.splitlines()
                 if f" {name} INFO the Conductor does not know this worker" in line]  # fmt: skip
        assert len(again) == 1, (name, again)
