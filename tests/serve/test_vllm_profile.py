"""Profiling a vLLM server (halfmoon/serve/vllm/profile.py): a request group the server
leaves unanswered is aborted and sent again, and one it never answers is a clear error.
The server here is a scripted stand-in for the connector's request calls; the real
servers' profiles are measured in tests/e2e/test_vllm_fleet.py and test_vllm_pd.py."""

from __future__ import annotations

import pytest

from halfmoon.core.request import SamplingParams
from halfmoon.engine.connector import RequestOutput
from halfmoon.serve.vllm import profile

ONCE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


class ScriptedServer:
    """Answers each request with one token on the next step, except the first ``drop``
    requests it receives, which it never answers (until aborted)."""

    metrics_text = "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"

    def __init__(self, drop: int) -> None:
        self.drop = drop
        self.received: list[str] = []
        self.aborted: list[str] = []
        self.queued: list[str] = []

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.received.append(rid)
        if len(self.received) > self.drop:
            self.queued.append(rid)

    def abort_request(self, rid: str) -> bool:
        self.aborted.append(rid)
        return True

    def step(self) -> list[RequestOutput]:
        out = [
            RequestOutput(request_id=rid, new_token_ids=(7,), token_ids=(7,), text="",
                          finished=True, finish_reason="length", num_prompt_tokens=4,
                          num_cached_tokens=0)
            for rid in self.queued
        ]  # fmt: skip
        self.queued = []
        return out

    def take_failures(self) -> list:
        return []


@pytest.fixture
def quick_stall(monkeypatch):
    monkeypatch.setattr(profile, "_STALL_S", 0.05)


def test_an_unanswered_group_is_aborted_and_sent_again(quick_stall, caplog) -> None:
    server = ScriptedServer(drop=1)
    times, sent = profile._run(server, {"warm": [1, 2, 3, 4]}, ONCE)
    assert server.received == ["warm", "warm-retry1"] and server.aborted == ["warm"]
    assert list(times) == ["warm"] and len(times["warm"]) == 1 and times["warm"][0] >= sent
    assert "no answer to warm" in caplog.text and "1 running, 0 waiting" in caplog.text


def test_a_group_resent_whole_when_one_request_stalls(quick_stall) -> None:
    server = ScriptedServer(drop=1)
    times, _ = profile._run(server, {"a": [1], "b": [2]}, ONCE)
    assert sorted(server.received) == ["a", "a-retry1", "b", "b-retry1"]
    assert server.aborted == ["a"]  # b had finished
    assert all(len(t) == 1 for t in times.values())


def test_a_server_that_never_answers_is_an_error_naming_its_state(quick_stall) -> None:
    server = ScriptedServer(drop=10)
    with pytest.raises(TimeoutError, match=r"no answer in 3 tries .*1 running, 0 waiting"):
        profile._run(server, {"warm": [1]}, ONCE)
    assert server.aborted == ["warm", "warm-retry1", "warm-retry2"]
