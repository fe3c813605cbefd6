"""Chunked pipeline parallelism (CPP) live: ``halfmoon serve --cpp-stages 2`` on 127.0.0.1.

Two prefill workers form one group; long prompts run through it as a 2-stage pipeline
(hidden states between the stages over the transfer engine, each stage streaming its
layers' KV to the decode worker). Greedy and seeded outputs must equal an offline
engine's; a stage killed mid-prompt must not hang the request.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import openai
import pytest

from .test_faults import _pids, _stream, _wait_registered, engine_request_failures


@pytest.fixture(scope="module")
def cpp(cluster_factory):
    # Placements by the profile's estimates, not by scales learned on loaded cores: the
    # tests need the group chosen for every long prompt.
    return cluster_factory(
        "--prefill", "2", "--decode", "1", "--cpp-stages", "2", "--cpp-chunk-tokens", "512",
        "--cpp-min-tokens", "1024", "--kv-cache-mb", "128", "--prefill-calibration", "off",
    )  # fmt: skip


def _client(cluster):
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0,
                         timeout=120)  # fmt: skip


def _prompt(tag: str, words: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


def _stage_stats(cluster) -> list:
    return sorted(
        (p for p in cluster.ping_workers() if p.role == "prefill"),
        key=lambda p: p.instance_id,
    )


def test_greedy_and_seeded_outputs_equal_an_offline_engine(cpp):
    from halfmoon.core.request import SamplingParams, StructuredOutput
    from halfmoon.engine import EngineConfig, LLMEngine

    prompts = [_prompt("a", 1500), _prompt("b", 2200)]  # ~4,300 and ~6,700 tokens
    before = [p.stats["cpp_requests"] for p in _stage_stats(cpp)]
    engine = LLMEngine(EngineConfig(model=str(cpp.cache / "presets" / "tiny-seed0")))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
    client = _client(cpp)
    for prompt in prompts:
        for params in (greedy, seeded):
            (ref,) = engine.generate([prompt], params)
            out = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=6, temperature=params.temperature,
                seed=params.seed, extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert out.choices[0].text == ref.text
            assert out.usage.prompt_tokens == ref.num_prompt_tokens
    # Log-probabilities: the first token's is sampled by the pipeline's last stage.
    from .test_serve_disaggregated import offline_logprobs

    lp_params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1)
    ref = offline_logprobs(engine, prompts[0], lp_params)
    out = client.completions.create(
        model="tiny", prompt=prompts[0], max_tokens=3, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    ours = out.choices[0].logprobs.token_logprobs
    assert len(ours) == len(ref) == 3
    assert all(abs(x - e.logprob) < 1e-3 for x, (_, e) in zip(ours, ref, strict=True))
    # Masks on the first token, drawn by the last stage: a structured output, and the
    # options that write into its logits (min_tokens, logit_bias: those once failed there).
    from .test_serve_disaggregated import SMALL_SCHEMA

    structured = StructuredOutput("json", json.dumps(SMALL_SCHEMA), compact=True)
    masked = [
        (SamplingParams(max_tokens=40, temperature=0.9, seed=4, structured=structured),
         {"structured_outputs": {"json": SMALL_SCHEMA, "disable_any_whitespace": True}}),
        (SamplingParams(max_tokens=4, temperature=0, min_tokens=2, logit_bias=((7, 5.0),)),
         {"min_tokens": 2}),
    ]  # fmt: skip
    for params, extra in masked:
        (ref,) = engine.generate([prompts[1]], params)
        out = client.completions.create(
            model="tiny", prompt=prompts[1], max_tokens=params.max_tokens,
            temperature=params.temperature, seed=params.seed,
            logit_bias={"7": 5.0} if params.logit_bias else None, extra_body=extra,
        )  # fmt: skip
        assert out.choices[0].text == ref.text
    assert json.loads(engine.generate([prompts[1]], masked[0][0])[0].text)["tag"]
    after = [p.stats["cpp_requests"] for p in _stage_stats(cpp)]
    # Both stages ran every request (the Conductor chose the group: it lowers TTFT).
    assert [a - b for a, b in zip(after, before, strict=True)] == [7, 7]
    assert all(p.stats["cpp_jobs"] == 0 and p.integrity == "ok" for p in _stage_stats(cpp))


def test_each_stage_reuses_its_cached_prefix(cpp):
    client = _client(cpp)
    base = _prompt("c", 1800)
    first = client.completions.create(model="tiny", prompt=base, max_tokens=2, temperature=0)
    reused_before = [p.stats["cpp_prefix_tokens_reused"] for p in _stage_stats(cpp)]
    second = client.completions.create(
        model="tiny", prompt=base + " and then some more words", max_tokens=2, temperature=0
    )
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 16  # all but the last partial block
    reused = [p.stats["cpp_prefix_tokens_reused"] - r for p, r in
              zip(_stage_stats(cpp), reused_before, strict=True)]  # fmt: skip
    assert reused == [cached, cached]  # every stage started after the same prefix


def test_a_group_reuses_a_prefix_one_worker_computed_alone(cpp):
    """A short prompt runs on one prefill worker alone (its blocks stay in that engine's
    pool: ``demote`` stores them only on eviction); a long one with that prefix runs on
    the group: the stage on that worker reads the prefix out of its engine's pool, the
    other pulls it from there. (Before, the first stage looked in its store only, failed
    the request as retryable, and after three tries the client got a 503.)"""
    from halfmoon.core.request import SamplingParams
    from halfmoon.engine import EngineConfig, LLMEngine

    client = _client(cpp)
    short = _prompt("g", 300)  # ~800 tokens: below --cpp-min-tokens
    first = client.completions.create(model="tiny", prompt=short, max_tokens=2, temperature=0)
    before = _stage_stats(cpp)
    long = short + " " + _prompt("h", 400)
    second = client.completions.create(model="tiny", prompt=long, max_tokens=4, temperature=0)
    after = _stage_stats(cpp)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == first.usage.prompt_tokens // 16 * 16
    assert [a.stats["cpp_requests"] - b.stats["cpp_requests"] for a, b in
            zip(after, before, strict=True)] == [1, 1]  # fmt: skip
    reused = [a.stats["cpp_prefix_tokens_reused"] - b.stats["cpp_prefix_tokens_reused"]
              for a, b in zip(after, before, strict=True)]  # fmt: skip
    assert reused == [cached, cached]
    pulled = sorted(a.stats["blocks_pulled"] - b.stats["blocks_pulled"]
                    for a, b in zip(after, before, strict=True))  # fmt: skip
    assert pulled == [0, cached // 16]  # one stage had it, the other pulled it
    engine = LLMEngine(EngineConfig(model=str(cpp.cache / "presets" / "tiny-seed0")))
    greedy = SamplingParams(max_tokens=4, temperature=0)
    (ref,) = engine.generate([long], greedy)
    assert second.choices[0].text == ref.text


def test_stage_killed_mid_prompt_fails_over_without_hanging(cpp):
    out: dict = {}
    t = threading.Thread(target=_stream, args=(cpp, _prompt("d", 5000), 4, out))
    t.start()
    victim = None
    end = time.monotonic() + 60
    ports = {}
    for pid in _pids(cpp, "prefill"):
        argv = open(f"/proc/{pid}/cmdline", "rb").read().decode().split("\0")
        ports[argv[argv.index("--index") + 1]] = pid
    while victim is None and time.monotonic() < end:
        for pong in _stage_stats(cpp):
            if pong.stats["cpp_jobs"] and pong.instance_id == "prefill-1":
                victim = ports["1"]  # one of the two stages, mid-pipeline
        time.sleep(0.02)
    assert victim is not None, "the group never started the prompt"
    os.kill(victim, signal.SIGKILL)
    t.join(180)
    assert not t.is_alive(), "the request hung"
    assert out["usage"].completion_tokens == 4  # placed again, completed
    _wait_registered(cpp, 3)
    assert all(p.stats["cpp_jobs"] == 0 and p.integrity == "ok" for p in _stage_stats(cpp))


def test_cache_salt_isolates_every_stage(cpp):
    client = _client(cpp)
    base = _prompt("s", 1200)

    def cached(salt):
        out = client.completions.create(model="tiny", prompt=base, max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": salt})  # fmt: skip
        return out.usage.prompt_tokens_details.cached_tokens, out.usage.prompt_tokens

    assert cached("a")[0] == 0
    reused_before = [p.stats["cpp_prefix_tokens_reused"] for p in _stage_stats(cpp)]
    hit, prompt_tokens = cached("a")
    assert hit >= prompt_tokens - 16  # the same salt: every stage reuses the prefix
    assert cached("b")[0] == 0  # another salt: no stage does
    reused = [p.stats["cpp_prefix_tokens_reused"] - r for p, r in
              zip(_stage_stats(cpp), reused_before, strict=True)]  # fmt: skip
    assert reused == [hit, hit]


def test_prompt_logprobs_through_the_pipeline_equal_an_offline_engine(cpp):
    """A long prompt's log-probabilities are computed by the pipeline's last stage, chunk
    by chunk, from token 0 even though the group holds the prompt cached."""
    import httpx

    from halfmoon.engine import EngineConfig, LLMEngine

    from .test_serve_disaggregated import offline_prompt_logprobs

    prompt = _prompt("a", 1500)  # the first test ran it: cached in both stages
    engine = LLMEngine(EngineConfig(model=str(cpp.cache / "presets" / "tiny-seed0")))
    ids = engine.tokenizer.encode(prompt)
    ref = offline_prompt_logprobs(engine, ids, 0)
    before = [p.stats["cpp_requests"] for p in _stage_stats(cpp)]
    answer = httpx.post(cpp.base_url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0,
    }).json()  # fmt: skip
    after = [p.stats["cpp_requests"] for p in _stage_stats(cpp)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1]
    field = answer["choices"][0]["prompt_logprobs"]
    assert len(field) == len(ids) and field[0] is None
    worst = max(
        abs(entry[str(token)]["logprob"] - theirs.logprob)
        for entry, token, theirs in zip(field[1:], ids[1:], ref, strict=True)
    )
    assert worst < 1e-3
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_prompt_that_fails_a_stage_fails_alone(cluster_factory, monkeypatch):
    """A long prompt whose computation raises in a stage (``HALFMOON_FAIL_STEP_ON_TOKEN``
    in the workers' environment) fails with a 503 naming the error after the gateway's
    three tries, and no worker restarts: the group then runs the next long prompt."""
    from .conftest import children_of

    monkeypatch.setenv("HALFMOON_FAIL_STEP_ON_TOKEN", "4000")
    cluster = cluster_factory(
        "--prefill", "2", "--decode", "1", "--cpp-stages", "2", "--cpp-chunk-tokens", "512",
        "--cpp-min-tokens", "1024", "--kv-cache-mb", "128", "--prefill-calibration", "off",
    )  # fmt: skip
    workers = sorted(children_of(cluster.proc.pid))
    client = _client(cluster)
    before = [p.stats["cpp_requests"] for p in _stage_stats(cluster)]
    ids = [100 + i % 3000 for i in range(3000)]
    ids[2000] = 4000  # in the fourth chunk: three went through both stages first
    with pytest.raises(openai.APIStatusError) as failed:
        client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0,
                                  logit_bias={"4000": -100})  # fmt: skip
    assert failed.value.status_code == 503
    assert "engine step failed" in failed.value.message, failed.value.message
    assert engine_request_failures(cluster) >= 3  # a stage failed in each try
    ran = [p.stats["cpp_requests"] - b for p, b in zip(_stage_stats(cluster), before,
                                                      strict=True)]  # fmt: skip
    # The group ran it (a try with its prefix cached may not; a try aborted when the
    # first stage failed may never have reached the second).
    assert min(ran) >= 1
    ids[2000] = 2100
    done = client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0,
                                     logit_bias={"4000": -100})  # fmt: skip
    assert done.usage.completion_tokens == 2
    assert sorted(children_of(cluster.proc.pid)) == workers  # no worker restarted
    assert all(p.stats["cpp_jobs"] == 0 and p.integrity == "ok" for p in _stage_stats(cluster))
