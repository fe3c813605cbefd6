"""A request's preparation, before any backend sees it: validation against the server's
limits, the prompt tokenized (chat template, truncation, ``echo``), sampling parameters
(defaults, penalties, ``logit_bias``, bad words, structured outputs, tool modes) and its
prefix-cache salt, into a :class:`~halfmoon.serve.gateway.responses.Prepared`.
:class:`RequestPreparation` is a base of :class:`~halfmoon.serve.gateway.gateway.Gateway`."""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.hashing import adapter_salt
from halfmoon.core.ids import IdGenerator
from halfmoon.core.request import SamplingParams, StructuredOutput
from halfmoon.engine.structured import check, grammar_tokenizer
from halfmoon.engine.tokenizer import Tokenizer
from halfmoon.serve.gateway.backend import Backend
from halfmoon.serve.gateway.config import GatewayConfig
from halfmoon.serve.gateway.openai_api import (
    STRUCTURED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    FieldError,
)
from halfmoon.serve.gateway.reasoning import ReasoningMode, held_after_reasoning
from halfmoon.serve.gateway.request_ids import client_request_id
from halfmoon.serve.gateway.responses import HTTPError, Prepared
from halfmoon.serve.gateway.served_models import ServedModels
from halfmoon.serve.gateway.tenancy import effective_salt
from halfmoon.serve.gateway.tools import ToolMode

#: Prompt tokens read to see whether the template opened the reasoning (``<think>``).
_PROMPT_TAIL = 8


class RequestPreparation(ServedModels):
    """Prepares requests for ``backend`` with ``tokenizer`` under ``config``."""

    def __init__(self, backend: Backend, tokenizer: Tokenizer, config: GatewayConfig) -> None:
        super().__init__(backend, config)
        self.tokenizer = tokenizer
        # Request ids are unique across gateways and restarts (a random prefix per
        # gateway); the OpenAI responses show them as cmpl-<id> / chatcmpl-<id>.
        self._ids = IdGenerator(secrets.token_hex(4))

    def prepare(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        api_key: str | None = None,
        id_header: str | None = None,
    ) -> Prepared:
        """Validate the model and lengths, tokenize, build sampling parameters; the
        caller's ``api_key`` salts its cache when the server salts by key; the request's
        ``X-Request-Id`` (``id_header``) or ``request_id`` names its response."""
        cfg = self.config
        self.check_model(body.model)
        client_id = client_request_id(id_header, body.request_id)
        unsupported = body.unsupported()
        if unsupported:
            raise HTTPError(
                400,
                f"not supported by this server: {', '.join(unsupported)}",
                "BadRequestError",
                param=unsupported[0].split()[0],
            )
        self.check_priority(body.priority)
        chat = isinstance(body, ChatCompletionRequest)
        if chat:
            messages = [m.for_template() for m in body.messages]
            prompt_ids = self.truncated(self.chat_prompt(messages, body.template_options()),
                                         body.truncate_prompt_tokens)  # fmt: skip
            max_tokens = body.output_limit(0) or self.default_output(len(prompt_ids))
        else:
            batch = [self.truncated(self._completion_prompt(prompt, body.add_special_tokens),
                                     body.truncate_prompt_tokens)
                     for prompt in body.prompts()]  # fmt: skip
            prompt_ids = max(batch, key=len)  # the limits below hold for every prompt
            max_tokens = body.max_tokens or 1  # 0 (with echo): one is computed, none sent
            if "max_tokens" not in body.model_fields_set:  # (OpenAI's default of 16)
                max_tokens = min(max_tokens, cfg.max_tokens_limit)
        if max_tokens > cfg.max_tokens_limit:
            raise HTTPError(
                400,
                f"max_tokens {max_tokens} exceeds this server's limit of {cfg.max_tokens_limit}",
                "BadRequestError",
                param="max_completion_tokens"
                if chat and body.max_completion_tokens is not None
                else "max_tokens",
            )
        if len(prompt_ids) + max_tokens > cfg.max_model_len:
            raise HTTPError(
                400,
                f"this model's maximum context length is {cfg.max_model_len} tokens; the "
                f"request has {len(prompt_ids)} prompt tokens and asks for {max_tokens} "
                "output tokens",
                "BadRequestError",
                param="messages" if chat else "prompt",
            )
        tool_mode, tool_schema = self._tool_mode(body) if chat else (None, None)
        params = self._sampling_params(body, max_tokens, tool_schema)
        reasoning = None
        if chat:
            params, reasoning = self._reasoning(body, prompt_ids, params)
        include_usage = bool(body.stream_options and body.stream_options.include_usage) or (
            cfg.force_include_usage
        )
        continuous = bool(
            body.stream and body.stream_options and body.stream_options.include_usage
            and body.stream_options.continuous_usage_stats
        )  # fmt: skip
        if chat:  # (echo with tool calls: they would not parse)
            prompts = [(prompt_ids, "" if tool_mode else body.echo_text())]
        else:
            prompts = [(ids, self._echo_text(body, text, ids))
                       for text, ids in zip(body.prompts(), batch, strict=True)]  # fmt: skip
        (first_ids, first_echo), *more = prompts
        return Prepared(
            self.new_id(), first_ids, params, body.stop_strings(), include_usage, chat,
            continuous, first_echo, body.n, body.include_stop_str_in_output,
            cache_salt=self.salt(body.cache_salt, api_key, params.lora),
            more=tuple(more),
            echo_logprobs=not chat and body.echo and body.logprobs is not None,
            echo_only=not chat and body.max_tokens == 0,
            show_prompt_logprobs=body.prompt_logprobs is not None,
            tool_mode=tool_mode,
            reasoning=reasoning,
            stop_regex=self._stop_regex(body),
            stream=bool(body.stream),
            # (a tool-call format whose marker is a special token keeps them, as vLLM's
            # parser asks)
            skip_special_tokens=body.skip_special_tokens
            and not (tool_mode is not None and tool_mode.keeps_special_tokens),
            return_token_ids=bool(body.return_token_ids),
            tokens_as_ids=bool(body.return_tokens_as_token_ids) or cfg.tokens_as_ids,
            client_id=client_id,
        )  # fmt: skip

    def new_id(self) -> str:
        """A new request id (unique across gateways and restarts)."""
        return self._ids.next()

    def default_output(self, num_prompt_tokens: int) -> int:
        """A chat (or generate) request's output limit when it sets none, as in vLLM: the rest of the
        served context, within the server's limit and the model's ``max_new_tokens`` (at
        least 1: a prompt that fills the context is refused after)."""
        cfg = self.config
        limits = [cfg.max_model_len - num_prompt_tokens, cfg.max_tokens_limit]
        if "max_new_tokens" in cfg.sampling_defaults:
            limits.append(int(cfg.sampling_defaults["max_new_tokens"]))
        return max(1, min(limits))

    def chat_prompt(
        self, messages: list[dict[str, Any]], options: Mapping[str, Any] | None = None
    ) -> list[int]:
        """``messages`` through the chat template (with ``options``: the request's
        :meth:`ChatTemplateOptions.template_options`, under the server's default template
        variables), tokenized; a 400 when the model has no template or the template
        refuses them (``raise_exception``)."""
        options = dict(options or {})
        defaults = self.config.default_template_kwargs
        if defaults:  # (the request's own win, as on vLLM)
            options["template_kwargs"] = {**defaults, **(options.get("template_kwargs") or {})}
        try:
            return self.tokenizer.apply_chat_template(messages, **options)
        except HalfmoonError as exc:
            raise HTTPError(400, str(exc), "BadRequestError") from None

    @staticmethod
    def _stop_regex(body: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
        """The request's ``stop_regex`` patterns, checked (a 400 names what is wrong)."""
        try:
            return body.stop_patterns()
        except FieldError as exc:
            raise HTTPError(400, str(exc), "BadRequestError", param=exc.param) from None

    def _reasoning(
        self, body: ChatCompletionRequest, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[SamplingParams, ReasoningMode | None]:
        """How the answer's reasoning is read (None: no ``--reasoning-parser``, or a
        grammar holds the whole output), and ``params`` with any structured output held
        after the reasoning (:func:`reasoning.held_after_reasoning`)."""
        parser = self.config.reasoning_parser
        if parser is None or not body.separate_reasoning:
            return params, None
        tail = self.tokenizer.decode(prompt_ids[-_PROMPT_TAIL:], skip_special_tokens=False)
        mode = ReasoningMode.for_prompt(parser, tail, body.include_reasoning)
        return (params, None) if mode is None else held_after_reasoning(mode, params)

    def _tool_mode(self, body: ChatCompletionRequest) -> tuple[ToolMode | None, dict | None]:
        """:meth:`ChatCompletionRequest.tool_mode` under this server's tool-call parser
        (a 400 naming the field when malformed)."""
        try:
            return body.tool_mode(self.config.tool_call_parser)
        except FieldError as exc:
            raise HTTPError(400, str(exc), "BadRequestError", param=exc.param) from None

    def _sampling_params(
        self, body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
        tool_schema: dict | None = None,
    ) -> SamplingParams:  # fmt: skip
        """The request's sampling options, checked (a 400 names what is wrong); an option
        the request leaves out takes the model's default where it has one; ``tool_schema``:
        what forced tool calls hold the output to."""
        defaults, given = self.config.sampling_defaults, body.model_fields_set

        def option(name: str) -> Any:
            return defaults[name] if name in defaults and name not in given else getattr(body, name)

        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=option("temperature"),
                top_p=option("top_p"),
                seed=body.seed,
                stop=body.stop_strings(),
                ignore_eos=body.ignore_eos,
                min_tokens=body.min_tokens,
                top_k=option("top_k"),
                min_p=option("min_p"),
                logprobs=body.num_logprobs(),
                prompt_logprobs=body.num_prompt_logprobs(),
                stop_token_ids=tuple(
                    self.checked_token_ids(body.stop_token_ids or (), "stop_token_ids")
                ),
                logit_bias=self._logit_bias(list((body.logit_bias or {}).items())),
                allowed_token_ids=tuple(
                    self.checked_token_ids(body.allowed_token_ids or (), "allowed_token_ids")
                ),
                presence_penalty=option("presence_penalty"),
                frequency_penalty=option("frequency_penalty"),
                repetition_penalty=option("repetition_penalty"),
                structured=self._structured(body, tool_schema),
                bad_words=self._bad_words(body.bad_words or ()),
                priority=body.priority,
                lora=self.lora_of(body.model),
                thinking_token_budget=self.thinking_budget(body.thinking_token_budget),
            )
        except ValueError as exc:
            raise HTTPError(400, str(exc), "BadRequestError") from None

    def thinking_budget(self, budget: int | None) -> int | None:
        """A request's ``thinking_token_budget`` (None: no limit, -1 too), a 400 without a
        reasoning parser: the server then knows no reasoning (vLLM refuses it without
        its reasoning config)."""
        if budget is None or budget == -1:
            return None
        if self.config.reasoning_parser is None:
            raise HTTPError(400, "thinking_token_budget needs a reasoning model's parser "
                            "(halfmoon serve --reasoning-parser)", "BadRequestError",
                            param="thinking_token_budget")  # fmt: skip
        return budget

    def check_priority(self, priority: int) -> None:
        """A 400 naming ``priority`` unless the engines schedule by it (or it is 0), or
        when it does not fit in 32 bits."""
        if priority and self.config.scheduling_policy != "priority":
            raise HTTPError(400, "priority other than 0 needs the priority scheduling "
                            "policy (halfmoon serve --scheduling-policy priority); this "
                            "server serves first come, first served", "BadRequestError",
                            param="priority")  # fmt: skip
        if not -(2**31) <= priority < 2**31:
            raise HTTPError(400, "priority must fit in 32 bits", "BadRequestError",
                            param="priority")  # fmt: skip

    def _bad_words(self, words: Sequence[str]) -> tuple[str, ...]:
        """``bad_words``, each checked to be some token (a 400 otherwise)."""
        try:
            self.tokenizer.bad_word_ids(words)
        except ValueError as exc:
            raise HTTPError(400, str(exc), "BadRequestError", param="bad_words") from None
        return tuple(words)

    def _structured(
        self, body: CompletionRequest | ChatCompletionRequest, tool_schema: dict | None
    ) -> StructuredOutput | None:
        """The request's structured output, or the schema of its forced tool calls (both:
        a 400), compiled here once so that a bad schema, regex or grammar is a 400 naming
        its field, not a failure on a worker."""
        try:
            structured = body.structured_output()
            if tool_schema is not None:
                if structured is not None:
                    raise FieldError("tool_choice forces tool calls: give no other "
                                     "structured output", "tool_choice")  # fmt: skip
                # No whitespace of the model's choosing: programs read the arguments, and a
                # small model held to flexible JSON can wander in whitespace until max_tokens.
                structured = StructuredOutput("json", json.dumps(tool_schema), compact=True)
            if structured is not None:
                tok = self.tokenizer
                eos = [] if tok.eos_token_id is None else [tok.eos_token_id]
                check(structured, grammar_tokenizer(tok, tok.vocab_size, eos))
        except (ValueError, HalfmoonError) as exc:
            fields = [f for f in STRUCTURED_FIELDS if getattr(body, f, None) is not None]
            param = getattr(exc, "param", None) or (fields[0] if fields else "tool_choice")
            raise HTTPError(400, str(exc), "BadRequestError", param=param) from None
        return structured

    def _echo_text(self, body: CompletionRequest, prompt: str | list[int], ids: list[int]) -> str:
        """The text of ``prompt`` (its token ``ids``, maybe truncated) a completion with
        ``echo`` sends first ("" otherwise)."""
        if not body.echo:
            return ""
        if isinstance(prompt, str) and body.truncate_prompt_tokens is None:
            return prompt
        return self.tokenizer.decode(ids)

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last ``keep`` prompt tokens (-1: as many
        as the context holds with one token of output); None keeps them all."""
        if keep is None:
            return ids
        limit = self.config.max_model_len - 1
        if keep > limit:
            raise HTTPError(400, f"truncate_prompt_tokens {keep} exceeds this model's context "
                            f"of {self.config.max_model_len} tokens (at most {limit})",
                            "BadRequestError", param="truncate_prompt_tokens")  # fmt: skip
        keep = limit if keep == -1 else keep
        return ids[-keep:] if keep else ids[:0]

    def _completion_prompt(self, prompt: str | list[int], special: bool = True) -> list[int]:
        """One prompt of a completion as token ids (token ids checked; text with the
        tokenizer's special tokens, e.g. BOS, unless ``special`` is False)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=special)
        return self.checked_token_ids(prompt, "prompt token ids")

    def checked_token_ids(self, ids: Sequence[Any], what: str) -> list[int]:
        """``ids`` if they are all token ids of this vocabulary, else a 400 naming ``what``."""
        vocab = self.tokenizer.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in ids):
            raise HTTPError(400, f"{what} must be integers in [0, {vocab})", "BadRequestError",
                            param=what.split()[0])  # fmt: skip
        return list(ids)

    def _logit_bias(self, pairs: list[tuple[str, float]]) -> tuple[tuple[int, float], ...]:
        """OpenAI's ``{"token id": bias}`` as checked ``(id, bias)`` pairs, or a 400."""
        ids = []
        for key, _ in pairs:
            if not key.strip().isdigit():
                raise HTTPError(400, f"logit_bias key {key!r} is not a token id",
                                "BadRequestError", param="logit_bias")  # fmt: skip
            ids.append(int(key))
        self.checked_token_ids(ids, "logit_bias keys")
        return tuple((token, float(bias)) for token, (_, bias) in zip(ids, pairs, strict=True))

    def salt(self, cache_salt: str | None, api_key: str | None, lora: str | None) -> str | None:
        """The salt the request's blocks hash under: its own, its tenant's (API key) and
        its LoRA adapter's (:func:`~halfmoon.core.hashing.adapter_salt`); a 400 for a salt
        no request may send."""
        tenant = api_key if self.config.cache_salt_from_api_key else None
        try:
            return adapter_salt(effective_salt(cache_salt, tenant), self.adapter_key(lora))
        except ValueError as exc:
            raise HTTPError(400, str(exc), "BadRequestError", param="cache_salt") from None
