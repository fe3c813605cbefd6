"""SGLang's native generation API, as halfmoon serves it (routes in
:mod:`halfmoon.serve.gateway.sglang_api`): ``POST /generate``, text or token ids in;
text, output token ids and ``meta_info`` out, as RL frameworks and SGLang's own clients
drive it.

A ``/generate`` request runs as one completion of its prompts (one or a batch, ``n``
choices each) through the gateway's completion path: the same placement, limits,
metrics and errors. SGLang's ``sampling_params`` map onto vLLM's and OpenAI's names
(``max_new_tokens`` -> ``max_tokens``, ``min_new_tokens``, ``no_stop_trim`` ->
``include_stop_str_in_output``, ``json_schema`` / ``regex`` / ``ebnf`` /
``structural_tag`` -> structured outputs, ``sampling_seed`` -> ``seed``); as on SGLang
an option left out takes the served model's default (its generation config), and
``max_new_tokens`` 128 (0: the prompt is only scored, for its log-probabilities).
Answers follow SGLang's shapes: ``text`` and ``output_ids``
(cumulative when streamed, as SGLang streams by default), ``meta_info`` with ``id``,
``finish_reason`` (``{"type": "stop", "matched": <stop string or token id>}``,
``{"type": "length", "length": N}`` or ``{"type": "abort", ...}``), ``prompt_tokens``,
``completion_tokens``, ``cached_tokens``, ``e2e_latency`` and, with ``return_logprob``,
``output_token_logprobs`` ``[[logprob, token id, text or null], ...]`` (and
``output_top_logprobs``; ``input_*`` from ``logprob_start_len``). A batch, or ``n`` above
1, answers a list (streamed: each chunk with its ``index``). Options SGLang has and this
server does not (multimodal data, embeddings in, hidden states out, custom logit
processors, beam width, regex stops) are a 400 naming them.

A batch whose per-prompt options differ (``sampling_params``, ``return_logprob``,
``logprob_start_len``, ``top_logprobs_num`` or ``lora_path`` given as a list of one value
per prompt, not all equal) runs as one completion per prompt, all at once, answered as
one list in the prompts' order (:meth:`SglangGenerateRequest.parts`; streamed, their
events interleave as they come, each with its ``index``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from halfmoon.core.request import MAX_LOGPROBS, TokenLogprob
from halfmoon.serve.gateway.backend import BackendError, Rejected
from halfmoon.serve.gateway.openai_api import CompletionRequest, stop_reason
from halfmoon.serve.gateway.prom import GatewayMetrics
from halfmoon.serve.gateway.responses import (
    Delta,
    Entry,
    HTTPError,
    Prepared,
    all_items,
    failed_event,
    interleave,
    turned_away,
)
from halfmoon.serve.gateway.token_generation import completion_from, refuse

#: The last event of a stream.
DONE_EVENT = b"data: [DONE]\n\n"
#: What SGLang defaults ``max_new_tokens`` to.
DEFAULT_MAX_NEW_TOKENS = 128
#: Completion fields by the names SGLang's requests give them (in a 400).
_SGLANG_NAMES = {"prompt": "text/input_ids", "request_id": "rid", "max_tokens":
                 "sampling_params.max_new_tokens", "min_tokens": "sampling_params.min_new_tokens",
                 "seed": "sampling_params.sampling_seed", "logprobs": "top_logprobs_num",
                 "prompt_logprobs": "top_logprobs_num", "model": "lora_path",
                 "include_stop_str_in_output": "sampling_params.no_stop_trim"}  # fmt: skip


class SglangSamplingParams(BaseModel):
    """SGLang's ``sampling_params`` by its names (None: the served model's default, as
    SGLang's ``--sampling-defaults model``). An unknown field is a 400."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(None, ge=0)
    min_new_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    n: int | None = Field(None, ge=1)
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    logit_bias: dict[str, float] | None = None
    sampling_seed: int | None = None
    stream_interval: int | None = None  # (how SGLang batches its stream: no effect here)
    stop_regex: Any = None
    beam_width: Any = None
    custom_params: Any = None
    watermark: Any = None

    def completion_fields(self) -> dict[str, Any]:
        """The completion request's fields these set (a 400 for what cannot be done)."""
        refused = [name for name in ("beam_width", "custom_params", "watermark")
                   if getattr(self, name) is not None]  # fmt: skip
        if self.spaces_between_special_tokens is False:
            refused.append("spaces_between_special_tokens false")
        refuse([f"sampling_params.{r}" for r in refused])
        out: dict[str, Any] = {
            "max_tokens": DEFAULT_MAX_NEW_TOKENS if self.max_new_tokens is None
            else self.max_new_tokens,
        }  # fmt: skip
        renamed = {"min_new_tokens": "min_tokens", "no_stop_trim": "include_stop_str_in_output",
                   "sampling_seed": "seed"}  # fmt: skip
        for name in ("min_new_tokens", "stop", "stop_regex", "stop_token_ids", "temperature", "top_p",
                     "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                     "n", "ignore_eos", "skip_special_tokens", "no_stop_trim", "logit_bias",
                     "sampling_seed"):  # fmt: skip
            value = getattr(self, name)
            if value is not None:
                out[renamed.get(name, name)] = value
        if self.top_k is not None:
            out["top_k"] = max(0, self.top_k)  # (-1: every token; 0 here)
        grammar = {"json": self.json_schema, "regex": self.regex, "grammar": self.ebnf,
                   "structural_tag": self.structural_tag}  # fmt: skip
        given = {kind: spec for kind, spec in grammar.items() if spec}
        if given:
            out["structured_outputs"] = given  # (more than one: the completion's 400)
        return out


#: SGLang ``/generate`` options this server does not do: a 400 when set (to anything but
#: null, false or empty).
_REFUSED = ("input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
            "mm_content_hashes", "token_ids_logprob", "return_hidden_states",
            "return_routed_experts", "return_indexer_topk", "return_sampling_mask",
            "return_entropy", "custom_logit_processor", "session_params",
            "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room",
            "bootstrap_pair_key", "background", "watermark", "max_thinking_tokens")  # fmt: skip


class SglangGenerateRequest(BaseModel):
    """The body of SGLang's ``POST /generate``. Fields of SGLang's that steer only its
    own machinery (``log_metrics``, ``routing_key``, ``data_parallel_rank``, ...) are
    ignored, as is any other unknown field; those of :data:`_REFUSED` are a 400 when set."""

    model_config = ConfigDict(extra="allow")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SglangSamplingParams | list[SglangSamplingParams] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | list[str | None] | None = None
    priority: int | None = None

    def refused(self) -> list[str]:
        """The options set that this server does not do (empty: none)."""
        extra = self.model_extra or {}
        return [name for name in _REFUSED if extra.get(name) not in (None, False, [], {}, "")]

    @property
    def batched(self) -> bool:
        """Whether the prompt is a batch (the answer a list)."""
        return isinstance(self.text, list) or bool(
            self.input_ids and isinstance(self.input_ids[0], list)
        )

    def prompts(self) -> list[str] | list[list[int]]:
        """The batch's prompts (text or token ids), one per answer group."""
        if isinstance(self.text, list):
            return self.text
        if self.input_ids and isinstance(self.input_ids[0], list):
            return self.input_ids  # type: ignore[return-value]
        return []

    def parts(self) -> list[SglangGenerateRequest] | None:
        """One request per prompt when the batch's per-prompt options differ (each list a
        value per prompt; a 400 when a list's length is not the number of prompts), else
        None: one completion serves the whole request."""
        prompts = self.prompts()
        lists = {name: value for name in _PER_PROMPT
                 if isinstance(value := getattr(self, name), list)}  # fmt: skip
        if not prompts or all(all(v == value[0] for v in value) for value in lists.values()):
            return None
        for name, value in lists.items():
            if len(value) != len(prompts):
                raise HTTPError(400, f"{name}: {len(value)} values for {len(prompts)} prompts "
                                "(give one per prompt)", "BadRequestError", param=name)  # fmt: skip
        field = "text" if isinstance(self.text, list) else "input_ids"
        return [
            self.model_copy(update={
                field: [prompt], "rid": [self.rid[i]] if isinstance(self.rid, list) else None,
                **{name: value[i] for name, value in lists.items()},
            })
            for i, prompt in enumerate(prompts)
        ]  # fmt: skip

    def to_completion(self, served_model: str) -> CompletionRequest:
        """The completion of these prompts that answers this request."""
        refuse(self.refused())
        if (self.text is None) == (self.input_ids is None):
            raise HTTPError(400, "give either text or input_ids", "BadRequestError",
                            param="text")  # fmt: skip
        params = _one("sampling_params", self.sampling_params) or SglangSamplingParams()
        fields = params.completion_fields()
        logprob = _one("return_logprob", self.return_logprob)
        top = _one("top_logprobs_num", self.top_logprobs_num) or 0
        start = _one("logprob_start_len", self.logprob_start_len)
        if logprob:
            if not 0 <= top <= MAX_LOGPROBS:
                raise HTTPError(400, f"top_logprobs_num must be in [0, {MAX_LOGPROBS}]",
                                "BadRequestError", param="top_logprobs_num")  # fmt: skip
            fields["logprobs"] = top
            if start is not None and start >= 0:
                fields["prompt_logprobs"] = top
        if fields["max_tokens"] == 0:  # the prompt scored alone (a completion's echo-only)
            fields["echo"] = True
        lora = _one("lora_path", self.lora_path)
        fields.update(model=lora or served_model, stream=self.stream, return_token_ids=True,
                      prompt=self.text if self.text is not None else self.input_ids)  # fmt: skip
        if isinstance(self.rid, str):
            fields["request_id"] = self.rid
        if self.priority is not None:
            fields["priority"] = self.priority
        return completion_from(fields, _SGLANG_NAMES)


#: The options SGLang takes once or per prompt (a list, one value per prompt).
_PER_PROMPT = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num",
               "lora_path")  # fmt: skip


def _one(name: str, value: Any) -> Any:
    """A per-prompt option given once, or as a list of one value for every prompt (all
    equal: a batch whose values differ runs as :meth:`SglangGenerateRequest.parts`)."""
    if not isinstance(value, list):
        return value
    if any(v != value[0] for v in value):  # (parts() splits such a batch first)
        raise HTTPError(400, f"{name} differs between the prompts", "BadRequestError",
                        param=name)  # fmt: skip
    return value[0] if value else None


# -- answers -------------------------------------------------------------------------------
class Answers:
    """Builds a ``/generate`` request's outputs (one per choice) from the completion
    path's items."""

    def __init__(self, body: SglangGenerateRequest, p: Prepared, start: float,
                 token_text: Callable[[int], str], weight_version: str = "default") -> None:  # fmt: skip
        self.body, self.p, self.start = body, p, start
        self.token_text = token_text
        #: The served weights' version label (a generation never spans a weight update).
        self.weight_version = weight_version
        self.logprobs = bool(_one("return_logprob", body.return_logprob))
        start_len = _one("logprob_start_len", body.logprob_start_len)
        self.start_len = start_len if start_len is not None and start_len >= 0 else None
        rids = body.rid if isinstance(body.rid, list) else None
        n = p.n
        self.ids = [
            rids[i // n] if rids and i // n < len(rids) else f"{p.public_id}.{i}"
            if p.num_choices > 1 else p.public_id
            for i in range(p.num_choices)
        ]  # fmt: skip
        self.text = [""] * p.num_choices
        self.entries: list[list[Entry]] = [[] for _ in range(p.num_choices)]
        self.prompt: list[list[Entry]] = [[] for _ in range(p.num_choices)]
        self.finish: list[str | None] = [None] * p.num_choices
        self.use: list[dict] = [{}] * p.num_choices

    def add(self, index: int, delta: Delta) -> None:
        """Take one item of choice ``index``."""
        text, finish, use, entries, prompt = delta
        self.text[index] += text
        self.entries[index] += entries
        self.prompt[index] += prompt or ()
        if finish is not None:
            self.finish[index], self.use[index] = finish, use or {}

    def _triple(self, token: int, logprob: float | None) -> list:
        text = self.token_text(token) if self.body.return_text_in_logprobs else None
        return [logprob, token, text]

    def _tops(self, value: TokenLogprob | None) -> list | None:
        if value is None or not value.top:
            return None
        return [self._triple(t, lp) for t, lp in value.top]

    def output(self, index: int) -> dict[str, Any]:
        """Choice ``index`` as SGLang answers it (cumulative so far)."""
        entries, finish = self.entries[index], self.finish[index]
        ids = [token for token, _ in entries]
        use = self.use[index]
        meta: dict[str, Any] = {
            "id": self.ids[index],
            "finish_reason": self._finish_reason(finish, ids),
            "prompt_tokens": len(self.p.prompt_ids_of(index)),
            "completion_tokens": len(ids),
            "cached_tokens": (use.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "weight_version": self.weight_version,
            "e2e_latency": round(time.monotonic() - self.start, 6),
        }
        if self.logprobs:
            meta["output_token_logprobs"] = [
                self._triple(t, None if v is None else v.logprob) for t, v in entries
            ]
            meta["output_top_logprobs"] = [self._tops(v) for _, v in entries]
            if self.start_len is not None:
                prompt = self.prompt[index][self.start_len :]
                meta["input_token_logprobs"] = [
                    self._triple(t, None if v is None else v.logprob) for t, v in prompt
                ]
                meta["input_top_logprobs"] = [self._tops(v) for _, v in prompt]
        out = {"text": self.text[index], "output_ids": ids, "meta_info": meta}
        if self.body.batched or self.p.num_choices > 1:
            out["index"] = index
        return out

    @staticmethod
    def _finish_reason(finish: str | None, ids: list[int]) -> dict[str, Any] | None:
        """SGLang's ``finish_reason`` object of a choice that ended with ``finish``."""
        if finish is None:
            return None
        if finish == "length":
            return {"type": "length", "length": len(ids)}
        if finish == "stop":
            matched = stop_reason(finish)
            if matched is None and ids:  # the end-of-sequence token that ended it
                matched = ids[-1]
            return {"type": "stop", "matched": matched}
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


async def whole(answers: Answers, first: tuple[int, Delta], rest: AsyncIterator,
                metrics: GatewayMetrics) -> Any:  # fmt: skip
    """The whole answer: one output, or a list of them (a batch, or ``n`` above 1)."""
    try:
        async with aclosing(all_items(first, rest)) as items:
            async for index, delta in items:
                answers.add(index, delta)
    except (Rejected, BackendError) as exc:  # a later choice was turned away, or failed
        raise turned_away(exc, metrics) from None
    outputs = [answers.output(i) for i in range(answers.p.num_choices)]
    return outputs if answers.body.batched or len(outputs) > 1 else outputs[0]


async def streamed(answers: Answers, first: tuple[int, Delta], rest: AsyncIterator,
                   metrics: GatewayMetrics) -> AsyncIterator[bytes]:  # fmt: skip
    """The answer as server-sent events: each choice's output so far whenever it grows
    (as SGLang streams by default), then ``[DONE]``; an error after the first byte as an
    error event."""
    try:
        async with aclosing(all_items(first, rest)) as items:
            async for index, delta in items:
                answers.add(index, delta)
                if delta[0] or delta[3] or delta[1] is not None:
                    yield f"data: {json.dumps(answers.output(index))}\n\n".encode()
    except (BackendError, Rejected) as exc:
        yield failed_event(exc, metrics)
    yield DONE_EVENT


# -- a batch run as parts -----------------------------------------------------------------
Started = tuple[Answers, tuple[int, Delta], AsyncIterator]


async def whole_parts(parts: list[Started], metrics: GatewayMetrics) -> list[dict[str, Any]]:
    """The answer of a batch run as parts (:meth:`SglangGenerateRequest.parts`): every
    part's outputs in the prompts' order, indexed as one batch's. One part turned away or
    failed ends the others (their requests abort) and answers as it does."""
    tasks = [asyncio.ensure_future(whole(a, first, rest, metrics)) for a, first, rest in parts]
    try:
        answers = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    outputs = [output for answer in answers for output in answer]
    for index, output in enumerate(outputs):
        output["index"] = index
    return outputs


async def streamed_parts(parts: list[Started], metrics: GatewayMetrics) -> AsyncIterator[bytes]:
    """The events of a batch run as parts, interleaved as they come, each output's
    ``index`` that of one batch; one ``[DONE]`` at the end. A part's error event ends
    the others."""
    offsets = [sum(a.p.num_choices for a, _, _ in parts[:i]) for i in range(len(parts))]
    streams = [streamed(a, first, rest, metrics) for a, first, rest in parts]
    async with aclosing(interleave(streams)) as events:
        async for part, event in events:
            if event == DONE_EVENT:
                continue
            body = json.loads(event.removeprefix(b"data: "))
            if "index" in body:
                body["index"] += offsets[part]
            yield f"data: {json.dumps(body)}\n\n".encode()
            if "error" in body:  # one part failed: the others end too (their requests abort)
                break
    yield DONE_EVENT
