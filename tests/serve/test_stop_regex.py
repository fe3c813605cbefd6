"""SGLang's ``stop_regex`` (halfmoon/serve/gateway/stop_regex.py): patterns checked when
a request comes, the output cut where it first matches one (whole answers; streamed text
already sent stays sent), on ``/generate`` and completions alike, and a pattern that
backtracks without end failing its request instead of stalling the gateway.

In-process (ASGI) over the token-generation tests' backend, which writes the alphabet."""

from __future__ import annotations

import json

import pytest

from halfmoon.serve.gateway.stop_regex import (
    MAX_PATTERNS,
    StopPatterns,
    StopRegexTimeout,
    parse_stop_regex,
)
from halfmoon.serve.gateway.text import OutputText

from .test_token_generation import counting


@pytest.fixture(scope="module")
def served(gateways):
    with counting(gateways) as pair:
        yield pair


def test_patterns_are_checked_when_the_request_comes():
    assert parse_stop_regex(None) == () and parse_stop_regex("a+") == ("a+",)
    assert parse_stop_regex(["x", "y[0-9]"]) == ("x", "y[0-9]")
    for bad, words in (("a(", "does not compile"), ("x*", "matches the empty text"),
                       ([""], "non-empty strings"), (["a"] * (MAX_PATTERNS + 1), "at most"),
                       ("a" * 2000, "at most 1024")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            parse_stop_regex(bad)


def test_the_earliest_match_of_any_pattern_and_a_runaway_one():
    patterns = StopPatterns(["d+e", "b."])
    found = patterns.first_match("abcdde", 4)
    assert (found.start, found.end, found.text) == (1, 3, "bc")
    assert StopPatterns(["z"]).first_match("abc", 0) is None
    with pytest.raises(StopRegexTimeout, match="took over 50 ms"):
        StopPatterns([r"(a|aa)+$"]).first_match("a" * 60 + "b", 0)


def test_output_text_is_cut_before_the_match(gateways):
    tok = gateways.tokenizer
    ids = tok.encode("hello world, bye", add_special_tokens=False)
    whole = OutputText(tok, [], stop_regex=("w[aeiou]r",), hold_all=True)
    sent = "".join(whole.add([t]) for t in ids) + whole.flush()
    assert sent == whole.text == "hello " and whole.stop_string == "wor" and whole.stopped
    kept = OutputText(tok, [], include_stop=True, stop_regex=("w[aeiou]r",), hold_all=True)
    assert "".join(kept.add([t]) for t in ids) + kept.flush() == "hello wor"
    streamed = OutputText(tok, [], stop_regex=("w[aeiou]r",))  # (nothing held for a regex)
    out = "".join(streamed.add([t]) for t in ids) + streamed.flush()
    assert out.startswith("hello ") and streamed.text == "hello "
    first = OutputText(tok, [], stop=(" wo",), stop_regex=("l+o",), hold_all=True)
    "".join(first.add([t]) for t in ids)
    assert first.stop_string == "llo"  # (found with the "o", before " wo" could be)


def test_generate_and_completions_stop_at_a_match(served):
    client, _ = served
    body = {"text": "Hi", "sampling_params": {"max_new_tokens": 12, "stop_regex": "[d-e]{2}"}}
    out = client.post("/generate", json=body).json()
    assert out["text"] == "abc"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "de"}
    kept = client.post("/generate", json={**body, "sampling_params": {
        **body["sampling_params"], "no_stop_trim": True}}).json()  # fmt: skip
    assert kept["text"] == "abcde"
    done = client.post("/v1/completions", json={
        "model": "m", "prompt": "Hi", "max_tokens": 12, "stop_regex": ["q", "f|g"]}).json()  # fmt: skip
    choice = done["choices"][0]
    assert choice["text"] == "abcde" and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == "f"
    streamed = client.post("/v1/completions", json={
        "model": "m", "prompt": "Hi", "max_tokens": 12, "stop_regex": "f", "stream": True})  # fmt: skip
    events = [json.loads(line[6:]) for line in streamed.text.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert "".join(e["choices"][0]["text"] for e in events) == "abcde"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("field", "words"), [("a(", "does not compile"), ("x*", "matches the empty text")]
)
def test_a_bad_pattern_is_a_400_naming_it(served, field, words):
    client, _ = served
    said = client.post("/v1/completions", json={"model": "m", "prompt": "Hi", "stop_regex": field})
    assert said.status_code == 400 and words in said.text
    assert said.json()["error"]["param"] == "stop_regex"
    said = client.post("/generate", json={"text": "Hi", "sampling_params": {"stop_regex": field}})
    assert said.status_code == 400 and words in said.text
