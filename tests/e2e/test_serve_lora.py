"""``halfmoon serve --lora-modules``: a request's ``model`` picks a LoRA adapter on the
prefill and the decode worker (the answer is the offline engine's with that adapter),
``/v1/models`` lists the adapters, and each adapter's prefix cache is its own."""

from __future__ import annotations

import httpx
import openai
import pytest

from halfmoon.engine.loader import preset_config
from halfmoon.engine.lora import write_random_adapter

PROMPT = "The quick brown fox jumps over the lazy dog. " * 6  # > 3 blocks of 16 tokens


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    config = preset_config("tiny")
    return {
        "sql": write_random_adapter(config, root / "sql", seed=1, std=0.3),
        "chat/v2": write_random_adapter(config, root / "chat", seed=2, std=0.3, rank=4,
                                        modules=("q_proj", "v_proj", "down_proj")),
    }  # fmt: skip


@pytest.fixture(scope="module")
def lora_cluster(cluster_factory, adapters):
    mods = [f"{name}={path}" for name, path in adapters.items()]
    return cluster_factory("--kv-cache-mb", "64", "--enable-lora", "--lora-modules", *mods)


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="x", max_retries=0)


def _complete(cluster, model: str, prompt: str = PROMPT):
    return _client(cluster).completions.create(model=model, prompt=prompt, max_tokens=8,
                                               temperature=0, extra_body={"ignore_eos": True})  # fmt: skip


def test_models_list_the_adapters(lora_cluster, adapters) -> None:
    cards = httpx.get(lora_cluster.base_url + "/v1/models", timeout=30).json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "sql", "chat/v2"]
    assert cards[0]["parent"] is None
    assert all(c["parent"] == "tiny" for c in cards[1:])
    assert cards[1]["root"] == str(adapters["sql"].resolve())
    one = httpx.get(lora_cluster.base_url + "/v1/models/chat/v2", timeout=30).json()
    assert one["id"] == "chat/v2" and one["parent"] == "tiny"
    with pytest.raises(openai.NotFoundError, match="'tiny', 'sql', 'chat/v2'"):
        _complete(lora_cluster, "nope")


def test_an_adapter_answers_as_the_offline_engine(lora_cluster, adapters) -> None:
    from halfmoon.core.request import SamplingParams
    from halfmoon.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(
        model=str(lora_cluster.cache / "presets" / "tiny-seed0"),
        lora_modules=tuple((n, str(p)) for n, p in adapters.items()),
    ))  # fmt: skip
    texts = {}
    for model in ("tiny", "sql", "chat/v2"):
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                lora=None if model == "tiny" else model)  # fmt: skip
        (offline,) = engine.generate([PROMPT], params)
        served = _complete(lora_cluster, model)
        assert served.choices[0].text == offline.text
        assert served.model == model
        texts[model] = offline.text
    assert len(set(texts.values())) == 3  # each adapter changes the answer
    # streamed chat through an adapter
    chunks = _client(lora_cluster).chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        temperature=0, stream=True,
    )  # fmt: skip
    assert all(c.model == "sql" for c in chunks)


def test_each_adapter_has_its_own_prefix_cache(lora_cluster) -> None:
    prompt = "Cache per adapter: " + "one two three four five six seven " * 8

    def cached(model: str) -> int:
        return _complete(lora_cluster, model, prompt).usage.prompt_tokens_details.cached_tokens

    assert cached("tiny") == 0
    assert cached("sql") == 0  # the base model's blocks are not the adapter's KV
    assert cached("sql") > 0
    assert cached("chat/v2") == 0
    assert cached("tiny") > 0
    with pytest.raises(openai.BadRequestError, match="U\\+001F"):
        _client(lora_cluster).completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_body={"cache_salt": "\x1flora:sql\x1f"}
        )


def test_requests_by_adapter_in_the_metrics(lora_cluster) -> None:
    """Finished requests are counted per adapter; none is left counted as running."""
    _complete(lora_cluster, "chat/v2", "Count me")
    text = httpx.get(lora_cluster.base_url + "/metrics", timeout=30).text

    def value(name: str, lora: str) -> float:
        lines = [ln for ln in text.splitlines()
                 if ln.startswith(name + "{") and f'lora_name="{lora}"' in ln]  # fmt: skip
        assert len(lines) == 1, lines
        return float(lines[0].rsplit(" ", 1)[1])

    assert value("halfmoon:lora_request_success_total", "chat/v2") >= 2
    assert value("halfmoon:lora_request_success_total", "sql") >= 3
    assert value("halfmoon:lora_requests_running", "chat/v2") == 0
