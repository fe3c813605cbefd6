"""L4 benchmark client: replay Mooncake traces or synthetic datasets against any
OpenAI-compatible endpoint (``halfmoon bench``).

Prompts are real token ids built from the trace's block ids (shared prefixes are real),
streamed from ``/v1/completions`` with the trace's output length; the report is
:func:`halfmoon.metrics.summarize`'s, key for key the same as ``halfmoon simulate``'s.
"""

from halfmoon.bench.client import ClientConfig, StreamStats, completion_body, send_request
from halfmoon.bench.report import bench_report, format_bench
from halfmoon.bench.runner import BenchRun, run_benchmark, run_requests
from halfmoon.bench.workload import (
    BenchRequest,
    PromptMaker,
    PromptSpec,
    block_tokens_for_scale,
    plan_requests,
)

__all__ = [
    "BenchRequest",
    "BenchRun",
    "ClientConfig",
    "PromptMaker",
    "PromptSpec",
    "StreamStats",
    "bench_report",
    "block_tokens_for_scale",
    "completion_body",
    "format_bench",
    "plan_requests",
    "run_benchmark",
    "run_requests",
    "send_request",
]
