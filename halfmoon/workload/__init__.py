"""L1 workloads: Mooncake JSONL traces, synthetic datasets shaped like the paper's Table 2,
token synthesis from block ids, trace statistics and prefix-cache replay.

numpy only (no torch): everything here runs anywhere, fast.
"""

from halfmoon.workload.datasets import DATASETS, DatasetSpec, generate_dataset
from halfmoon.workload.stats import replay_cache, trace_stats
from halfmoon.workload.tokens import TokenSynthesizer, scale_length, scale_request
from halfmoon.workload.trace import (
    TRACE_BLOCK_SIZE_TOKENS,
    TraceFormatError,
    iter_trace,
    read_trace,
    write_trace,
)

__all__ = [
    "DATASETS",
    "TRACE_BLOCK_SIZE_TOKENS",
    "DatasetSpec",
    "TokenSynthesizer",
    "TraceFormatError",
    "generate_dataset",
    "iter_trace",
    "read_trace",
    "replay_cache",
    "scale_length",
    "scale_request",
    "trace_stats",
    "write_trace",
]
