"""LoRA adapters loaded while the cluster serves (``halfmoon serve
--allow-runtime-lora-updating``; vLLM's ``/v1/load_lora_adapter`` and
``/v1/unload_lora_adapter``): every worker loads it (a worker started later too), a
request's ``model`` picks it and the answer is the offline engine's with it; unloading
and loading the name again with other weights never reuses the old weights' cached KV;
bad loads are refused with the reason and leave nothing behind."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from halfmoon.engine.loader import preset_config
from halfmoon.engine.lora import write_random_adapter

from .conftest import children_of

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # > 3 blocks of 16 tokens


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime-adapters")
    return {
        "one": write_random_adapter(preset_config("tiny"), root / "one", seed=1, std=0.3),
        "two": write_random_adapter(preset_config("tiny"), root / "two", seed=2, std=0.3),
        "alien": write_random_adapter(preset_config("small"), root / "alien", seed=3),
    }


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    return cluster_factory("--kv-cache-mb", "64", "--allow-runtime-lora-updating")


@pytest.fixture(scope="module")
def offline(cluster):
    from halfmoon.engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(cluster.cache / "presets" / "tiny-seed0")))


def _completion(cluster, model: str):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip


def _answer(cluster, model: str) -> str:
    return _completion(cluster, model).choices[0].text


def _cached(completion) -> int:
    details = completion.usage.prompt_tokens_details
    return 0 if details is None else details.cached_tokens or 0


def _expected(offline, path: Path) -> str:
    from halfmoon.core.adapters import RuntimeAdapter
    from halfmoon.core.request import SamplingParams

    adapter = RuntimeAdapter.new("check", str(path))
    offline.load_lora(adapter)
    try:
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, lora="check")
        (out,) = offline.generate([PROMPT], params)
    finally:
        offline.unload_lora("check")
        offline.step()  # (drops it: no request uses it)
    return out.text


def _post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(cluster.base_url + path, json=body, timeout=120)


def _models(cluster) -> dict[str, dict]:
    cards = httpx.get(cluster.base_url + "/v1/models", timeout=30).json()["data"]
    return {c["id"]: c for c in cards}


def test_load_serve_unload_and_load_again(cluster, adapters, offline) -> None:
    load = _post(cluster, "/v1/load_lora_adapter",
                 {"lora_name": "sql", "lora_path": str(adapters["one"])})  # fmt: skip
    assert load.status_code == 200, load.text
    assert load.text == "Success: LoRA adapter 'sql' added successfully."
    card = _models(cluster)["sql"]
    assert card["parent"] == "tiny" and card["root"] == str(adapters["one"].resolve())
    first = _expected(offline, adapters["one"])
    assert _answer(cluster, "sql") == first
    cached = _completion(cluster, "sql")
    assert cached.choices[0].text == first and _cached(cached) > 0  # its prefix cache
    assert _answer(cluster, "tiny") != first

    again = _post(cluster, "/v1/load_lora_adapter",
                  {"lora_name": "sql", "lora_path": str(adapters["two"])})  # fmt: skip
    assert again.status_code == 400
    assert "The lora adapter 'sql' has already been loaded." in again.text

    unload = _post(cluster, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert unload.status_code == 200, unload.text
    assert unload.text == "Success: LoRA adapter 'sql' removed successfully."
    assert "sql" not in _models(cluster)
    with pytest.raises(openai.NotFoundError, match="model 'sql' does not exist"):
        _answer(cluster, "sql")
    gone = _post(cluster, "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert gone.status_code == 404 and "'sql' cannot be found" in gone.text

    # the name again with other weights: the answer is theirs, not the cached KV's
    load = _post(cluster, "/v1/load_lora_adapter",
                 {"lora_name": "sql", "lora_path": str(adapters["two"])})  # fmt: skip
    assert load.status_code == 200, load.text
    second = _expected(offline, adapters["two"])
    assert second != first
    fresh = _completion(cluster, "sql")
    assert fresh.choices[0].text == second and _cached(fresh) == 0


def test_bad_loads_are_refused_and_leave_nothing(cluster, adapters, tmp_path) -> None:
    missing = _post(cluster, "/v1/load_lora_adapter",
                    {"lora_name": "nope", "lora_path": str(tmp_path / "none")})  # fmt: skip
    assert missing.status_code == 404 and "is not a directory" in missing.text
    empty = _post(cluster, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert empty.status_code == 400
    assert "Both 'lora_name' and 'lora_path' must be provided." in empty.text
    base = _post(cluster, "/v1/load_lora_adapter",
                 {"lora_name": "tiny", "lora_path": str(adapters["one"])})  # fmt: skip
    assert base.status_code == 400 and "conflicts with the base model" in base.text
    # an adapter of another model: every worker refuses it; no worker keeps it
    alien = _post(cluster, "/v1/load_lora_adapter",
                  {"lora_name": "alien", "lora_path": str(adapters["alien"])})  # fmt: skip
    assert alien.status_code == 400 and "names layer 10; the model has 4" in alien.text
    assert "alien" not in _models(cluster) and "nope" not in _models(cluster)
    ok = _post(cluster, "/v1/load_lora_adapter",
               {"lora_name": "alien", "lora_path": str(adapters["one"])})  # fmt: skip
    assert ok.status_code == 200, ok.text  # (the name was left free)
    assert _post(cluster, "/v1/unload_lora_adapter", {"lora_name": "alien"}).status_code == 200


def _pids(cluster, role: str) -> list[int]:
    """The launcher's children that run ``role`` (``decode``, ``conductor``)."""
    return [p for p in children_of(cluster.proc.pid)
            if role in Path(f"/proc/{p}/cmdline").read_bytes().decode().split("\0")]  # fmt: skip


def test_a_worker_started_later_loads_the_adapters(cluster, adapters, offline) -> None:
    """The decode worker is killed; the one the launcher starts in its place registers
    and is given the adapters loaded while serving, before it takes a request."""
    load = _post(cluster, "/v1/load_lora_adapter",
                 {"lora_name": "later", "lora_path": str(adapters["one"])})  # fmt: skip
    assert load.status_code == 200, load.text
    victims = _pids(cluster, "decode")
    assert len(victims) == 1
    os.kill(victims[0], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        pids = _pids(cluster, "decode")
        workers = httpx.get(cluster.base_url + "/health", timeout=10).json().get("instances", {})
        if pids and pids != victims and len(workers) == 2:
            break
        assert time.monotonic() < deadline, "the decode worker was not started again"
        time.sleep(0.5)
    assert _answer(cluster, "later") == _expected(offline, adapters["one"])


def test_a_restarted_conductor_learns_the_adapters_back(cluster, adapters, offline) -> None:
    """The Conductor is killed; the launcher starts another, the workers register again
    with the adapters they loaded while serving, and its list (what gateways serve and
    workers started later are given) holds them again, under the same tag."""
    load = _post(cluster, "/v1/load_lora_adapter",
                 {"lora_name": "kept", "lora_path": str(adapters["two"])})  # fmt: skip
    assert load.status_code == 200, load.text
    (before,) = [a for a in cluster.ping_conductor().adapters if a.name == "kept"]
    (conductor,) = _pids(cluster, "conductor")
    os.kill(conductor, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        try:
            after = [a for a in cluster.ping_conductor(timeout_ms=2000).adapters
                     if a.name == "kept"]  # fmt: skip
        except Exception:  # noqa: BLE001 - not started yet
            after = []
        pids = _pids(cluster, "conductor")
        # (the gateway learns the Conductor's list from its pings, every 0.5 s)
        if after and pids and pids != [conductor] and "kept" in _models(cluster):
            break
        assert time.monotonic() < deadline, "the new Conductor did not learn the adapter"
        time.sleep(0.5)
    assert after == [before]
    assert _answer(cluster, "kept") == _expected(offline, adapters["two"])
