"""Frozen configuration records shared across layers."""

from __future__ import annotations

from dataclasses import dataclass

TBT_METRICS = ("p90", "top10mean")


@dataclass(frozen=True)
class SLOConfig:
    """Latency objectives. ``tbt_metric`` says how one request's TBT is summarised:
    ``p90`` of its inter-token gaps (arXiv version) or ``top10mean``, the mean of its
    longest 10% of gaps (FAST'25)."""

    ttft_s: float = 30.0
    tbt_s: float = 0.1
    tbt_metric: str = "top10mean"

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tbt_s <= 0:
            raise ValueError(f"SLOs must be positive, got ttft={self.ttft_s} tbt={self.tbt_s}")
        if self.tbt_metric not in TBT_METRICS:
            raise ValueError(
                f"unknown tbt metric {self.tbt_metric!r}; choose from {', '.join(TBT_METRICS)}"
            )
