"""CUDA graphs for decode steps: each step's kernels recorded once, then replayed.

On a GPU a decode step of a small model is bound by kernel launches, not by arithmetic:
SmolLM2 on an H200 took 10-21 ms a step at every batch size (docs/benchmarks.md, "On a
GPU"), about 30 layers x ~15 kernels launched one by one from Python. A CUDA graph
records the step's kernels once and replays them all with one launch.

A graph replays fixed shapes on fixed memory, so decode steps are sorted into buckets:
a step of ``n`` sequences whose longest block table has ``m`` blocks runs in the graph of
``(N, M)``, ``N`` the smallest power of two >= ``n`` (up to the engine's ``max_num_seqs``)
and ``M`` the smallest power of two >= ``m`` (up to the blocks of ``max_model_len``).
Each bucket owns static input tensors (token ids, positions, pool slots, block tables,
context lengths). A step copies its inputs into them, padding its rows to ``N`` by
repeating its last row: the same token at the same position writes the same K/V into
the same slot, so the padding changes nothing in the pool, and its logits are dropped.
Block tables are padded to ``M`` columns with block 0, which the attention masks out by
context length, as the eager path does.

A bucket's graph is captured the first time a step needs it: the static inputs are
filled with that step's, the forward runs once eagerly on a side stream (it writes the
step's K/V and lets cuBLAS set up its workspaces outside the capture), then it is
captured and replayed. Every graph draws its intermediates from one shared memory pool
(graphs replay one at a time). When a capture fails, graphs are switched off with a
warning naming the reason and the engine keeps stepping eagerly; steps that no bucket
fits (more sequences than ``max_num_seqs``) and steps with a prompt chunk run eagerly.

Logits agree with the eager path up to float rounding (a padded batch can take another
GEMM kernel); greedy tokens are compared in ``tests/engine/test_engine_graphs.py``,
which drives the same buckets on the CPU by replaying the recorded forward itself, and
runs the real capture where a GPU is present (``benchmarks/eval/gpu_check.sh``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from halfmoon.engine.attention import AttentionBatch, DecodeGroup
from halfmoon.engine.kernels import DecodeKernel
from halfmoon.engine.kv_cache import KVCache
from halfmoon.engine.model import LlamaForCausalLM
from halfmoon.engine.packages import failure_reason

logger = logging.getLogger(__name__)

#: ``capture(forward)`` -> ``replay``: records ``forward`` (which reads only a bucket's
#: static inputs) and returns a callable that reruns the record and returns its output.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


def cuda_capture(pool: object | None = None) -> Capture:
    """The CUDA-graph :data:`Capture`: one eager warm-up run on a side stream, then
    ``torch.cuda.graph`` capture into the memory pool ``pool`` (shared by every graph made
    by this capture; a new one when None)."""
    shared = pool if pool is not None else torch.cuda.graph_pool_handle()

    def capture(forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a worker's other threads (KV arriving, the store) may use CUDA
        # while this one captures; only this thread's unsafe calls are refused.
        with torch.cuda.graph(graph, pool=shared, capture_error_mode="thread_local"):
            output = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    return capture


def buckets(limit: int) -> tuple[int, ...]:
    """Powers of two from 1 up to the first one >= ``limit``."""
    sizes = [1]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes)


@dataclass
class _Bucket:
    """The static inputs of one ``(N, M)`` bucket and its replay."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor
    replay: Callable[[], torch.Tensor] | None = None


@dataclass(frozen=True)
class DecodeRow:
    """One sequence of a decode step: its new token at ``position``, written to pool
    ``slot``, attending over ``context_len`` tokens in ``block_table`` (the blocks that
    hold them, no more)."""

    token_id: int
    position: int
    slot: int
    block_table: Sequence[int]
    context_len: int


class DecodeGraphs:
    """Decode steps replayed from captured graphs, one per bucket (see the module
    docstring). ``capture`` defaults to :func:`cuda_capture`."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        max_num_seqs: int,
        max_blocks: int,
        decode_kernel: DecodeKernel | None = None,
        capture: Capture | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.pool.device
        self.block_size = kv_cache.layout.block_size
        self.decode_kernel = decode_kernel
        self._scale = torch.tensor(model.config.head_dim**-0.5, device=self.device)
        self.batch_buckets = buckets(max_num_seqs)
        self.block_buckets = buckets(max_blocks)
        self.capture = capture if capture is not None else cuda_capture()
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        #: Why graphs were switched off (a failed capture), or None while they are on.
        self.disabled_reason: str | None = None
        self.num_replays = 0

    @property
    def num_captured(self) -> int:
        """Graphs captured so far."""
        return sum(1 for b in self._buckets.values() if b.replay is not None)

    def bucket_for(self, num_seqs: int, max_blocks: int) -> tuple[int, int] | None:
        """The ``(N, M)`` bucket of a step, or None when none fits."""
        n = next((b for b in self.batch_buckets if b >= num_seqs), None)
        m = next((b for b in self.block_buckets if b >= max_blocks), None)
        return None if n is None or m is None else (n, m)

    def run(self, rows: Sequence[DecodeRow]) -> torch.Tensor | None:
        """Logits ``[len(rows), vocab]`` of one decode step (its K/V written into the
        pool), or None when graphs are off or no bucket fits: the caller steps eagerly."""
        if self.disabled_reason is not None or not rows:
            return None
        key = self.bucket_for(len(rows), max(len(r.block_table) for r in rows))
        if key is None:
            return None
        bucket = self._buckets.get(key) or self._new_bucket(*key)
        self._fill(bucket, rows, key[1])
        if bucket.replay is None:
            try:
                bucket.replay = self.capture(self._forward(bucket, *key))
            except Exception as exc:  # noqa: BLE001 - a capture problem must not stop serving
                self.disabled_reason = failure_reason(exc)
                logger.warning(
                    "CUDA graph capture failed (%s); decode steps run eagerly",
                    self.disabled_reason,
                )
                return None
        self.num_replays += 1
        return bucket.replay()[: len(rows)].clone()

    def _new_bucket(self, num_seqs: int, num_blocks: int) -> _Bucket:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=self.device)

        bucket = _Bucket(
            longs(num_seqs), longs(num_seqs), longs(num_seqs), longs(num_seqs, num_blocks),
            torch.ones(num_seqs, dtype=torch.long, device=self.device),
        )  # fmt: skip
        self._buckets[(num_seqs, num_blocks)] = bucket
        return bucket

    def _fill(self, bucket: _Bucket, rows: Sequence[DecodeRow], num_blocks: int) -> None:
        """Copy the step's inputs into the bucket's, the last row repeated as padding."""
        padded = list(rows) + [rows[-1]] * (bucket.input_ids.shape[0] - len(rows))
        tables = [[*r.block_table, *[0] * (num_blocks - len(r.block_table))] for r in padded]
        for static, values in (
            (bucket.input_ids, [r.token_id for r in padded]),
            (bucket.positions, [r.position for r in padded]),
            (bucket.slots, [r.slot for r in padded]),
            (bucket.lens, [r.context_len for r in padded]),
            (bucket.tables, tables),
        ):
            static.copy_(torch.tensor(values, dtype=torch.long))

    def _forward(self, bucket: _Bucket, num_seqs: int, num_blocks: int):
        """The step as a function of the bucket's static inputs only."""

        def forward() -> torch.Tensor:
            group = DecodeGroup(num_seqs, num_blocks, bucket.tables, bucket.lens, self.block_size)
            batch = AttentionBatch(bucket.slots, group, (), None, self.decode_kernel, self._scale)
            hidden = self.model(bucket.input_ids, bucket.positions, batch, self.kv_cache)
            return self.model.compute_logits(hidden)

        return forward
