"""Prefill candidates of one request: each instance with its local prefix, and (paper,
step 3c) each instance fetching the longest prefix held anywhere first.

Estimates go through a per-decision memo: most instances share a cost model and a
cached length (often zero), so each distinct estimate is computed once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from halfmoon.conductor.messages import PrefillCandidate
from halfmoon.conductor.state import PrefillState
from halfmoon.core.request import Request
from halfmoon.costmodel.base import CostModel

Memo = dict[tuple[int, int, int], float]


def memo_prefill_s(memo: Memo, cost_model: CostModel, new: int, cached: int) -> float:
    """``cost_model.prefill_time_s(new, cached)``, computed once per decision."""
    key = (id(cost_model), new, cached)
    value = memo.get(key)
    if value is None:
        value = memo[key] = cost_model.prefill_time_s(new, cached)
    return value


def local_candidates(
    request: Request,
    states: Mapping[str, PrefillState],
    instance_ids: Sequence[str],
    matched_blocks: Mapping[str, int],
    now_s: float,
    memo: Memo,
) -> list[PrefillCandidate]:
    """One candidate per instance, using the prefix it holds itself."""
    block = request.block_size_tokens
    out = []
    for iid in instance_ids:
        state = states[iid]
        cached = min(matched_blocks[iid] * block, request.input_length - 1)
        prefill_s = memo_prefill_s(memo, state.cost_model, request.input_length - cached, cached)
        out.append(PrefillCandidate(iid, cached, iid, state.queue_s(now_s), prefill_s, 0.0))
    return out


def remote_candidates(
    request: Request,
    states: Mapping[str, PrefillState],
    local: Sequence[PrefillCandidate],
    matched_blocks: Mapping[str, int],
    threshold: float,
    memo: Memo,
) -> list[PrefillCandidate]:
    """Candidates that first fetch the longest prefix held anywhere, for instances whose
    own prefix is shorter by more than ``threshold`` x prompt length."""
    block = request.block_size_tokens
    source = max(matched_blocks, key=matched_blocks.__getitem__)  # first on ties
    best_blocks = matched_blocks[source]
    threshold_tokens = threshold * request.input_length
    out = []
    for cand in local:
        missing_blocks = best_blocks - matched_blocks[cand.instance_id]
        if missing_blocks <= 0 or missing_blocks * block <= threshold_tokens:
            continue
        cm = states[cand.instance_id].cost_model
        cached = min(best_blocks * block, request.input_length - 1)
        out.append(
            PrefillCandidate(
                cand.instance_id,
                cached,
                source,
                cand.queue_s,
                memo_prefill_s(memo, cm, request.input_length - cached, cached),
                cm.transfer_time_s(missing_blocks * block * cm.kv_bytes_per_token),
            )
        )
    return out
