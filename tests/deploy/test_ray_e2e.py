"""``halfmoon serve --ray`` on a two-node local Ray cluster: serve, scale, survive a
killed worker actor, stop leaving nothing behind."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from halfmoon.serve.runtime import free_port

from .conftest import RayNodes, marked_processes

API_KEY = "ray-e2e-key"
pytestmark = pytest.mark.timeout(400)


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
        assert proc.poll() is None, f"serve exited: {log.read_text()[-4000:]}"
        time.sleep(0.5)
    raise AssertionError(f"serve not ready: {log.read_text()[-4000:]}")


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
            except Exception:  # only while a restarted worker rejoins (retry_s > 0)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        assert out.usage.completion_tokens == 8 and out.choices[0].text
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content is not None


def test_serve_scale_restart_and_stop_on_two_nodes(ray_nodes: RayNodes, tmp_path: Path):
    import ray

    log = tmp_path / "serve.log"
    serve = ray_nodes.halfmoon(
        "serve", "--ray", ray_nodes.address, "--model", "tiny", "--prefill", "1", "--decode",
        "1", "--prefill-resource", "prefill", "--decode-resource", "decode",
        "--port", str(free_port()), "--api-key", API_KEY, "--max-worker-restarts", "2",
        "--store-dram-mb", "32", "--startup-timeout", "150", "--deployment-name", "e2e",
        log=log,
    )  # fmt: skip
    try:
        url = _wait_for_url(serve, log)
        _complete(url)
        ray.init(address=ray_nodes.address, namespace="halfmoon", logging_level="ERROR",
                 log_to_driver=False)  # fmt: skip
        controller = ray.get_actor("e2e", namespace="halfmoon")
        workers = {w["name"]: w for w in ray.get(controller.status.remote())["workers"]}
        # the pools are pinned by their custom resources: one node each
        assert workers["prefill-0"]["node_id"] != workers["decode-0"]["node_id"]

        # scale decode to 2 from the CLI; the new worker lands on the decode node
        scale = subprocess.run(
            [*_cli(), "cluster", "scale", "--address", ray_nodes.address, "--name", "e2e",
             "--decode", "2", "--wait", "120"],
            env=ray_nodes.env, capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert scale.returncode == 0, scale.stdout + scale.stderr
        reply = json.loads(scale.stdout)
        assert reply["added"] == ["decode-1"] and reply["sizes"] == {"prefill": 1, "decode": 2}
        workers = {w["name"]: w for w in reply["status"]["workers"]}
        assert workers["decode-1"]["node_id"] == workers["decode-0"]["node_id"]
        assert set(reply["status"]["registered"]) == {"prefill-0", "decode-0", "decode-1"}
        _complete(url, n=4)

        # and back to 1 through the gateway's admin endpoint: decode-1 drains and leaves
        _scale_over_http(url, {"decode": 1}, expect_draining=["decode-1"])
        _wait(lambda: [w["name"] for w in ray.get(controller.status.remote())["workers"]]
              == ["prefill-0", "decode-0"], "decode-1 to drain and leave")  # fmt: skip
        with pytest.raises(ValueError):
            ray.get_actor("e2e:decode-1", namespace="halfmoon")
        _complete(url)

        # kill a worker actor: Ray restarts it, it registers again and serves
        actor = ray.get_actor("e2e:decode-0", namespace="halfmoon")
        old_pid = ray.get(actor.info.remote())["pid"]
        ray.kill(actor, no_restart=False)
        _wait(lambda: _restarted(ray, actor, old_pid), "decode-0 to be restarted")
        _complete(url, retry_s=60)
        ray.shutdown()

        # stop: the deployment leaves no halfmoon process; ray stop leaves nothing at all
        serve.send_signal(signal.SIGINT)
        assert serve.wait(90) == 0, log.read_text()[-3000:]
        _wait(lambda: not [p for p in marked_processes(ray_nodes.mark)
                           if "halfmoon.cli" in _cmdline(p)], "halfmoon processes to exit")  # fmt: skip
        stopped = ray_nodes.ray("stop", "--force", timeout_s=60)
        assert stopped.returncode == 0, stopped.stderr
        _wait(lambda: not marked_processes(ray_nodes.mark), "Ray processes to exit", 20)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def _cli() -> list[str]:
    return [sys.executable, "-m", "halfmoon.cli"]


def _scale_over_http(url: str, body: dict, expect_draining: list[str]) -> None:
    import httpx

    denied = httpx.post(f"{url}/admin/scale", json=body, timeout=30)
    assert denied.status_code == 401
    reply = httpx.post(f"{url}/admin/scale", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert reply.json()["draining"] == expect_draining


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
