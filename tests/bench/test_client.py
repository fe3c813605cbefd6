"""One streamed request against the fake server: timing, token counting, outcomes."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from halfmoon.bench.client import ClientConfig, StreamStats, completion_body, send_request
from halfmoon.metrics.records import RequestRecord

from .fake_openai import FakeOpenAI, Reply

#: How late the client may read an event after the server wrote it: a loaded 2-core box
#: (a CI run beside other tests read one 56 ms late); the gaps below are set far enough
#: apart that a client timing its tokens wrongly (all at the end, or out of order) still
#: misses by more.
READ_SLACK_S = 0.15


def _send(url: str, output_length: int = 4, **config) -> tuple[RequestRecord, StreamStats, float]:
    """Send one request; returns its record, stream stats and the clock origin used."""
    cfg = ClientConfig(url, "fake-model", **config)

    async def go():
        origin = time.monotonic()

        def now() -> float:
            return time.monotonic() - origin

        record = RequestRecord("r0", now(), 10, output_length)
        async with httpx.AsyncClient(trust_env=False) as client:
            stats = await send_request(client, cfg, record, list(range(20, 30)), now)
        return record, stats, origin

    return asyncio.run(go())


def test_ttft_and_gaps_match_what_the_server_did():
    gaps = [0.02, 0.4, 0.0, 0.2]
    with FakeOpenAI(lambda body: Reply(ttft_s=0.25, gaps_s=gaps)) as server:
        record, stats, origin = _send(server.url, output_length=5)
    (exchange,) = server.exchanges
    sent = [t - origin for t in exchange.event_times_s]
    assert len(record.token_times_s) == 5 and stats.num_events == 5
    for got, wrote in zip(record.token_times_s, sent, strict=True):
        assert wrote <= got <= wrote + READ_SLACK_S
    assert record.ttft_s >= 0.25
    assert record.ttft_s == pytest.approx(sent[0] - record.arrival_s, abs=READ_SLACK_S)
    for got, want in zip(record.tbt_gaps_s, gaps, strict=True):
        assert got == pytest.approx(want, abs=READ_SLACK_S)
    assert record.completed and record.finish_s >= record.token_times_s[-1]
    assert record.prefill_done_s == record.token_times_s[0]
    assert stats.num_reported_tokens == 5


def test_request_body_asks_for_exact_output():
    with FakeOpenAI(lambda body: Reply()) as server:
        _send(server.url, output_length=7, api_key="sekret")
    (exchange,) = server.exchanges
    body = exchange.body
    assert body["prompt"] == list(range(20, 30))
    assert (body["max_tokens"], body["min_tokens"], body["ignore_eos"]) == (7, 7, True)
    assert body["stream"] is True and body["model"] == "fake-model"
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert exchange.headers["authorization"] == "Bearer sekret"
    plain = completion_body(ClientConfig("http://x", "m", vllm_extensions=False), [1], 3)
    assert "ignore_eos" not in plain and "min_tokens" not in plain
    assert plain["stream_options"] == {"include_usage": True}
    assert "priority" not in plain
    assert completion_body(ClientConfig("http://x", "m"), [1], 3, priority=-2)["priority"] == -2


def test_multi_token_events_with_running_usage():
    reply = Reply(gaps_s=[0.01, 0.01], tokens_per_event=[1, 3, 2], continuous_usage=True)
    with FakeOpenAI(lambda body: reply) as server:
        record, stats, _ = _send(server.url, output_length=6)
    times = record.token_times_s
    assert len(times) == 6 and stats.num_events == 3
    assert times[1] == times[2] == times[3] and times[4] == times[5]
    assert stats.num_reported_tokens == 6


def test_without_usage_one_token_per_non_empty_event():
    # The middle event has no text: its token shows with the next event. The closing
    # usage (3 tokens) matches the events' count once the last one is in.
    reply = Reply(gaps_s=[0.05, 0.05], texts=["a", "", "b"])
    with FakeOpenAI(lambda body: reply) as server:
        record, stats, _ = _send(server.url, output_length=3)
    assert len(record.token_times_s) == 3 and stats.num_events == 2
    assert record.token_times_s[1] == record.token_times_s[2]
    assert stats.num_reported_tokens == 3 and record.completed


def test_tokens_without_text_are_counted_at_the_finishing_event():
    # A random-weight model may emit only special tokens: no event has text, yet the
    # server generated 4 tokens, all seen by the client when the stream finished.
    reply = Reply(gaps_s=[0.02] * 3, texts=["", "", "", ""])
    with FakeOpenAI(lambda body: reply) as server:
        record, stats, _ = _send(server.url, output_length=4)
    (exchange,) = server.exchanges
    assert record.completed and stats.num_events == 0
    assert len(set(record.token_times_s)) == 1 and len(record.token_times_s) == 4
    assert record.ttft_s >= exchange.event_times_s[-1] - exchange.received_s


def test_cached_tokens_come_from_usage():
    with FakeOpenAI(lambda body: Reply(cached_tokens=6)) as server:
        record, _, _ = _send(server.url, output_length=1)
    assert record.cached_tokens == 6


def test_429_is_a_rejection():
    with FakeOpenAI(lambda body: Reply(status=429, message="TTFT SLO")) as server:
        record, _, _ = _send(server.url)
    assert record.rejected and record.reject_reason == "TTFT SLO"
    assert not record.error and not record.completed and record.finish_s is None


def test_other_status_is_an_error():
    with FakeOpenAI(lambda body: Reply(status=503, message="down")) as server:
        record, _, _ = _send(server.url)
    assert record.error == "HTTP 503: down" and not record.rejected


def test_error_event_mid_stream_keeps_tokens_so_far():
    with FakeOpenAI(lambda body: Reply(gaps_s=[0.01] * 3, error_after=2)) as server:
        record, _, _ = _send(server.url)
    assert "worker died" in record.error
    assert len(record.token_times_s) == 2 and record.prefill_done_s is not None
    assert not record.completed


def test_stream_cut_before_done_is_an_error():
    with FakeOpenAI(lambda body: Reply(gaps_s=[0.01] * 3, cut_after=1)) as server:
        record, _, _ = _send(server.url)
    assert record.error == "stream ended before [DONE]"


def test_timeout_is_an_error():
    with FakeOpenAI(lambda body: Reply(gaps_s=[5.0])) as server:
        start = time.monotonic()
        record, _, _ = _send(server.url, timeout_s=0.3)
    assert time.monotonic() - start < 3.0
    assert record.error.startswith("timed out") and len(record.token_times_s) == 1


def test_connection_refused_is_an_error():
    with FakeOpenAI(lambda body: Reply()) as server:
        url = server.url
    record, _, _ = _send(url)
    assert record.error and not record.token_times_s


def test_client_config_checks():
    with pytest.raises(ValueError, match="timeout"):
        ClientConfig("http://x", "m", timeout_s=0)
    with pytest.raises(ValueError, match="temperature"):
        ClientConfig("http://x", "m", temperature=3)
