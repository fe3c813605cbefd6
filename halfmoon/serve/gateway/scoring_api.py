"""vLLM's score and rerank APIs over embeddings (``POST /score``, ``/v1/score``;
``/rerank``, ``/v1/rerank``, ``/v2/rerank``, Jina's and Cohere's shape), as vLLM serves
them for an embedding model (a bi-encoder): each text is embedded
(:mod:`halfmoon.serve.gateway.embeddings_api`: its last token's final state) and a pair's
score is the cosine similarity of its two vectors.

Score: one or many first texts against as many second ones (``text_1``/``text_2``, or
``data_1``/``data_2``, ``queries``/``documents``, ``queries``/``items``); one first
text is paired with every second one. Rerank: a ``query`` against ``documents``, answered
most relevant first (``top_n`` of them; 0: all). Each distinct text is embedded once and
counted once in the usage. Cross-encoder options (``instruction``,
``chat_template_kwargs``) are a 400: the served model scores by embeddings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from pydantic import Field, ValidationInfo, field_validator, model_validator

from halfmoon.serve.gateway import request_ids
from halfmoon.serve.gateway.embeddings_api import MAX_INPUTS, PoolingOptions, checked_prompts, pool
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.openai_api import check_text
from halfmoon.serve.gateway.responses import HTTPError

#: The names a score request's two sides may go by (vLLM's four forms).
PAIR_NAMES = (("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"),
              ("queries", "items"))  # fmt: skip

Texts = str | list[str]


class _Scoring(PoolingOptions):
    """What score and rerank requests share (vLLM's pooling options)."""

    #: Keep a query's (a document's) first this many tokens; 0: all.
    max_tokens_per_query: int = Field(0, ge=0)
    max_tokens_per_doc: int = Field(0, ge=0)
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def cross_encoder_options(self) -> list[str]:
        """The options only a cross-encoder's template would read, that were given."""
        return [n for n in ("instruction", "chat_template_kwargs") if getattr(self, n)]


def _texts(value: Texts | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _valid_texts(value: Texts | None, info: ValidationInfo) -> Texts | None:
    """``value`` unchanged, or a ValueError naming the field when a text is not valid
    Unicode (a lone surrogate parses from JSON but cannot be tokenized)."""
    for item in _texts(value):
        check_text(item, str(info.field_name))
    return value


class ScoreRequest(_Scoring):
    """Body of ``POST /score``: the two sides under any of vLLM's names."""

    text_1: Texts | None = None
    text_2: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None

    _text = field_validator("text_1", "text_2", "data_1", "data_2", "queries", "documents",
                            "items")(_valid_texts)  # fmt: skip

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        given = [pair for pair in PAIR_NAMES
                 if getattr(self, pair[0]) is not None and getattr(self, pair[1]) is not None]  # fmt: skip
        if len(given) != 1:
            raise ValueError("give one pair of text_1 and text_2 (or data_1 and data_2, "
                             "queries and documents, queries and items)")  # fmt: skip
        return self

    def sides(self) -> tuple[list[str], list[str], tuple[str, str]]:
        """The first and second texts, and the names they came under."""
        first, second = next(p for p in PAIR_NAMES if getattr(self, p[0]) is not None
                             and getattr(self, p[1]) is not None)  # fmt: skip
        return _texts(getattr(self, first)), _texts(getattr(self, second)), (first, second)


class RerankRequest(_Scoring):
    """Body of ``POST /rerank``: a query and the documents to order by relevance to it."""

    query: str
    documents: Texts
    #: The most relevant this many (0: every document).
    top_n: int = Field(0, ge=0)
    #: Cohere's: leave the documents' texts out of the results when false.
    return_documents: bool = True

    _text = field_validator("query", "documents")(_valid_texts)


def scoring_router(gw: Gateway) -> APIRouter:
    """The score and rerank routes over ``gw``."""
    router = APIRouter()

    def check(body: _Scoring) -> None:
        unsupported = body.cross_encoder_options()
        if unsupported:
            raise HTTPError(400, f"not supported by this server: {', '.join(unsupported)} (this "
                            "model scores by embeddings: no cross-encoder template)",
                            "BadRequestError", param=unsupported[0])  # fmt: skip

    async def similarities(
        body: _Scoring, request: Request, first: list[str], second: list[str],
        names: tuple[str, str],
    ) -> tuple[list[float], Any]:  # fmt: skip
        """The cosine similarity of each pair (``first`` broadcast when it is one text),
        and the pooled embeddings."""
        check(body)
        if not first or not second:
            empty = names[0] if not first else names[1]
            raise HTTPError(400, f"{empty} must not be empty", "BadRequestError", param=empty)
        if len(first) not in (1, len(second)):
            raise HTTPError(400, f"{names[0]} has {len(first)} texts and {names[1]} "
                            f"{len(second)}: give one, or as many as {names[1]}",
                            "BadRequestError", param=names[0])  # fmt: skip
        texts = list(dict.fromkeys([*first, *second]))  # each distinct text once
        if len(texts) > MAX_INPUTS:
            raise HTTPError(400, f"at most {MAX_INPUTS} distinct texts per request, got "
                            f"{len(texts)}", "BadRequestError", param=names[1])  # fmt: skip

        def side(items: list[str], name: str, cap: int) -> dict[str, list[int]]:
            ids = [gw.tokenizer.encode(text) for text in items]
            ids = [one[:cap] if cap else one for one in ids]
            return dict(zip(items, checked_prompts(gw, ids, name, body.truncate_prompt_tokens),
                            strict=True))  # fmt: skip

        def tokenize() -> list[list[int]]:
            ids = side(second, names[1], body.max_tokens_per_doc)
            ids.update(side(first, names[0], body.max_tokens_per_query))
            return [ids[text] for text in texts]

        pooled = await pool(gw, request, tokenize, model=body.model, priority=body.priority,
                            cache_salt=body.cache_salt, request_id=body.request_id)  # fmt: skip
        vector = dict(zip(texts, pooled.vectors, strict=True))
        pairs = zip(first * len(second) if len(first) == 1 else first, second, strict=True)
        return [cosine(vector[a], vector[b]) for a, b in pairs], pooled

    async def score(body: ScoreRequest, request: Request) -> dict[str, Any]:
        first, second, names = body.sides()
        scores, pooled = await similarities(body, request, first, second, names)
        public = pooled.answer_id("score-")
        request_ids.note_response_id(request.scope, public)
        return {
            "id": public, "object": "list", "created": int(time.time()),
            "model": body.model or gw.config.model_names[0],
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": pooled.num_tokens, "total_tokens": pooled.num_tokens,
                      "completion_tokens": 0, "prompt_tokens_details": None},
        }  # fmt: skip

    async def rerank(body: RerankRequest, request: Request) -> dict[str, Any]:
        query, documents = _texts(body.query), _texts(body.documents)
        scores, pooled = await similarities(body, request, query, documents,
                                            ("query", "documents"))  # fmt: skip
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if body.top_n:
            order = order[: body.top_n]
        public = pooled.answer_id("rerank-")
        request_ids.note_response_id(request.scope, public)
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        return {
            "id": public, "model": body.model or gw.config.model_names[0],
            "usage": {"prompt_tokens": pooled.num_tokens, "total_tokens": pooled.num_tokens},
            "results": results,
        }  # fmt: skip

    for path in ("/score", "/v1/score"):
        router.add_api_route(path, score, methods=["POST"],
                             summary="Score pairs of texts by their embeddings (vLLM's)")  # fmt: skip
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        router.add_api_route(path, rerank, methods=["POST"],
                             summary="Order documents by relevance to a query (vLLM's)")  # fmt: skip
    return router


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """The cosine similarity of ``a`` and ``b`` (0 when either is zero)."""
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norms if norms > 0 else 0.0
