"""OpenAI's Responses API (``/v1/responses``, halfmoon/serve/gateway/openai_responses.py):
the request as a chat request, the answer as a ``response`` object, whole and streamed.

In-process (ASGI) over a backend that "generates" a fixed answer (the tools tests'); a
live cluster answers the ``openai`` client's ``responses.create`` in tests/e2e."""

from __future__ import annotations

import json

import pytest

from halfmoon.serve.gateway.openai_responses import ResponsesRequest, to_chat

from .test_gateway_tools import WEATHER, answering

TOOLS = [{"type": "function", "name": "weather", "parameters": WEATHER}]


@pytest.fixture(scope="module")
def served(gateways):
    with answering(gateways, "hermes") as pair:
        yield pair


def _post(client, **body):
    return client.post("/v1/responses", json={"model": "m", **body})


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_text_in_text_out(served):
    client, backend = served
    backend.answer = "Paris is the capital."
    body = _post(client, input="Capital of France?", max_output_tokens=32).json()
    assert body["object"] == "response" and body["status"] == "completed"
    assert body["id"].startswith("resp_") and body["incomplete_details"] is None
    (message,) = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["content"][0] == {"type": "output_text", "text": "Paris is the capital.",
                                     "annotations": [], "logprobs": []}  # fmt: skip
    usage = body["usage"]
    assert usage["output_tokens"] > 0 and usage["total_tokens"] == (
        usage["input_tokens"] + usage["output_tokens"]
    )
    assert backend.params[-1].max_tokens == 32


def test_a_cut_answer_is_incomplete(served):
    client, backend = served
    backend.answer = "one two three"

    async def cut(request_id, prompt_token_ids, params):  # ends at max_tokens: "length"
        from halfmoon.serve.gateway.backend import GenerationChunk

        yield GenerationChunk((65, 66), "length", 0)

    original, backend.generate = backend.generate, cut
    try:
        body = _post(client, input="x", max_output_tokens=2).json()
    finally:
        backend.generate = original
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_input_items_become_the_conversation() -> None:
    request = ResponsesRequest(model="m", instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "18 C"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Mild."}]},
    ], tools=TOOLS, tool_choice={"type": "function", "name": "weather"}, max_output_tokens=9,
        text={"format": {"type": "json_object"}})  # fmt: skip
    chat = to_chat(request)
    roles = [m.role for m in chat.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in chat.messages[2].tool_calls] == ["c1", "c2"]  # one turn
    assert chat.messages[3].tool_call_id == "c1" and chat.messages[4].text() == "Mild."
    assert chat.tools == [{"type": "function", "function": {"name": "weather",
                                                            "parameters": WEATHER}}]  # fmt: skip
    assert chat.tool_choice == {"type": "function", "function": {"name": "weather"}}
    assert chat.max_completion_tokens == 9 and chat.response_format == {"type": "json_object"}
    assert "temperature" not in chat.model_fields_set  # left out: the model's default


def test_json_schema_format_holds_the_output(served):
    client, backend = served
    backend.answer = '{"city": "Rome"}'
    fmt = {"type": "json_schema", "name": "w", "schema": WEATHER}
    body = _post(client, input="x", text={"format": fmt}).json()
    assert json.loads(backend.params[-1].structured.spec) == WEATHER
    assert json.loads(body["output"][0]["content"][0]["text"]) == {"city": "Rome"}


def test_function_calls_whole_and_streamed(served):
    client, backend = served
    backend.answer = '{"city": "Oslo"}'
    forced = {"type": "function", "name": "weather"}
    body = _post(client, input="x", tools=TOOLS, tool_choice=forced).json()
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["name"] == "weather"
    assert call["arguments"] == '{"city": "Oslo"}' and call["call_id"] and call["id"]
    events = _events(_post(client, input="x", tools=TOOLS, tool_choice=forced, stream=True).text)
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["response"]["output"][0]["arguments"] == '{"city": "Oslo"}'


def test_auto_calls_and_text_streamed(served):
    """``tool_choice`` auto (hermes): the text before the block streams as output text;
    the block becomes a function call after the message."""
    client, backend = served
    backend.answer = (
        'Checking.<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    events = _events(_post(client, input="x", tools=TOOLS, stream=True).text)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "Checking."
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == '{"city": "Oslo"}'
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [0, 1]


def test_text_streams_as_deltas_that_add_up(served):
    client, backend = served
    backend.answer = "Hello there, how are you today?"
    events = _events(_post(client, input="hi", stream=True).text)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == backend.answer
    assert events[0]["response"]["status"] == "in_progress"
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == backend.answer


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"tools": [{"type": "web_search"}], "tool_choice": "none"}, "tools", "function tools"),
        ({"input": [{"type": "input_image"}]}, "input", "input_image"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input",
         "text only"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input", "Input should be"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice",
         "not in tools"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_it(served, body, param, says):
    client, backend = served
    before = len(backend.params)
    response = _post(client, **{"input": "x", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert len(backend.params) == before
