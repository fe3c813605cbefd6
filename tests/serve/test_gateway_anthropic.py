"""Anthropic's Messages API (``/v1/messages``, halfmoon/serve/gateway/anthropic_messages.py
and anthropic_api.py): the request as a chat request, the answer as a ``message``, whole
and streamed (with text and tool calls), ``count_tokens``, Anthropic-shaped errors and
``x-api-key``; and the ``anthropic`` SDK as a client.

In-process (ASGI) over a backend that "generates" a fixed answer (the tools tests'); a
live cluster answers the SDK in tests/e2e/test_serve_disaggregated.py."""

from __future__ import annotations

import json

import anthropic
import pytest

from halfmoon.serve.gateway.anthropic_messages import MessagesRequest, to_chat
from halfmoon.serve.gateway.backend import GenerationChunk

from .test_gateway_tools import WEATHER, answering

TOOLS = [{"name": "weather", "description": "Weather of a city", "input_schema": WEATHER}]
HELLO = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def served(gateways):
    with answering(gateways, "hermes") as pair:
        yield pair


def _post(client, path="/v1/messages", **body):
    return client.post(path, json={"model": "m", "max_tokens": 32, "messages": HELLO, **body})


def _events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event, checking that both name the type."""
    out = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        body = json.loads(data[6:])
        assert body["type"] == name[7:]
        out.append((name[7:], body))
    return out


def test_text_in_text_out(served, gateways):
    client, backend = served
    backend.answer = "Mild and grey."
    body = _post(client, system="Be brief.", temperature=0.5).json()
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["id"].startswith("msg_") and body["model"] == "m"
    assert body["content"] == [{"type": "text", "text": "Mild and grey."}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    prompt = gateways.tokenizer.decode(backend.prompts[-1])
    assert "Be brief." in prompt and "Weather in Oslo?" in prompt
    assert body["usage"]["input_tokens"] == len(backend.prompts[-1])
    assert body["usage"]["output_tokens"] > 0
    params = backend.params[-1]
    assert params.max_tokens == 32 and params.temperature == 0.5


def test_stop_reasons(served):
    client, backend = served
    backend.answer = "one two END three"
    body = _post(client, stop_sequences=["END"]).json()
    assert body["content"][0]["text"] == "one two "
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")

    async def cut(request_id, prompt_token_ids, params):  # ends at max_tokens: "length"
        yield GenerationChunk((65, 66), "length", 0)

    original, backend.generate = backend.generate, cut
    try:
        body = _post(client, max_tokens=2).json()
        events = _events(_post(client, max_tokens=2, stream=True).text)
    finally:
        backend.generate = original
    assert body["stop_reason"] == "max_tokens" and body["usage"]["output_tokens"] == 2
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_a_streamed_answer(served):
    client, backend = served
    backend.answer = "Mild and grey, as ever."
    events = _events(_post(client, stream=True).text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    deltas = [e["delta"]["text"] for name, e in events if name == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == backend.answer
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert end["usage"]["output_tokens"] > 0


def test_a_forced_tool_whole_and_streamed(served):
    client, backend = served
    backend.answer = '{"city": "Oslo"}'
    choice = {"type": "tool", "name": "weather"}
    body = _post(client, tools=TOOLS, tool_choice=choice).json()
    (use,) = body["content"]
    assert use["type"] == "tool_use" and use["name"] == "weather"
    assert use["input"] == {"city": "Oslo"} and use["id"].startswith("toolu_")
    assert body["stop_reason"] == "tool_use"
    assert json.loads(backend.params[-1].structured.spec) == WEATHER
    events = _events(_post(client, tools=TOOLS, tool_choice=choice, stream=True).text)
    (start,) = [e for name, e in events if name == "content_block_start"]
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    parts = [e["delta"]["partial_json"] for name, e in events if name == "content_block_delta"]
    assert len(parts) > 1 and json.loads("".join(parts)) == {"city": "Oslo"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_text_then_a_parsed_call(served):
    client, backend = served
    backend.answer = (
        'Let me look.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    body = _post(client, tools=TOOLS).json()  # tool_choice left out: auto, read by hermes
    text, use = body["content"]
    assert text == {"type": "text", "text": "Let me look."}
    assert use["name"] == "weather" and use["input"] == {"city": "Oslo"}
    assert body["stop_reason"] == "tool_use"
    events = _events(_post(client, tools=TOOLS, stream=True).text)
    blocks = [(e["index"], e["content_block"]["type"]) for n, e in events
              if n == "content_block_start"]  # fmt: skip
    assert blocks == [(0, "text"), (1, "tool_use")]
    said = "".join(e["delta"].get("text", "") for n, e in events if n == "content_block_delta")
    assert said == "Let me look."
    # the call as it is written (Hermes): its arguments' JSON in parts, joined the input
    args = [e["delta"]["partial_json"] for n, e in events
            if n == "content_block_delta" and e["index"] == 1]  # fmt: skip
    assert len(args) > 1 and json.loads("".join(args)) == {"city": "Oslo"}
    order = [(n, e.get("index")) for n, e in events if n.startswith("content_block")]
    assert order.index(("content_block_stop", 0)) < order.index(("content_block_start", 1))
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    # two calls, the second arguments-first (read only whole): at the end, after the first
    second = '<tool_call>{"arguments": {"city": "Rome"}, "name": "weather"}</tool_call>'
    backend.answer += second
    events = _events(_post(client, tools=TOOLS, stream=True).text)
    starts = [(e["index"], e["content_block"]["type"]) for n, e in events
              if n == "content_block_start"]  # fmt: skip
    assert starts == [(0, "text"), (1, "tool_use"), (2, "tool_use")]
    inputs = ["".join(e["delta"]["partial_json"] for n, e in events
                      if n == "content_block_delta" and e["index"] == i) for i in (1, 2)]  # fmt: skip
    assert [json.loads(i) for i in inputs] == [{"city": "Oslo"}, {"city": "Rome"}]
    stops = [e["index"] for n, e in events if n == "content_block_stop"]
    assert stops == [0, 1, 2]
    # the Anthropic SDK puts the streamed call together
    sdk = anthropic.Anthropic(base_url=str(client.base_url), api_key="none", http_client=client,
                              max_retries=0)  # fmt: skip
    with sdk.messages.stream(model="m", max_tokens=64, messages=HELLO, tools=TOOLS) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert [b.input for b in final.content[1:]] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert final.stop_reason == "tool_use"
    # a call cut short: what was written of it; none of its text as content
    backend.answer = backend.answer[: backend.answer.index("Oslo") + 2]
    events = _events(_post(client, tools=TOOLS, stream=True).text)
    said = "".join(e["delta"].get("text", "") for n, e in events if n == "content_block_delta")
    assert said == "Let me look."
    starts = [(e["index"], e["content_block"]["type"]) for n, e in events
              if n == "content_block_start"]  # fmt: skip
    assert starts == [(0, "text"), (1, "tool_use")]
    assert [e["index"] for n, e in events if n == "content_block_stop"] == [0, 1]


def test_calls_alone_streamed_start_at_the_first_block(served):
    """``any`` (the chat's ``required``): the answer is calls only; streamed, they are
    blocks 0, 1, ... with no text block before them."""
    client, backend = served
    backend.answer = ('[{"name": "weather", "parameters": {"city": "Oslo"}}, '
                      '{"name": "weather", "parameters": {"city": "Rome"}}]')  # fmt: skip
    events = _events(_post(client, tools=TOOLS, tool_choice={"type": "any"}, stream=True).text)
    starts = [(e["index"], e["content_block"]["type"]) for n, e in events
              if n == "content_block_start"]  # fmt: skip
    assert starts == [(0, "tool_use"), (1, "tool_use")]
    inputs = [json.loads(e["delta"]["partial_json"]) for n, e in events
              if n == "content_block_delta"]  # fmt: skip
    assert inputs == [{"city": "Oslo"}, {"city": "Rome"}]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_a_conversation_with_tool_results_becomes_chat_messages() -> None:
    request = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "t2", "name": "weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "18 C"},
                {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                 "content": [{"type": "text", "text": "no station"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["\n\n"], "top_k": 5, "thinking": {"type": "disabled"},
    })  # fmt: skip
    chat = to_chat(request)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "tool",
                                               "user"]  # fmt: skip
    assert chat.messages[0].text() == "Be brief." and chat.messages[2].text() == "Checking."
    calls = chat.messages[2].tool_calls
    assert [c["id"] for c in calls] == ["t1", "t2"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Rome"}
    assert chat.messages[3].tool_call_id == "t1" and chat.messages[3].text() == "18 C"
    assert chat.messages[4].text() == "Error: no station"
    assert chat.tools == [{"type": "function", "function": {
        "name": "weather", "parameters": WEATHER, "description": "Weather of a city"}}]  # fmt: skip
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.max_completion_tokens == 9 and chat.stop == ["\n\n"] and chat.top_k == 5
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert "temperature" not in chat.model_fields_set  # left out: the model's default


def test_a_prefilled_answer_is_continued(served, gateways):
    client, backend = served
    backend.answer = " grey."
    prefilled = [*HELLO, {"role": "assistant", "content": "Mild and"}]
    body = _post(client, messages=prefilled).json()
    assert body["content"] == [{"type": "text", "text": " grey."}]  # the continuation alone
    prompt = gateways.tokenizer.decode(backend.prompts[-1])
    assert prompt.endswith("Mild and")  # no new turn opened after it


def test_count_tokens_counts_the_prompt_a_request_gets(served):
    client, backend = served
    backend.answer = "ok"
    body = {"system": "Be brief.", "tools": TOOLS}
    counted = _post(client, "/v1/messages/count_tokens", **body).json()
    _post(client, tool_choice={"type": "tool", "name": "weather"}, **body)
    assert counted == {"input_tokens": len(backend.prompts[-1])}


@pytest.mark.parametrize(
    ("body", "status", "kind", "says"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         400, "invalid_request_error", "messages[0].content[0]: blocks of type 'image'"),
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
        ({"model": "other"}, 404, "not_found_error", "model 'other' does not exist"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         400, "invalid_request_error", "only client tools"),
        ({"tool_choice": {"type": "sometimes"}}, 400, "invalid_request_error", "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "clock"}},
         400, "invalid_request_error", "not in tools"),
    ],
)  # fmt: skip
def test_errors_are_anthropic_shaped(served, body, status, kind, says):
    client, _ = served
    answer = _post(client, **{k: v for k, v in body.items() if v is not None})
    if body.get("max_tokens", 0) is None:
        answer = client.post("/v1/messages", json={"model": "m", "messages": HELLO})
    assert answer.status_code == status
    error = answer.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert says in error["error"]["message"]


def test_api_keys_by_either_header(gateways):
    with answering(gateways, api_key="k1") as (client, backend):
        backend.answer = "hi"
        refused = _post(client)
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "authentication_error"
        for headers in ({"x-api-key": "k1"}, {"authorization": "Bearer k1"}):
            answer = client.post("/v1/messages", headers=headers,
                                 json={"model": "m", "max_tokens": 8, "messages": HELLO})  # fmt: skip
            assert answer.status_code == 200, answer.text
        assert client.post("/v1/messages", headers={"x-api-key": "k2"},
                           json={"model": "m", "max_tokens": 8, "messages": HELLO}
                           ).status_code == 401  # fmt: skip
        # elsewhere errors keep OpenAI's shape
        other = client.post("/v1/chat/completions", json={"model": "m", "messages": HELLO})
        assert other.status_code == 401 and other.json()["error"]["type"] == "AuthenticationError"


def test_the_anthropic_sdk_as_a_client(served):
    client, backend = served
    backend.answer = "Mild and grey, as ever."
    sdk = anthropic.Anthropic(base_url=str(client.base_url), api_key="none", http_client=client,
                              max_retries=0)  # fmt: skip
    message = sdk.messages.create(model="m", max_tokens=32, messages=HELLO)
    assert message.content[0].text == backend.answer and message.stop_reason == "end_turn"
    with sdk.messages.stream(model="m", max_tokens=32, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == backend.answer == final.content[0].text
    assert final.usage.output_tokens == message.usage.output_tokens
    backend.answer = '{"city": "Oslo"}'
    called = sdk.messages.create(model="m", max_tokens=32, messages=HELLO, tools=TOOLS,
                                 tool_choice={"type": "tool", "name": "weather"})  # fmt: skip
    assert called.content[0].type == "tool_use" and called.content[0].input == {"city": "Oslo"}
    assert sdk.messages.count_tokens(model="m", messages=HELLO).input_tokens > 0
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.create(model="other", max_tokens=8, messages=HELLO)
