"""Turns a step's chunks into tensors, runs the model and returns the wanted logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from halfmoon.engine.attention import (
    AttentionBatch,
    LayerHook,
    PrefillSegment,
    build_decode_group,
)
from halfmoon.engine.fused import FusedDecode
from halfmoon.engine.graphs import DecodeGraphs, DecodeRow
from halfmoon.engine.kernels import DecodeKernel
from halfmoon.engine.kv_cache import KVCache
from halfmoon.engine.lora import LoraSet
from halfmoon.engine.model import LlamaForCausalLM

#: What logits a chunk wants back: none, its last token's, or every token's; or, for
#: an embedding, its last token's final hidden state instead of logits.
LOGITS_NONE, LOGITS_LAST, LOGITS_ALL, HIDDEN_LAST = "none", "last", "all", "hidden"


@dataclass(frozen=True)
class ChunkInput:
    """One sequence's slice of a step: ``token_ids`` at positions ``start..``, stored in
    ``block_table`` (which covers at least ``start + len(token_ids)`` tokens).

    ``hook``: call the per-layer KV hook for it (prompt chunks). A one-token chunk without
    a hook runs in the batched decode path.
    """

    request_id: str
    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    logits: str = LOGITS_LAST
    hook: bool = False
    #: The LoRA adapter it runs with (a name in the runner's :class:`LoraSet`), or None.
    lora: str | None = None

    @property
    def end(self) -> int:
        """One past the last position."""
        return self.start + len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """Whether it joins the batched decode group."""
        return len(self.token_ids) == 1 and not self.hook


class ModelRunner:
    """Runs :class:`LlamaForCausalLM` on chunks over a :class:`KVCache`."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        hook: LayerHook | None = None,
        decode_kernel: DecodeKernel | None = None,
        fused_decode: FusedDecode | None = None,
        loras: LoraSet | None = None,
    ):
        self.model = model
        #: The LoRA adapters chunks may name (:mod:`halfmoon.engine.lora`).
        # (the engine's own set, even empty: adapters loaded while serving join it)
        self.loras = loras if loras is not None else LoraSet()
        self.kv_cache = kv_cache
        self.hook = hook
        #: The compiled paged decode attention (None: the reference gather + SDPA).
        self.decode_kernel = decode_kernel
        #: RoPE + pool write + the kernel in one call for decode-only steps (None: apart).
        self.fused_decode = fused_decode
        self._scale = torch.tensor(model.config.head_dim**-0.5, device=kv_cache.pool.device)
        self.block_size = kv_cache.layout.block_size
        self.device = kv_cache.pool.device
        # Reused gather buffers [2, capacity_blocks, B, H_kv, D]; grown on demand, never shrunk.
        self._workspace = torch.empty(0, device=self.device)
        #: Decode-only steps replayed from CUDA graphs (:mod:`halfmoon.engine.graphs`), or
        #: None: every step runs eagerly.
        self.decode_graphs: DecodeGraphs | None = None

    def _workspace_for(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if num_blocks == 0:
            return None
        if self._workspace.numel() == 0 or self._workspace.shape[1] < num_blocks:
            shape = (2, num_blocks, *self.kv_cache.pool.shape[3:])
            self._workspace = torch.empty(shape, dtype=self.kv_cache.pool.dtype, device=self.device)
        return self._workspace[0], self._workspace[1]

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _slot(self, table: Sequence[int], position: int) -> int:
        """The flat pool slot of ``position`` in a sequence stored in ``table``."""
        bs = self.block_size
        return table[position // bs] * bs + position % bs

    def _decode_row(self, chunk: ChunkInput) -> DecodeRow:
        table = list(chunk.block_table[: self._blocks(chunk.end)])
        slot = self._slot(chunk.block_table, chunk.start)
        return DecodeRow(chunk.token_ids[0], chunk.start, slot, table, chunk.end)

    def _prepare(
        self, ordered: list[ChunkInput], num_decode: int
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for chunk in ordered:
            token_ids.extend(chunk.token_ids)
            table = chunk.block_table
            for p in range(chunk.start, chunk.end):
                positions.append(p)
                slots.append(self._slot(table, p))
        decode = None
        if num_decode:
            decodes = ordered[:num_decode]
            decode = build_decode_group(
                [list(c.block_table[: self._blocks(c.end)]) for c in decodes],
                [c.end for c in decodes],
                bs,
                self.device,
            )
        segments = []
        row = sum(len(c.token_ids) for c in ordered[:num_decode])
        for c in ordered[num_decode:]:
            table = list(c.block_table[: self._blocks(c.end)])
            segments.append(
                PrefillSegment(
                    request_id=c.request_id,
                    row=row,
                    start=c.start,
                    end=c.end,
                    block_table=torch.tensor(table, dtype=torch.long, device=self.device),
                    block_ids=table[c.start // bs :],
                    hook=c.hook and self.hook is not None,
                )
            )
            row += len(c.token_ids)
        as_long = {"dtype": torch.long, "device": self.device}
        gathered = [s.block_table.numel() for s in segments if s.start > 0]
        if decode is not None and self.decode_kernel is None:
            gathered.append(decode.max_blocks * decode.num_seqs)
        workspace = self._workspace_for(max(gathered, default=0))
        lora = None
        if any(c.lora is not None for c in ordered):
            lora = self.loras.batch([(c.lora, len(c.token_ids)) for c in ordered])
        batch = AttentionBatch(
            torch.tensor(slots, **as_long), decode, tuple(segments), workspace,
            self.decode_kernel, self._scale, self.fused_decode, lora,
        )  # fmt: skip
        return torch.tensor(token_ids, **as_long), torch.tensor(positions, **as_long), batch

    @torch.inference_mode()
    def execute_layers(
        self, chunk: ChunkInput, layers: tuple[int, int], hidden: torch.Tensor | None
    ) -> torch.Tensor:
        """One prompt chunk through layers ``first..last-1`` (a pipeline stage); returns
        its hidden states ``[n, hidden]`` (see :meth:`LlamaForCausalLM.run_layers`)."""
        input_ids, positions, batch = self._prepare([chunk], 0)
        return self.model.run_layers(
            input_ids, positions, batch, self.kv_cache, self.hook, layers, hidden
        )

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ChunkInput]) -> list[torch.Tensor | None]:
        """Compute ``chunks`` (writing their K/V) and return, per chunk in the given
        order, its logits ``[1 or n, vocab]`` (or None when it asked for none; its last
        row's final hidden state ``[1, hidden]`` when it asked for :data:`HIDDEN_LAST`)."""
        if not chunks:
            return []
        decode_idx = [i for i, c in enumerate(chunks) if c.is_decode]
        with_lora = any(c.lora is not None for c in chunks)
        if with_lora:  # each adapter's decode rows in one run (see LoraSet.batch)
            decode_idx.sort(key=lambda i: chunks[i].lora or "")
        if self.decode_graphs is not None and len(decode_idx) == len(chunks) and not with_lora:
            logits = self.decode_graphs.run([self._decode_row(c) for c in chunks])
            if logits is not None:  # else no graph for this step: it runs eagerly
                return [
                    None if c.logits == LOGITS_NONE else logits[i : i + 1]
                    for i, c in enumerate(chunks)
                ]
        other_idx = [i for i, c in enumerate(chunks) if not c.is_decode]
        order = decode_idx + other_idx
        ordered = [chunks[i] for i in order]
        input_ids, positions, batch = self._prepare(ordered, len(decode_idx))
        hidden = self.model(input_ids, positions, batch, self.kv_cache, self.hook)
        rows: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        pooled: dict[int, torch.Tensor] = {}
        row = 0
        for i, chunk in zip(order, ordered, strict=True):
            n = len(chunk.token_ids)
            first = len(rows)
            if chunk.logits == HIDDEN_LAST:
                pooled[i] = hidden[row + n - 1 : row + n]
            elif chunk.logits == LOGITS_LAST:
                rows.append(row + n - 1)
            elif chunk.logits == LOGITS_ALL:
                rows.extend(range(row, row + n))
            spans[i] = (first, len(rows))
            row += n
        logits = self.model.compute_logits(hidden[rows]) if rows else None
        out: list[torch.Tensor | None] = []
        for i in range(len(chunks)):
            if i in pooled:
                out.append(pooled[i])
                continue
            first, last = spans[i]
            out.append(logits[first:last] if logits is not None and last > first else None)
        return out
