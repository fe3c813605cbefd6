"""The decode worker's TBT guard on a real cluster (1 prefill + 1 decode, tiny preset).

A 1 us TBT SLO makes the guard bind as soon as a request decodes (a lone request still
joins: an idle batch admits anything); ``--early-reject none`` keeps the Conductor from
turning the requests away first. Counts and messages, never timings."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

GUARD_ARGS = ("--kv-cache-mb", "32", "--attention", "reference", "--early-reject", "none",
              "--tbt-slo", "0.000001")  # fmt: skip
#: Long enough that the first request still decodes when the second one's KV arrives.
LONG_TOKENS = 120
SHORT_TOKENS = 8


def _body(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip


def _while_one_decodes(base_url: str, second: dict) -> tuple[int, httpx.Response]:
    """Stream a long request; once its decode worker has sent a token (it is in the
    batch), post ``second`` (from a thread: the long one is read on meanwhile). Returns
    the long request's token count and the second's response."""
    with httpx.Client(base_url=base_url, timeout=120, trust_env=False) as client, \
            ThreadPoolExecutor(1) as pool:  # fmt: skip
        chunks = 0
        reply = None
        body = _body("a long story " * 8, LONG_TOKENS, stream=True)
        with client.stream("POST", "/v1/completions", json=body) as long:
            assert long.status_code == 200
            for line in long.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunks += 1
                if chunks == 2:  # the first token is the prefill's; this one the decode's
                    reply = pool.submit(client.post, "/v1/completions", json=second)
        assert reply is not None
        return chunks, reply.result(timeout=120)


def _until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _decode_stats(cluster) -> dict:
    (pong,) = [p for p in cluster.ping_workers() if p.role == "decode"]
    return pong.stats


def test_reject_turns_a_request_away_with_a_clear_error_and_serves_a_lone_one(cluster_factory):
    cluster = cluster_factory(*GUARD_ARGS, "--decode-guard", "reject")
    with httpx.Client(base_url=cluster.base_url, timeout=120, trust_env=False) as client:
        lone = client.post("/v1/completions", json=_body("alone", SHORT_TOKENS))
    assert lone.status_code == 200, lone.text
    assert lone.json()["usage"]["completion_tokens"] == SHORT_TOKENS
    chunks, refused = _while_one_decodes(cluster.base_url, _body("a short one", SHORT_TOKENS))
    assert chunks >= LONG_TOKENS  # the running request was not disturbed
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["type"] == "ServiceUnavailable"
    assert "refused the request after its prefill" in error["message"]
    assert "0.001ms TBT SLO (decode guard 'reject')" in error["message"]
    stats = _decode_stats(cluster)
    assert stats["guard_refused"] == 1 and stats["guard_waited"] == 0
    # The Conductor heard the refused request finished: nothing is left placed.
    _until(lambda: cluster.ping_conductor().num_placements == 0)


def test_wait_serves_every_request(cluster_factory):
    cluster = cluster_factory(*GUARD_ARGS, "--decode-guard", "wait")
    chunks, waited = _while_one_decodes(cluster.base_url, _body("a short one", SHORT_TOKENS))
    assert chunks >= LONG_TOKENS
    assert waited.status_code == 200, waited.text
    assert waited.json()["usage"]["completion_tokens"] == SHORT_TOKENS
    with ThreadPoolExecutor(4) as pool:  # and a few at once
        replies = list(pool.map(
            lambda i: httpx.post(f"{cluster.base_url}/v1/completions", timeout=120,
                                 json=_body(f"prompt {i}", SHORT_TOKENS), trust_env=False),
            range(4),
        ))  # fmt: skip
    assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
    stats = _decode_stats(cluster)
    assert stats["guard_refused"] == 0 and stats["guard_waited"] >= 1
    assert stats["guard_waiting"] == 0
