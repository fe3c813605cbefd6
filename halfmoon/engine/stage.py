"""One stage of chunked pipeline parallelism (CPP): a slice of the layers over a prompt.

A CPP group of K workers cuts the model into K contiguous layer slices
(:meth:`LayerSlice.split`) and the prompt into chunks. Stage ``s`` runs its layers on
chunk ``c`` while stage ``s+1`` runs chunk ``c-1``; only hidden states ``[T, hidden]``
cross a stage boundary. Each stage keeps the KV of *its* layers in a pool of its own
(:class:`StageKVCache`), so the next chunk's attention finds the earlier chunks' keys::

    stage 0: embed -> layers [0, a)          chunk c  -> hidden -> stage 1
    stage 1: layers [a, b)                   chunk c  -> hidden -> ...
    last:    layers [z, L) -> norm           chunk c  (last chunk: logits of its last token)

The model's weights are shared with the worker's engine (a worker of the group can still
prefill whole prompts on its own); only the stage's pool is extra, sized like the
engine's in blocks but holding ``1/K`` of the layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.attention import LayerHook
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.kv_cache import KVCache, KVLayout, from_bytes, host_bytes
from halfmoon.engine.lora import LoraSet
from halfmoon.engine.model import LlamaForCausalLM
from halfmoon.engine.runner import LOGITS_NONE, ChunkInput, ModelRunner


@dataclass(frozen=True)
class LayerSlice:
    """Layers ``first..last-1`` of a ``num_layers``-layer model."""

    first: int
    last: int
    num_layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.first < self.last <= self.num_layers:
            raise ValueError(
                f"layer slice [{self.first}, {self.last}) is not inside [0, {self.num_layers})"
            )

    @property
    def is_first(self) -> bool:
        """Whether the stage embeds the tokens."""
        return self.first == 0

    @property
    def is_last(self) -> bool:
        """Whether the stage produces the final hidden states (and the logits)."""
        return self.last == self.num_layers

    @property
    def size(self) -> int:
        """Number of layers in the slice."""
        return self.last - self.first

    @staticmethod
    def split(num_layers: int, num_stages: int) -> list[LayerSlice]:
        """``num_stages`` contiguous slices whose sizes differ by at most one (earlier
        stages take the extra layers: they also embed, later ones also sample)."""
        if not 1 <= num_stages <= num_layers:
            raise HalfmoonError(
                f"cannot split {num_layers} layers into {num_stages} pipeline stages"
            )
        base, extra = divmod(num_layers, num_stages)
        out, first = [], 0
        for s in range(num_stages):
            last = first + base + (1 if s < extra else 0)
            out.append(LayerSlice(first, last, num_layers))
            first = last
        return out


class StageKVCache(KVCache):
    """A KV pool for the layers of one slice, addressed by *global* layer index."""

    def __init__(
        self, layout: KVLayout, layers: LayerSlice, num_blocks: int, device: str = "cpu"
    ) -> None:
        if layout.num_layers != layers.num_layers:
            raise HalfmoonError(
                f"the slice is of a {layers.num_layers}-layer model, the layout has "
                f"{layout.num_layers}"
            )
        super().__init__(dataclasses.replace(layout, num_layers=layers.size), num_blocks, device)
        self.layers = layers

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views ``(K, V)`` of global layer ``layer`` (which must be in the slice)."""
        return super().layer(self._local(layer))

    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat views of global layer ``layer`` (see :meth:`KVCache.layer_slots`)."""
        return super().layer_slots(self._local(layer))

    def _local(self, layer: int) -> int:
        if not self.layers.first <= layer < self.layers.last:
            raise HalfmoonError(
                f"layer {layer} is outside this stage's [{self.layers.first}, {self.layers.last})"
            )
        return layer - self.layers.first

    def payload_layers(self) -> tuple[int, int, int]:
        """The slice's layers of a whole-model payload (what ``import_payloads`` keeps)."""
        return self.layers.first, self.layers.last, self.layers.num_layers


class StageExecutor:
    """Runs one layer slice of a loaded model over prompt chunks (a CPP stage).

    ``full_layout`` is the engine's KV layout (all layers); the stage keeps
    ``num_blocks`` blocks of its own layers. ``hook`` is the per-layer KV hook of
    :mod:`halfmoon.engine.attention`, called for every chunk with global layer indices.

    The stage runs on the model's device; what crosses its boundary (hidden states in and
    out as bytes, prefix payloads, the hook's K/V) is host memory, moved here.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        full_layout: KVLayout,
        layers: LayerSlice,
        num_blocks: int,
        hook: LayerHook | None = None,
        enable_prefix_caching: bool = True,
        loras: LoraSet | None = None,
    ) -> None:
        device = str(next(model.parameters()).device)
        self.model = model
        self.layers = layers
        self.block_size = full_layout.block_size
        self.kv_cache = StageKVCache(full_layout, layers, num_blocks, device)
        # The stage's own prefix cache: its blocks hold only this slice's layers.
        self.blocks = BlockManager(num_blocks, full_layout.block_size, enable_prefix_caching)
        self.runner = ModelRunner(model, self.kv_cache, hook, loras=loras)

    @property
    def hidden_size(self) -> int:
        """Width of the hidden states that cross stage boundaries."""
        return self.model.config.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the hidden states and the pool."""
        return self.kv_cache.pool.dtype

    def match_blocks(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Leading blocks of ``token_ids`` (under ``cache_salt``) this stage's pool holds
        (no side effects)."""
        return len(self.blocks.match_prefix(token_ids, cache_salt))

    def start(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_cached_tokens: int = 0,
        cache_salt: str | None = None,
    ) -> int:
        """Blocks for the prompt ``token_ids``, reusing at most ``max_cached_tokens`` of
        its cached prefix under ``cache_salt`` (every stage of a group must start at the
        same token); returns the prefix tokens reused. Raises when the pool is too small."""
        capped = list(token_ids[: max(0, max_cached_tokens) + 1])
        cached = self.blocks.admit(request_id, capped, 1, cache_salt)
        if cached is None or not self.blocks.grow(request_id, len(token_ids)):
            self.release(request_id)
            raise HalfmoonError(
                f"stage pool has {self.blocks.num_free_blocks} free blocks; request "
                f"{request_id!r} needs {self.blocks.blocks_for(len(token_ids))}"
            )
        return cached

    def load_prefix(
        self, request_id: str, payloads: Sequence[bytes | bytearray], first_block: int = 0
    ) -> None:
        """Write cached prefix blocks into the request's blocks ``first_block..``: each
        payload is one whole-model block in the export layout (what the store holds, host
        memory); only this stage's layers are kept."""
        table = self.blocks.block_table(request_id)
        if first_block + len(payloads) > len(table):
            raise HalfmoonError(f"{len(payloads)} prefix blocks for a {len(table)}-block table")
        self.kv_cache.import_payloads(table[first_block : first_block + len(payloads)], payloads)

    def commit(self, request_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Offer the full blocks of the first ``num_tokens`` tokens to the stage cache."""
        self.blocks.commit(request_id, token_ids, num_tokens)

    def run(
        self,
        request_id: str,
        token_ids: Sequence[int],
        start: int,
        hidden: torch.Tensor | bytes | bytearray | memoryview | None = None,
        hook: bool = True,
        lora: str | None = None,
    ) -> torch.Tensor:
        """Run the slice on the chunk ``token_ids`` at positions ``start..``, writing its
        KV; returns the hidden states ``[len(token_ids), hidden]`` for the next stage (the
        final-normed ones on the last stage), on the model's device: hand them on with
        :meth:`hidden_bytes`, or to :meth:`logits`.

        ``hidden`` (every stage but the first): the previous stage's output, as a tensor
        on any device or as its host bytes (at least ``len(token_ids)`` rows in the stage
        dtype; further rows are ignored); it is moved to the model's device here.
        ``lora``: the LoRA adapter the request runs with (one of the stage's ``loras``).
        """
        if not self.layers.is_first:
            hidden = self._hidden_in(hidden, len(token_ids))
        chunk = ChunkInput(
            request_id=request_id,
            token_ids=token_ids,
            start=start,
            block_table=self.blocks.block_table(request_id),
            logits=LOGITS_NONE,
            hook=hook,
            lora=lora,
        )
        return self.runner.execute_layers(chunk, (self.layers.first, self.layers.last), hidden)

    def _hidden_in(self, hidden: object, num_rows: int) -> torch.Tensor:
        if isinstance(hidden, (bytes, bytearray, memoryview)):
            flat = from_bytes(hidden, self.dtype)
            if flat.numel() >= num_rows * self.hidden_size:
                hidden = flat[: num_rows * self.hidden_size].view(num_rows, self.hidden_size)
        if not isinstance(hidden, torch.Tensor) or hidden.shape[0] != num_rows:
            raise HalfmoonError(f"stage {self.layers} needs hidden states for every chunk token")
        return hidden.to(self.kv_cache.pool.device)

    def hidden_bytes(self, hidden: torch.Tensor, num_rows: int | None = None) -> memoryview:
        """Host bytes of :meth:`run`'s output (what the next stage's ``run`` takes),
        padded with zero rows to ``num_rows`` (fixed-size slots of a stream)."""
        rows = hidden.shape[0]
        if num_rows is not None and num_rows > rows:
            pad = hidden.new_zeros(num_rows - rows, hidden.shape[1])
            hidden = torch.cat([hidden, pad])
        return host_bytes(hidden)

    def logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """LM-head logits of final hidden rows (last stage only), on the model's device
        (what :func:`halfmoon.engine.sampling.sample_with_logprobs` takes)."""
        if not self.layers.is_last:
            raise HalfmoonError("only the last stage computes logits")
        with torch.inference_mode():
            return self.model.compute_logits(hidden_rows.to(self.kv_cache.pool.device))

    def release(self, request_id: str) -> None:
        """Give the request's blocks back (no-op when it holds none); committed ones stay
        cached for later prompts."""
        if self.blocks.has_request(request_id):
            self.blocks.free(request_id)
