"""OpenAI's Responses API (``/v1/responses``, halfmoon/serve/gateway/openai_responses.py):
the request as a chat request, the answer as a ``response`` object, whole and streamed;
stored responses (halfmoon/serve/gateway/response_store.py) continued by
``previous_response_id``, read, listed and deleted.

In-process (ASGI) over a backend that "generates" a fixed answer (the tools tests'); a
live cluster answers the ``openai`` client's ``responses.create`` in tests/e2e."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from halfmoon.serve.gateway.backend import BackendError
from halfmoon.serve.gateway.openai_responses import ResponsesRequest, to_chat
from halfmoon.serve.gateway.response_store import EventLogs, ResponseStore
from halfmoon.serve.runtime import free_port

from .test_gateway_tools import WEATHER, AnswerBackend, answering

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
    # ``tools: []`` (the API's default, which clients send as it is) is no tools
    empty = _post(client, input="Capital of France?", tools=[], tool_choice="auto")
    assert empty.status_code == 200, empty.text
    assert empty.json()["output"][0]["content"][0]["text"] == "Paris is the capital."


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
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # a named function's arguments stream as they come
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     *[d["type"] for d in deltas], "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]["output"][0]
    assert final["arguments"] == "".join(d["delta"] for d in deltas) == '{"city": "Oslo"}'
    added = events[2]["item"]
    assert added["arguments"] == "" and added["status"] == "in_progress"
    assert (added["id"], added["call_id"]) == (final["id"], final["call_id"])
    assert {d["item_id"] for d in deltas} == {final["id"]} and final["status"] == "completed"
    # required calls still come whole at the end
    backend.answer = '[{"name": "weather", "parameters": {"city": "Rome"}}]'
    events = _events(_post(client, input="x", tools=TOOLS, tool_choice="required",
                           stream=True).text)  # fmt: skip
    (delta,) = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert delta["delta"] == '{"city": "Rome"}'
    assert events[-1]["response"]["output"][0]["arguments"] == '{"city": "Rome"}'


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
    # the call as it is written: its item once its JSON names the function (the message
    # done before it), its arguments in parts; joined, the item's arguments
    kinds = [e["type"] for e in events]
    assert kinds.index("response.output_text.done") < kinds.index(
        "response.function_call_arguments.delta"
    )
    parts = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(parts) > 1 and "".join(parts) == final["output"][1]["arguments"]
    call_id = next(e["item"]["call_id"] for e in events if e["type"] == "response.output_item.added"
                   and e["item"]["type"] == "function_call")  # fmt: skip
    assert final["output"][1]["call_id"] == call_id and final["output"][0]["content"][0][
        "text"
    ] == ("Checking.")
    # a second call, arguments first (read only whole): after the first, at the end
    backend.answer += '<tool_call>{"arguments": {"city": "Rome"}, "name": "weather"}</tool_call>'
    events = _events(_post(client, input="x", tools=TOOLS, stream=True).text)
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "function_call"]
    assert [json.loads(o["arguments"]) for o in final["output"][1:]] == [
        {"city": "Oslo"}, {"city": "Rome"}]  # fmt: skip
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2]
    # OpenAI's SDK puts the stream together
    import openai

    oa = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="none", http_client=client,
                       max_retries=0)  # fmt: skip
    with oa.responses.stream(model="m", input="x", tools=TOOLS) as stream:
        response = stream.get_final_response()
    calls = [o for o in response.output if o.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == [{"city": "Oslo"}, {"city": "Rome"}]
    # a call cut short: what was written of it, incomplete; none of its text as content
    backend.answer = backend.answer[: backend.answer.index("Oslo") + 2]
    events = _events(_post(client, input="x", tools=TOOLS, stream=True).text)
    said = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert said == "Checking."
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["arguments"] == '{"city": "Os'


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
        ({"previous_response_id": "resp_1"}, "previous_response_id", "not found"),
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


def _prompt_of_chat(client, backend, messages, **extra) -> list[int]:
    """The prompt tokens the backend got for a chat request of ``messages``."""
    body = {"model": "m", "messages": messages, "max_tokens": 8, **extra}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    return backend.prompts[-1]


def test_previous_response_id_continues_the_conversation(served):
    """A turn after a stored response is served as the whole conversation: the earlier
    input and output, then the new input, under the new instructions only (the API does
    not carry instructions over); its prompt is the equivalent chat request's."""
    client, backend = served
    backend.answer = "Paris."
    first = _post(client, input="Capital of France?", instructions="Be brief.").json()
    assert first["store"] is True and first["previous_response_id"] is None
    backend.answer = "Rome."
    second = _post(client, input="And Italy?", instructions="Be kind.",
                   previous_response_id=first["id"]).json()  # fmt: skip
    assert second["previous_response_id"] == first["id"] and second["store"] is True
    chained = backend.prompts[-1]
    messages = [{"role": "system", "content": "Be kind."},
                {"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "Paris."},
                {"role": "user", "content": "And Italy?"}]  # fmt: skip
    assert chained == _prompt_of_chat(client, backend, messages)
    # and a third turn continues the second (two turns back, through the chain)
    third = _post(client, input=[{"role": "user", "content": "Spain?"}],
                  previous_response_id=second["id"]).json()  # fmt: skip
    assert third["status"] == "completed"
    messages = [*messages[1:], {"role": "assistant", "content": "Rome."},
                {"role": "user", "content": "Spain?"}]  # fmt: skip
    assert backend.prompts[-1] == _prompt_of_chat(client, backend, messages)


def test_a_function_call_is_answered_by_its_output_in_the_next_turn(served):
    """The agent loop: a stored turn ends in a function call, the next sends only the
    call's output (``function_call_output`` with its ``call_id``), streamed."""
    client, backend = served
    backend.answer = '{"city": "Oslo"}'
    forced = {"type": "function", "name": "weather"}
    call_turn = _post(client, input="Weather?", tools=TOOLS, tool_choice=forced).json()
    (call,) = call_turn["output"]
    backend.answer = "Mild."
    events = _events(_post(client, stream=True, previous_response_id=call_turn["id"], tools=TOOLS,
                           input=[{"type": "function_call_output", "call_id": call["call_id"],
                                   "output": "18 C"}]).text)  # fmt: skip
    done = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert done["previous_response_id"] == call_turn["id"] and done["store"] is True
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call["call_id"], "type": "function",
                     "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": call["call_id"], "content": "18 C"}]  # fmt: skip
    chained = backend.prompts[-1]
    assert chained == _prompt_of_chat(client, backend, messages, tools=[
        {"type": "function", "function": {"name": "weather", "parameters": WEATHER}}])  # fmt: skip
    # stored before response.completed went out: readable at once, as streamed
    assert client.get(f"/v1/responses/{done['id']}").json() == done


def test_a_stored_response_is_read_listed_and_deleted(served):
    client, backend = served
    backend.answer = "Noted."
    items = [{"role": "user", "content": f"note {i}"} for i in range(5)]
    body = _post(client, input=items).json()
    got = client.get(f"/v1/responses/{body['id']}")
    assert got.status_code == 200 and got.json() == body
    listed = client.get(f"/v1/responses/{body['id']}/input_items").json()
    assert listed["object"] == "list" and not listed["has_more"]
    texts = [item["content"][0]["text"] for item in listed["data"]]
    assert texts == [f"note {i}" for i in reversed(range(5))]  # newest first by default
    assert all(item["id"].startswith("msg_") and item["type"] == "message"
               and item["content"][0]["type"] == "input_text" for item in listed["data"])  # fmt: skip
    assert listed["first_id"] == listed["data"][0]["id"]
    page = client.get(f"/v1/responses/{body['id']}/input_items",
                      params={"order": "asc", "limit": 2}).json()  # fmt: skip
    assert [i["content"][0]["text"] for i in page["data"]] == ["note 0", "note 1"]
    assert page["has_more"] and page["last_id"] == page["data"][-1]["id"]
    rest = client.get(f"/v1/responses/{body['id']}/input_items",
                      params={"order": "asc", "after": page["last_id"]}).json()  # fmt: skip
    assert [i["content"][0]["text"] for i in rest["data"]] == ["note 2", "note 3", "note 4"]
    for params, param in (({"limit": 0}, "limit"), ({"limit": 101}, "limit"),
                          ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after"),
                          ({"limit": "ten"}, "limit")):  # fmt: skip
        bad = client.get(f"/v1/responses/{body['id']}/input_items", params=params)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, bad.text
    deleted = client.delete(f"/v1/responses/{body['id']}")
    assert deleted.json() == {"id": body["id"], "object": "response", "deleted": True}
    for path in (f"/v1/responses/{body['id']}", f"/v1/responses/{body['id']}/input_items"):
        gone = client.get(path)
        assert gone.status_code == 404 and "not found" in gone.json()["error"]["message"]
    assert client.delete(f"/v1/responses/{body['id']}").status_code == 404
    later = _post(client, input="x", previous_response_id=body["id"])
    assert later.status_code == 400 and later.json()["error"]["param"] == "previous_response_id"


def test_store_false_keeps_nothing(served):
    client, backend = served
    backend.answer = "Fine."
    body = _post(client, input="x", store=False).json()
    assert body["store"] is False
    assert client.get(f"/v1/responses/{body['id']}").status_code == 404
    events = _events(_post(client, input="x", store=False, stream=True).text)
    assert events[-1]["response"]["store"] is False
    assert client.get(f"/v1/responses/{events[-1]['response']['id']}").status_code == 404


def test_a_server_that_stores_nothing_says_so(gateways):
    with answering(gateways, responses_store_bytes=0) as (client, backend):
        backend.answer = "Fine."
        body = _post(client, input="x").json()
        assert body["store"] is False
        assert client.get(f"/v1/responses/{body['id']}").status_code == 404
        later = _post(client, input="x", previous_response_id=body["id"])
        error = later.json()["error"]
        assert later.status_code == 400 and error["param"] == "previous_response_id"
        assert "--responses-store-mb 0" in error["message"]


def test_each_api_key_sees_its_own_responses(gateways):
    with answering(gateways, api_keys=("key-a", "key-b")) as (client, backend):
        backend.answer = "Secret."
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        body = client.post("/v1/responses", headers=a, json={"model": "m", "input": "x"}).json()
        path = f"/v1/responses/{body['id']}"
        assert client.get(path, headers=a).status_code == 200
        assert client.get(path).status_code == 401
        assert client.get(path, headers=b).status_code == 404  # another's: as if missing
        assert client.delete(path, headers=b).status_code == 404
        chained = client.post("/v1/responses", headers=b, json={
            "model": "m", "input": "y", "previous_response_id": body["id"]})  # fmt: skip
        assert chained.status_code == 400
        assert client.get(path, headers=a).status_code == 200  # still there for its owner
        metrics = client.get("/metrics", headers=a).text
        assert re.search(r"^halfmoon:responses_stored\{[^}]*\} 1\.0$", metrics, re.M), metrics


def _answer(i: int, text: str) -> dict:
    return {"id": f"resp_{i}", "object": "response",
            "output": [{"type": "message", "content": [{"type": "output_text", "text": text}]}]}  # fmt: skip


def test_the_store_keeps_the_most_recently_used_within_its_bytes():
    store = ResponseStore(4000)
    item = [{"type": "message", "role": "user", "content": "q" * 100}]
    kept = [store.put(None, _answer(i, "a" * 300), item) for i in range(3)]
    assert all(kept) and len(store) == 3
    assert store.bytes == sum(k.size for k in kept) <= 4000
    assert store.get(None, "resp_0") is not None  # used: now the most recent
    for i in range(3, 8):
        store.put(None, _answer(i, "a" * 300), item)
    assert store.bytes <= 4000 and store.evictions > 0
    assert store.get(None, "resp_1") is None and store.get(None, "resp_7") is not None
    # a chained turn holds the whole conversation and counts it
    last = store.get(None, "resp_7")
    turn = store.put(None, _answer(8, "b"), [{"type": "message", "role": "user", "content": "n"}],
                     last)  # fmt: skip
    assert [i.get("content") for i in turn.conversation] == [
        "q" * 100, [{"type": "output_text", "text": "a" * 300}], "n",
        [{"type": "output_text", "text": "b"}]]  # fmt: skip
    assert turn.size > last.conversation_bytes
    assert store.put(None, _answer(9, "z" * 5000), item) is None  # larger than the store
    assert store.get(None, "resp_9") is None
    assert store.get("someone", "resp_8") is None and not store.delete("someone", "resp_8")
    before = store.bytes
    assert store.delete(None, "resp_8") and store.bytes == before - turn.size


class GatedBackend(AnswerBackend):
    """An answer that waits for ``gate`` (set from the test's thread), or fails."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.gate = threading.Event()
        self.fail = False
        self.aborted: list[str] = []

    async def generate(self, request_id, prompt_token_ids, params):
        while not self.gate.is_set():
            await asyncio.sleep(0.005)
        if self.fail:
            raise BackendError("the decode worker went away")
        async for chunk in super().generate(request_id, prompt_token_ids, params):
            yield chunk

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _until(client, resp_id, *statuses, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = client.get(f"/v1/responses/{resp_id}").json()
        if body["status"] in statuses:
            return body
        time.sleep(0.01)
    raise AssertionError(f"{resp_id} never reached {statuses}: {body['status']}")


@pytest.fixture
def gated(gateways):
    backend = GatedBackend(gateways.tokenizer)
    app = gateways.app(backend, "m", max_tokens_limit=64)
    with TestClient(app) as client:
        yield client, backend


def test_a_background_response_is_polled_until_done(gated):
    client, backend = gated
    backend.answer = "Done in the background."
    queued = _post(client, input="x", background=True).json()
    assert queued["status"] == "queued" and queued["background"] is True and queued["output"] == []
    in_progress = _until(client, queued["id"], "queued", "in_progress")
    chained = _post(client, input="y", previous_response_id=queued["id"])  # not yet
    assert chained.status_code == 400 and "still" in chained.json()["error"]["message"]
    assert in_progress["status"] in ("queued", "in_progress")
    backend.gate.set()
    done = _until(client, queued["id"], "completed")
    assert done["output"][0]["content"][0]["text"] == backend.answer
    assert done["id"] == queued["id"] and done["created_at"] == queued["created_at"]
    later = _post(client, input="y", previous_response_id=queued["id"]).json()
    assert later["status"] == "completed"
    cancelled_late = client.post(f"/v1/responses/{queued['id']}/cancel").json()
    assert cancelled_late == done  # finished already: unchanged


def test_a_background_response_is_cancelled(gated):
    client, backend = gated
    queued = _post(client, input="x", background=True).json()
    _until(client, queued["id"], "queued", "in_progress")
    cancelled = client.post(f"/v1/responses/{queued['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert backend.aborted  # the cluster was told to stop it
    assert client.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
    backend.gate.set()  # nothing runs on: the stored response stays cancelled
    time.sleep(0.05)
    assert client.get(f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"
    plain = _post(client, input="x").json()
    refused = client.post(f"/v1/responses/{plain['id']}/cancel")
    assert refused.status_code == 400 and "background" in refused.json()["error"]["message"]
    assert client.post("/v1/responses/resp_nope/cancel").status_code == 404


def test_a_background_response_that_fails_says_why(gated):
    client, backend = gated
    backend.fail = True
    backend.gate.set()
    queued = _post(client, input="x", background=True).json()
    failed = _until(client, queued["id"], "failed")
    assert "decode worker went away" in failed["error"]["message"]


def test_background_needs_store(gated):
    client, _ = gated
    response = _post(client, input="x", background=True, store=False)
    assert response.status_code == 400 and response.json()["error"]["param"] == "store"


def test_a_streamed_background_response_is_streamed_again_from_any_event(gated):
    """vLLM's streamed background responses: the events stream as they are made, and
    ``GET ...?stream=true&starting_after=N`` streams them again from event N + 1."""
    client, backend = gated
    backend.answer = "Streamed in the background."
    backend.gate.set()
    made = _post(client, input="x", background=True, stream=True)
    assert made.headers["content-type"].startswith("text/event-stream")
    events = _events(made.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert events[0]["response"]["status"] == "queued" and events[0]["response"]["background"]
    assert events[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == backend.answer
    resp_id = events[0]["response"]["id"]
    done = client.get(f"/v1/responses/{resp_id}").json()
    assert done["status"] == "completed" and done == events[-1]["response"]
    again = _events(client.get(f"/v1/responses/{resp_id}?stream=true").text)
    assert again == events
    rest = _events(client.get(f"/v1/responses/{resp_id}?stream=true&starting_after=2").text)
    assert rest == events[3:]
    assert _events(client.get(
        f"/v1/responses/{resp_id}?stream=true&starting_after={len(events) - 1}").text) == []  # fmt: skip
    bad = client.get(f"/v1/responses/{resp_id}?stream=true&starting_after=-5")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "starting_after"
    plain = _post(client, input="x").json()  # not made in the background: nothing to stream
    refused = client.get(f"/v1/responses/{plain['id']}?stream=true")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"
    assert client.get("/v1/responses/resp_nope?stream=true").status_code == 404
    client.delete(f"/v1/responses/{resp_id}")
    assert client.get(f"/v1/responses/{resp_id}?stream=true").status_code == 404


@pytest.fixture
def live_gated(gateways):
    """The gated gateway on a real uvicorn server (127.0.0.1, a free port), where a
    client can go away mid-stream (the in-process test client reads a stream whole):
    (base URL, backend)."""
    import uvicorn

    backend = GatedBackend(gateways.tokenizer)
    port = free_port()
    app = gateways.app(backend, "m", max_tokens_limit=64)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", backend
    finally:
        backend.gate.set()  # nothing left waiting
        server.should_exit = True
        thread.join(10)


def _stream_events(base: str, path: str, into: list[dict], stop_after: int = 0) -> None:
    """Read a stream's events into ``into``; with ``stop_after``, go away after that many."""
    body = {"model": "m", "input": "x", "background": True, "stream": True}
    request = ("POST", base + path) if path == "/v1/responses" else ("GET", base + path)
    with httpx.stream(*request, json=body if request[0] == "POST" else None, timeout=10) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                into.append(json.loads(line[6:]))
                if stop_after and len(into) >= stop_after:
                    return


def _wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_streamed_background_response_runs_on_without_its_client(live_gated):
    """The stream follows the answer as it is made; a client that reads an event and
    goes does not stop it, and resumes from where it was."""
    base, backend = live_gated
    backend.answer = "Still made after the client left."
    first: list[dict] = []
    _stream_events(base, "/v1/responses", first, stop_after=1)  # then the client goes
    assert first[0]["type"] == "response.created" and first[0]["sequence_number"] == 0
    resp_id = first[0]["response"]["id"]
    backend.gate.set()  # the generation runs on, its client gone

    def status() -> str:
        return httpx.get(f"{base}/v1/responses/{resp_id}", timeout=10).json()["status"]

    _wait_for(lambda: status() == "completed")
    resumed: list[dict] = []
    _stream_events(base, f"/v1/responses/{resp_id}?stream=true&starting_after=0", resumed)
    assert resumed[0]["sequence_number"] == 1 and resumed[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in resumed if e["type"] == "response.output_text.delta")
    assert text == backend.answer and not backend.aborted


def test_a_streamed_background_response_that_fails_or_is_cancelled_ends_its_stream(live_gated):
    base, backend = live_gated
    backend.fail = True
    backend.gate.set()
    events: list[dict] = []
    _stream_events(base, "/v1/responses", events)
    assert events[-1]["type"] == "error" and "went away" in events[-1]["message"]
    resp_id = events[0]["response"]["id"]
    failed = httpx.get(f"{base}/v1/responses/{resp_id}", timeout=10).json()
    assert failed["status"] == "failed" and failed["error"]["message"] == events[-1]["message"]
    backend.fail = False
    backend.gate.clear()  # held: cancelled while it waits
    seen: list[dict] = []
    reader = threading.Thread(target=_stream_events, args=(base, "/v1/responses", seen))
    reader.start()
    _wait_for(lambda: len(seen) >= 1)  # created (queued); then it waits for the gate
    held = seen[0]["response"]["id"]
    follower: list[dict] = []  # a second client following the same response
    second = threading.Thread(target=_stream_events,
                              args=(base, f"/v1/responses/{held}?stream=true", follower))  # fmt: skip
    second.start()
    _wait_for(lambda: len(follower) >= 1)
    cancelled = httpx.post(f"{base}/v1/responses/{held}/cancel", timeout=10).json()
    assert cancelled["status"] == "cancelled"
    reader.join(timeout=10)
    second.join(timeout=10)
    assert not reader.is_alive() and not second.is_alive()  # both streams ended with it
    assert [e["type"] for e in seen] == [e["type"] for e in follower]
    assert seen[-1]["type"] != "response.completed" and backend.aborted


def test_event_logs_keep_running_ones_and_the_latest_ended_within_their_bytes():
    async def scenario() -> None:
        logs = EventLogs(max_bytes=25)
        a, b = logs.open("a"), logs.open("b")
        for log in (a, b):
            log.append(b"x" * 10)
            log.append(b"y" * 10)
        follower = asyncio.ensure_future(_collect(b.follow(1)))
        await asyncio.sleep(0)
        b.append(b"z")  # a follower sees events as they come ...
        logs.end("a")  # 20 bytes ended: kept
        assert logs.get("a") is a and a.ended and len(logs) == 2
        logs.end("b")  # ... until the log ends; 41 bytes ended: the older one dropped
        assert await follower == [b"y" * 10, b"z"]
        assert logs.get("a") is None and logs.get("b") is b and logs.ended_bytes == 21
        assert [e async for e in b.follow(5)] == []  # past the end: nothing, at once
        logs.drop("b")
        assert logs.get("b") is None and logs.ended_bytes == 0 and len(logs) == 0
        c = logs.open("c")
        c.append(b"w" * 100)  # a running log is kept whatever its size
        logs.drop("c")  # (only an ended one is dropped: deletes cancel first)
        assert logs.get("c") is c

    asyncio.run(scenario())


async def _collect(events) -> list[bytes]:
    return [e async for e in events]
