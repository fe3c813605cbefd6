"""``halfmoon serve --ray`` on a two-node local Ray cluster: serve, scale, load a LoRA
adapter while serving, survive a killed worker actor (which loads the adapter again),
gateway actor and controller, stop leaving nothing behind.

One deployment serves every test of this module (starting one takes most of a minute);
the tests run in file order and the last one stops it. Each test needs only a deployment
that serves, so any one of them also runs alone (``-k``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from halfmoon.deploy.record import load_record
from halfmoon.serve.launch.local import log_tail
from halfmoon.serve.runtime import free_port

from .conftest import RayNodes, marked_processes

API_KEY = "ray-e2e-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NAME = "e2e"
ORIGIN = "https://app.example"
pytestmark = pytest.mark.timeout(400)


@dataclass
class Deployment:
    """The running ``serve --ray`` driver and the URL it printed."""

    url: str
    serve: subprocess.Popen
    log: Path
    #: Where the workers write their profiler traces (``--profiler-config``).
    traces: Path


@pytest.fixture(scope="module")
def deployment(ray_nodes: RayNodes, tmp_path_factory):
    """1 prefill (head node) + 1 decode (second node), a Ray driver connected for checks."""
    import ray

    log = tmp_path_factory.mktemp("serve") / "serve.log"
    traces = tmp_path_factory.mktemp("traces")
    profiler = json.dumps({"profiler": "torch", "torch_profiler_dir": str(traces),
                           "torch_profiler_with_stack": False})  # fmt: skip
    serve = ray_nodes.halfmoon(
        "serve", "--ray", ray_nodes.address, "--model", "tiny", "--prefill", "1", "--decode",
        "1", "--prefill-resource", "prefill", "--decode-resource", "decode",
        "--port", str(free_port()), "--api-key", API_KEY, "--max-worker-restarts", "2",
        "--store-dram-mb", "32", "--startup-timeout", "150", "--deployment-name", NAME,
        "--allowed-origins", ORIGIN, "--allow-runtime-lora-updating",
        "--profiler-config", profiler, log=log,
    )  # fmt: skip
    try:
        url = _wait_for_url(serve, log)
        ray.init(address=ray_nodes.address, namespace="halfmoon", logging_level="ERROR",
                 log_to_driver=False)  # fmt: skip
        yield Deployment(url, serve, log, traces)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_serve_and_scale_on_two_nodes(deployment: Deployment, ray_nodes: RayNodes):
    import ray

    url = deployment.url
    _complete(url)
    # the gateway actor answers a browser page's preflight (CORS), before the key check
    preflight = httpx.options(f"{url}/v1/completions", timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    })  # fmt: skip
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    controller = ray.get_actor(NAME, namespace="halfmoon")
    workers = _workers(controller)
    # the pools are pinned by their custom resources: one node each
    assert workers["prefill-0"]["node_id"] != workers["decode-0"]["node_id"]

    # scale decode to 2 from the CLI; the new worker lands on the decode node
    reply = _scale_cli(ray_nodes, decode=2)
    assert reply["added"] == ["decode-1"] and reply["sizes"] == {"prefill": 1, "decode": 2}
    workers = {w["name"]: w for w in reply["status"]["workers"]}
    assert workers["decode-1"]["node_id"] == workers["decode-0"]["node_id"]
    assert set(reply["status"]["registered"]) == {"prefill-0", "decode-0", "decode-1"}
    _complete(url, n=4)

    # and back to 1 through the gateway's admin endpoint: decode-1 drains and leaves
    _scale_over_http(url, {"decode": 1}, expect_draining=["decode-1"])
    _wait(lambda: list(_workers(controller)) == ["prefill-0", "decode-0"],
          "decode-1 to drain and leave")  # fmt: skip
    with pytest.raises(ValueError):
        ray.get_actor(f"{NAME}:decode-1", namespace="halfmoon")
    _complete(url)


def test_the_profiler_reaches_the_worker_actors(deployment: Deployment):
    """``serve --ray --profiler-config``: the gateway actor serves ``/start_profile`` and
    ``/stop_profile``; each worker actor's process writes its trace on its node."""
    started = httpx.post(f"{deployment.url}/start_profile", headers=AUTH, timeout=60)
    assert started.json() == {"status": "profiling", "workers": ["decode-0", "prefill-0"]}
    _complete(deployment.url)
    stopped = httpx.post(f"{deployment.url}/stop_profile", headers=AUTH, timeout=300).json()
    assert sorted(stopped["traces"]) == ["decode-0", "prefill-0"], stopped
    for paths in stopped["traces"].values():
        assert all(Path(p).parent == deployment.traces and Path(p).is_file() for p in paths)


@pytest.fixture(scope="module")
def adapter(deployment: Deployment, ray_nodes: RayNodes, tmp_path_factory) -> str:
    """A random LoRA adapter of the tiny preset, loaded as "one" through the gateway's
    ``/v1/load_lora_adapter`` (``--allow-runtime-lora-updating``), and an offline engine's
    greedy answer with it."""
    from halfmoon.core.adapters import RuntimeAdapter
    from halfmoon.core.request import SamplingParams
    from halfmoon.engine import EngineConfig, LLMEngine
    from halfmoon.engine.loader import preset_config
    from halfmoon.engine.lora import write_random_adapter

    path = write_random_adapter(preset_config("tiny"), tmp_path_factory.mktemp("lora") / "one",
                                seed=1, std=0.3)  # fmt: skip
    preset = ray_nodes.root / "cache" / "presets" / "tiny-seed0"  # (the nodes' own copy)
    offline = LLMEngine(EngineConfig(model=str(preset)))
    offline.load_lora(RuntimeAdapter.new("one", str(path)))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, lora="one")
    (out,) = offline.generate([LORA_PROMPT], params)
    load = httpx.post(f"{deployment.url}/v1/load_lora_adapter", headers=AUTH, timeout=120,
                      json={"lora_name": "one", "lora_path": str(path)})  # fmt: skip
    assert load.status_code == 200, load.text
    return out.text


LORA_PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def _lora_answer(url: str, model: str, retry_s: float = 0.0) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    deadline = time.monotonic() + retry_s
    while True:
        try:
            out = client.completions.create(model=model, prompt=LORA_PROMPT, max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
            return out.choices[0].text
        except Exception:  # only while a restarted process comes back (retry_s > 0)
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def test_an_adapter_loaded_while_serving_reaches_every_worker(deployment: Deployment, adapter):
    """vLLM's load endpoint on the gateway actor loads the adapter on both nodes'
    workers: a request naming it gets the offline engine's answer with it."""
    models = httpx.get(f"{deployment.url}/v1/models", headers=AUTH, timeout=30).json()["data"]
    assert "one" in {m["id"] for m in models}
    assert _lora_answer(deployment.url, "one") == adapter
    assert _lora_answer(deployment.url, "tiny") != adapter


def test_a_killed_worker_actor_is_restarted(deployment: Deployment, adapter):
    import ray

    # kill a worker actor: Ray restarts it, it registers again and serves (the adapter
    # loaded while serving too: the Conductor's list is given to it as it registers)
    actor = ray.get_actor(f"{NAME}:decode-0", namespace="halfmoon")
    old_pid = ray.get(actor.info.remote())["pid"]
    ray.kill(actor, no_restart=False)
    _wait(lambda: _restarted(ray, actor, old_pid), "decode-0 to be restarted")
    _complete(deployment.url, retry_s=60)
    assert _lora_answer(deployment.url, "one", retry_s=60) == adapter


def test_a_killed_gateway_comes_back_at_the_same_url(deployment: Deployment):
    """The controller restarts the gateway, whether its actor was killed through Ray
    (which alone would not restart it), its process was SIGKILLed, or its server stopped
    while the actor lives on (which Ray would not notice)."""
    import ray

    controller = ray.get_actor(NAME, namespace="halfmoon")
    restarts = _status(controller)["gateway_restarts"]
    for kill in (_ray_kill, _sigkill, _stop_serving):
        gateway = ray.get_actor(f"{NAME}:gateway", namespace="halfmoon")
        old = ray.get(gateway.info.remote(), timeout=30)
        kill(gateway, old["pid"])
        _complete(deployment.url, n=1, retry_s=90)  # the same URL serves again
        new = ray.get(ray.get_actor(f"{NAME}:gateway", namespace="halfmoon").info.remote())
        assert new["pid"] != old["pid"] and new["url"] == old["url"] == deployment.url
        assert new["node_id"] == old["node_id"]
        restarts += 1
        status = _status(controller)
        assert status["gateway"] == deployment.url and status["gateway_restarts"] == restarts
    assert deployment.serve.poll() is None, "the driver must not take a gateway death for the end"


def test_a_restarted_controller_adopts_the_running_deployment(
    deployment: Deployment, ray_nodes: RayNodes
):
    """Kill the controller: the deployment serves on (nothing is stopped or started
    again), the new controller knows every process, scales, and watches the gateway."""
    import ray

    url = deployment.url
    controller = ray.get_actor(NAME, namespace="halfmoon")
    before = _processes(ray, controller)
    decode_before = sorted(n for n in before if n.startswith("decode-"))
    next_index = load_record(NAME)["pools"]["next_index"]["decode"]  # the persisted record

    # requests keep succeeding while the controller is dead and while it comes back
    asking = _KeepAsking(url)
    asking.start()
    try:
        time.sleep(1.0)
        ray.kill(controller, no_restart=False)  # Ray restarts it (max_restarts=-1)
        _wait(lambda: _answers(ray, controller), "the controller to come back", 60)
        time.sleep(1.0)
    finally:
        asking.finish()
    assert asking.errors == [] and asking.done >= 3, (asking.done, asking.errors[:3])

    status = _status(controller)
    assert status["controller_restarted"] and status["gateway"] == url
    assert _processes(ray, controller) == before  # the same actors, the same pids
    assert deployment.serve.poll() is None, "the driver waits for a restarting controller"

    # scale still works, and never reissues an index the old controller gave out
    reply = _scale_over_http(url, {"decode": len(decode_before) + 1}, expect_draining=[])
    newcomer = f"decode-{next_index}"
    assert reply["added"] == [newcomer], reply
    _wait(lambda: newcomer in _status(controller)["registered"], f"{newcomer} to register")
    _complete(url, n=2)
    reply = _scale_cli(ray_nodes, decode=len(decode_before))
    assert sorted(w["name"] for w in reply["status"]["workers"] if w["role"] == "decode") == (
        decode_before
    )

    # and the restarted controller watches the gateway
    gateway = ray.get_actor(f"{NAME}:gateway", namespace="halfmoon")
    _sigkill(gateway, before["gateway"])
    _complete(url, n=1, retry_s=90)


def test_stop_leaves_nothing_behind(deployment: Deployment, ray_nodes: RayNodes):
    import ray

    ray.shutdown()
    # stop: the deployment leaves no halfmoon process; ray stop leaves nothing at all
    deployment.serve.send_signal(signal.SIGINT)
    assert deployment.serve.wait(90) == 0, log_tail(deployment.log.read_text())
    _wait(lambda: not [p for p in marked_processes(ray_nodes.mark)
                       if "halfmoon.cli" in _cmdline(p)], "halfmoon processes to exit")  # fmt: skip
    stopped = ray_nodes.ray("stop", "--force", timeout_s=60)
    assert stopped.returncode == 0, stopped.stderr
    _wait(lambda: not marked_processes(ray_nodes.mark), "Ray processes to exit", 20)


# -- helpers ------------------------------------------------------------------------------------
class _KeepAsking(threading.Thread):
    """Completes requests one after the other until told to finish; counts the outcomes."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.done = 0
        self.errors: list[str] = []
        self._finished = threading.Event()

    def run(self) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        while not self._finished.is_set():
            try:
                out = client.completions.create(model="tiny", prompt="keep going", max_tokens=8,
                                                temperature=0)  # fmt: skip
                assert out.usage.completion_tokens == 8
                self.done += 1
            except Exception as exc:  # recorded: the test asserts there is none
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def finish(self) -> None:
        self._finished.set()
        self.join(90)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _wait_for_url(proc: subprocess.Popen, log: Path, timeout_s: float = 240) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.search(r"serving at (http://\S+)/v1", log.read_text(errors="replace"))
        if found:
            return found.group(1)
        assert proc.poll() is None, f"serve exited: {log_tail(log.read_text())}"
        time.sleep(0.5)
    raise AssertionError(f"serve not ready: {log_tail(log.read_text())}")


def _complete(url: str, n: int = 2, retry_s: float = 0.0) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    deadline = time.monotonic() + retry_s
    for i in range(n):
        while True:
            try:
                out = client.completions.create(model="tiny", prompt=f"hello {i}", max_tokens=8,
                                                temperature=0)  # fmt: skip
                break
            except Exception:  # only while a restarted process comes back (retry_s > 0)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert out.usage.completion_tokens == 8 and out.choices[0].text
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content is not None


def _cli() -> list[str]:
    return [sys.executable, "-m", "halfmoon.cli"]


def _scale_cli(ray_nodes: RayNodes, **sizes: int) -> dict:
    """``halfmoon cluster scale --wait``'s reply."""
    argv = [f"--{role}={n}" for role, n in sizes.items()]
    scale = subprocess.run(
        [*_cli(), "cluster", "scale", "--address", ray_nodes.address, "--name", NAME, *argv,
         "--wait", "120"],
        env=ray_nodes.env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert scale.returncode == 0, scale.stdout + scale.stderr
    return json.loads(scale.stdout)


def _scale_over_http(url: str, body: dict, expect_draining: list[str]) -> dict:
    import httpx

    denied = httpx.post(f"{url}/admin/scale", json=body, timeout=30)
    assert denied.status_code == 401
    reply = httpx.post(f"{url}/admin/scale", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert reply.json()["draining"] == expect_draining
    return reply.json()


def _status(controller, retry_s: float = 30) -> dict:
    """The controller's status; asked again while Ray reports it unavailable (a handle
    fails a call or two around a restart of its actor)."""
    import ray

    deadline = time.monotonic() + retry_s
    while True:
        try:
            return ray.get(controller.status.remote(), timeout=60)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _workers(controller) -> dict[str, dict]:
    return {w["name"]: w for w in _status(controller)["workers"]}


def _processes(ray, controller) -> dict[str, int]:
    """{worker name, "gateway", "conductor": pid} of the running processes."""
    pids = {name: w["pid"] for name, w in _workers(controller).items()}
    for process in ("gateway", "conductor"):
        actor = ray.get_actor(f"{NAME}:{process}", namespace="halfmoon")
        call = actor.info.remote() if process == "gateway" else actor.pid.remote()
        reply = ray.get(call, timeout=30)
        pids[process] = reply["pid"] if process == "gateway" else reply
    return pids


def _answers(ray, controller) -> bool:
    try:
        return bool(ray.get(controller.ping.remote(), timeout=5))
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def _ray_kill(actor, pid: int) -> None:
    import ray

    ray.kill(actor)  # no_restart=True, Ray's default: only the controller brings it back


def _stop_serving(actor, pid: int) -> None:
    import ray

    ray.get(actor.stop.remote(), timeout=30)  # the server exits; the actor's process stays


def _sigkill(actor, pid: int) -> None:
    os.kill(pid, signal.SIGKILL)  # a local cluster: the actor's process is ours to kill


def _restarted(ray, actor, old_pid: int) -> bool:
    try:
        info = ray.get(actor.info.remote(), timeout=5)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False  # being restarted
    return info["pid"] != old_pid and info["restarted"]


def _wait(check, what: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
