"""Tool calling on chat completions (halfmoon/serve/gateway/tools.py): ``tool_choice``
turned into the schema the output is held to, the output into OpenAI's ``tool_calls``
(whole and streamed), the tools and earlier calls into the chat template, and every
malformed combination into a 400 naming its field.

In-process (ASGI) over a backend that "generates" a fixed answer; a live cluster's
answers are checked in tests/e2e/test_serve_disaggregated.py."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from fastapi.testclient import TestClient

from halfmoon.core.request import SamplingParams, TokenLogprob
from halfmoon.serve.gateway.backend import GenerationChunk
from halfmoon.serve.gateway.openai_api import ChatCompletionRequest
from halfmoon.serve.gateway.tool_streams import StreamedCoderCalls, StreamedJsonCalls
from halfmoon.serve.gateway.tools import (
    ToolMode,
    template_message,
    tool_calls,
    tool_schema,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock"}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


class AnswerBackend:
    """Generates the tokens of ``answer`` (set per test), two per chunk, ending ``stop``
    (each token's log-probability -0.5 when asked for)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.answer = ""
        self.params: list[SamplingParams] = []
        self.prompts: list[list[int]] = []
        self.salts: list[str | None] = []

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:  # fmt: skip
        self.params.append(params)
        self.salts.append(cache_salt)
        self.prompts.append(list(prompt_token_ids))
        ids = self.tokenizer.encode(self.answer, add_special_tokens=False)
        for i in range(0, len(ids), 2):
            last = i + 2 >= len(ids)
            chunk = tuple(ids[i : i + 2])
            logprobs = () if params.logprobs is None else tuple(TokenLogprob(-0.5) for _ in chunk)
            yield GenerationChunk(chunk, "stop" if last else None, 0 if i == 0 else None,
                                  logprobs=logprobs)  # fmt: skip

    async def abort(self, request_id: str) -> None:
        return None

    async def health(self) -> dict[str, Any]:
        return {"mode": "answer"}


@contextlib.contextmanager
def answering(gateways, parser: str | None = None, **config):
    """A gateway over an :class:`AnswerBackend` (``parser``: its ``tool_call_parser``;
    ``config``: more GatewayConfig fields): (test client, backend)."""
    backend = AnswerBackend(gateways.tokenizer)
    app = gateways.app(backend, "m", max_tokens_limit=64, tool_call_parser=parser, **config)
    with TestClient(app) as client:
        yield client, backend


@pytest.fixture(scope="module")
def served(gateways):
    with answering(gateways) as pair:
        yield pair


def _chat(client, **extra):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 32, **extra}
    return client.post("/v1/chat/completions", json=body)


def test_a_named_function_holds_the_output_to_its_parameters(served):
    client, backend = served
    backend.answer = '{"city": "Paris"}'
    choice = {"type": "function", "function": {"name": "weather"}}
    body = _chat(client, tools=TOOLS, tool_choice=choice).json()
    structured = backend.params[-1].structured
    assert structured.kind == "json" and json.loads(structured.spec) == WEATHER
    message = body["choices"][0]["message"]
    assert message["content"] == "" and body["choices"][0]["finish_reason"] == "stop"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}


def test_required_calls_come_from_a_json_array(served):
    client, backend = served
    backend.answer = json.dumps([{"name": "weather", "parameters": {"city": "Oslo"}},
                                 {"name": "clock", "parameters": {}}])  # fmt: skip
    body = _chat(client, tools=TOOLS, tool_choice="required").json()
    schema = json.loads(backend.params[-1].structured.spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [alt["properties"]["name"]["enum"] for alt in schema["items"]["anyOf"]]
    assert names == [["weather"], ["clock"]]
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = [c["function"] for c in choice["message"]["tool_calls"]]
    assert calls == [{"name": "weather", "arguments": '{"city": "Oslo"}'},
                     {"name": "clock", "arguments": "{}"}]  # fmt: skip
    _chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert json.loads(backend.params[-1].structured.spec)["maxItems"] == 1


def test_streamed_tool_calls_come_whole_before_the_finish(served):
    client, backend = served
    backend.answer = '[{"name": "weather", "parameters": {"city": "Rome"}}]'
    text = _chat(client, tools=TOOLS, tool_choice="required", stream=True).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant"} and not any("content" in d for d in deltas)
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    assert calls[0][0]["function"] == {"name": "weather", "arguments": '{"city": "Rome"}'}
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "tool_calls"


def test_a_named_functions_arguments_stream_as_they_come(served):
    """Streamed, a forced function's arguments go out as generated: the first chunk
    carries the call's id, type and name, the next ones only argument text (with their
    log-probabilities); joined, they are the whole answer's call. Cut short by
    ``max_tokens``, the call is what was generated, ``finish_reason`` ``length``, whole
    and streamed alike (as OpenAI and vLLM answer)."""
    client, backend = served
    backend.answer = '{"city": "Buenos Aires"}'
    forced = {"type": "function", "function": {"name": "weather"}}
    text = _chat(client, tools=TOOLS, tool_choice=forced, stream=True, logprobs=True).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    calls = [e["choices"][0]["delta"]["tool_calls"] for e in events
             if "tool_calls" in e["choices"][0]["delta"]]  # fmt: skip
    assert len(calls) > 3 and all(len(c) == 1 and c[0]["index"] == 0 for c in calls)
    first, *rest = (c[0] for c in calls)
    assert first["id"].startswith("chatcmpl-tool-") and first["type"] == "function"
    assert first["function"]["name"] == "weather"
    assert all(set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
               for c in rest)  # fmt: skip
    joined = first["function"]["arguments"] + "".join(c["function"]["arguments"] for c in rest)
    assert joined == backend.answer
    tokens = [t for e in events if e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert "".join(t["token"] for t in tokens) == backend.answer
    assert not any(e["choices"][0]["delta"].get("content") for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    backend.answer = '{"city": "Bue'  # what max_tokens let through

    async def cut(request_id, prompt_token_ids, params):
        ids = backend.tokenizer.encode(backend.answer, add_special_tokens=False)
        yield GenerationChunk(tuple(ids), "length", 0)

    original, backend.generate = backend.generate, cut
    try:
        whole = _chat(client, tools=TOOLS, tool_choice=forced).json()["choices"][0]
        text = _chat(client, tools=TOOLS, tool_choice=forced, stream=True).text
    finally:
        backend.generate = original
    assert whole["finish_reason"] == "length"
    assert whole["message"]["tool_calls"][0]["function"]["arguments"] == backend.answer
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    (call,) = [e["choices"][0]["delta"]["tool_calls"][0] for e in events
               if "tool_calls" in e["choices"][0]["delta"]]  # fmt: skip
    assert call["function"] == {"name": "weather", "arguments": backend.answer}
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_an_output_cut_short_is_answered_as_text(served):
    client, backend = served
    backend.answer = '[{"name": "weather", "param'
    body = _chat(client, tools=TOOLS, tool_choice="required").json()
    message = body["choices"][0]["message"]
    assert message["content"] == backend.answer and "tool_calls" not in message


def test_tool_choice_none_answers_text_and_no_constraint(served):
    client, backend = served
    backend.answer = "It is sunny."
    body = _chat(client, tools=TOOLS, tool_choice="none").json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    assert backend.params[-1].structured is None


@pytest.mark.parametrize(
    ("extra", "param", "says"),
    [
        ({"tools": TOOLS}, "tool_choice", '"auto"'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "parser"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [], "tool_choice": "none"}, "tools", "must not be empty"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "not in tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", '"required"'),
        ({"tools": [{"type": "function", "function": {}}], "tool_choice": "required"},
         "tools", "needs a name"),
        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools", "given twice"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools", "tools[0]"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "no other structured output"),
    ],
)  # fmt: skip
def test_malformed_tool_requests_are_400s_naming_the_field(served, extra, param, says):
    client, backend = served
    before = len(backend.params)
    response = _chat(client, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert len(backend.params) == before


def test_messages_with_tool_calls_and_results_are_accepted(served):
    client, backend = served
    backend.answer = "Sunny."
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "18 C"}]  # fmt: skip
    body = {"model": "m", "messages": history, "tools": TOOLS, "tool_choice": "none"}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    no_content = {"model": "m", "messages": [{"role": "user", "content": None}]}
    response = client.post("/v1/chat/completions", json=no_content)
    assert response.status_code == 400 and "needs content" in response.text


def test_the_template_sees_the_tools_and_the_calls_as_objects(gateways):
    from halfmoon.engine.tokenizer import Tokenizer

    template = (
        "{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }} {{ c.function.arguments.city }}>"
        "{% endfor %}{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %};{% endfor %}"
    )
    tok = gateways.tokenizer
    tokenizer = Tokenizer(tok._tok, {}, template)
    call = {"id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    request = ChatCompletionRequest(model="m", tools=TOOLS, tool_choice="none", messages=[
        *MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ])  # fmt: skip
    ids = tokenizer.apply_chat_template([m.for_template() for m in request.messages],
                                        **request.template_options())  # fmt: skip
    assert tokenizer.decode(ids) == (
        "[weather][clock]user:Weather in Paris?;assistant:<weather Paris>;tool:18 C#c1;"
    )


def test_tool_helpers() -> None:
    assert tool_schema(None, None, None) == (None, None)
    mode, schema = tool_schema(TOOLS, {"type": "function", "function": {"name": "clock"}}, None)
    assert mode == ToolMode("clock") and schema == {"type": "object", "properties": {}}
    assert ToolMode("clock").finish("stop") == "stop" and ToolMode().finish("stop") == "tool_calls"
    assert ToolMode().finish("length") == "length"
    (cut,) = tool_calls(ToolMode("clock"), "{")  # a named call's arguments, cut short
    assert cut["function"] == {"name": "clock", "arguments": "{"}
    assert tool_calls(ToolMode(), '{"name": "clock"}') is None  # not an array
    assert tool_calls(ToolMode(), '[{"parameters": {}}]') is None  # no name
    kept = template_message({"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "not json"}}]})  # fmt: skip
    assert kept["content"] == "" and kept["tool_calls"][0]["function"]["arguments"] == "not json"


HERMES = ('Let me check.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>')  # fmt: skip


@pytest.fixture(scope="module")
def hermes(gateways):
    with answering(gateways, "hermes") as pair:
        yield pair


def test_auto_reads_hermes_calls_out_of_the_text(hermes):
    """``tool_choice: "auto"`` with ``--tool-call-parser hermes``: the model is not held
    to anything; its ``<tool_call>`` blocks become calls, the text before them content."""
    client, backend = hermes
    backend.answer = HERMES
    body = _chat(client, tools=TOOLS).json()
    assert backend.params[-1].structured is None
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    calls = [c["function"] for c in choice["message"]["tool_calls"]]
    assert calls == [{"name": "weather", "arguments": '{"city": "Paris"}'},
                     {"name": "clock", "arguments": "{}"}]  # fmt: skip
    backend.answer = "It is sunny in Paris."  # no call: plain text
    body = _chat(client, tools=TOOLS, tool_choice="auto").json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": backend.answer}
    assert body["choices"][0]["finish_reason"] == "stop"
    backend.answer = '<tool_call>{"name": "clock", "arguments": {}}'  # left open at EOS
    body = _chat(client, tools=TOOLS).json()
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "clock"
    backend.answer = "<tool_call>{not json</tool_call>"  # unreadable: text as it came
    body = _chat(client, tools=TOOLS).json()
    assert body["choices"][0]["message"]["content"] == backend.answer


def test_auto_streams_the_text_then_the_calls(hermes):
    client, backend = hermes
    backend.answer = HERMES
    text = _chat(client, tools=TOOLS, stream=True).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "Let me check."  # nothing of the blocks leaked as text
    # each call as it is written (as vLLM streams them): its id and name once its JSON
    # named the function, then its arguments' text in parts; joined, the whole answer's
    parts = [c for d in deltas for c in d.get("tool_calls", ())]
    heads = [c for c in parts if "id" in c]
    assert [(c["index"], c["function"]["name"]) for c in heads] == [(0, "weather"), (1, "clock")]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in heads)
    joined = ["".join(c["function"]["arguments"] for c in parts if c["index"] == i) for i in (0, 1)]
    assert joined == ['{"city": "Paris"}', "{}"]
    assert len([c for c in parts if c["index"] == 0]) > 2  # (in parts: two tokens a chunk)
    whole = _chat(client, tools=TOOLS).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in whole] == [
        json.loads(j) for j in joined
    ]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert all("content" not in d for d in deltas[first_call:])
    # a call cut short (by max_tokens, say): what was written of it, and no text of it
    # as content
    backend.answer = HERMES[: HERMES.index("Paris") + 2]
    text = _chat(client, tools=TOOLS, stream=True).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    cut = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls", ()))
    assert cut and '{"city": "Paris"}'.startswith(cut) and cut != '{"city": "Paris"}'
    assert events[-1]["choices"][0]["finish_reason"] == "stop"  # (the generation's)
    # arguments first (a shape read only whole): the call goes whole at the end
    backend.answer = '<tool_call>{"arguments": {"city": "Oslo"}, "name": "weather"}</tool_call>'
    text = _chat(client, tools=TOOLS, stream=True).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    (calls,) = [e["choices"][0]["delta"]["tool_calls"] for e in events
                if "tool_calls" in e["choices"][0]["delta"]]  # fmt: skip
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    backend.answer = "Plain <tool text, no call."  # a tail that looked like a tag: sent
    text = _chat(client, tools=TOOLS, stream=True).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == backend.answer


def test_the_openai_sdk_puts_streamed_calls_together(hermes):
    """OpenAI's SDK joins the parts by index into the answer's calls (its stream helper
    parses each call's arguments at the end)."""
    import openai

    client, backend = hermes
    backend.answer = HERMES
    oa = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="none", http_client=client,
                       max_retries=0)  # fmt: skip
    with oa.chat.completions.stream(model="m", messages=MESSAGES, tools=TOOLS) as stream:
        final = stream.get_final_completion()
    message = final.choices[0].message
    assert message.content == "Let me check." and final.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("weather", {"city": "Paris"}), ("clock", {})]  # fmt: skip


def test_held_from_keeps_back_what_may_start_a_block() -> None:
    auto = ToolMode(parser="hermes")
    assert auto.held_from("Hello") == 5
    assert auto.held_from("Hello <tool") == 6
    assert auto.held_from("Hi <tool_call>{") == 3
    assert auto.held_from("a <b") == 4 and auto.held_from("x<") == 1
    assert ToolMode().held_from("[{") == 0


@pytest.fixture(scope="module")
def llama(gateways):
    with answering(gateways, "llama3_json") as pair:
        yield pair


def test_auto_reads_llama3_json_calls(llama):
    """``--tool-call-parser llama3_json``: an answer that is one or more ``{"name",
    "parameters"}`` objects (``;`` between them) is calls; any other answer is text, and
    streams as it comes."""
    client, backend = llama
    backend.answer = ('{"name": "weather", "parameters": {"city": "Paris; France"}}; '
                      '{"name": "clock", "parameters": {}}')  # fmt: skip
    body = _chat(client, tools=TOOLS).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city": "Paris; France"}'},
        {"name": "clock", "arguments": "{}"},
    ]
    streamed = _chat(client, tools=TOOLS, stream=True).text
    events = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert not any(d.get("content") for d in deltas)
    # each object as it is written (its arguments' text in parts), as Hermes calls
    parts = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [c["function"]["name"] for c in parts if "id" in c] == ["weather", "clock"]
    joined = ["".join(c["function"]["arguments"] for c in parts if c["index"] == i) for i in (0, 1)]
    assert joined == ['{"city": "Paris; France"}', "{}"] and len(parts) > 4
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    backend.answer = "It is sunny; no call needed."
    streamed = _chat(client, tools=TOOLS, stream=True).text
    events = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
    contents = [e["choices"][0]["delta"].get("content") for e in events]
    assert "".join(c for c in contents if c) == backend.answer
    assert len([c for c in contents if c]) > 1  # not held back to the end
    backend.answer = '{"weather": "sunny"}'  # JSON, but not a call: text
    body = _chat(client, tools=TOOLS).json()
    assert body["choices"][0]["message"]["content"] == backend.answer
    streamed = _chat(client, tools=TOOLS, stream=True).text  # (streamed alike: no call)
    events = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == backend.answer
    assert not any("tool_calls" in e["choices"][0]["delta"] for e in events)


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_llama3_json_calls_cut_anyhow_join_into_the_whole_answers(step):
    """However the answer is cut, the streamed objects' arguments (and those sent whole at
    the end: an object that names its arguments first, and every one after it) are the
    whole answer's."""
    mode = ToolMode(parser="llama3_json")
    cases = ['{"name": "weather", "parameters": {"city": "Pa\\"ris}"}}; {"name": "clock", '
             '"parameters": {}}',
             '<|python_tag|>{"name": "weather", "parameters": {"days": [1, {"a": 2}]}}',
             '  {"name": "weather", "arguments": {"city": "Oslo"}}\n{"name": "clock", '
             '"parameters": {}}',
             '{"parameters": {"city": "X"}, "name": "weather"}; {"name": "clock", "parameters": {}}']  # fmt: skip
    for text in cases:
        _assert_streamed_as_whole(mode, StreamedJsonCalls(), text, step)


def _assert_streamed_as_whole(mode, streamer, text: str, step: int) -> None:
    """``text`` given to ``streamer`` ``step`` characters at a time: the arguments it
    streamed, joined (with the calls it leaves to the end), are the whole answer's."""
    whole = tool_calls(mode, text)
    cuts = [*range(step, len(text), step), len(text)]
    got: dict[int, str] = {}
    for i, cut in enumerate(cuts):
        for part in streamer.deltas(text[:cut], final=i == len(cuts) - 1):
            got[part["index"]] = got.get(part["index"], "") + part["function"]["arguments"]
    for call in streamer.rest(whole):
        got[call["index"]] = call["function"]["arguments"]
    assert [json.loads(got[k]) for k in sorted(got)] == [
        json.loads(c["function"]["arguments"]) for c in whole]  # fmt: skip


@pytest.fixture(scope="module")
def pythonic(gateways):
    with answering(gateways, "pythonic") as pair:
        yield pair


def test_auto_reads_pythonic_calls(pythonic):
    """``--tool-call-parser pythonic``: an answer that is a Python list of calls with
    keyword arguments (Llama 3.2 / 4) is calls, its literals as JSON arguments, whole
    and streamed, with or without Llama 4's markers; anything else is text."""
    client, backend = pythonic
    backend.answer = ('[weather(city="Paris", days=[1, 2], metric=True, note=None), '
                      "clock()]")  # fmt: skip
    choice = _chat(client, tools=TOOLS).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "weather",
         "arguments": '{"city": "Paris", "days": [1, 2], "metric": true, "note": null}'},
        {"name": "clock", "arguments": "{}"},
    ]  # fmt: skip
    backend.answer = '<|python_start|>[weather(city="Oslo")]<|python_end|>'
    streamed = _chat(client, tools=TOOLS, stream=True).text
    events = [json.loads(x[6:]) for x in streamed.splitlines() if x.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert not any(d.get("content") for d in deltas)
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    for text in ("It is sunny.", "[1, 2, 3]", '[weather("Paris")]', "[weather(city=x)]",
                 '[os.system(cmd="ls")]', '[weather(city="P")] and more'):  # fmt: skip
        backend.answer = text  # not calls: the text as it is
        body = _chat(client, tools=TOOLS).json()
        assert body["choices"][0]["message"]["content"] == text, text
        assert "tool_calls" not in body["choices"][0]["message"]
    backend.answer = "Sunny and mild today."  # plain text streams as it comes
    streamed = _chat(client, tools=TOOLS, stream=True).text
    contents = [json.loads(x[6:])["choices"][0]["delta"].get("content")
                for x in streamed.splitlines() if x.startswith("data: {")]  # fmt: skip
    assert len([c for c in contents if c]) > 1


@pytest.fixture(scope="module")
def mistral(gateways):
    with answering(gateways, "mistral") as pair:
        yield pair


def test_auto_reads_mistral_calls_in_both_formats(mistral):
    """``--tool-call-parser mistral``: text, then ``[TOOL_CALLS]`` and a JSON array of
    ``{"name", "arguments"}`` (tokenizers before v11) or ``name[ARGS]{...}`` per call (v11
    and later); ids of 9 letters and digits, as Mistral's templates require."""
    client, backend = mistral
    backend.answer = ('Let me look.[TOOL_CALLS][{"name": "weather", "arguments": {"city": '
                      '"Paris"}}, {"name": "clock", "arguments": {}}]')  # fmt: skip
    body = _chat(client, tools=TOOLS).json()
    choice = body["choices"][0]
    assert (
        choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    )
    calls = choice["message"]["tool_calls"]
    assert [c["function"] for c in calls] == [{"name": "weather", "arguments": '{"city": "Paris"}'},
                                              {"name": "clock", "arguments": "{}"}]  # fmt: skip
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in calls)
    backend.answer = '[TOOL_CALLS]weather[ARGS]{"city": "Rome"}[TOOL_CALLS]clock[ARGS]{}'
    message = _chat(client, tools=TOOLS).json()["choices"][0]["message"]
    assert message["content"] is None
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "weather", "arguments": '{"city": "Rome"}'},
        {"name": "clock", "arguments": "{}"},
    ]
    backend.answer = "No call [here], just text."
    body = _chat(client, tools=TOOLS).json()
    assert body["choices"][0]["message"]["content"] == backend.answer
    backend.answer = "[TOOL_CALLS]weather[ARGS]{not json"  # unreadable: text as it came
    assert _chat(client, tools=TOOLS).json()["choices"][0]["message"]["content"] == backend.answer
    # [TOOL_CALLS] is a special token: with tools, the text keeps special tokens
    backend.answer = "a<|im_end|>b"
    assert _chat(client, tools=TOOLS).json()["choices"][0]["message"]["content"] == "a<|im_end|>b"
    assert _chat(client).json()["choices"][0]["message"]["content"] == "ab"  # no tools


def test_mistral_calls_stream_after_the_text(mistral):
    client, backend = mistral
    backend.answer = 'Sure.[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}'
    text = _chat(client, tools=TOOLS, stream=True).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content", "") for d in deltas) == "Sure."
    (calls,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    mode = ToolMode(parser="mistral")
    assert mode.held_from("Hi [TOOL") == 3 and mode.held_from("Hi [TOOL_CALLS]x") == 3
    assert mode.held_from("Hi [x") == 5 and mode.keeps_special_tokens
    assert not ToolMode(parser="hermes").keeps_special_tokens


def test_llama3_held_from() -> None:
    mode = ToolMode(parser="llama3_json")
    assert mode.held_from("") == 0 and mode.held_from("  {") == 0
    assert mode.held_from("<|py") == 0 and mode.held_from("<|python_tag|>{") == 0
    assert mode.held_from("Sunny") == 5 and mode.held_from("<b>") == 3
    mode = ToolMode(parser="pythonic")
    assert mode.held_from("") == 0 and mode.held_from(" [") == 0
    assert mode.held_from("<|py") == 0 and mode.held_from("<|python_start|>[") == 0
    assert mode.held_from("Sunny") == 5 and mode.held_from("{") == 1


TYPED = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "scale": {"type": "number"},
    "metric": {"type": "boolean"}, "hours": {"type": "array"}, "where": {"type": "object"},
    "note": {"type": ["string", "null"]}, "hint": {"type": ["integer", "null"]}}}  # fmt: skip
CODER_TOOLS = [{"type": "function", "function": {"name": "forecast", "parameters": TYPED}},
               {"type": "function", "function": {"name": "clock"}}]  # fmt: skip
QWEN3_CODER = (
    "I'll check.\n<tool_call>\n<function=forecast>\n<parameter=city>\nNew York\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=scale>\n1.5\n</parameter>\n"
    "<parameter=metric>\nTrue\n</parameter>\n<parameter=hours>\n[6, 12]\n</parameter>\n"
    "<parameter=where>\n{'lat': 40.7}\n</parameter>\n<parameter=note>\n  two\nlines \n"
    '</parameter>\n<parameter=hint>\nnull\n</parameter>\n<parameter=extra>\n{"k": 1}\n'
    "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=clock>\n</function>\n"
    "</tool_call>"
)


@pytest.fixture(scope="module")
def coder(gateways):
    with answering(gateways, "qwen3_coder") as pair:
        yield pair


def test_auto_reads_qwen3_coder_calls_by_their_schemas(coder):
    """``--tool-call-parser qwen3_coder``: ``<function=...>`` blocks with
    ``<parameter=...>`` values, each value read as its parameter's schema types it (a
    string as written, whitespace inside it kept; a parameter it does not name as JSON)."""
    client, backend = coder
    backend.answer = QWEN3_CODER
    choice = _chat(client, tools=CODER_TOOLS).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "I'll check."
    forecast, clock = choice["message"]["tool_calls"]
    assert forecast["function"]["name"] == "forecast"
    assert json.loads(forecast["function"]["arguments"]) == {
        "city": "New York", "days": 3, "scale": 1.5, "metric": True, "hours": [6, 12],
        "where": {"lat": 40.7}, "note": "  two\nlines ", "hint": None, "extra": {"k": 1}}  # fmt: skip
    assert clock["function"] == {"name": "clock", "arguments": "{}"}
    # the wrapper left out, the last parameter and function left open at EOS
    backend.answer = (
        "<function=forecast>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2"
    )
    message = _chat(client, tools=CODER_TOOLS).json()["choices"][0]["message"]
    assert message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Oslo", "days": 2}  # fmt: skip
    # a value that is not of its type stays text; inf is no JSON number
    backend.answer = ("<function=forecast><parameter=days>soon</parameter>"
                      "<parameter=scale>inf</parameter></function>")  # fmt: skip
    arguments = _chat(client, tools=CODER_TOOLS).json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(arguments[0]["function"]["arguments"]) == {"days": "soon", "scale": "inf"}
    backend.answer = "No call <function here, just text."
    body = _chat(client, tools=CODER_TOOLS).json()
    assert body["choices"][0]["message"]["content"] == backend.answer
    assert "tool_calls" not in body["choices"][0]["message"]
    backend.answer = "<function=>nameless</function>"  # unreadable: text as it came
    body = _chat(client, tools=CODER_TOOLS).json()
    assert body["choices"][0]["message"]["content"] == backend.answer


def test_qwen3_coder_calls_stream_on_the_responses_and_messages_apis(coder):
    client, backend = coder
    backend.answer = QWEN3_CODER
    whole = _chat(client, tools=CODER_TOOLS).json()["choices"][0]["message"]["tool_calls"]
    want = [json.loads(c["function"]["arguments"]) for c in whole]
    flat = [{"type": "function", **t["function"]} for t in CODER_TOOLS]
    text = client.post("/v1/responses", json={"model": "m", "input": "x", "tools": flat,
                                              "stream": True}).text  # fmt: skip
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    output = events[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["message", "function_call", "function_call"]
    assert [json.loads(o["arguments"]) for o in output[1:]] == want
    parts = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(parts) > 8
    anthropic_tools = [{"name": t["function"]["name"],
                        "input_schema": t["function"].get("parameters") or {"type": "object"}}
                       for t in CODER_TOOLS]  # fmt: skip
    text = client.post("/v1/messages", json={"model": "m", "max_tokens": 64, "messages": MESSAGES,
                                             "tools": anthropic_tools, "stream": True}).text  # fmt: skip
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    inputs = ["".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["index"] == i) for i in (1, 2)]  # fmt: skip
    assert [json.loads(i) for i in inputs] == want


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_qwen3_coder_calls_cut_anyhow_join_into_the_whole_answers(step):
    """However the output is cut, the streamed arguments join into JSON of the whole
    answer's (a value with an end tag's beginning in it, a call left open at the end, a
    parameter without its end tag, an empty call)."""
    functions = {name: t["function"].get("parameters") or {} for t in CODER_TOOLS
                 for name in [t["function"]["name"]]}  # fmt: skip
    cases = [QWEN3_CODER, QWEN3_CODER.replace("New York", 'say "</p" then\n\n'),
             "<function=forecast>\n<parameter=city>\nleft open",
             "<function=forecast>\n<parameter=days>\n5\n<parameter=city>\np\n</function>"]  # fmt: skip
    mode = ToolMode(parser="qwen3_coder", functions=functions)
    for text in cases:
        _assert_streamed_as_whole(mode, StreamedCoderCalls(functions), text, step)


def test_qwen3_coder_calls_stream_after_the_text(coder):
    client, backend = coder
    backend.answer = QWEN3_CODER
    text = _chat(client, tools=CODER_TOOLS, stream=True).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content", "") for d in deltas) == "I'll check.\n"  # (as written)
    # each call as it is written: its name once its tag is whole, then its arguments as
    # JSON, a parameter once its value ends (a string's as its text comes); joined, the
    # whole answer's arguments
    parts = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [c["function"]["name"] for c in parts if "id" in c] == ["forecast", "clock"]
    joined = ["".join(c["function"]["arguments"] for c in parts if c["index"] == i) for i in (0, 1)]
    whole = _chat(client, tools=CODER_TOOLS).json()["choices"][0]["message"]["tool_calls"]
    assert [json.loads(j) for j in joined] == [
        json.loads(c["function"]["arguments"]) for c in whole
    ]
    assert len([c for c in parts if c["index"] == 0]) > 8
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # a string value streams as it comes, the format's newline and an end tag's start held
    streamer = StreamedCoderCalls({"write": {"properties": {"text": {"type": "string"}}}})
    assert streamer.deltas("<function=write>\n<parameter=text>\nab\n</par")[1:] == [
        {"index": 0, "function": {"arguments": '{"text": "ab'}}]  # fmt: skip
    assert streamer.deltas("<function=write>\n<parameter=text>\nab\n</parameter>\n") == [
        {"index": 0, "function": {"arguments": '"'}}]  # fmt: skip
    assert streamer.deltas("<function=write>\n<parameter=text>\nab\n</parameter>\n</function>") == [
        {"index": 0, "function": {"arguments": "}"}}]  # fmt: skip
    mode = ToolMode(parser="qwen3_coder")
    assert mode.held_from("Hi <func") == 3 and mode.held_from("Hi <tool_ca") == 3
    assert mode.held_from("Hi <function=f>") == 3 and mode.held_from("a<tool_call>b<function=") == 1
    assert mode.held_from("Hi <b") == 5
