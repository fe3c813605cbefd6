"""Reasoning parsers (halfmoon/serve/gateway/reasoning.py, ``--reasoning-parser``): the
text read into reasoning and content, whole and delta by delta (the same parts however
it is cut), and the reasoning as each API answers it: chat's ``reasoning`` (whole and
streamed, with ``include_reasoning``), the Responses API's ``reasoning`` item, the
Messages API's ``thinking`` block.

In-process (ASGI) over a backend that "generates" a fixed answer, two tokens a chunk, so
the tags arrive cut across chunks (the tools tests' backend)."""

from __future__ import annotations

import json

import pytest

from halfmoon.serve.gateway.config import GatewayConfig
from halfmoon.serve.gateway.openai_api import ChatMessage
from halfmoon.serve.gateway.reasoning import ReasoningMode, split_reasoning

from .test_gateway_tools import MESSAGES, answering

R1, QWEN = ReasoningMode("deepseek_r1"), ReasoningMode("qwen3")
THOUGHT = "The user asks about Paris. I should say yes."
ANSWER = f"{THOUGHT}</think>\n\nYes, Paris."

CASES = [
    (R1, ANSWER, (THOUGHT, "\n\nYes, Paris.")),
    (R1, f"<think>{THOUGHT}</think>Yes.", (THOUGHT, "Yes.")),
    (R1, f"\n<think>{THOUGHT}</think>Yes.", (THOUGHT, "Yes.")),
    (R1, THOUGHT, (THOUGHT, None)),  # never closed (cut by max_tokens): all reasoning
    (R1, f"{THOUGHT}</think>", (THOUGHT, None)),
    (R1, "", (None, "")),
    (R1, "a </thin b", ("a </thin b", None)),  # a tag's beginning that is not one
    (QWEN, "Yes, Paris.", (None, "Yes, Paris.")),  # thinking off: all content
    (QWEN, f"<think>{THOUGHT}</think>\n\nYes.", (THOUGHT, "\n\nYes.")),
    (QWEN, f"  <think>{THOUGHT}</think>Yes.", (THOUGHT, "Yes.")),
    (QWEN, "<thin", (None, "<thin")),
    (QWEN, "Yes </think> no", (None, "Yes </think> no")),  # not opened: no reasoning
    (ReasoningMode("qwen3", opened=True), ANSWER, (THOUGHT, "\n\nYes, Paris.")),
]


@pytest.mark.parametrize(("mode", "text", "parts"), CASES)
def test_a_whole_output_splits_into_reasoning_and_content(mode, text, parts):
    assert split_reasoning(mode, text) == parts


@pytest.mark.parametrize(("mode", "text", "parts"), CASES)
@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_deltas_give_the_whole_outputs_parts_however_it_is_cut(mode, text, parts, step):
    split = mode.splitter()
    reasoning, content = [], []
    deltas = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for i, delta in enumerate(deltas):
        thought, said = split.add(delta, final=i == len(deltas) - 1)
        assert "</think>" not in thought
        if "</think>" not in (parts[1] or ""):
            assert "</think>" not in said
        reasoning.append(thought)
        content.append(said)
    want_reasoning, want_content = parts
    assert "".join(reasoning) == (want_reasoning or "")
    assert "".join(content) == (want_content or "")


def test_a_tail_that_may_be_a_tag_is_held_until_the_next_delta_tells():
    split = R1.splitter()
    assert split.add("so </th") == ("so ", "")  # "</th" may begin "</think>"
    assert split.add("ink>Yes") == ("", "Yes")
    split = QWEN.splitter()
    assert split.add("<th") == ("", "")
    assert split.in_reasoning is False
    assert split.add("ink>why") == ("why", "")
    assert split.in_reasoning is True


def test_a_prompt_that_opens_the_reasoning_starts_the_output_in_it():
    assert ReasoningMode.for_prompt("qwen3", "<|im_start|>assistant\n<think>\n").opened
    assert not ReasoningMode.for_prompt("qwen3", "<|im_start|>assistant\n").opened
    # a prompt that closed it (Qwen3 without thinking): no reasoning to read
    assert ReasoningMode.for_prompt("deepseek_r1", "<think>\n\n</think>\n\n") is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'nope'"):
        ReasoningMode.for_prompt("nope", "")
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        GatewayConfig("m", 256, reasoning_parser="nope")


def test_an_earlier_turns_reasoning_reaches_the_template_as_reasoning_content():
    turn = ChatMessage(role="assistant", content="Yes.", reasoning="because")
    assert turn.for_template()["reasoning_content"] == "because"
    older = ChatMessage(role="assistant", content="Yes.", reasoning_content="so")
    assert older.for_template()["reasoning_content"] == "so"
    assert "reasoning_content" not in ChatMessage(role="user", content="hi").for_template()


@pytest.fixture(scope="module")
def served(gateways):
    with answering(gateways, "hermes", reasoning_parser="deepseek_r1") as pair:
        yield pair


def _chat(client, **extra):
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 64, **extra}
    return client.post("/v1/chat/completions", json=body)


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_a_chat_answer_carries_its_reasoning_apart(served):
    client, backend = served
    backend.answer = ANSWER
    message = _chat(client).json()["choices"][0]["message"]
    assert message["reasoning"] == THOUGHT and message["content"] == "\n\nYes, Paris."
    hidden = _chat(client, include_reasoning=False).json()["choices"][0]["message"]
    assert "reasoning" not in hidden and hidden["content"] == "\n\nYes, Paris."
    raw = _chat(client, separate_reasoning=False).json()["choices"][0]["message"]
    assert raw == {"role": "assistant", "content": ANSWER}  # (SGLang's switch: not read)


def test_streamed_reasoning_comes_in_its_own_deltas_before_the_content(served):
    client, backend = served
    backend.answer = ANSWER
    events = _events(_chat(client, stream=True, logprobs=True).text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert deltas[0]["role"] == "assistant"
    thought = "".join(d.get("reasoning", "") for d in deltas)
    said = "".join(d.get("content", "") for d in deltas)
    assert thought == THOUGHT and said == "\n\nYes, Paris."
    last_thought = max(i for i, d in enumerate(deltas) if d.get("reasoning"))
    assert all(not d.get("content") for d in deltas[:last_thought])
    # every token's log-probability went out once, with the reasoning or the content
    entries = [t for e in events if e["choices"] and e["choices"][0]["logprobs"]
               for t in e["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert "".join(t["token"] for t in entries) == ANSWER
    events = _events(_chat(client, stream=True, include_reasoning=False).text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert not any("reasoning" in d for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == "\n\nYes, Paris."


def test_tool_calls_are_read_from_the_content_alone(served):
    client, backend = served
    call = '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>'
    backend.answer = f"I need the weather.</think>{call}"
    tools = [{"type": "function", "function": {"name": "weather"}}]
    choice = _chat(client, tools=tools).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning"] == "I need the weather."
    (made,) = choice["message"]["tool_calls"]
    assert made["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}
    events = _events(_chat(client, tools=tools, stream=True).text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == "I need the weather."
    parts = [c for d in deltas for c in d.get("tool_calls", ())]
    assert [c["function"]["name"] for c in parts if "id" in c] == ["weather"]
    assert "".join(c["function"]["arguments"] for c in parts) == '{"city": "Paris"}'
    # the Messages API: the thinking block, then the call's block as it is written
    body = {"model": "m", "max_tokens": 64, "messages": MESSAGES, "stream": True,
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}]}  # fmt: skip
    events = _events(client.post("/v1/messages", json=body).text)
    starts = [(e["index"], e["content_block"]["type"]) for e in events
              if e["type"] == "content_block_start"]  # fmt: skip
    assert starts == [(0, "thinking"), (1, "tool_use")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]
    args = "".join(e["delta"].get("partial_json", "") for e in events
                   if e["type"] == "content_block_delta" and e["index"] == 1)  # fmt: skip
    assert json.loads(args) == {"city": "Paris"}
    # the Responses API: the reasoning item, then the call's item as it is written
    body = {"model": "m", "input": "Paris?", "stream": True,
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}]}  # fmt: skip
    events = _events(client.post("/v1/responses", json=body).text)
    added = [(e["output_index"], e["item"]["type"]) for e in events
             if e["type"] == "response.output_item.added"]  # fmt: skip
    assert added == [(0, "reasoning"), (1, "function_call")]
    output = events[-1]["response"]["output"]
    assert [o["type"] for o in output] == ["reasoning", "function_call"]
    assert json.loads(output[1]["arguments"]) == {"city": "Paris"}


def test_a_structured_output_holds_after_the_reasoning(served):
    client, backend = served
    backend.answer = 'Braces needed.</think>{"a": 1}'
    body = _chat(client, response_format={"type": "json_object"}).json()
    structured = backend.params[-1].structured
    assert structured.kind == "json_object" and structured.reasoning == "first"
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": '{"a": 1}', "reasoning": "Braces needed."}
    # a forced function: its arguments after the reasoning, which streams first
    backend.answer = 'The weather tool.</think>{"city": "Oslo"}'
    tools = [{"type": "function", "function": {"name": "weather"}}]
    named = {"type": "function", "function": {"name": "weather"}}
    choice = _chat(client, tools=tools, tool_choice=named).json()["choices"][0]
    assert backend.params[-1].structured.reasoning == "first"
    assert choice["message"]["reasoning"] == "The weather tool."
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    events = _events(_chat(client, tools=tools, tool_choice=named, stream=True).text)
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [i for i, d in enumerate(deltas) if d.get("tool_calls")]
    assert "".join(d.get("reasoning", "") for d in deltas[: calls[0]]) == "The weather tool."
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[calls[0] :]
                        if d.get("tool_calls"))  # fmt: skip
    assert arguments == '{"city": "Oslo"}'


def test_a_grammar_that_holds_the_whole_output_leaves_no_reasoning(served):
    client, backend = served
    backend.answer = "xx."
    grammar = {"grammar": 'root ::= ("x" | "y")+ "."'}
    body = _chat(client, structured_outputs=grammar).json()
    assert backend.params[-1].structured.reasoning == ""
    message = body["choices"][0]["message"]
    assert message["content"] == "xx." and "reasoning" not in message


def test_without_a_parser_the_tags_stay_in_the_content(gateways):
    with answering(gateways) as (client, backend):
        backend.answer = ANSWER
        message = _chat(client).json()["choices"][0]["message"]
    assert message["content"] == ANSWER and "reasoning" not in message


def test_qwen3_reads_reasoning_the_prompt_opened(gateways):
    with answering(gateways, reasoning_parser="qwen3") as (client, backend):
        backend.answer = ANSWER
        plain = _chat(client).json()["choices"][0]["message"]
        assert plain["content"] == ANSWER and "reasoning" not in plain
        opened = [*MESSAGES, {"role": "assistant", "content": "<think>\n"}]
        body = _chat(client, messages=opened, add_generation_prompt=False,
                     continue_final_message=True).json()  # fmt: skip
        message = body["choices"][0]["message"]
        assert message["reasoning"] == THOUGHT and message["content"] == "\n\nYes, Paris."
        closed = [*MESSAGES, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
        body = _chat(client, messages=closed, add_generation_prompt=False,
                     continue_final_message=True, response_format={"type": "json_object"})  # fmt: skip
        assert backend.params[-1].structured.reasoning == ""  # (held from the start)
    assert body.json()["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}


def test_the_responses_api_answers_a_reasoning_item_first(served):
    client, backend = served
    backend.answer = ANSWER
    body = client.post("/v1/responses", json={"model": "m", "input": "Paris?"}).json()
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert message["content"][0]["text"] == "\n\nYes, Paris."
    # the stored turn (its reasoning item with it) continues
    again = client.post("/v1/responses", json={"model": "m", "input": "Sure?",
                                               "previous_response_id": body["id"]})  # fmt: skip
    assert again.status_code == 200, again.text
    hidden = client.post("/v1/responses", json={"model": "m", "input": "Paris?",
                                                "include_reasoning": False}).json()  # fmt: skip
    assert [item["type"] for item in hidden["output"]] == ["message"]


def test_the_responses_api_streams_the_reasoning_item_then_the_message(served):
    client, backend = served
    backend.answer = ANSWER
    text = client.post("/v1/responses", json={"model": "m", "input": "Paris?", "stream": True}).text
    events = _events(text)
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(e["delta"] for e in deltas) == THOUGHT
    assert {e["output_index"] for e in deltas} == {0}
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    said = [e for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(e["delta"] for e in said) == "\n\nYes, Paris."
    assert {e["output_index"] for e in said} == {1}
    done = events[-1]["response"]
    assert [item["type"] for item in done["output"]] == ["reasoning", "message"]
    assert done["output"][0]["id"] == deltas[0]["item_id"]


def test_the_messages_api_answers_a_thinking_block_first(served):
    client, backend = served
    backend.answer = ANSWER
    body = {"model": "m", "max_tokens": 64, "messages": MESSAGES}
    blocks = client.post("/v1/messages", json=body).json()["content"]
    assert blocks == [{"type": "thinking", "thinking": THOUGHT, "signature": ""},
                      {"type": "text", "text": "\n\nYes, Paris."}]  # fmt: skip
    events = _events(client.post("/v1/messages", json={**body, "stream": True}).text)
    starts = [(e["index"], e["content_block"]["type"]) for e in events
              if e["type"] == "content_block_start"]  # fmt: skip
    assert starts == [(0, "thinking"), (1, "text")]
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert "".join(e["delta"].get("thinking", "") for e in deltas if e["index"] == 0) == THOUGHT
    assert "".join(e["delta"].get("text", "") for e in deltas if e["index"] == 1) == (
        "\n\nYes, Paris."
    )
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == [0, 1]


def test_sglangs_separate_reasoning_reads_a_text(served):
    client, _ = served
    said = client.post("/separate_reasoning", json={"text": ANSWER,
                                                    "reasoning_parser": "deepseek-r1"})  # fmt: skip
    assert said.json() == {"text": "\n\nYes, Paris.", "reasoning_text": THOUGHT}
    said = client.post("/separate_reasoning", json={"text": ANSWER, "reasoning_parser": "qwen3"})
    assert said.json() == {"text": ANSWER, "reasoning_text": ""}  # (not opened)
    said = client.post("/separate_reasoning",
                       json={"text": ANSWER, "reasoning_parser": "qwen3-thinking"})  # fmt: skip
    assert said.json()["reasoning_text"] == THOUGHT
    refused = client.post("/separate_reasoning", json={"text": "x", "reasoning_parser": "kimi"})
    assert refused.status_code == 400 and "unknown reasoning parser 'kimi'" in refused.text


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it():
    from halfmoon.serve.gateway.openai_api import ChatCompletionRequest
    from halfmoon.serve.gateway.openai_responses import ResponsesRequest, to_chat

    def kwargs(**body):
        request = ChatCompletionRequest(model="m", messages=MESSAGES, **body)
        return request.template_options()["template_kwargs"]

    assert kwargs() == {}
    assert kwargs(reasoning_effort="low") == {"enable_thinking": True, "reasoning_effort": "low"}
    assert kwargs(reasoning_effort="none")["enable_thinking"] is False
    kept = kwargs(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert kept == {"enable_thinking": False, "reasoning_effort": "high"}  # the client's wins
    with pytest.raises(ValueError, match="reasoning_effort"):
        ChatCompletionRequest(model="m", messages=MESSAGES, reasoning_effort="extreme")
    chat = to_chat(ResponsesRequest(model="m", input="hi", reasoning={"effort": "minimal"}))
    assert chat.reasoning_effort == "minimal"


def test_usage_counts_the_reasoning_tokens(served, gateways):
    """vLLM's ``completion_tokens_details.reasoning_tokens`` (the Responses API's
    ``output_tokens_details``): the tokens whose text is reasoning, the tags' not."""
    client, backend = served
    backend.answer = ANSWER
    ids = gateways.tokenizer.encode(ANSWER, add_special_tokens=False)
    ends = [len(gateways.tokenizer.decode(ids[: i + 1])) for i in range(len(ids))]
    expected = sum(1 for end in ends if end <= len(THOUGHT))
    assert 0 < expected < len(ids)
    use = _chat(client).json()["usage"]
    assert use["completion_tokens_details"] == {"reasoning_tokens": expected}
    use = _chat(client, n=2).json()["usage"]  # (summed over the choices)
    assert use["completion_tokens_details"] == {"reasoning_tokens": 2 * expected}
    events = _events(_chat(client, stream=True, stream_options={"include_usage": True}).text)
    assert events[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == expected
    body = client.post("/v1/responses", json={"model": "m", "input": "Paris?"}).json()
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == expected
    backend.answer = "Plain."  # a prompt that closed it: no reasoning read, none counted
    closed = [*MESSAGES, {"role": "assistant", "content": "<think>\n\n</think>\n\n"}]
    use = _chat(client, messages=closed, add_generation_prompt=False,
                continue_final_message=True).json()["usage"]  # fmt: skip
    assert "completion_tokens_details" not in use


def test_the_sdks_read_the_reasoning(served):
    """OpenAI's and Anthropic's SDKs as clients: chat's ``reasoning``, the Responses
    API's reasoning item, the Messages API's thinking block, whole and streamed."""
    import anthropic
    import openai

    client, backend = served
    backend.answer = ANSWER
    oa = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="none", http_client=client,
                       max_retries=0)  # fmt: skip
    chat = oa.chat.completions.create(model="m", messages=MESSAGES, max_tokens=64)
    assert chat.choices[0].message.reasoning == THOUGHT
    assert chat.choices[0].message.content == "\n\nYes, Paris."
    streamed = oa.chat.completions.create(model="m", messages=MESSAGES, max_tokens=64, stream=True)
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == THOUGHT
    response = oa.responses.create(model="m", input="Paris?")
    assert response.output[0].type == "reasoning"
    assert response.output[0].content[0].text == THOUGHT
    assert response.output_text == "\n\nYes, Paris."
    with oa.responses.stream(model="m", input="Paris?") as events:
        final = events.get_final_response()
    assert final.output[0].content[0].text == THOUGHT
    sdk = anthropic.Anthropic(base_url=str(client.base_url), api_key="none", http_client=client,
                              max_retries=0)  # fmt: skip
    message = sdk.messages.create(model="m", max_tokens=64, messages=MESSAGES)
    assert message.content[0].type == "thinking" and message.content[0].thinking == THOUGHT
    with sdk.messages.stream(model="m", max_tokens=64, messages=MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "\n\nYes, Paris." and final.content[0].thinking == THOUGHT


def test_a_thinking_budget_reaches_the_engine_from_every_api(served):
    """vLLM's ``thinking_token_budget`` on chat, completions and ``/inference/v1/generate``
    (-1: none), and an enabled Messages ``thinking``'s ``budget_tokens``, as vLLM maps
    it; beam search cannot honour one (a 400)."""
    client, backend = served
    backend.answer = ANSWER
    assert _chat(client, thinking_token_budget=12).status_code == 200
    assert backend.params[-1].thinking_token_budget == 12
    assert _chat(client, thinking_token_budget=-1).status_code == 200
    assert backend.params[-1].thinking_token_budget is None
    completion = {"model": "m", "prompt": "Why?", "max_tokens": 8, "thinking_token_budget": 0}
    assert client.post("/v1/completions", json=completion).status_code == 200
    assert backend.params[-1].thinking_token_budget == 0
    generate = {"token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4,
                                                             "thinking_token_budget": 3}}  # fmt: skip
    assert client.post("/inference/v1/generate", json=generate).status_code == 200
    assert backend.params[-1].thinking_token_budget == 3
    body = {"model": "m", "max_tokens": 64, "messages": MESSAGES,
            "thinking": {"type": "enabled", "budget_tokens": 1024}}  # fmt: skip
    assert client.post("/v1/messages", json=body).status_code == 200
    assert backend.params[-1].thinking_token_budget == 1024
    bad = _chat(client, thinking_token_budget=-2)
    assert bad.status_code == 400 and "thinking_token_budget" in bad.text
    beams = _chat(client, thinking_token_budget=4, use_beam_search=True, n=2)
    assert beams.status_code == 400 and "thinking_token_budget" in beams.text


def test_without_a_parser_a_thinking_budget_is_refused_naming_it(gateways):
    """No parser, no reasoning to bound: a 400 naming the flag (vLLM refuses one without
    its reasoning config); a Messages request's ``thinking`` is then only the template's
    switch."""
    with answering(gateways) as (client, backend):
        refused = _chat(client, thinking_token_budget=8)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "thinking_token_budget"
        assert "--reasoning-parser" in error["message"]
        body = {"model": "m", "max_tokens": 64, "messages": MESSAGES,
                "thinking": {"type": "enabled", "budget_tokens": 1024}}  # fmt: skip
        assert client.post("/v1/messages", json=body).status_code == 200
        assert backend.params[-1].thinking_token_budget is None
