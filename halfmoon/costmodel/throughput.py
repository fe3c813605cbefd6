"""The constant-rate cost model of the paper's worked scheduling example.

Prefill runs at a fixed token rate and ignores the cached prefix (the paper's example
divides the uncached tokens by 2,000 tok/s); transfers divide bytes by a link bandwidth;
a decode step is linear in the total context. Useful to reproduce the example's numbers
exactly and as a cheap, predictable model in Conductor and simulator tests.
"""

from __future__ import annotations

import numpy as np

from halfmoon.costmodel.base import check_amount, check_count, check_counts, check_positive

#: Worked-example settings (LLaMA2-70B on 8xA800): 2,000 tok/s prefill, 320 KiB of KV per
#: token (16-token blocks are 5 MiB), 100 GB/s RDMA.
PAPER_PREFILL_TOKENS_PER_S = 2000.0
PAPER_KV_BYTES_PER_TOKEN = 320 * 1024
PAPER_LINK_BYTES_PER_S = 100e9


class ThroughputCostModel:
    """Fixed rates: ``prefill = new / rate``, ``transfer = latency + bytes / link``,
    ``decode step = base + per_token * context``.

    Decode defaults follow :class:`RooflineCostModel` for LLaMA2-70B on 8xA800 at its
    default efficiencies (weights streamed in ~12.5 ms per step, ~27 ns per context token
    of KV); the capacity default is that model's ~1.3M tokens.
    """

    def __init__(
        self,
        prefill_tokens_per_s: float,
        kv_bytes_per_token: int,
        link_bytes_per_s: float,
        decode_step_base_s: float = 0.0125,
        decode_step_per_token_s: float = 2.7e-8,
        kv_capacity_tokens: int = 1_300_000,
        link_latency_s: float = 0.0,
    ) -> None:
        self.prefill_tokens_per_s = check_positive("prefill_tokens_per_s", prefill_tokens_per_s)
        self.kv_bytes_per_token = check_count("kv_bytes_per_token", kv_bytes_per_token)
        check_positive("kv_bytes_per_token", self.kv_bytes_per_token)
        self.link_bytes_per_s = check_positive("link_bytes_per_s", link_bytes_per_s)
        self.decode_step_base_s = check_amount("decode_step_base_s", decode_step_base_s)
        self.decode_step_per_token_s = check_amount(
            "decode_step_per_token_s", decode_step_per_token_s
        )
        # Stored privately: the public name is the protocol's method.
        self._kv_capacity_tokens = check_count("kv_capacity_tokens", kv_capacity_tokens)
        self.link_latency_s = check_amount("link_latency_s", link_latency_s)

    @classmethod
    def paper_example(cls) -> ThroughputCostModel:
        """The worked example's model: 2,000 tok/s, 320 KiB/token, 100 GB/s."""
        return cls(PAPER_PREFILL_TOKENS_PER_S, PAPER_KV_BYTES_PER_TOKEN, PAPER_LINK_BYTES_PER_S)

    def __repr__(self) -> str:
        return (
            f"ThroughputCostModel(prefill_tokens_per_s={self.prefill_tokens_per_s}, "
            f"kv_bytes_per_token={self.kv_bytes_per_token}, "
            f"link_bytes_per_s={self.link_bytes_per_s}, "
            f"decode_step_base_s={self.decode_step_base_s}, "
            f"decode_step_per_token_s={self.decode_step_per_token_s}, "
            f"kv_capacity_tokens={self._kv_capacity_tokens}, "
            f"link_latency_s={self.link_latency_s})"
        )

    def prefill_time_s(self, num_new_tokens: int, num_cached_tokens: int = 0) -> float:
        """``num_new_tokens / rate``; the cached prefix is checked but costs nothing."""
        n = check_count("num_new_tokens", num_new_tokens)
        check_count("num_cached_tokens", num_cached_tokens)
        return n / self.prefill_tokens_per_s

    def decode_step_time_s(self, batch_size: int, total_context_tokens: int) -> float:
        """``base + per_token * total_context_tokens`` (0 for an empty batch)."""
        b = check_count("batch_size", batch_size)
        ctx = check_count("total_context_tokens", total_context_tokens)
        if b == 0:
            return 0.0
        return self.decode_step_base_s + self.decode_step_per_token_s * ctx

    def decode_step_times_s(
        self, batch_sizes: np.ndarray, total_context_tokens: np.ndarray
    ) -> np.ndarray:
        """:meth:`decode_step_time_s` of many batches at once (the same values)."""
        b = check_counts("batch_sizes", batch_sizes)
        ctx = check_counts("total_context_tokens", total_context_tokens)
        step_s = self.decode_step_base_s + self.decode_step_per_token_s * ctx
        return np.where(b == 0, 0.0, step_s)

    def transfer_time_s(self, num_bytes: float) -> float:
        """``latency + num_bytes / link`` (0 for nothing to move)."""
        size = check_amount("num_bytes", num_bytes)
        if size == 0:
            return 0.0
        return self.link_latency_s + size / self.link_bytes_per_s

    def kv_capacity_tokens(self) -> int:
        """The configured KV capacity in tokens."""
        return self._kv_capacity_tokens
