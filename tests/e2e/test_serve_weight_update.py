"""``POST /update_weights_from_disk`` through a live disaggregated cluster (started with
``VLLM_SERVER_DEV_MODE=1``): every worker installs the new checkpoint, the KV cached with
the old weights (pools and block store) is forgotten, so a prompt served before the update
is computed afresh and answers as an engine started on the new weights does; a worker
restarted afterwards installs them before it serves; a checkpoint of another shape is
refused everywhere and changes nothing. vLLM's sleep mode through the same cluster: the
workers' KV pools go back to the system and come back, and an RL trainer's round (sleep,
wake the weights, install new ones, wake the KV cache) serves the new weights."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from halfmoon.core.request import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.loader import create_preset_dir
from halfmoon.store.meta import NO_NAMESPACE
from halfmoon.store.ssd import JOURNAL_FILE

from .conftest import wait_for_log
from .test_faults import _pids, _wait_registered

PROMPT_IDS = [(17 * i + 5) % 500 + 4 for i in range(150)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def ssd_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ssd")


@pytest.fixture(scope="module")
def devmode(cluster_factory, ssd_dir):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_SERVER_DEV_MODE", "1")  # the cluster's processes inherit it
        # copy: every prompt block is in the prefill worker's store too
        return cluster_factory("--kv-cache-mb", "64", "--prefix-store", "copy",
                               "--store-ssd-dir", str(ssd_dir), "--store-ssd-mb", "16")  # fmt: skip


def _ssd_namespace(ssd_dir: Path) -> bytes:
    """The origin the prefill worker's SSD journal names (its header's 16 bytes)."""
    return (ssd_dir / "prefill-0" / JOURNAL_FILE).read_bytes()[24:40]


def _generate(cluster) -> tuple[list[int], int]:
    """Greedy tokens of PROMPT_IDS and how many prompt tokens were cached."""
    body = {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    r = httpx.post(cluster.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _update(cluster, **body) -> httpx.Response:
    return httpx.post(cluster.base_url + "/update_weights_from_disk", json=body, timeout=300)


def test_new_weights_everywhere_and_no_stale_kv(devmode, ssd_dir, tmp_path):
    new_dir = create_preset_dir("tiny", tmp_path / "step-1", seed=5)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = list(LLMEngine(EngineConfig(model=str(new_dir), kv_cache_mb=16))
                    .generate([PROMPT_IDS], params)[0].token_ids)  # fmt: skip

    # a version label alone (no update yet): a worker that restarts still registers
    label = httpx.post(devmode.base_url + "/update_weight_version", json={"new_version": "v0"},
                       timeout=30)  # fmt: skip
    assert label.status_code == 200, label.text
    os.kill(_pids(devmode, "decode")[0], signal.SIGKILL)
    time.sleep(0.5)
    _wait_registered(devmode, 2)

    before, cached = _generate(devmode)
    assert cached == 0
    assert _generate(devmode) == (before, 144)  # whole blocks of 16 cached
    assert before != expected  # (the new weights answer otherwise)

    old_namespace = _ssd_namespace(ssd_dir)
    r = _update(devmode, model_path=str(new_dir), weight_version="step-1")
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True
    prefill = [p for p in devmode.ping_workers() if p.role == "prefill"]
    assert [p.stats["store_blocks"] for p in prefill] == [0]  # the store forgot its KV
    # blocks on SSD are of the new weights from now on: a restart on the old ones does not
    # serve them
    assert _ssd_namespace(ssd_dir) not in (old_namespace, NO_NAMESPACE)
    assert _generate(devmode) == (expected, 0)  # computed afresh, with the new weights
    assert _generate(devmode) == (expected, 144)
    flushed = httpx.post(devmode.base_url + "/flush_cache", timeout=60)  # (SGLang's)
    assert (flushed.status_code, flushed.text) == (200, "Cache flushed.\n")
    assert _generate(devmode) == (expected, 0)
    info = httpx.get(devmode.base_url + "/model_info", timeout=10).json()
    assert info["weight_version"] == "step-1" and info["model_path"] == str(new_dir)

    # a decode worker restarted now installs the cluster's weights before it serves
    victim = _pids(devmode, "decode")[0]
    os.kill(victim, signal.SIGKILL)
    time.sleep(0.5)
    _wait_registered(devmode, 2)
    wait_for_log(devmode, "the cluster serves the weights of .*step-1.*installing them")
    assert _generate(devmode)[0] == expected

    # another architecture: refused by every worker, nothing changes
    other = create_preset_dir("small", tmp_path / "small", seed=0)
    r = _update(devmode, model_path=str(other))
    assert r.status_code == 400
    assert "not the served model's architecture" in r.json()["message"]
    assert _generate(devmode)[0] == expected
    assert httpx.get(devmode.base_url + "/weight_info", timeout=10).json() == {
        "weight_version": "step-1"
    }
    assert all(p.integrity == "ok" for p in devmode.ping_workers())


def test_updates_under_load_lose_no_request_and_leak_nothing(devmode, tmp_path):
    """Clients keep generating (streamed and not) while the weights change four times,
    half of the updates aborting what runs: every request answers 200 with a finish,
    every update succeeds, and the workers end idle, their block accounting intact."""
    checkpoints = [create_preset_dir("tiny", tmp_path / f"s{i}", seed=20 + i) for i in range(2)]
    stop = threading.Event()
    answers: list[tuple[int, str | None]] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            stream = rng.random() < 0.5
            body = {"model": "tiny", "prompt": [rng.randrange(4, 500) for _ in range(40)],
                    "max_tokens": rng.choice([4, 60]), "temperature": 0, "ignore_eos": True,
                    "stream": stream}  # fmt: skip
            r = httpx.post(devmode.base_url + "/v1/completions", json=body, timeout=120)
            if r.status_code != 200:
                answers.append((r.status_code, r.text[:200]))
            elif stream:
                answers.append((200, "done" if "data: [DONE]" in r.text else r.text[-200:]))
            else:
                answers.append((200, r.json()["choices"][0]["finish_reason"]))

    clients = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in clients:
        t.start()
    try:
        for k in range(4):
            time.sleep(0.6)
            r = _update(devmode, model_path=str(checkpoints[k % 2]), abort_all_requests=k % 2 == 1)
            assert r.status_code == 200 and r.json()["success"], r.text
    finally:
        stop.set()
        for t in clients:
            t.join()
    assert answers and all(status == 200 for status, _ in answers), answers
    assert {finish for _, finish in answers} <= {"done", "length", "abort"}, answers
    deadline = time.monotonic() + 10
    while True:
        pongs = devmode.ping_workers()
        idle = all(p.num_running == 0 and p.num_waiting == 0 for p in pongs)
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle and all(p.integrity == "ok" for p in pongs)


def _resident_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_sleep_releases_every_kv_pool_and_wakes_serving_the_same(devmode):
    """vLLM's ``/sleep`` (level 1): each worker's 64 MiB KV pool goes back to the system; a
    request sent while asleep waits, and once ``/wake_up`` has woken everything it is
    answered as before the sleep."""
    base = devmode.base_url
    before, _ = _generate(devmode)
    workers = _pids(devmode, "prefill") + _pids(devmode, "decode")
    resident = {pid: _resident_bytes(pid) for pid in workers}
    slept = httpx.post(base + "/sleep", params={"level": 1}, timeout=120)
    assert slept.json() == {"status": "sleeping", "level": 1}, slept.text
    assert httpx.get(base + "/is_sleeping", timeout=30).json() == {"is_sleeping": True}
    for pid in workers:  # the pool (64 MiB, zero-filled: resident) is gone
        assert resident[pid] - _resident_bytes(pid) > 48 * 2**20, (pid, resident[pid])
    assert _sleep_states(base) == {
        "prefill-0": "weights_offloaded",
        "decode-0": "weights_offloaded",
    }
    out: dict = {}
    held = threading.Thread(target=lambda: out.setdefault("tokens", _generate(devmode)[0]))
    held.start()
    time.sleep(0.5)
    assert held.is_alive()  # waits while asleep
    woke = httpx.post(base + "/wake_up", timeout=120)
    assert woke.json() == {"status": "awake", "tags": None}, woke.text
    held.join(120)
    assert out["tokens"] == before
    assert httpx.get(base + "/is_sleeping", timeout=30).json() == {"is_sleeping": False}
    assert _sleep_states(base) == {"prefill-0": "awake", "decode-0": "awake"}
    # SGLang's names for the same (what RL frameworks driving SGLang call)
    released = httpx.post(base + "/release_memory_occupation", json={"tags": ["kv_cache"]},
                          timeout=120).json()  # fmt: skip
    assert released["released_bytes"] >= 2 * 64 * 2**20, released  # both pools
    assert _sleep_states(base) == {
        "prefill-0": "weights_offloaded",
        "decode-0": "weights_offloaded",
    }
    resumed = httpx.post(base + "/resume_memory_occupation", json={}, timeout=120).json()
    assert resumed == {"status": "awake", "tags": None}
    assert _generate(devmode)[0] == before


def _sleep_states(base: str) -> dict[str, str]:
    """Each worker's state in vLLM's ``engine_sleep_state`` gauge, as ``/metrics`` says."""
    states = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        if line.startswith("halfmoon:engine_sleep_state{") and line.endswith(" 1.0"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            states[labels["worker"]] = labels["sleep_state"]
    return states


def test_a_trainers_round_sleep_new_weights_wake(devmode, tmp_path):
    """An RL trainer's round on vLLM: sleep, wake the weights, install new ones, wake the
    KV cache; the cluster then answers as an engine started on the new weights."""
    base = devmode.base_url
    new_dir = create_preset_dir("tiny", tmp_path / "step-2", seed=11)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = list(LLMEngine(EngineConfig(model=str(new_dir), kv_cache_mb=16))
                    .generate([PROMPT_IDS], params)[0].token_ids)  # fmt: skip
    assert _generate(devmode)[0] != expected
    assert httpx.post(base + "/sleep", timeout=120).status_code == 200
    woke = httpx.post(base + "/wake_up", params={"tags": "weights"}, timeout=120).json()
    assert woke == {"status": "sleeping", "tags": ["weights"]}
    r = _update(devmode, model_path=str(new_dir), weight_version="step-2")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert httpx.get(base + "/is_sleeping", timeout=30).json() == {"is_sleeping": True}
    woke = httpx.post(base + "/wake_up", params={"tags": "kv_cache"}, timeout=120).json()
    assert woke == {"status": "awake", "tags": ["kv_cache"]}
    assert _generate(devmode)[0] == expected
