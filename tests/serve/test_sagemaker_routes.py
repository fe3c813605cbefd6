"""SageMaker's routes as vLLM serves them (``/ping``: the health check by another name;
``/invocations``: a chat completion or a completion, told apart by the body) and vLLM's
``/load`` (generations in flight). In-process, over the tools tests' answering backend."""

from __future__ import annotations

import asyncio
import json

from halfmoon.serve.gateway.backend import GenerationChunk

from .test_gateway_tools import answering

CHAT = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}


def test_ping_is_health_by_either_method_and_needs_no_key(gateways):
    with answering(gateways, api_key="k") as (client, _):
        for method in (client.get, client.post):
            answer = method("/ping")
            assert answer.status_code == 200 and answer.json()["status"] == "ok"
        assert client.get("/load").status_code == 401  # (everything else needs the key)
        assert client.post("/invocations", json=CHAT).status_code == 401


def test_invocations_answer_as_chat_or_completion(gateways):
    with answering(gateways) as (client, backend):
        backend.answer = "Hello there."
        chat = client.post("/invocations", json=CHAT).json()
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"]["content"] == "Hello there."
        same = client.post("/v1/chat/completions", json=CHAT).json()
        assert backend.prompts[-1] == backend.prompts[-2]  # the same prompt as the chat route
        assert same["usage"] == chat["usage"]
        text = client.post("/invocations", json={"model": "m", "prompt": "Hi", "max_tokens": 8})
        assert text.json()["object"] == "text_completion"
        assert text.json()["choices"][0]["text"] == "Hello there."
        streamed = client.post("/invocations", json={**CHAT, "stream": True}).text
        chunks = [json.loads(line[6:]) for line in streamed.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        said = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert said == "Hello there." and streamed.rstrip().endswith("data: [DONE]")


def test_invocations_refuse_what_is_neither(gateways):
    with answering(gateways) as (client, _):
        neither = client.post("/invocations", json={"model": "m", "input": "Hi"})
        assert neither.status_code == 400
        assert "chat completion (messages) or a completion (prompt)" in neither.json()["error"][
            "message"]  # fmt: skip
        bad = client.post("/invocations", json={**CHAT, "max_tokens": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        other = client.post("/invocations", json={**CHAT, "model": "other"})
        assert other.status_code == 404


def test_load_counts_generations_in_flight(gateways):
    with answering(gateways) as (client, backend):
        assert client.get("/load").json() == {"server_load": 0}
        gate = asyncio.Event()
        seen: list[int] = []

        async def slow(request_id, prompt_token_ids, params):
            yield GenerationChunk((65,), None, 0)
            await gate.wait()
            yield GenerationChunk((66,), "stop", None)

        original, backend.generate = backend.generate, slow
        try:
            with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: {"))
                seen.append(client.get("/load").json()["server_load"])
                client.portal.call(gate.set)  # (the app's loop: its event)
                list(lines)
        finally:
            backend.generate = original
        assert seen == [1]
        assert client.get("/load").json() == {"server_load": 0}
