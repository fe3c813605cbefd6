"""The engine's connector: everything a serving role does with an engine, in host bytes.

A worker process (``halfmoon.serve.worker``) holds one :class:`EngineConnector` and
nothing else of the engine: no block manager, no KV pool, no tensor. Every method is about
requests, tokens and *bytes*, so a second engine (vLLM, through its own KV connector) can
sit behind the same interface. :class:`LocalConnector` is the implementation over this
package's :class:`~halfmoon.engine.engine.LLMEngine`.

Threads
    One thread, the worker's loop (the *engine thread*), calls every method. The two hooks
    (:meth:`EngineConnector.set_prompt_kv_hook`, :meth:`EngineConnector.set_cache_listener`)
    are called back on that thread, inside :meth:`~EngineConnector.step` (or a pipeline
    stage's :meth:`~StageConnector.run_chunk`): they must be quick (the forward pass
    waits) and must not call back into the connector. So is the demote hook
    (:meth:`EngineConnector.set_demote_hook`). :meth:`~EngineConnector.read_cached_block`
    is the exception: any thread may call it, and so may a prefix reservation's
    ``write`` (:meth:`EngineConnector.reserve_prefix`).

Who frees what
    - A request's blocks belong to the engine. ``add_request(keep_kv=True)`` keeps them
      after its first token until :meth:`~EngineConnector.take_handoff` (or
      :meth:`~EngineConnector.abort_request`) gives them back.
    - The views a prompt-KV hook receives point into the engine's pool (zero copy on a CPU)
      or are host copies (on a GPU); they stay valid and unchanged until the request's
      blocks are given back. The caller must not write into them; a caller that needs the
      bytes longer copies them before it gives the blocks back.
    - Bytes handed *to* the connector (:meth:`~EngineConnector.seed_prefix`,
      :meth:`~EngineConnector.import_request`, a stage's ``load_prefix``/``run_chunk``) are
      copied before the method returns: the caller frees them when it likes.
    - :meth:`~EngineConnector.block_bytes` returns a new host copy the caller owns.

The bytes of a block are the engine's export layout ``[L, 2, n, B, H_kv, D]``
(:class:`~halfmoon.engine.kv_cache.KVLayout`): what the block store holds and what a KV
stream carries, layer by layer (a layer's K blocks, then its V blocks).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

from halfmoon.core.adapters import RuntimeAdapter
from halfmoon.core.errors import HalfmoonError, Unsupported
from halfmoon.core.events import CacheEvent
from halfmoon.core.profiling import ProfilerConfig, ProfileSession
from halfmoon.core.request import SamplingParams, TokenLogprob
from halfmoon.costmodel import CostProfile
from halfmoon.engine.attention import LayerKV
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.config import EngineConfig, ModelConfig
from halfmoon.engine.engine import (
    ASLEEP,
    EngineStats,
    KVHandoff,
    LLMEngine,
    RequestFailure,
    RequestOutput,
)
from halfmoon.engine.kv_cache import KVCache, KVLayout
from halfmoon.engine.kvcodec import KVCodec, compiled_or_eager
from halfmoon.engine.profiler import cached_profile
from halfmoon.engine.sampling import (
    chunk_prompt_logprobs,
    finish_reason,
    row_for,
    sample_with_logprobs,
    stop_ids_for,
)
from halfmoon.engine.seeding import PrefixReservation
from halfmoon.engine.stage import LayerSlice as LayerSlice  # a stage's layers, re-exported
from halfmoon.engine.stage import StageExecutor
from halfmoon.engine.weight_update import StagedWeights

#: ``hook(request_id, layer, keys, values)``: layer ``layer``'s K and V of the request's
#: whole prompt (one host ``memoryview`` per block), called once per layer after the
#: prompt's last chunk wrote it. ``layer`` is the model's global layer index. A step
#: that failed and is computed again hands over its layers again (same bytes): a hook
#: skips those it has.
PromptKVHook = Callable[[str, int, list[memoryview], list[memoryview]], None]
#: Receives the engine pool's cache events (a block hash became reusable or went away).
CacheListener = Callable[[CacheEvent], None]
#: ``hook(block_hash, parent_hash, position, payload)``: a cached block is leaving the
#: pool (its memory is about to hold new KV); ``payload()``, called during the hook if at
#: all, makes a host copy of its bytes in the export layout, the hook's to keep (a hook
#: that already has the block skips the copy). On the engine thread, inside ``step``.
DemoteHook = Callable[[int, int, int, Callable[[], memoryview]], None]


@dataclass(frozen=True)
class HandoffState:
    """A request's state at a prefill -> decode handoff (its KV travels separately):
    prompt + generated ``token_ids`` (the last not yet computed), how many are computed,
    the sampling seed and the tenant's ``cache_salt``."""

    request_id: str
    token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_computed_tokens: int
    seed: int
    cache_salt: str | None = None


def model_kv_layout(model_dir: str | Path, block_size: int, dtype: str) -> KVLayout:
    """The export layout of the model at ``model_dir`` (its ``config.json``), for an
    engine that does not load the model in this process."""
    import json

    config = ModelConfig.from_hf(json.loads((Path(model_dir) / "config.json").read_text()))
    return KVLayout(num_layers=config.num_layers, block_size=block_size,
                    num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=dtype)  # fmt: skip


def wire_codec(mode: str, layout: KVLayout, directions: Sequence[str]) -> KVCodec:
    """The codec of ``--kv-compression MODE`` for KV of ``layout``, compiled for
    ``directions`` (``encode`` on a prefill worker, ``decode`` on a decode worker) when it
    builds, else eager (:mod:`halfmoon.engine.kvcodec`). It turns host bytes into host
    bytes, so the serving side handles it like the KV views the connector hands out."""
    return compiled_or_eager(KVCodec.make(mode, layout), directions)


class StageConnector(ABC):
    """One layer slice of the model run over prompt chunks: a chunked-pipeline (CPP)
    stage. Hidden states cross stage boundaries as host bytes (:attr:`row_bytes` per
    token). Called on the engine thread only."""

    layers: LayerSlice

    @property
    @abstractmethod
    def row_bytes(self) -> int:
        """Bytes of one token's hidden state."""

    @abstractmethod
    def match_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading prompt blocks this stage's pool holds (no side effects)."""

    @abstractmethod
    def start(
        self, request_id: str, token_ids: Sequence[int], max_cached_tokens: int,
        cache_salt: str | None = None, prompt_logprobs: int | None = None,
        lora: str | None = None,
    ) -> int:  # fmt: skip
        """Take blocks for the prompt reusing at most ``max_cached_tokens``; returns the
        prefix tokens reused. Raises HalfmoonError when the pool is too small or ``lora``
        (the request's LoRA adapter) is not served.
        ``prompt_logprobs`` (last stage; the group then starts at token 0): compute the
        prompt's log-probabilities with this many alternatives, for :meth:`take_prompt_logprobs`."""

    @abstractmethod
    def load_prefix(self, request_id: str, payloads: Sequence[bytes | bytearray | memoryview],
                    first_block: int, token_ids: Sequence[int]) -> None:  # fmt: skip
        """Write whole-model block payloads (the store's bytes) into the request's blocks
        ``first_block..``, keep this stage's layers, and offer them to the stage cache."""

    @abstractmethod
    def run_chunk(
        self, request_id: str, token_ids: Sequence[int], start: int, end: int,
        hidden_in: memoryview | None, pad_rows: int,
    ) -> memoryview | None:  # fmt: skip
        """Run the slice on prompt tokens ``start..end-1`` (``hidden_in``: the previous
        stage's host bytes, every stage but the first) and offer the computed blocks to
        the stage cache. Returns the output hidden states as host bytes padded to
        ``pad_rows`` rows for the next stage; None on the last stage, which keeps the
        final row for :meth:`sample_first`."""

    @abstractmethod
    def sample_first(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams
    ) -> tuple[int, TokenLogprob | None, int, str | None]:
        """Last stage, after the prompt's last chunk: ``(token, logprob or None, seed,
        finish)`` of the first token; ``finish`` is ``stop``/``length`` when the request
        ends with it (the same rule as the engine's)."""

    @abstractmethod
    def take_prompt_logprobs(self, request_id: str) -> tuple[TokenLogprob, ...] | None:
        """Last stage, after the prompt's last chunk: the log-probabilities of prompt
        tokens 1.. (None when :meth:`start` asked for none)."""

    @abstractmethod
    def release(self, request_id: str) -> None:
        """Give the request's blocks back (committed ones stay cached)."""


class EngineConnector(ABC):
    """What a serving role needs from an engine (see the module docstring for threads and
    ownership). Request methods mirror :class:`~halfmoon.engine.engine.LLMEngine`'s."""

    #: Whether a request's ``num_cached_tokens`` is known only on its last output (an
    #: engine in another process that reports it with the request's usage), not its first.
    cached_tokens_at_finish: bool = False

    # -- shape ---------------------------------------------------------------------------------
    @property
    @abstractmethod
    def layout(self) -> KVLayout:
        """The KV layout (layers, block size, heads, dtype) of every byte exchanged."""

    @property
    @abstractmethod
    def config(self) -> EngineConfig:
        """The engine's configuration (block size, prefix caching, seed, ...)."""

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Longest prompt + output, in tokens."""

    @property
    @abstractmethod
    def hidden_bytes_per_token(self) -> int:
        """Bytes of one token's hidden state (what a CPP stage boundary carries)."""

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one KV block across all layers (K and V)."""
        return self.layout.bytes_per_block

    # -- requests ------------------------------------------------------------------------------
    @abstractmethod
    def add_request(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams, *,
        keep_kv: bool = False, cache_salt: str | None = None,
    ) -> None:  # fmt: skip
        """Queue a request; with ``keep_kv`` its blocks outlive it until
        :meth:`take_handoff`."""

    @abstractmethod
    def abort_request(self, request_id: str) -> bool:
        """Drop a request and give its blocks back; False if unknown."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """One scheduling step; hooks are called from inside it."""

    @abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether a request waits or runs."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Queue lengths and block usage."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the block pool is consistent (tests and debug runs)."""

    def close(self) -> None:
        """Release what the engine holds outside this process's memory (threads, servers);
        nothing for this package's engine."""
        return None

    def take_failures(self) -> list[RequestFailure]:
        """Requests that failed inside the engine since the last call (an engine in
        another process can lose one; a step that fails fails the requests it computed);
        each is gone from the engine."""
        return []

    def reset_prefix_cache(self) -> bool:
        """Forget the pool's cached prefixes (vLLM's ``/reset_prefix_cache``); False while
        requests hold blocks; HalfmoonError naming why it cannot at all. Cache listeners
        hear the evictions."""
        raise HalfmoonError(f"{type(self).__name__} cannot reset its prefix cache")

    @property
    def sleeping(self) -> bool:
        """Whether the engine sleeps (:meth:`sleep`)."""
        return False

    def sleep(self) -> int:
        """vLLM's sleep, level 1: forget every cached prefix and release the KV pool's
        memory; the bytes released. HalfmoonError while requests are in the engine;
        :class:`~halfmoon.core.errors.Unsupported` where the engine has no sleep mode."""
        raise self._no_sleep_mode()

    def wake_up(self) -> None:
        """The KV pool's memory again after :meth:`sleep` (nothing when awake)."""
        raise self._no_sleep_mode()

    def start_profile(self, config: ProfilerConfig, session: ProfileSession, name: str) -> None:
        """vLLM's ``/start_profile``: record the engine's coming steps with torch's profiler
        into ``config``'s directory, the trace named after ``name`` (nothing while a
        session is on); :class:`~halfmoon.core.errors.Unsupported` where it cannot."""
        raise Unsupported(f"{type(self).__name__} has no profiler")

    def stop_profile(self) -> list[str]:
        """End the session (if one is on): the traces written since the last stop."""
        raise Unsupported(f"{type(self).__name__} has no profiler")

    def _no_sleep_mode(self) -> Unsupported:
        return Unsupported(f"{type(self).__name__} has no sleep mode (--engine halfmoon has)")

    def stage_weights(self, model_path: str) -> object:
        """Read new weights for the served model (SGLang's ``/update_weights_from_disk``)
        beside the served ones, for :meth:`commit_weights`; nothing served changes yet.
        HalfmoonError naming why it cannot (another architecture, unreadable weights)."""
        raise HalfmoonError(f"{type(self).__name__} cannot update its weights while serving")

    def commit_weights(self, staged: object) -> None:
        """Install weights :meth:`stage_weights` read and forget every cached prefix (KV
        of the old weights); HalfmoonError while requests are in the engine."""
        raise HalfmoonError(f"{type(self).__name__} cannot update its weights while serving")

    def load_lora(self, adapter: RuntimeAdapter) -> None:
        """Serve LoRA adapter ``adapter`` from now on (``/v1/load_lora_adapter``);
        HalfmoonError naming why it cannot."""
        raise HalfmoonError(f"{type(self).__name__} cannot load LoRA adapters while serving")

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` once the requests using it have left
        (``/v1/unload_lora_adapter``); HalfmoonError when it is not served."""
        raise HalfmoonError(f"{type(self).__name__} cannot unload LoRA adapters while serving")

    # -- KV out --------------------------------------------------------------------------------
    @abstractmethod
    def set_prompt_kv_hook(self, hook: PromptKVHook | None) -> None:
        """Receive every request's prompt KV layer by layer (see :data:`PromptKVHook`)."""

    @abstractmethod
    def set_cache_listener(self, listener: CacheListener | None) -> None:
        """Receive the pool's cache events (tier ``dram``)."""

    def set_demote_hook(self, hook: DemoteHook | None) -> None:
        """Receive every cached block the pool evicts, with its bytes (see
        :data:`DemoteHook`): a store can then keep blocks only once they leave the pool."""
        raise HalfmoonError(f"{type(self).__name__} cannot report the blocks its pool evicts")

    def read_cached_block(self, block_hash: int) -> tuple[int, int, memoryview] | None:
        """``(parent_hash, position, host copy)`` of a block the pool holds cached, or
        None. The one method any thread may call (a peer's pull of a block that lives
        only in the pool); the block is not reused while it is copied."""
        return None

    @abstractmethod
    def block_bytes(self, request_id: str, index: int) -> memoryview:
        """A host copy of the request's block ``index`` (all layers, export layout)."""

    @abstractmethod
    def take_handoff(self, request_id: str) -> HandoffState:
        """A finished ``keep_kv`` request's state; its blocks go back to the pool (its
        full blocks stay cached)."""

    # -- KV in ---------------------------------------------------------------------------------
    @abstractmethod
    def cached_prefix_blocks(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        """Leading blocks of ``token_ids`` the pool holds (no side effects)."""

    @abstractmethod
    def seed_prefix(
        self, token_ids: Sequence[int], first_block: int,
        payloads: Sequence[bytes | bytearray | memoryview], cache_salt: str | None,
    ) -> int:  # fmt: skip
        """Make blocks ``first_block..first_block+len(payloads)-1`` of ``token_ids`` cached
        in the pool (free but matchable, so the next request with this prefix reuses
        them); returns how many were added (0 when the pool has no room or its cached
        prefix is no longer ``first_block`` blocks)."""

    def reserve_prefix(
        self, token_ids: Sequence[int], first_block: int, count: int, cache_salt: str | None
    ) -> PrefixReservation | None:
        """Hold ``count`` pool blocks for blocks ``first_block..`` of ``token_ids``, to be
        written (from any thread) as their bytes arrive and kept as cached blocks by the
        reservation's ``finish`` (see :mod:`halfmoon.engine.seeding`); None when the
        pool has no room, its cached prefix is no longer ``first_block`` blocks, or the
        engine cannot take blocks that way (the caller then uses :meth:`seed_prefix`)."""
        return None

    @abstractmethod
    def import_request(
        self, state: HandoffState, params: SamplingParams, kv: bytes | bytearray | memoryview
    ) -> None:
        """Continue a handed-off request: ``kv`` holds its computed tokens' blocks in the
        export layout; it joins the running batch at once."""

    @abstractmethod
    def cost_profile(self, model: str, cache_dir: Path) -> CostProfile:
        """This engine's measured cost profile (the Conductor's estimates in real seconds
        here), measured once per engine shape and then read from ``cache_dir``."""

    # -- pipeline stages -----------------------------------------------------------------------
    @abstractmethod
    def pipeline_stage(self, num_stages: int, stage: int) -> StageConnector:
        """Stage ``stage`` of a ``num_stages``-stage split of this model (cached per
        split); its prompt KV goes to the hook set by :meth:`set_prompt_kv_hook`."""


def _forward_prompt_kv(
    hook: PromptKVHook | None, num_prompt: int | None, rid: str, layer: int, kv: LayerKV,
    blocks: BlockManager, kv_cache: KVCache,
) -> None:  # fmt: skip
    """The attention hook of an engine or a stage: once the chunk that completes the
    prompt wrote ``layer``, hand the prompt's blocks of that layer to ``hook`` as host views."""
    if hook is None or num_prompt is None or kv.end_token < num_prompt:
        return
    table = blocks.block_table(rid)[: blocks.blocks_for(num_prompt)]
    keys, values = kv_cache.layer_bytes(layer, table)
    hook(rid, layer, keys, values)


class _LocalStage(StageConnector):
    """:class:`StageConnector` over a :class:`~halfmoon.engine.stage.StageExecutor`."""

    def __init__(self, owner: LocalConnector, layers: LayerSlice) -> None:
        engine = owner.engine
        self.owner = owner
        self.layers = layers
        self.executor = StageExecutor(
            engine.runner.model, engine.kv_layout, layers, engine.kv_cache.num_blocks,
            hook=self._on_layer, enable_prefix_caching=engine.config.enable_prefix_caching,
            loras=engine.loras,
        )  # fmt: skip
        self._last_rows: dict[str, object] = {}
        self._lora: dict[str, str] = {}
        self._prompt_len: dict[str, int] = {}
        #: request -> (alternatives wanted, entries so far) for prompt log-probabilities.
        self._prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = {}
        self._rng = random.Random(engine.config.seed)

    @property
    def row_bytes(self) -> int:
        return self.executor.hidden_size * self.executor.dtype.itemsize

    def _on_layer(self, rid: str, layer: int, block_ids: list[int], kv: LayerKV) -> None:
        _forward_prompt_kv(self.owner.prompt_kv_hook, self._prompt_len.get(rid), rid, layer, kv,
                           self.executor.blocks, self.executor.kv_cache)  # fmt: skip

    def match_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        return self.executor.match_blocks(token_ids, cache_salt)

    def start(
        self, request_id: str, token_ids: Sequence[int], max_cached_tokens: int,
        cache_salt: str | None = None, prompt_logprobs: int | None = None,
        lora: str | None = None,
    ) -> int:  # fmt: skip
        if prompt_logprobs is not None:
            max_cached_tokens = 0
        if lora is not None:
            self.owner.engine.loras.get(lora)  # an unknown adapter fails before any block
        cached = self.executor.start(request_id, token_ids, max_cached_tokens, cache_salt)
        if lora is not None:
            self._lora[request_id] = lora
        self._prompt_len[request_id] = len(token_ids)
        if prompt_logprobs is not None and self.layers.is_last:
            self._prompt_logprobs[request_id] = (prompt_logprobs, [])
        return cached

    def load_prefix(self, request_id: str, payloads: Sequence[bytes | bytearray | memoryview],
                    first_block: int, token_ids: Sequence[int]) -> None:  # fmt: skip
        self.executor.load_prefix(request_id, payloads, first_block=first_block)
        num_tokens = (first_block + len(payloads)) * self.executor.block_size
        self.executor.commit(request_id, token_ids, num_tokens)

    def run_chunk(
        self, request_id: str, token_ids: Sequence[int], start: int, end: int,
        hidden_in: memoryview | None, pad_rows: int,
    ) -> memoryview | None:  # fmt: skip
        self.owner.engine.check_fault(token_ids[start:end])
        profiler = self.owner.engine.profiler  # (a stage's chunk is a step of its trace)
        with profiler.step(self._label(end - start)) if profiler.active else nullcontext():
            out = self.executor.run(request_id, token_ids[start:end], start, hidden_in,
                                    lora=self._lora.get(request_id))  # fmt: skip
        self.executor.commit(request_id, token_ids, end)  # later prompts reuse this slice
        if self.layers.is_last:
            self._last_rows[request_id] = out[-1:]
            wanted = self._prompt_logprobs.get(request_id)
            if wanted is not None:  # the LM head for the rows that predict prompt tokens only
                k, entries = wanted
                entries += chunk_prompt_logprobs(
                    lambda lo, hi: self.executor.logits(out[lo:hi]), token_ids, len(token_ids),
                    start, end, len(entries), k,
                )  # fmt: skip
            return None
        return self.executor.hidden_bytes(out, pad_rows)

    def _label(self, num_tokens: int) -> str:
        """A chunk's range name in a profiler trace: ``stage[layers 0-14, prefill 256]``."""
        return f"stage[layers {self.layers.first}-{self.layers.last - 1}, prefill {num_tokens}]"

    def sample_first(
        self, request_id: str, prompt: Sequence[int], params: SamplingParams
    ) -> tuple[int, TokenLogprob | None, int, str | None]:
        rows = self._last_rows.pop(request_id, None)
        if rows is None:
            raise HalfmoonError(f"request {request_id!r} has no final hidden state here")
        engine = self.owner.engine
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        stop_ids = stop_ids_for(params, engine.eos_token_ids)
        constraint = engine.new_constraint(params)
        mask = constraint.allowed() if constraint is not None else None
        row = row_for(params, seed, 0, tuple(sorted(stop_ids)), list(prompt), mask,
                      engine.bad_words_ids(params), engine.thinking_tags(params))  # fmt: skip
        (token,), (entry,) = sample_with_logprobs(
            self.executor.logits(rows), [row], [params.logprobs]
        )
        finish = finish_reason(token, params, stop_ids, 1, len(prompt) + 1, engine.max_model_len)
        if constraint is not None:
            finish = constraint.finish_after(token) or finish
        return token, entry, seed, finish

    def take_prompt_logprobs(self, request_id: str) -> tuple[TokenLogprob, ...] | None:
        wanted = self._prompt_logprobs.pop(request_id, None)
        return None if wanted is None else tuple(wanted[1])

    def release(self, request_id: str) -> None:
        self._lora.pop(request_id, None)
        self._last_rows.pop(request_id, None)
        self._prompt_len.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self.executor.release(request_id)


class LocalConnector(EngineConnector):
    """The connector of this package's :class:`LLMEngine` (built with ``config``, or
    lent an engine already built)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.prompt_kv_hook: PromptKVHook | None = None
        self._stages: dict[tuple[int, int], _LocalStage] = {}

    @classmethod
    def create(cls, config: EngineConfig) -> LocalConnector:
        """Load the model of ``config`` and wrap its engine."""
        return cls(LLMEngine(config))

    # -- shape ---------------------------------------------------------------------------------
    @property
    def layout(self) -> KVLayout:
        return self.engine.kv_layout

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def hidden_bytes_per_token(self) -> int:
        return self.engine.model_config.hidden_size * self.layout.bytes_per_element

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, token_ids: Sequence[int], params: SamplingParams, *,
        keep_kv: bool = False, cache_salt: str | None = None,
    ) -> None:  # fmt: skip
        self.engine.add_request(
            request_id, list(token_ids), params, keep_kv=keep_kv, cache_salt=cache_salt
        )

    def abort_request(self, request_id: str) -> bool:
        return self.engine.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    @property
    def sleeping(self) -> bool:
        return self.engine.sleeping

    def sleep(self) -> int:
        freed = self.engine.sleep()
        # The pipeline stages' pools too (made again, empty, by the next stage job; their
        # cached prefixes were never in the Conductor's index).
        freed += sum(stage.executor.kv_cache.pool.nbytes for stage in self._stages.values())
        self._stages.clear()
        return freed

    def wake_up(self) -> None:
        self.engine.wake_up()

    def start_profile(self, config: ProfilerConfig, session: ProfileSession, name: str) -> None:
        self.engine.start_profile(config, session, name)

    def stop_profile(self) -> list[str]:
        return self.engine.stop_profile()

    def stage_weights(self, model_path: str) -> object:
        return self.engine.stage_weights(model_path)

    def commit_weights(self, staged: object) -> None:
        assert isinstance(staged, StagedWeights)
        self.engine.commit_weights(staged)

    def load_lora(self, adapter: RuntimeAdapter) -> None:
        self.engine.load_lora(adapter)

    def unload_lora(self, name: str) -> None:
        self.engine.unload_lora(name)

    def take_failures(self) -> list[RequestFailure]:
        return self.engine.take_failures()

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    # -- KV out --------------------------------------------------------------------------------
    def set_prompt_kv_hook(self, hook: PromptKVHook | None) -> None:
        self.prompt_kv_hook = hook
        self.engine.runner.hook = self._on_layer if hook is not None else None

    def _on_layer(self, rid: str, layer: int, block_ids: list[int], kv: LayerKV) -> None:
        _forward_prompt_kv(self.prompt_kv_hook, self.engine.num_prompt_tokens(rid), rid, layer,
                           kv, self.engine.block_manager, self.engine.kv_cache)  # fmt: skip

    def set_cache_listener(self, listener: CacheListener | None) -> None:
        self.engine.block_manager.listener = listener

    def set_demote_hook(self, hook: DemoteHook | None) -> None:
        bm, kv_cache = self.engine.block_manager, self.engine.kv_cache
        if hook is None:
            bm.evict_hook = None
            return

        def on_evict(block_hash: int, parent: int, position: int, block: int) -> None:
            hook(block_hash, parent, position, lambda: kv_cache.export_bytes([block]))

        bm.evict_hook = on_evict

    def read_cached_block(self, block_hash: int) -> tuple[int, int, memoryview] | None:
        kv_cache = self.engine.kv_cache
        return self.engine.block_manager.read_cached(
            block_hash, lambda block: kv_cache.export_bytes([block])
        )

    def block_bytes(self, request_id: str, index: int) -> memoryview:
        table = self.engine.block_manager.block_table(request_id)
        return self.engine.kv_cache.export_bytes([table[index]])

    def take_handoff(self, request_id: str) -> HandoffState:
        h = self.engine.export_kv(request_id, release=True, with_data=False)
        return HandoffState(h.request_id, h.token_ids, h.num_prompt_tokens,
                            h.num_computed_tokens, h.seed, h.cache_salt)  # fmt: skip

    # -- KV in ---------------------------------------------------------------------------------
    def cached_prefix_blocks(self, token_ids: Sequence[int], cache_salt: str | None) -> int:
        return len(self.engine.block_manager.match_prefix(token_ids, cache_salt))

    def seed_prefix(
        self, token_ids: Sequence[int], first_block: int,
        payloads: Sequence[bytes | bytearray | memoryview], cache_salt: str | None,
    ) -> int:  # fmt: skip
        return self.engine.seed_cached_blocks(token_ids, first_block, payloads, cache_salt)

    def reserve_prefix(
        self, token_ids: Sequence[int], first_block: int, count: int, cache_salt: str | None
    ) -> PrefixReservation | None:
        return self.engine.reserve_cached_blocks(token_ids, first_block, count, cache_salt)

    def import_request(
        self, state: HandoffState, params: SamplingParams, kv: bytes | bytearray | memoryview
    ) -> None:
        handoff = KVHandoff(
            request_id=state.request_id, token_ids=state.token_ids,
            num_prompt_tokens=state.num_prompt_tokens,
            num_computed_tokens=state.num_computed_tokens, seed=state.seed,
            layout=self.layout, data=kv, cache_salt=state.cache_salt,
        )  # fmt: skip
        self.engine.import_request(handoff, params)

    def cost_profile(self, model: str, cache_dir: Path) -> CostProfile:
        return cached_profile(self.engine, model, cache_dir)

    # -- pipeline stages -----------------------------------------------------------------------
    def pipeline_stage(self, num_stages: int, stage: int) -> StageConnector:
        if self.engine.sleeping:
            raise HalfmoonError(ASLEEP)
        layers = LayerSlice.split(self.layout.num_layers, num_stages)[stage]
        key = (layers.first, layers.last)
        if key not in self._stages:
            self._stages[key] = _LocalStage(self, layers)
        return self._stages[key]
