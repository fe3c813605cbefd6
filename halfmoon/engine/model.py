"""The Llama-family decoder (Llama 2/3, Qwen2, Mistral) over a flat token batch.

Weights are stored fused (``qkv_proj`` = q|k|v rows, ``gate_up_proj`` = gate|up rows):
one matmul instead of three (two) per layer. :mod:`halfmoon.engine.weights` maps the
Hugging Face tensor names onto these slices.
"""

from __future__ import annotations

from functools import partial
from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn

from halfmoon.engine.attention import (
    AttentionBatch,
    LayerHook,
    LayerKV,
    decode_attention,
    prefill_attention,
)
from halfmoon.engine.config import ModelConfig
from halfmoon.engine.glue import EAGER_GLUE, Glue
from halfmoon.engine.kv_cache import KVCache
from halfmoon.engine.rope import inverse_frequencies, rope_cos_sin


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference implementations do."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            # The same math in one fused kernel (bit-identical in float32).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP with residuals."""

    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_dim = config.num_heads * config.head_dim
        self.kv_dim = config.num_kv_heads * config.head_dim
        h, i = config.hidden_size, config.intermediate_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, q_dim + 2 * self.kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, h, bias=config.o_bias)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.gate_up_proj = nn.Linear(h, 2 * i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
        kv_cache: KVCache,
        hook: LayerHook | None,
        glue: Glue = EAGER_GLUE,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp_out, residual)``: the residual stream is ``mlp_out + residual``, left
        un-added so that the next layer adds it inside its fused add + norm. ``residual``
        None: ``x`` is the whole stream (the first layer of a stage)."""
        # Submodules are called through ``forward``: a decode step at batch 1 is mostly
        # dispatch, and ``nn.Module.__call__``'s hook checks cost ~1 ms of SmolLM2's ~40 ms
        # step (no module hooks run on this path).
        if residual is None:
            h, residual = self.input_layernorm.forward(x), x
        else:
            h, residual = glue.add_rms_norm(x, residual, self.input_layernorm)
        lora, i = batch.lora, self.layer_index
        qkv = self.qkv_proj.forward(h)
        if lora is not None:  # (each: the adapters' deltas added in place)
            lora.apply(qkv, h, i, "qkv_proj")
        out = self._attention(qkv, rope, batch, kv_cache, hook, glue)
        o = self.o_proj.forward(out)
        if lora is not None:
            lora.apply(o, out, i, "o_proj")
        h, residual = glue.add_rms_norm(o, residual, self.post_attention_layernorm)
        gate_up = self.gate_up_proj.forward(h)
        if lora is not None:
            lora.apply(gate_up, h, i, "gate_up_proj")
        act = glue.silu_mul(gate_up)
        down = self.down_proj.forward(act)
        if lora is not None:
            lora.apply(down, act, i, "down_proj")
        return down, residual

    def _attention(
        self,
        qkv: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: AttentionBatch,
        kv_cache: KVCache,
        hook: LayerHook | None,
        glue: Glue,
    ) -> torch.Tensor:
        """RoPE, this step's K/V into the pool, attention: ``[T, H * D]`` from ``qkv``."""
        keys, values = kv_cache.layer(self.layer_index)
        group = batch.decode
        decode_only = group is not None and not batch.prefills
        if decode_only and batch.fused_decode is not None:  # all of it in one call
            return batch.fused_decode(qkv, *rope, keys, values, batch.slot_mapping,
                                      group.block_tables, group.context_lens, batch.scale)  # fmt: skip
        q, k, v = glue.rope_split(qkv, *rope, self.num_heads, self.num_kv_heads, self.head_dim)
        key_slots, value_slots = kv_cache.layer_slots(self.layer_index)
        key_slots.index_copy_(0, batch.slot_mapping, k)
        value_slots.index_copy_(0, batch.slot_mapping, v)
        if hook is not None:
            self._call_hook(hook, batch, kv_cache)
        if decode_only:  # no copy of the batch's rows
            return decode_attention(q, keys, values, batch, self.scale)
        out = torch.empty(qkv.shape[0], self.num_heads * self.head_dim, dtype=qkv.dtype,
                          device=qkv.device)  # fmt: skip
        if group is not None:
            num_decode = group.num_seqs
            out[:num_decode] = decode_attention(q[:num_decode], keys, values, batch, self.scale)
        for seg in batch.prefills:
            rows = slice(seg.row, seg.row + seg.end - seg.start)
            out[rows] = prefill_attention(
                q[rows], k[rows], v[rows], keys, values, seg, batch, self.scale
            )
        return out

    def _call_hook(self, hook: LayerHook, batch: AttentionBatch, kv_cache: KVCache) -> None:
        for seg in batch.prefills:
            if seg.hook:
                read = partial(kv_cache.layer_blocks, self.layer_index, seg.block_ids)
                kv = LayerKV(seg.start, seg.end, read)
                hook(seg.request_id, self.layer_index, list(seg.block_ids), kv)


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm and LM head (tied to the embedding or not)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # A plain attribute, not a buffer: `.to(bfloat16)` must not round the frequencies.
        self.inv_freq = inverse_frequencies(config)
        #: The LM head in oneDNN's packed layout (:func:`halfmoon.engine.prepack.prepack_lm_head`);
        #: when set, it computes the logits (and an untied ``lm_head`` is gone).
        self.packed_lm_head: nn.Module | None = None
        #: The elementwise steps between the matmuls (:mod:`halfmoon.engine.glue`):
        #: eager by default, compiled when the engine loads them.
        self.glue: Glue = EAGER_GLUE

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: KVCache,
        hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the flat batch; writes K/V into the pool."""
        return self.run_layers(input_ids, positions, batch, kv_cache, hook)

    def run_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: KVCache,
        hook: LayerHook | None = None,
        layers: tuple[int, int] | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Layers ``first..last-1`` only (one pipeline stage; all layers by default).

        The first stage embeds ``input_ids``; a later one continues from ``hidden``, the
        previous stage's output ``[T, hidden]``. The last stage returns the final-normed
        hidden states, any other stage the raw residual stream for the next one.
        """
        first, last = layers if layers is not None else (0, len(self.layers))
        if first == 0:
            x = self.embed_tokens(input_ids)
        elif hidden is None:
            raise ValueError(f"a stage starting at layer {first} needs the hidden states")
        else:
            x = hidden
        rope = rope_cos_sin(positions, self.inv_freq, x.dtype)
        residual = None
        # Not ``self.layers[first:last]``: a ModuleList slice is a new ModuleList, per step.
        for layer in islice(self.layers, first, last):
            x, residual = layer.forward(x, residual, rope, batch, kv_cache, hook, self.glue)
        if last == len(self.layers):
            return (
                self.norm(x)
                if residual is None
                else self.glue.add_rms_norm(x, residual, self.norm)[0]
            )
        return x if residual is None else x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM-head logits ``[N, vocab]`` for the given hidden rows."""
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)
