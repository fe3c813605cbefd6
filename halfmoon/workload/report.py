"""Small aligned text tables for trace statistics and cache-replay results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_SUMMARY_KEYS = ("mean", "p50", "p90", "p99", "max")


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell: the first left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = (cell.rjust(width) for cell, width in zip(cells[1:], widths[1:], strict=True))
        return "  ".join((first, *rest)).rstrip()

    return "\n".join(line(row) for row in (header, *rows))


def _number(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def format_stats(stats: dict[str, Any]) -> str:
    """Human-readable form of :func:`halfmoon.workload.stats.trace_stats`'s result."""
    rate = stats.get("rate_rps")
    overview = format_table(
        ("requests", str(stats["num_requests"])),
        [
            ("duration_s", f"{stats['duration_s']:.1f}"),
            ("rate_rps", "-" if rate is None else f"{rate:.2f}"),
            ("unique_blocks", str(stats["unique_blocks"])),
            ("hit_ratio_infinite", f"{stats['hit_ratio_infinite']:.4f}"),
        ],
    )
    lengths = format_table(
        ("tokens", *_SUMMARY_KEYS),
        [
            (label, *(_number(stats[key][k]) for k in _SUMMARY_KEYS))
            for label, key in (("input", "input_tokens"), ("output", "output_tokens"))
        ],
    )
    return f"{overview}\n\n{lengths}"


def format_capacity(capacity_blocks: int | None) -> str:
    """A capacity in blocks, ``inf`` for unbounded."""
    return "inf" if capacity_blocks is None else str(capacity_blocks)


def format_cache(result: dict[str, Any]) -> str:
    """Human-readable form of :func:`halfmoon.workload.stats.replay_cache`'s result."""
    rows = [
        (format_capacity(item["capacity_blocks"]), f"{item['hit_ratio']:.4f}")
        for item in result["results"]
    ]
    return f"policy: {result['policy']}\n" + format_table(("capacity_blocks", "hit_ratio"), rows)
