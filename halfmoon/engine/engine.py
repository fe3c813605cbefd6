"""``LLMEngine``: requests in, tokens out, one ``step()`` at a time.

A step is: schedule (which sequences compute which tokens), run the model, sample one
token for every sequence that reached its end (or, with speculative decoding, check its
draft tokens and keep those the sampler agrees with, :mod:`halfmoon.engine.speculative`),
check stop conditions, report. The KV
of a request can leave the engine (``export_kv``) and enter another (``import_request``)
between steps: that is the prefill -> decode handoff.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import random
from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

import torch

from halfmoon.core.adapters import RuntimeAdapter, check_adapter_dir
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.hashing import adapter_salt, chain_root
from halfmoon.core.profiling import ProfilerConfig, ProfileSession
from halfmoon.core.request import REASONING_TAGS, SamplingParams, TokenLogprob
from halfmoon.core.speculative import SpecDecodeCounts
from halfmoon.engine.attention import LayerHook
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.fused import fused_decode_spec, select_fused_decode, uses_fused
from halfmoon.engine.glue import EAGER_GLUE, GlueShape, glue_specs, select_glue
from halfmoon.engine.graphs import DecodeGraphs
from halfmoon.engine.kernels import (
    KernelShape,
    compile_mode,
    decode_kernel_spec,
    select_decode_kernel,
    uses_compiled,
)
from halfmoon.engine.kv_cache import KVCache, KVLayout
from halfmoon.engine.loader import LoadedModel, load_model
from halfmoon.engine.lora import LoraAdapter, LoraModule, LoraSet
from halfmoon.engine.packages import build_missing
from halfmoon.engine.prepack import prepack_linears, prepack_lm_head
from halfmoon.engine.runner import (
    HIDDEN_LAST,
    LOGITS_ALL,
    LOGITS_LAST,
    LOGITS_NONE,
    ChunkInput,
    ModelRunner,
)
from halfmoon.engine.sampling import (
    ThinkingTags,
    chunk_prompt_logprobs,
    finish_reason,
    row_for,
    sample_with_logprobs,
    stop_ids_for,
)
from halfmoon.engine.scheduler import ScheduledChunk, Scheduler, Sequence, Status
from halfmoon.engine.seeding import PrefixReservation, reserve_prefix, seed_prefix
from halfmoon.engine.speculative import NgramProposer
from halfmoon.engine.step_profiler import StepProfiler, step_label
from halfmoon.engine.structured import Constraint, grammar_tokenizer
from halfmoon.engine.tokenizer import IncrementalDetokenizer
from halfmoon.engine.weight_update import StagedWeights, install_weights, stage_weights

#: Why a sleeping engine takes no request (:meth:`LLMEngine.sleep`).
ASLEEP = "the engine sleeps (vLLM's /sleep): no request until it wakes up"
logger = logging.getLogger(__name__)

Prompt = str | SequenceABC[int]
#: Steps in a row that may fail (see :meth:`LLMEngine.step`) before the engine counts
#: itself broken and raises: a failed batch and then each of its requests alone fail
#: in a row when several requests break their steps at once, while an engine whose every
#: step fails (a CUDA error poisons its context) must end.
MAX_FAILED_STEPS_IN_A_ROW = 8
#: A token id whose presence in a step's computed tokens fails the step (a fault to test
#: the failure path with, in tests and drills; unset in serving).
FAIL_STEP_ENV = "HALFMOON_FAIL_STEP_ON_TOKEN"


@dataclass(frozen=True)
class RequestOutput:
    """A request's progress after a step: the tokens/text generated so far and, once
    ``finished``, why (``stop``: EOS, stop id or stop string; ``length``: max_tokens or
    the context limit). ``num_cached_tokens``: prompt tokens served by the prefix cache."""

    request_id: str
    new_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    #: Log-probabilities of ``new_token_ids`` when the request asked for them.
    new_logprobs: tuple[TokenLogprob, ...] = ()
    #: With the first token of a request that asked for them (``prompt_logprobs``): the
    #: log-probabilities of its prompt tokens after the first, in order.
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    #: An embedding request's answer (``params.embed``; no tokens, finished ``stop``):
    #: the prompt's last token's final hidden state, in float32, not normalized.
    embedding: tuple[float, ...] | None = None


@dataclass(frozen=True)
class RequestFailure:
    """A request the engine dropped: why, and whether another instance may retry it.

    ``retryable``: the request itself may well succeed elsewhere (its engine became
    unreachable, or a step it was part of failed); not when the engine refused it.
    ``instance_failed``: whether the instance is to blame (an unreachable engine: the
    gateway reports it to the Conductor), or only the step (the instance goes on)."""

    request_id: str
    error: str
    retryable: bool = False
    instance_failed: bool = True


@dataclass(frozen=True)
class KVHandoff:
    """A request's state and KV leaving one engine for another.

    ``data`` holds the KV of tokens ``0..num_computed_tokens-1`` in the export layout of
    :mod:`halfmoon.engine.kv_cache` (``layout`` says which): the exporter's tensor (in host
    memory, whatever the exporter's device), or its raw bytes after a transfer
    (``export_to_bytes``); the importer moves it to its own device. ``token_ids`` are
    prompt + generated tokens, the last ones not yet computed. ``seed`` keeps seeded
    sampling identical; ``cache_salt`` keeps its blocks in its tenant's prefix cache.
    """

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_computed_tokens: int
    seed: int
    layout: KVLayout
    data: torch.Tensor | bytes | memoryview
    cache_salt: str | None = None


@dataclass(frozen=True)
class EngineStats:
    """Load snapshot (what a worker reports to the Conductor)."""

    num_waiting: int
    num_running: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_preemptions: int
    #: Prompt tokens still to compute: every token of a waiting request (a preempted one
    #: recomputes its output too), the rest of a running prompt. Prefix-cache hits of
    #: waiting requests are not known before they are scheduled, so they count.
    num_prefill_tokens: int = 0
    #: Speculative decoding so far (:class:`~halfmoon.core.speculative.SpecDecodeCounts`),
    #: or None when the engine does not speculate.
    spec_decode: SpecDecodeCounts | None = None
    #: Whether its KV pool's memory is released (:meth:`LLMEngine.sleep`, sleep level 1).
    sleeping: bool = False


def _build_compiled_side_by_side(backend: str, kernel: KernelShape, glue: GlueShape) -> None:
    """Build the missing compiled packages this engine will load (the decode kernel, its
    glue and, on the CPU, the fused decode attention) that no other process is building
    (:func:`build_missing`): workers starting together build different ones at once. A
    build that fails here is left to the loaders, which retry it and report the failure
    (a warning, or the error of ``--attention compiled``)."""
    if not uses_compiled(backend, kernel.device) or compile_mode() == "jit":
        return  # in process, each compiles its own: nothing to build
    fused = [fused_decode_spec(kernel)] if uses_fused(kernel) else []
    try:
        build_missing([decode_kernel_spec(kernel), *glue_specs(glue), *fused])
    except Exception as exc:  # noqa: BLE001 - the loaders below say what went wrong
        logger.debug("building the compiled packages side by side failed: %s", exc)


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (see docs/engine.md).

    ``loaded`` lends an already loaded model (else ``config.model`` is loaded); with
    ``config.prepack_weights`` its linear weights are packed in place for the CPU.
    ``kv_layer_hook`` receives each prompt chunk's KV layer by layer (see
    :data:`halfmoon.engine.attention.LayerHook`).
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        kv_layer_hook: LayerHook | None = None,
        loaded: LoadedModel | None = None,
    ):
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise HalfmoonError("--device cuda requested but torch sees no CUDA device")
        self.config = config
        loaded = loaded or load_model(config.model, config.dtype, config.device, config.seed)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.max_model_len = min(
            config.max_model_len or loaded.config.max_context_tokens,
            loaded.config.max_context_tokens,
        )
        self.kv_layout = KVLayout(
            num_layers=loaded.config.num_layers,
            block_size=config.block_size,
            num_kv_heads=loaded.config.num_kv_heads,
            head_dim=loaded.config.head_dim,
            dtype=config.dtype,
        )
        self.kv_cache = KVCache.from_budget(self.kv_layout, config.kv_cache_mb, config.device)
        self.block_manager = BlockManager(
            self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            config.chunk_tokens, config.scheduling_policy,
        )  # fmt: skip
        if config.prepack_weights:
            prepack_linears(loaded.model)
        if config.prepack_lm_head:
            prepack_lm_head(loaded.model)
        mc, pool = loaded.config, self.kv_cache.pool
        glue_shape = GlueShape(
            mc.hidden_size, mc.intermediate_size, mc.num_heads, mc.num_kv_heads,
            mc.head_dim, mc.rms_norm_eps, pool.dtype, pool.device.type,
        )  # fmt: skip
        kernel_shape = KernelShape(
            mc.num_kv_heads, mc.num_queries_per_kv, mc.head_dim, config.block_size,
            pool.dtype, pool.device.type,
        )  # fmt: skip
        _build_compiled_side_by_side(config.attention, kernel_shape, glue_shape)
        kernel, self.attention_backend = select_decode_kernel(config.attention, kernel_shape)
        loaded.model.glue = EAGER_GLUE
        fused = None
        if kernel is not None:  # the elementwise glue compiled alongside the kernel
            loaded.model.glue = select_glue(config.attention, glue_shape)
            self.attention_backend += f", {loaded.model.glue.description} glue"
            if loaded.model.glue is not EAGER_GLUE:
                fused = select_fused_decode(kernel_shape)
            if fused is not None:
                self.attention_backend += ", fused decode attention"
        #: Adapters being unloaded, dropped when no request uses them (:meth:`unload_lora`).
        self._retiring: set[str] = set()
        #: The LoRA adapters a request may name (:mod:`halfmoon.engine.lora`).
        self.loras = LoraSet.load(
            [LoraModule(name, path) for name, path in config.lora_modules],
            loaded.config, pool.dtype, pool.device,
        )  # fmt: skip
        self.runner = ModelRunner(
            loaded.model, self.kv_cache, kv_layer_hook, kernel, fused, self.loras
        )
        for name, info in self.loras.describe().items():
            logger.info("LoRA adapter %r: rank %d on %s, %.1f MiB (%s)", name, info["rank"],
                        ", ".join(info["modules"]), info["mib"], info["path"])  # fmt: skip
        #: Makes the decode step's CUDA graphs (None: none), again after a sleep (the
        #: graphs hold the pool's old address).
        self._new_graphs: Callable[[], DecodeGraphs] | None = None
        if config.cuda_graphs:
            blocks = -(-self.max_model_len // config.block_size)

            def new_graphs(model=loaded.model, kernel=kernel) -> DecodeGraphs:
                return DecodeGraphs(model, self.kv_cache, config.max_num_seqs, blocks, kernel)

            self._new_graphs = new_graphs
            self.runner.decode_graphs = new_graphs()
            self.attention_backend += ", CUDA graphs for decode"
        #: Speculative decoding's drafts and their counts (None: the engine does not speculate).
        self.proposer: NgramProposer | None = None
        if config.speculative is not None:
            self.proposer = NgramProposer(config.speculative, self.max_model_len)
            self.scheduler.proposer = self.proposer.propose
        self._rng = random.Random(config.seed)
        self._thinking_tags: ThinkingTags | None = None
        self._seqs: dict[str, Sequence] = {}
        self._failures: list[RequestFailure] = []
        self._failed_steps_in_a_row = 0
        #: Requests of a failed step, each computed alone until a step of it succeeds.
        self._suspects: set[str] = set()
        #: Embedding requests whose prompt the running step finished, with their vectors.
        self._pooled: list[tuple[Sequence, torch.Tensor]] = []
        #: torch's profiler over the steps, between :meth:`start_profile` and
        #: :meth:`stop_profile` (vLLM's ``/start_profile``, ``/stop_profile``).
        self.profiler = StepProfiler()
        fail_on = os.environ.get(FAIL_STEP_ENV, "").strip()
        self._fail_on_token = int(fail_on) if fail_on.lstrip("-").isdigit() else None

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block across all layers (K and V)."""
        return self.kv_layout.bytes_per_block

    def stats(self) -> EngineStats:
        """Queue lengths, block usage and preemptions so far."""
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_blocks=self.block_manager.num_blocks,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_cached_blocks=self.block_manager.num_cached_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefill_tokens=self.scheduler.num_prefill_tokens(),
            spec_decode=None if self.proposer is None else self.proposer.stats.counts(),
            sleeping=self.sleeping,
        )

    # -- requests ---------------------------------------------------------------------------
    def _new_sequence(
        self, request_id: str, token_ids: list[int], num_prompt: int, params: SamplingParams,
        seed: int | None, keep_kv: bool,
    ) -> Sequence:  # fmt: skip
        if self.sleeping:
            raise HalfmoonError(ASLEEP)
        if request_id in self._seqs:
            raise HalfmoonError(f"request id {request_id!r} is already in use")
        if params.lora is not None:
            self.loras.get(params.lora)  # an unknown adapter fails here
            if params.lora in self._retiring:
                raise HalfmoonError(f"LoRA adapter {params.lora!r} is being unloaded")
        if num_prompt < 1:
            raise HalfmoonError(f"request {request_id!r} has an empty prompt")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise HalfmoonError(f"request {request_id!r}: token ids must lie in [0, {vocab})")
        if num_prompt >= self.max_model_len:
            raise HalfmoonError(
                f"request {request_id!r}: prompt of {num_prompt} tokens does not fit the "
                f"context of {self.max_model_len} tokens (at least one must be generated)"
            )
        needed = min(num_prompt + params.max_tokens, self.max_model_len)
        if self.block_manager.blocks_for(needed) > self.block_manager.num_blocks:
            raise HalfmoonError(
                f"request {request_id!r} needs {needed} tokens of KV, more than the whole "
                f"pool ({self.block_manager.num_blocks} blocks of {self.config.block_size}); "
                "raise --kv-cache-mb or lower max_tokens"
            )
        stop_ids = stop_ids_for(params, self.eos_token_ids)
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, token_ids[:num_prompt])
            for token in token_ids[num_prompt:]:
                detok.add(token)
        seq = Sequence(request_id, list(token_ids), num_prompt, params, seed,
                       stop_ids, detok, keep_kv)  # fmt: skip
        seq.text = detok.text if detok else ""
        seq.constraint = self.new_constraint(params)
        seq.bad_words = self.bad_words_ids(params)
        if seq.constraint is not None:  # a request continued here: its tokens so far
            seq.constraint.consume(token_ids[num_prompt:])
        return seq

    def bad_words_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """``params.bad_words`` as token sequences (:meth:`Tokenizer.bad_word_ids`)."""
        if not params.bad_words:
            return ()
        if self.tokenizer is None:
            raise HalfmoonError("bad_words need the model's tokenizer")
        try:
            return self.tokenizer.bad_word_ids(params.bad_words)
        except ValueError as exc:
            raise HalfmoonError(str(exc)) from None

    def thinking_tags(self, params: SamplingParams) -> ThinkingTags | None:
        """The reasoning's tags as token ids when ``params`` set a thinking budget (the
        sampler forces the end tag once it is spent: :func:`sampling.thinking_forced`),
        else None; tokenized as vLLM does (no special tokens added)."""
        if params.thinking_token_budget is None:
            return None
        if self._thinking_tags is None:
            if self.tokenizer is None:
                raise HalfmoonError("thinking_token_budget needs the model's tokenizer")
            start, end = (tuple(self.tokenizer.encode(tag, add_special_tokens=False))
                          for tag in REASONING_TAGS)  # fmt: skip
            self._thinking_tags = (start, end)
        return self._thinking_tags

    def new_constraint(self, params: SamplingParams) -> Constraint | None:
        """A fresh :class:`Constraint` for ``params.structured`` (None without one);
        HalfmoonError when it does not compile or the model has no tokenizer."""
        if params.structured is None:
            return None
        if self.tokenizer is None:
            raise HalfmoonError("structured outputs need the model's tokenizer")
        vocab = self.model_config.vocab_size
        grammar_tok = grammar_tokenizer(self.tokenizer, vocab, self.eos_token_ids)
        return Constraint(params.structured, grammar_tok)

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        keep_kv: bool = False,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request (text is tokenized with the model's tokenizer).

        ``keep_kv``: when it finishes, keep its blocks until :meth:`export_kv` takes them
        (the prefill side of a handoff runs with ``max_tokens=1`` and this flag).
        ``cache_salt``: its prefix-cache hits come only from requests with the same salt
        (and LoRA adapter: ``params.lora`` marks it, :func:`~halfmoon.core.hashing.adapter_salt`).
        """
        params = params or SamplingParams()
        token_ids = self._tokenize(prompt)
        cache_salt = self._salt(cache_salt, params)
        seq = self._new_sequence(request_id, token_ids, len(token_ids), params, None, keep_kv)
        seq.cache_salt = cache_salt
        self._seqs[request_id] = seq
        self.scheduler.add(seq)

    def _salt(self, cache_salt: str | None, params: SamplingParams) -> str | None:
        """The request's salt marked with its adapter (:meth:`LoraSet.key`); a bad salt
        fails here, not in a later step."""
        try:
            cache_salt = adapter_salt(cache_salt, self.loras.key(params.lora))
            chain_root(cache_salt)
        except ValueError as exc:
            raise HalfmoonError(str(exc)) from None
        return cache_salt

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise HalfmoonError("this model directory has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def abort_request(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is unknown or already gone."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        self._suspects.discard(request_id)
        self.scheduler.remove(seq)
        self._retire()
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget the pool's cached prefixes (vLLM's ``reset_prefix_cache``); False while
        a request holds blocks (nothing is forgotten then)."""
        return self.block_manager.reset_prefix_cache()

    # -- sleeping (vLLM's sleep mode, level 1) --------------------------------------------------
    @property
    def sleeping(self) -> bool:
        """Whether the KV pool's memory is released (:meth:`sleep`)."""
        return self.kv_cache.released

    def sleep(self) -> int:
        """vLLM's sleep, level 1: forget every cached prefix and release the KV pool's
        memory (the weights stay where they are); the bytes released (0 when asleep
        already). HalfmoonError while requests are in the engine; until :meth:`wake_up`
        no request is taken and no block read or written."""
        if self.sleeping:
            return 0
        if self._seqs:
            raise HalfmoonError(
                f"{len(self._seqs)} requests are in the engine: it sleeps once none is"
            )
        if not self.block_manager.reset_prefix_cache():  # (no request holds a block)
            raise HalfmoonError("the engine's prefix cache could not be reset")
        self.runner.decode_graphs = None  # (captured over the pool's address)
        freed = self.kv_cache.release()
        logger.info("asleep: %.1f MiB of KV pool released", freed / 2**20)
        return freed

    def wake_up(self) -> None:
        """The KV pool's memory again (empty: nothing cached) after :meth:`sleep`."""
        if not self.sleeping:
            return
        self.kv_cache.restore()
        if self._new_graphs is not None:
            self.runner.decode_graphs = self._new_graphs()
        logger.info("awake: KV pool of %.1f MiB allocated again",
                    self.kv_cache.pool.nbytes / 2**20)  # fmt: skip

    # -- profiling (vLLM's /start_profile, /stop_profile) ----------------------------------------
    def start_profile(
        self, config: ProfilerConfig, session: ProfileSession, name: str = "engine"
    ) -> None:
        """Record the coming steps with torch's profiler (:mod:`halfmoon.engine.step_profiler`),
        ``name`` in the trace's file name (nothing while a session is on)."""
        self.profiler.start(config, session, name)

    def stop_profile(self) -> list[str]:
        """End the session (if one is on): the traces written since the last stop."""
        return self.profiler.stop()

    # -- weights replaced while serving --------------------------------------------------------
    def stage_weights(self, model_path: str) -> StagedWeights:
        """Read new weights for this engine's model (:mod:`halfmoon.engine.weight_update`):
        nothing served changes until :meth:`commit_weights`; HalfmoonError when they do
        not fit (another architecture, missing or misshapen tensors)."""
        pool = self.kv_cache.pool
        return stage_weights(self.model_config, model_path, pool.dtype, pool.device)

    def commit_weights(self, staged: StagedWeights) -> None:
        """Install ``staged`` and forget every cached prefix (KV of the old weights);
        HalfmoonError while requests are in the engine (their KV is of the old weights:
        pause, let them finish or abort them, then commit)."""
        if self._seqs:
            raise HalfmoonError(
                f"{len(self._seqs)} requests are in the engine: new weights are installed "
                "once none is"
            )
        count = install_weights(self.runner.model, staged)
        if not self.block_manager.reset_prefix_cache():  # (no request holds a block)
            raise HalfmoonError("the engine's prefix cache could not be reset")
        logger.debug("weights updated from %s (%d tensors); cached prefixes forgotten",
                    staged.path, count)  # fmt: skip

    # -- LoRA adapters loaded while serving ----------------------------------------------------
    def load_lora(self, adapter: RuntimeAdapter) -> None:
        """Serve ``adapter`` from now on (vLLM's ``/v1/load_lora_adapter``): its PEFT
        directory read and checked as at start (HalfmoonError naming what is wrong); a
        name already served is refused, unless it is this very load (the same tag: a
        worker that got it twice, at registration and by broadcast)."""
        if adapter.name in self._retiring:
            using = sum(seq.params.lora == adapter.name for seq in self._seqs.values())
            raise HalfmoonError(
                f"LoRA adapter {adapter.name!r} is still being unloaded ({using} requests use "
                "it): load it again once they have finished"
            )
        if adapter.name in self.loras:
            if self.loras.tag(adapter.name) == adapter.tag and adapter.tag:
                return
            raise HalfmoonError(f"LoRA adapter {adapter.name!r} is already loaded")
        check_adapter_dir(adapter.module)
        pool = self.kv_cache.pool
        loaded = LoraAdapter.load(adapter.module, self.model_config, pool.dtype, pool.device)
        self.loras.add(loaded, adapter.tag)
        logger.info("LoRA adapter %r loaded while serving: rank %d on %s (%s)", adapter.name,
                    loaded.rank, ", ".join(loaded.modules), adapter.path)  # fmt: skip

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (HalfmoonError when it is not served): new
        requests naming it are refused at once; it is dropped when the last request
        using it has left (those running finish with it)."""
        self.loras.get(name)
        self._retiring.add(name)
        self._retire()

    def _retire(self) -> None:
        """Drop the adapters being unloaded that no request uses any more."""
        if not self._retiring:
            return
        used = {seq.params.lora for seq in self._seqs.values()}
        for name in self._retiring - used:
            self.loras.remove(name)
            logger.info("LoRA adapter %r unloaded", name)
        self._retiring &= used

    def num_prompt_tokens(self, request_id: str) -> int | None:
        """The prompt length of a live request (None if unknown)."""
        seq = self._seqs.get(request_id)
        return None if seq is None else seq.num_prompt_tokens

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_unfinished()

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for every request that got a token.

        A failure while a step computes (the model, the sampler) does not end the engine.
        A failed step of several requests makes each a *suspect*, computed alone (one
        suspect per step, the others waiting meanwhile) until a step of it succeeds: the
        requests batched with a culprit lose one step, not their work. A failed step of
        one request fails it: it leaves the engine (its blocks free, none of what the step
        computed cached) and :meth:`take_failures` reports it as retryable (the fault may
        have been passing: memory, a neighbour). A failure after sampling (detokenizing,
        a grammar) fails its request alone, not retryable. Only
        :data:`MAX_FAILED_STEPS_IN_A_ROW` failed steps in a row raise (the engine itself
        is broken)."""
        self._retire()
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        if not self.profiler.active:
            return self._step(plan.chunks)
        with self.profiler.step(step_label(plan.chunks) if self.profiler.recording else ""):
            return self._step(plan.chunks)

    def _step(self, chunks: tuple[ScheduledChunk, ...]) -> list[RequestOutput]:
        """:meth:`step`'s work on the scheduled ``chunks``."""
        if self._suspects:
            alone = [c for c in chunks if c.seq.request_id in self._suspects]
            chunks = tuple(alone[:1]) or chunks
        try:
            # (Prompt log-probabilities a failed step took stay: each chunk computes only
            # those its sequence does not have yet.)
            sampled = self._compute(chunks)
        except Exception as exc:
            self._step_failed(chunks, exc)
            return []
        self._failed_steps_in_a_row = 0
        accepted = {id(seq): len(tokens) - 1 for seq, tokens in sampled}
        for chunk in chunks:
            seq = chunk.seq
            self._suspects.discard(seq.request_id)
            # Accepted drafts' KV is the KV of the tokens they become (rejected ones'
            # is overwritten later): computed, and cacheable once a block is full.
            n = accepted.get(id(seq), 0) if chunk.draft else 0
            seq.num_computed_tokens = chunk.end + n
            token_ids = seq.token_ids + list(chunk.draft[:n]) if n else seq.token_ids
            self.block_manager.commit(seq.request_id, token_ids, seq.num_computed_tokens)
        outputs = [self._embedded(seq, vector) for seq, vector in self._pooled]
        self._pooled = []
        for seq, tokens in sampled:
            try:
                outputs.append(self._append(seq, tokens))
            except Exception as exc:
                logger.exception("request %s failed after its step", seq.request_id)
                error = f"request failed in the engine: {type(exc).__name__}: {exc}"
                self._fail(seq, error, retryable=False)
        return outputs

    def _step_failed(self, chunks: SequenceABC[ScheduledChunk], exc: Exception) -> None:
        """A step raised ``exc``: its requests become suspects, or its one request fails;
        the engine raises once steps failed :data:`MAX_FAILED_STEPS_IN_A_ROW` times in a
        row."""
        self._failed_steps_in_a_row += 1
        if self._failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise HalfmoonError(
                f"the engine failed {self._failed_steps_in_a_row} steps in a row (last: {exc!r})"
            ) from exc
        if len(chunks) > 1:
            logger.warning("an engine step of %d requests failed (%r): computing each alone",
                           len(chunks), exc)  # fmt: skip
            self._suspects.update(c.seq.request_id for c in chunks)
            return
        seq = chunks[0].seq
        logger.error("request %s failed its engine step", seq.request_id, exc_info=exc)
        self._fail(seq, f"engine step failed: {type(exc).__name__}: {exc}", retryable=True)

    def _compute(
        self, chunks: SequenceABC[ScheduledChunk]
    ) -> list[tuple[Sequence, list[tuple[int, TokenLogprob | None]]]]:
        """Run the model over the step's chunks and sample the tokens of each that is due:
        ``(sequence, [(token, its log-probability), ...])``, one token, or with draft
        tokens the accepted drafts and the token after them
        (:mod:`halfmoon.engine.speculative`). Changes no scheduling state."""
        self._pooled = []
        if self._fail_on_token is not None:
            for c in chunks:
                self.check_fault(c.seq.token_ids[c.start : c.end])
        inputs: list[ChunkInput] = []
        wanted = [self._logits_wanted(c) for c in chunks]
        for c, want in zip(chunks, wanted, strict=True):
            table = self.block_manager.block_table(c.seq.request_id)
            lora = c.seq.params.lora
            if c.draft:
                # The token and its drafts as decode rows of one sequence, row j over
                # the context up to its own position: the batched decode attention
                # reads the pool in place, where one chunk of them would be gathered.
                tokens = (c.seq.token_ids[c.start], *c.draft)
                inputs += [ChunkInput(c.seq.request_id, (t,), c.start + j, table, lora=lora)
                           for j, t in enumerate(tokens)]  # fmt: skip
                continue
            inputs.append(ChunkInput(
                request_id=c.seq.request_id, token_ids=c.seq.token_ids[c.start : c.end],
                start=c.start, block_table=table, logits=want,
                hook=c.start < c.seq.num_prompt_tokens, lora=lora,
            ))  # fmt: skip
        rows = self.runner.execute(inputs)
        logits: list[torch.Tensor | None] = []
        at = 0
        for c, want in zip(chunks, wanted, strict=True):
            if c.draft:
                n = len(c.draft) + 1
                logits.append(torch.cat(rows[at : at + n]))
                at += n
                continue
            lg = rows[at]
            at += 1
            if want == HIDDEN_LAST:
                assert lg is not None
                self._pooled.append((c.seq, lg[0]))
                lg = None
            elif want == LOGITS_ALL:
                self._take_prompt_logprobs(c.seq, c.start, lg)
                lg = lg[-1:] if c.samples else None
            logits.append(lg)
        sampling = [(c, lg) for c, lg in zip(chunks, logits, strict=True) if lg is not None]
        if not sampling:
            return []
        rows = []
        for c, _ in sampling:
            seq = c.seq
            masks: list[torch.Tensor | None] = [None] * (len(c.draft) + 1)
            if seq.constraint is not None:
                masks = seq.constraint.allowed_along(c.draft)
            # Row j samples the position after draft j-1, as decoding would once drafts
            # 0..j-1 were its tokens: the same seed index, penalties, bans and grammar.
            for j, mask in enumerate(masks):
                token_ids = seq.token_ids + list(c.draft[:j]) if j else seq.token_ids
                rows.append(row_for(
                    seq.params, seq.seed, seq.num_output_tokens + j, tuple(seq.stop_token_ids),
                    token_ids, mask, seq.bad_words, self.thinking_tags(seq.params),
                ))  # fmt: skip
        batch = torch.cat([lg for _, lg in sampling])
        num_top = [c.seq.params.logprobs for c, _ in sampling for _ in range(len(c.draft) + 1)]
        tokens, logprobs = sample_with_logprobs(batch, rows, num_top)
        out = []
        row = 0
        for c, _ in sampling:
            taken = [(tokens[row], logprobs[row])]
            for j, draft in enumerate(c.draft):  # accepted while the draw equals the draft
                if tokens[row + j] != draft:
                    break
                taken.append((tokens[row + j + 1], logprobs[row + j + 1]))
            out.append((c.seq, taken))
            row += len(c.draft) + 1
        if self.proposer is not None:
            for (c, _), (_, taken) in zip(sampling, out, strict=True):
                self.proposer.observe(c.seq, len(c.draft), len(taken) - 1)
        return out

    def _fail(self, seq: Sequence, error: str, retryable: bool) -> None:
        """``seq`` leaves the engine failed: its blocks go back (the ones it computed
        since its last commit were never cached), :meth:`take_failures` reports it."""
        self._suspects.discard(seq.request_id)
        if self._seqs.get(seq.request_id) is seq:
            del self._seqs[seq.request_id]
        self.scheduler.remove(seq)  # (a finished keep_kv request's blocks too)
        self._failures.append(RequestFailure(
            seq.request_id, error, retryable=retryable, instance_failed=False,
        ))  # fmt: skip

    def take_failures(self) -> list[RequestFailure]:
        """Requests that failed in a step since the last call (each gone from the engine)."""
        failures, self._failures = self._failures, []
        return failures

    def check_fault(self, token_ids: SequenceABC[int]) -> None:
        """Raise the drill's fault when ``token_ids``, about to be computed, hold
        :data:`FAIL_STEP_ENV`'s token (a pipeline stage's chunks ask too)."""
        if self._fail_on_token is not None and self._fail_on_token in token_ids:
            raise HalfmoonError(f"token {self._fail_on_token} computed ({FAIL_STEP_ENV})")

    @contextlib.contextmanager
    def faults_suspended(self) -> Iterator[None]:
        """No step fails on :data:`FAIL_STEP_ENV`'s token inside (the engine measuring
        itself: its random prompts may hold the token)."""
        token, self._fail_on_token = self._fail_on_token, None
        try:
            yield
        finally:
            self._fail_on_token = token

    @contextlib.contextmanager
    def speculation_suspended(self) -> Iterator[None]:
        """No draft tokens inside: one token a step, as without speculative decoding (the
        engine measuring its own steps, which the Conductor's cost model counts so)."""
        proposer, self.scheduler.proposer = self.scheduler.proposer, None
        try:
            yield
        finally:
            self.scheduler.proposer = proposer

    @staticmethod
    def _logits_wanted(chunk: ScheduledChunk) -> str:
        """Every row of a chunk whose prompt log-probabilities are due, else the last
        row of one that samples."""
        seq = chunk.seq
        if seq.wants_prompt_logprobs and chunk.start < seq.num_prompt_tokens - 1:
            return LOGITS_ALL
        if not chunk.samples:
            return LOGITS_NONE
        return HIDDEN_LAST if seq.params.embed else LOGITS_LAST

    @staticmethod
    def _take_prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor) -> None:
        """Add the prompt log-probabilities a chunk's rows from position ``start`` give."""
        seq.prompt_logprobs += chunk_prompt_logprobs(
            lambda lo, hi: logits[lo:hi], seq.token_ids, seq.num_prompt_tokens, start,
            start + logits.shape[0], len(seq.prompt_logprobs), seq.params.prompt_logprobs or 0,
        )  # fmt: skip

    def _append(
        self, seq: Sequence, tokens: SequenceABC[tuple[int, TokenLogprob | None]]
    ) -> RequestOutput:
        """Add a step's sampled ``tokens`` (one, or accepted drafts and the next) to
        ``seq`` in order, up to the one that finishes it."""
        first_output = seq.num_output_tokens == 0
        new: list[int] = []
        new_logprobs: list[TokenLogprob] = []
        reason = None
        for token, logprob in tokens:
            seq.token_ids.append(token)
            new.append(token)
            if logprob is not None:
                new_logprobs.append(logprob)
            if seq.detokenizer is not None:
                delta = seq.detokenizer.add(token)
                seq.text = seq.detokenizer.text
                reason = self._check_stop_strings(seq, len(delta))
            reason = reason or finish_reason(
                token, seq.params, seq.stop_token_ids, seq.num_output_tokens, seq.num_tokens,
                self.max_model_len,
            )  # fmt: skip
            if seq.constraint is not None:  # it ends once its grammar admits nothing more
                reason = seq.constraint.finish_after(token) or reason
            if reason is not None:
                break
        if reason is not None:
            # (Drafts computed past a finishing token are not its tokens.)
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            self.scheduler.finish(seq, reason)
            if not seq.keep_kv:
                self._seqs.pop(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tuple(new),
            token_ids=tuple(seq.output_token_ids),
            text=seq.text,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            new_logprobs=tuple(new_logprobs),
            prompt_logprobs=(
                tuple(seq.prompt_logprobs)
                if seq.params.prompt_logprobs is not None and first_output
                else None
            ),
        )

    def _embedded(self, seq: Sequence, vector: torch.Tensor) -> RequestOutput:
        """An embedding request's prompt is computed: it finishes with its vector."""
        self.scheduler.finish(seq, "stop")
        if not seq.keep_kv:
            self._seqs.pop(seq.request_id)
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=(), token_ids=(), text="", finished=True,
            finish_reason="stop", num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            embedding=tuple(vector.float().cpu().tolist()),
        )  # fmt: skip

    @staticmethod
    def _check_stop_strings(seq: Sequence, delta_len: int) -> str | None:
        stops = seq.params.stop
        if not stops or delta_len == 0 or seq.num_output_tokens < seq.params.min_tokens:
            return None
        # Only a stop string overlapping the new text can be new.
        window_start = max(0, len(seq.text) - delta_len - max(len(s) for s in stops) + 1)
        hits = [i for s in stops if (i := seq.text.find(s, window_start)) >= 0]
        if not hits:
            return None
        seq.text = seq.text[: min(hits)]
        return "stop"

    def generate(
        self,
        prompts: SequenceABC[Prompt],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; final outputs in prompt order."""
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [f"generate-{self._rng.getrandbits(48):012x}-{i}" for i in range(len(prompts))]
        try:
            for request_id, prompt, params in zip(ids, prompts, params_list, strict=True):
                self.add_request(request_id, prompt, params)
        except (HalfmoonError, ValueError):
            for request_id in ids:  # leave no half-submitted batch behind
                self.abort_request(request_id)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
            if self._failures:
                mine = [f for f in self._failures if f.request_id in ids]
                if mine:
                    self._failures = [f for f in self._failures if f.request_id not in ids]
                    for request_id in ids:
                        self.abort_request(request_id)
                    raise HalfmoonError(mine[0].error)
        return [final[i] for i in ids]

    # -- KV handoff ------------------------------------------------------------------------
    def export_kv(self, request_id: str, release: bool = True, with_data: bool = True) -> KVHandoff:
        """Copy a request's computed KV out (one contiguous host tensor, export layout).

        With ``release`` a finished ``keep_kv`` request gives its blocks back; a running
        request is left running either way. Without ``with_data`` nothing is copied and
        ``data`` is empty: the request's state alone, for a KV that already left by a
        stream (a prefill worker's handoff).
        """
        seq = self._seqs.get(request_id)
        if seq is None or not self.block_manager.has_request(request_id):
            raise HalfmoonError(f"request {request_id!r} holds no KV in this engine")
        num_blocks = self.block_manager.blocks_for(seq.num_computed_tokens)
        table = self.block_manager.block_table(request_id)[:num_blocks]
        handoff = KVHandoff(
            request_id=request_id,
            token_ids=tuple(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens,
            num_computed_tokens=seq.num_computed_tokens,
            seed=seq.seed,
            layout=self.kv_layout,
            data=self.kv_cache.export_blocks(table) if with_data else b"",
            cache_salt=seq.cache_salt,
        )
        if release and seq.status is Status.FINISHED:
            self.block_manager.free(request_id)
            self._seqs.pop(request_id)
        return handoff

    def import_request(
        self, handoff: KVHandoff, params: SamplingParams, request_id: str | None = None
    ) -> None:
        """Continue a request from another engine's :class:`KVHandoff`; it joins the
        running batch at once (no prefill). ``params.max_tokens`` counts the tokens it
        already generated."""
        self.kv_layout.check_compatible(handoff.layout)
        request_id = request_id or handoff.request_id
        token_ids = list(handoff.token_ids)
        if not 0 < handoff.num_computed_tokens < len(token_ids):
            raise HalfmoonError("a handoff must leave at least one token to compute")
        if len(token_ids) - handoff.num_prompt_tokens >= params.max_tokens:
            raise HalfmoonError(
                f"request {request_id!r} already generated max_tokens={params.max_tokens} tokens"
            )
        # The prompt's log-probabilities came with the first token (and a preempted
        # request here must not recompute its prompt for them).
        params = dataclasses.replace(params, prompt_logprobs=None)
        seq = self._new_sequence(request_id, token_ids, handoff.num_prompt_tokens, params,
                                 handoff.seed, False)  # fmt: skip
        seq.cache_salt = self._salt(handoff.cache_salt, params)
        table = self.block_manager.allocate(request_id, len(token_ids), seq.cache_salt)
        if table is None:
            raise HalfmoonError(f"no free KV blocks to import request {request_id!r}")
        num_blocks = self.block_manager.blocks_for(handoff.num_computed_tokens)
        try:
            self.kv_cache.import_blocks(table[:num_blocks], handoff.data)
        except HalfmoonError:
            self.block_manager.free(request_id)
            raise
        seq.num_computed_tokens = handoff.num_computed_tokens
        self.block_manager.commit(request_id, token_ids, seq.num_computed_tokens)
        self._seqs[request_id] = seq
        self.scheduler.add_running(seq)

    def seed_cached_blocks(
        self,
        token_ids: SequenceABC[int],
        first_block: int,
        payloads: SequenceABC[bytes | bytearray | memoryview],
        cache_salt: str | None = None,
    ) -> int:
        """Put ``payloads`` (one-block export buffers of the whole model, host bytes) into
        the pool as *cached free* blocks ``first_block..`` of ``token_ids``'s chain under
        ``cache_salt``, so the next request with that prefix reuses them; returns how many
        (0 when the pool has no room, or when the pool's own cached prefix is no longer
        ``first_block`` blocks long: nothing is guessed).

        The pool's cached prefix (blocks ``0..first_block-1``) is held while the new blocks
        are taken, so taking them cannot evict it.
        """
        return seed_prefix(
            self.block_manager, self.kv_cache, token_ids, first_block, payloads, cache_salt
        )

    def reserve_cached_blocks(
        self, token_ids: SequenceABC[int], first_block: int, count: int,
        cache_salt: str | None = None,
    ) -> PrefixReservation | None:  # fmt: skip
        """Hold ``count`` pool blocks for blocks ``first_block..`` of ``token_ids``'s chain
        (and its cached prefix with them), to be written as their KV arrives and kept as
        cached blocks once it has (:class:`~halfmoon.engine.seeding.PrefixReservation`);
        None when the pool has no room or its cached prefix is no longer ``first_block``
        blocks long."""
        return reserve_prefix(
            self.block_manager, self.kv_cache, token_ids, first_block, count, cache_salt
        )

    def check_integrity(self) -> None:
        """Assert the block pool is consistent with the live requests."""
        self.block_manager.check_integrity()
        holders = {s.request_id for s in self.scheduler.running}
        holders |= {r for r, s in self._seqs.items() if s.status is Status.FINISHED}
        for request_id in list(holders):
            assert self.block_manager.has_request(request_id), f"{request_id} lost its blocks"
        for seq in self.scheduler.waiting:
            assert not self.block_manager.has_request(seq.request_id), "waiting seq holds blocks"
