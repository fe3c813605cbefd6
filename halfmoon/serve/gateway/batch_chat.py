"""vLLM's batched chat completions, ``POST /v1/chat/completions/batch``: one body whose
``messages`` is a list of conversations, answered as one chat completion with a choice
per conversation (indexed in their order) and the usage of them all.

Every other field is a chat completion's and applies to each conversation, which runs
as its own chat request (the model's defaults filled in as for any), all at once. As on
vLLM, streaming, tools, beam search and ``n`` above 1 are refused with a 400 naming them.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from halfmoon.serve.gateway.backend import BackendError, Rejected
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.openai_api import ChatCompletionRequest
from halfmoon.serve.gateway.responses import HTTPError, Prepared, collect, turned_away
from halfmoon.serve.gateway.responses_api import Name, Start

#: The most conversations one batch may hold.
MAX_CONVERSATIONS = 64


def conversations_of(body: dict[str, Any]) -> list[ChatCompletionRequest]:
    """One chat request per conversation of a batch ``body`` (a 400 for what a batch
    cannot do; an invalid field is answered as any route's invalid body)."""
    batch = body.get("messages")
    if not isinstance(batch, list) or not batch or not all(isinstance(c, list) for c in batch):
        raise HTTPError(400, "messages must be a non-empty list of conversations (each a "
                        "list of messages)", "BadRequestError", param="messages")  # fmt: skip
    if len(batch) > MAX_CONVERSATIONS:
        raise HTTPError(400, f"at most {MAX_CONVERSATIONS} conversations in one batch",
                        "BadRequestError", param="messages")  # fmt: skip
    refused = [name for name, ok in (("stream", not body.get("stream")),
                                     ("tools", not body.get("tools")),
                                     ("use_beam_search", not body.get("use_beam_search")),
                                     ("n", body.get("n") in (None, 1))) if not ok]  # fmt: skip
    if refused:
        raise HTTPError(400, f"not supported by the batch endpoint: {', '.join(refused)}",
                        "BadRequestError", param=refused[0])  # fmt: skip
    chats = []
    for i, conversation in enumerate(batch):
        try:
            chats.append(ChatCompletionRequest.model_validate({**body, "messages": conversation}))
        except ValidationError as exc:  # (the path names the conversation: messages.[i]...)
            errors = [{**e, "loc": ("body", "messages", i, *e["loc"][1:])
                       if e["loc"][:1] == ("messages",) else ("body", *e["loc"])}
                      for e in exc.errors()]  # fmt: skip
            raise RequestValidationError(errors, body=body) from None
    return chats


def merged(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One chat completion of every conversation's: their choices, reindexed in order,
    and their usage summed."""
    out = dict(answers[0])
    out["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    use: dict[str, Any] = {}
    for answer in answers:
        for key, value in (answer.get("usage") or {}).items():
            if isinstance(value, int):
                use[key] = use.get(key, 0) + value
            elif isinstance(value, dict):  # (prompt_tokens_details)
                inner = use.setdefault(key, {})
                for k, v in value.items():
                    inner[k] = inner.get(k, 0) + (v or 0)
    out["usage"] = use
    out.pop("prompt_token_ids", None)  # (one per conversation: in their choices instead)
    return out


def batch_chat_router(gw: Gateway, start: Start, name: Name) -> APIRouter:
    """The batch route over ``gw`` (``start``: the app's, so every conversation is
    limited and counted as any request)."""
    router = APIRouter()

    @router.post("/v1/chat/completions/batch")
    async def batch(body: dict[str, Any], request: Request) -> dict[str, Any]:
        chats = conversations_of(body)
        if len(chats) > gw.config.max_concurrent_requests:  # never fits: not a 429
            raise HTTPError(400, f"{len(chats)} conversations; this server runs at most "
                            f"{gw.config.max_concurrent_requests} requests at once",
                            "BadRequestError", param="messages")  # fmt: skip

        async def one(chat: ChatCompletionRequest) -> tuple[Prepared, dict[str, Any]]:
            p, first, stream = await start(chat, request)
            try:
                return p, await collect(p, chat.model, first, stream, gw.metrics,
                                             gw.token_text)  # fmt: skip
            except (Rejected, BackendError) as exc:
                raise turned_away(exc, gw.metrics) from None

        tasks = [asyncio.ensure_future(one(chat)) for chat in chats]
        try:
            done = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one failed: the others stop (their requests abort)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        answers = [answer for _, answer in done]
        for (p, _), answer in zip(done, answers, strict=True):
            if p.return_token_ids:
                answer["choices"][0]["prompt_token_ids"] = p.prompt_ids
        name(done[0][0], request, answers[0]["id"])
        return merged(answers)

    return router
