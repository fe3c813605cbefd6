"""OpenAI's embeddings API, ``POST /v1/embeddings``, as vLLM serves a generative model
converted to embeddings (``--convert embed``): each input's embedding is its last token's
final hidden state (after the model's last norm), L2-normalized unless
``use_activation`` is false.

An input is a text, a list of texts, a list of token ids or a list of such lists, or
(vLLM's) one chat conversation in ``messages``, rendered by the chat template (no
generation prompt unless asked). Each input is its own request to the cluster: placed by
the Conductor (prefix-cache hits count: an input whose prefix is cached computes only
the rest), computed by a prefill (or coupled) worker, answered from there; no decode
worker is involved. Answers as ``float`` lists or ``base64`` (float32 in the host's byte
order, vLLM's default, unless ``endianness`` names one). ``dimensions`` is refused: the served models have
no matryoshka embeddings (vLLM refuses it for them too).
"""

from __future__ import annotations

import asyncio
import base64
import math
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from halfmoon.core.request import SamplingParams
from halfmoon.serve.gateway import request_ids
from halfmoon.serve.gateway.access_log import note_generation
from halfmoon.serve.gateway.backend import BackendError, Rejected
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.openai_api import (
    ChatMessage,
    ChatTemplateOptions,
    check_text,
    checked_salt,
)
from halfmoon.serve.gateway.request_ids import client_request_id
from halfmoon.serve.gateway.responses import HTTPError, turned_away

#: Inputs one request may carry (each is a request to the cluster).
MAX_INPUTS = 2048


class PoolingOptions(BaseModel):
    """The options every pooling request takes (embeddings, score, rerank), as vLLM's."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    user: str | None = None
    #: vLLM's: keep the last ``n`` tokens of each input (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    #: vLLM's: false leaves the vectors unnormalized.
    use_activation: bool | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _salt(cls, value: object) -> object:
        return checked_salt(value)


class EmbeddingRequest(ChatTemplateOptions, PoolingOptions):
    """Body of ``POST /v1/embeddings``: ``input`` (OpenAI's) or ``messages`` (vLLM's chat
    form), and vLLM's extra options."""

    model_config = ConfigDict(extra="ignore")

    input: str | list[str] | list[int] | list[list[int]] | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    #: A text ``input`` gets the tokenizer's special tokens (BOS); false: it does not.
    #: (``messages`` get what their chat template writes.)
    add_special_tokens: bool = True
    embed_dtype: Literal["float32"] = "float32"
    endianness: Literal["native", "little", "big"] = "native"
    #: Unlike a chat completion's, off by default (vLLM's default for embeddings).
    add_generation_prompt: bool = False

    @field_validator("input")
    @classmethod
    def _text(cls, value: Any) -> Any:
        for item in [value] if isinstance(value, str) else value or []:
            if isinstance(item, str):
                check_text(item, "input")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> EmbeddingRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give either input or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self

    def inputs(self) -> list[str | list[int]]:
        """Each text input or token-id list (not ``messages``)."""
        given = self.input
        if given is None:
            return []
        if isinstance(given, str):
            return [given]
        if given and all(isinstance(t, int) for t in given):
            return [list(given)]  # type: ignore[arg-type]
        return list(given)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Pooled:
    """A pooling request's answers: each prompt's token ids and vector (not normalized),
    in order, and the id the client knows the request by (None: the gateway's)."""

    prompts: list[list[int]]
    vectors: list[tuple[float, ...]]
    run_id: str
    client_id: str | None

    @property
    def num_tokens(self) -> int:
        """Prompt tokens of every input."""
        return sum(len(prompt) for prompt in self.prompts)

    def answer_id(self, prefix: str) -> str:
        """The id an answer is shown under: the client's, else ``prefix`` + the gateway's."""
        return self.client_id if self.client_id is not None else f"{prefix}{self.run_id}"


def checked_prompts(
    gw: Gateway, ids: list[list[int]], what: str, keep: int | None
) -> list[list[int]]:
    """``ids`` (the prompts of ``what``, the field a 400 names) truncated to their last
    ``keep`` tokens when asked, each checked to fit the context with its one computed
    position; a 400 when there are none, too many, an empty one or one too long."""
    if not ids:
        raise HTTPError(400, f"{what} must not be empty", "BadRequestError", param=what)
    if len(ids) > MAX_INPUTS:
        raise HTTPError(400, f"at most {MAX_INPUTS} inputs per request, got {len(ids)}",
                        "BadRequestError", param=what)  # fmt: skip
    ids = [gw.truncated(one, keep) for one in ids]
    limit = gw.config.max_model_len - 1
    for i, one in enumerate(ids):
        if not one:
            raise HTTPError(400, f"{what} {i} has no tokens", "BadRequestError", param=what)
        if len(one) > limit:
            raise HTTPError(
                400, f"{what} {i} has {len(one)} tokens; this model embeds at most {limit} "
                f"(its context is {gw.config.max_model_len})", "BadRequestError", param=what,
            )  # fmt: skip
    return ids


async def pool(
    gw: Gateway, request: Request, tokenize: Callable[[], list[list[int]]], *,
    model: str | None, priority: int, cache_salt: str | None, request_id: str | None,
) -> Pooled:  # fmt: skip
    """Embed the prompts ``tokenize`` makes (on the gateway's CPU threads), each its own
    request to the cluster, all under one id (``/abort_requests`` ends them together):
    the model checked, the request counted against the server's limit (429) while it is
    tokenized, inputs beyond the limit waiting their turn; a refusal or failure answered
    as generation's are (429, 503)."""
    config = gw.config
    gw.check_model(model)
    gw.check_priority(priority)
    lora = gw.lora_of(model)
    salt = gw.salt(cache_salt, getattr(request.state, "api_key", None), lora)
    client_id = client_request_id(request.headers.get(request_ids.HEADER), request_id)
    run_id = client_id if client_id is not None else gw.new_id()
    busy = gw.in_flight + gw.preparing
    if busy + 1 > config.max_concurrent_requests:
        gw.metrics.rejections.inc()
        gw.series.rejected()
        raise HTTPError(429, f"server busy: {busy} requests in flight", "RateLimitError",
                        {"Retry-After": "1"})  # fmt: skip
    gw.preparing += 1
    try:
        prompts = await gw.off_loop(tokenize)
    finally:
        gw.preparing -= 1
    params = SamplingParams(max_tokens=1, embed=True, priority=priority, lora=lora)
    # Inputs beyond the server's concurrency wait their turn here, not as 429s.
    slots = asyncio.Semaphore(max(1, config.max_concurrent_requests - gw.in_flight))

    async def one(prompt: list[int]) -> tuple[float, ...]:
        async with slots:
            return await gw.embed(prompt, params, salt, run_id)

    try:
        vectors = await asyncio.gather(*(one(prompt) for prompt in prompts))
    except (Rejected, BackendError) as exc:
        if isinstance(exc, Rejected):
            gw.series.rejected()
        else:
            gw.series.failed()
        raise turned_away(exc, gw.metrics) from None
    pooled = Pooled(prompts, list(vectors), run_id, client_id)
    note_generation(pooled.num_tokens, 0, None)  # the access line counts every input
    return pooled


def embeddings_router(gw: Gateway) -> APIRouter:
    """``POST /v1/embeddings`` over ``gw``."""
    router = APIRouter()
    config = gw.config

    def tokenized(body: EmbeddingRequest) -> list[list[int]]:
        """Each input's token ids, checked against the context (400s name the field)."""
        if body.messages is not None:
            options = body.template_options()
            ids = [gw.chat_prompt([m.for_template() for m in body.messages], options)]
            return checked_prompts(gw, ids, "messages", body.truncate_prompt_tokens)
        special = body.add_special_tokens
        ids = [
            gw.tokenizer.encode(item, add_special_tokens=special) if isinstance(item, str)
            else gw.checked_token_ids(item, "input token ids")
            for item in body.inputs()
        ]  # fmt: skip
        return checked_prompts(gw, ids, "input", body.truncate_prompt_tokens)

    @router.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        """Each input's embedding, in input order."""
        if body.dimensions is not None:
            raise HTTPError(400, "dimensions is not supported: this model has no matryoshka "
                            "embeddings", "BadRequestError", param="dimensions")  # fmt: skip
        pooled = await pool(gw, request, lambda: tokenized(body), model=body.model,
                            priority=body.priority, cache_salt=body.cache_salt,
                            request_id=body.request_id)  # fmt: skip
        normalize = body.use_activation is not False
        order = {"native": "=", "little": "<", "big": ">"}[body.endianness]
        data = []
        for index, vector in enumerate(pooled.vectors):
            values = unit(vector) if normalize else list(vector)
            shown: list[float] | str = values
            if body.encoding_format == "base64":
                packed = struct.pack(f"{order}{len(values)}f", *values)
                shown = base64.b64encode(packed).decode("ascii")
            data.append({"object": "embedding", "index": index, "embedding": shown})
        public = pooled.answer_id("embd-")
        request_ids.note_response_id(request.scope, public)
        num_tokens = pooled.num_tokens
        return {
            "id": public, "object": "list", "created": int(time.time()),
            "model": body.model or config.model_names[0], "data": data,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None},
        }  # fmt: skip

    return router


def unit(vector: tuple[float, ...] | list[float]) -> list[float]:
    """``vector`` scaled to length 1 (a zero vector stays zero)."""
    norm = math.sqrt(math.fsum(v * v for v in vector))
    return [v / norm for v in vector] if norm > 0 else list(vector)
