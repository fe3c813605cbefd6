"""Chunked pipeline parallelism (CPP) in the Conductor: groups and their candidates.

With ``ConductorConfig.cpp_stages`` K > 1 the prefill instances, in registration order,
form disjoint groups of K consecutive instances (``P1..PK``, ``PK+1..P2K``, ...; the
remainder forms none). A group runs a prompt as a K-stage pipeline
(:func:`halfmoon.costmodel.pipeline.cpp_prefill_estimate`): it starts when every member
is free, so its queue is the longest member queue, and member ``s`` is held until its
stage ends. Each stage uses only its layers' KV, so the prefix a group reuses is the one
every member holds; a longer prefix held elsewhere is fetched by each member for its
layers only (1/K of the bytes each). The shares leave the source over its one link, one
after another (:func:`group_fetches`; the simulator books them so), and with link books
the fetch also waits for the links (:meth:`~halfmoon.conductor.links.LinkBook.fan_out_s`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from halfmoon.conductor.config import ConductorConfig
from halfmoon.conductor.links import LinkBook
from halfmoon.conductor.messages import PrefillCandidate
from halfmoon.conductor.priorities import WHOLE_QUEUE, QueueView
from halfmoon.conductor.state import PrefillState
from halfmoon.core.request import Request
from halfmoon.costmodel.base import CostModel
from halfmoon.costmodel.pipeline import (
    PipelineEstimate,
    cpp_prefill_estimate,
    hidden_bytes_per_token,
)

EstimateFn = Callable[[CostModel, int, int], PipelineEstimate]


def cpp_groups(instance_ids: Sequence[str], num_stages: int) -> list[tuple[str, ...]]:
    """Disjoint groups of ``num_stages`` consecutive instances (none when K <= 1)."""
    if num_stages <= 1:
        return []
    full = len(instance_ids) // num_stages * num_stages
    return [tuple(instance_ids[i : i + num_stages]) for i in range(0, full, num_stages)]


class PipelineEstimator:
    """Memoised pipelined-prefill estimates for one Conductor's configuration."""

    def __init__(self, config: ConductorConfig) -> None:
        self.config = config
        self._memo: dict[tuple[int, int, int], PipelineEstimate] = {}

    def estimate(self, cost_model: CostModel, new: int, cached: int) -> PipelineEstimate:
        """The schedule of ``new`` tokens after ``cached`` over ``cpp_stages`` stages."""
        key = (id(cost_model), new, cached)
        value = self._memo.get(key)
        if value is None:
            if len(self._memo) > 4096:  # bounded: keys are mostly distinct prompt lengths
                self._memo.clear()
            cfg = self.config
            hidden = hidden_bytes_per_token(cost_model, cfg.cpp_hidden_bytes_per_token)
            value = self._memo[key] = cpp_prefill_estimate(
                cost_model, cfg.cpp_stages, new, cached, cfg.cpp_chunk_tokens, hidden
            )
        return value


def group_fetches(
    request: Request,
    group: Sequence[str],
    source: str,
    num_blocks: int,
    matched_blocks: dict[str, int],
    cost_model: CostModel,
) -> list[tuple[str, float]]:
    """``(member, seconds)`` for each member of ``group`` that lacks part of the first
    ``num_blocks`` blocks held by ``source``: the link time of its layers' share (1/K)
    of the blocks it lacks, in stage order."""
    share_bytes = request.block_size_tokens * cost_model.kv_bytes_per_token / len(group)
    return [
        (m, cost_model.transfer_time_s((num_blocks - matched_blocks.get(m, 0)) * share_bytes))
        for m in group
        if m != source and matched_blocks.get(m, 0) < num_blocks
    ]


def group_fetch_s(
    fetches: Sequence[tuple[str, float]],
    source: str,
    ready_s: float,
    links: LinkBook | None,
    book: bool = False,
) -> float:
    """Seconds until every member's share of the fetch (:func:`group_fetches`) is in, the
    source sending one share after another from ``ready_s``; with ``links`` also waiting
    for them (``book``: reserving them)."""
    if links is None:
        return sum(seconds for _, seconds in fetches)
    return links.fan_out_s(ready_s, source, fetches, book)


def group_scale(states: dict[str, PrefillState], group: Sequence[str]) -> float:
    """The prefill scale of a CPP group: its slowest member's (a pipeline runs at the
    pace of its slowest stage)."""
    return max(states[m].prefill_scale for m in group)


def group_candidates(
    request: Request,
    groups: Sequence[tuple[str, ...]],
    states: dict[str, PrefillState],
    matched_blocks: dict[str, int],
    now_s: float,
    estimator: PipelineEstimator,
    use_remote: bool,
    links: LinkBook | None = None,
    view: QueueView = WHOLE_QUEUE,
) -> list[PrefillCandidate]:
    """One candidate per group with the prefix all members hold, and (``use_remote``)
    one that first fetches the longest prefix held anywhere, when it is longer by more
    than the balancing threshold (the fetch starts when the group's queue is through);
    a group's queue is its members' longest as ``view`` sees them."""
    block = request.block_size_tokens
    source = max(matched_blocks, key=matched_blocks.__getitem__) if matched_blocks else ""
    best_blocks = matched_blocks.get(source, 0)
    threshold_tokens = estimator.config.kvcache_balancing_threshold * request.input_length
    out = []
    for group in groups:
        cm = states[group[0]].cost_model
        queue_s = max(view.state_s(states[m], now_s) for m in group)
        common = min(matched_blocks[m] for m in group)
        options = [(common, group[0], 0.0)]
        if use_remote and (best_blocks - common) * block > threshold_tokens:
            fetches = group_fetches(request, group, source, best_blocks, matched_blocks, cm)
            transfer_s = group_fetch_s(fetches, source, now_s + queue_s, links)
            options.append((best_blocks, source, transfer_s))
        scale = group_scale(states, group)
        for num_blocks, src, transfer_s in options:
            cached = min(num_blocks * block, request.input_length - 1)
            est = estimator.estimate(cm, request.input_length - cached, cached)
            prefill_s = est.ttft_s * scale
            out.append(
                PrefillCandidate(group[0], cached, src, queue_s, prefill_s, transfer_s, group)
            )
    return out
