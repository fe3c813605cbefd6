"""The request record shared by traces, datasets, the Conductor, the simulator and serving."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Most alternatives a request may ask log-probabilities for, per token (as vLLM and
#: OpenAI's chat API).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model, and the ``top`` most likely tokens at
    that position as ``(token_id, logprob)``, most likely first. ``rank``: the token's
    place among all of the vocabulary (1 = the likeliest), where it was computed (prompt
    log-probabilities report it, as vLLM's do)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


#: How an engine orders its queue (vLLM's ``--scheduling-policy``): first come, first
#: served, or by each request's ``priority`` (lower first; arrival order among equals).
SCHEDULING_POLICIES = ("fcfs", "priority")

#: The kinds of :class:`StructuredOutput` (vLLM's ``structured_outputs`` fields).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")

#: The tags between which a thinking model reasons (the gateway's reasoning parsers).
REASONING_TAGS = ("<think>", "</think>")
#: :attr:`StructuredOutput.reasoning`: none; the output starts in reasoning (a start tag
#: may open it) and the constraint holds after the end tag; or a reasoning block between
#: the tags may come first.
REASONING_PLACES = ("", "first", "optional")
#: The kinds that may hold after a reasoning (:attr:`StructuredOutput.reasoning`).
AFTER_REASONING_KINDS = ("json", "json_object", "regex", "choice")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output (vLLM's structured outputs): ``kind`` one of
    :data:`STRUCTURED_KINDS`, ``spec`` its text: a JSON schema (``json``), a regular
    expression (``regex``), a JSON list of strings (``choice``), a Lark or GBNF grammar
    (``grammar``), vLLM's structural tag as JSON (``structural_tag``: ``{"structures":
    [{"begin", "schema", "end"}, ...], "triggers": [...]}``, free text in which each
    trigger starts one of its structures: the ``begin`` text, JSON of the ``schema``,
    the ``end`` text); empty for ``json_object`` (any JSON object). For JSON: ``compact``, no
    whitespace of the model's choosing (vLLM's ``disable_any_whitespace``);
    ``whitespace``, a regex for the whitespace allowed between items instead (vLLM's
    ``whitespace_pattern``; "" for the default); ``closed``, objects without an
    ``additionalProperties`` admit only their listed properties (vLLM's
    ``disable_additional_properties``). ``reasoning`` (:data:`REASONING_PLACES`): the
    constraint holds after a thinking model's reasoning (``<think>...</think>``, free
    text), as vLLM holds it under a reasoning parser. Plain data: the engine compiles it
    (:mod:`halfmoon.engine.structured`)."""

    kind: str
    spec: str = ""
    compact: bool = False
    closed: bool = False
    whitespace: str = ""
    reasoning: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                f"got {self.kind!r}"
            )
        if self.kind == "json_object" and self.spec:
            raise ValueError("a json_object structured output takes no spec")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"a {self.kind} structured output needs a spec")
        if self.reasoning not in REASONING_PLACES:
            raise ValueError(f"reasoning must be one of {REASONING_PLACES}, got {self.reasoning!r}")
        if self.reasoning and self.kind not in AFTER_REASONING_KINDS:
            raise ValueError(f"a {self.kind} structured output cannot follow a reasoning")


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI-style sampling options plus vLLM's ``ignore_eos`` / ``min_tokens`` /
    ``top_k`` (0 = off), ``min_p`` (0 = off) and extra ``stop_token_ids``. ``logprobs``: None, or return each
    generated token's log-probability with that many top alternatives (0..20).
    Penalties as OpenAI's (``presence_penalty``, ``frequency_penalty``: subtracted from
    the logits of tokens already generated, once / per occurrence) and vLLM's
    ``repetition_penalty`` (logits of tokens in the prompt or output divided by it when
    positive, multiplied when negative)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int = 0
    #: vLLM's min-p: tokens less likely than ``min_p`` times the likeliest one are never
    #: drawn (after temperature; 0 = off).
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    #: vLLM's ``prompt_logprobs``: None, or the log-probability of every prompt token
    #: after the first (with that many top alternatives, 0..20), computed in the prefill.
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: ``(token id, bias)`` pairs added to the logits before the choice (OpenAI's
    #: ``logit_bias``; -100 bans a token, +100 all but forces it).
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: vLLM's ``allowed_token_ids``: only these may be drawn (empty: any token).
    allowed_token_ids: tuple[int, ...] = ()
    #: The output held to a JSON schema, a regular expression, choices or a grammar.
    structured: StructuredOutput | None = None
    #: vLLM's ``bad_words``: words never generated (the engine bans each one's last
    #: token where the output already ends with the rest of it).
    bad_words: tuple[str, ...] = ()
    #: vLLM's request ``priority``: under the ``priority`` scheduling policy a lower value
    #: is served earlier (and preempted later); ignored under ``fcfs``.
    priority: int = 0
    #: The LoRA adapter the request runs with (a name the engines serve; None: the base
    #: model). Its blocks hash under the adapter (:func:`halfmoon.core.hashing.adapter_salt`).
    lora: str | None = None
    #: An embedding request (``/v1/embeddings``): the engine computes the prompt and
    #: answers with its last token's final hidden state (after the model's last norm, as
    #: vLLM pools a generative model by default) instead of sampling a token.
    embed: bool = False
    #: vLLM's ``thinking_token_budget``: at most this many tokens of a reasoning (counted
    #: from its start tag, in the prompt or the output) before the engine forces its end
    #: tag (:data:`REASONING_TAGS`); None: no limit.
    thinking_token_budget: int | None = None

    @property
    def has_penalties(self) -> bool:
        """Whether any repetition penalty applies (the sampler then needs the tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.lora is not None and (not isinstance(self.lora, str) or not self.lora):
            raise ValueError("lora must be a non-empty adapter name or None")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(not -100.0 <= bias <= 100.0 for _, bias in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(token < 0 for token, _ in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids >= 0")
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be non-blank strings")
        if any(token < 0 for token in self.allowed_token_ids):
            raise ValueError("allowed_token_ids must be token ids >= 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}"
            )
        if self.embed and (self.prompt_logprobs is not None or self.structured is not None):
            raise ValueError("an embedding request takes no prompt_logprobs or structured output")
        if self.thinking_token_budget is not None and self.thinking_token_budget < 0:
            raise ValueError(
                f"thinking_token_budget must be >= 0, got {self.thinking_token_budget}"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )


@dataclass(frozen=True)
class Request:
    """One inference request.

    ``block_hashes`` are the prompt's chained prefix-block hashes at ``block_size_tokens``
    tokens per block (for Mooncake traces: the trace's ``hash_ids`` at 512 tokens).
    ``prompt_token_ids`` is empty when only lengths are known (simulation of a trace).
    ``admitted`` marks a request that was admitted before and is placed again (its worker
    died mid-request): it is never rejected early, since rejecting it would lose work the
    client was promised. ``priority``: vLLM's request priority (lower first under the
    ``priority`` scheduling policy; always 0 under ``fcfs``), which the Conductor's queue
    estimates follow (:meth:`~halfmoon.conductor.state.PrefillState.queue_s`).
    ``prefill_only``: an embedding, answered by the instance that computes its prompt: it
    books no decode instance, and only its TTFT is held against the SLOs.
    """

    request_id: str
    arrival_time_s: float
    input_length: int
    output_length: int
    block_hashes: tuple[int, ...] = ()
    block_size_tokens: int = 512
    prompt_token_ids: tuple[int, ...] = field(default=(), repr=False)
    admitted: bool = False
    priority: int = 0
    prefill_only: bool = False

    def __post_init__(self) -> None:
        if self.input_length < 1:
            raise ValueError(f"input_length must be >= 1, got {self.input_length}")
        if self.output_length < 1:
            raise ValueError(f"output_length must be >= 1, got {self.output_length}")
        if self.block_hashes:
            expected = -(-self.input_length // self.block_size_tokens)
            if len(self.block_hashes) != expected:
                raise ValueError(
                    f"{len(self.block_hashes)} block hashes for {self.input_length} tokens "
                    f"at {self.block_size_tokens} tokens/block (expected {expected})"
                )

    @property
    def num_full_blocks(self) -> int:
        """Blocks of the prompt that hold ``block_size_tokens`` tokens (cacheable)."""
        return self.input_length // self.block_size_tokens
