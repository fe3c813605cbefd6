"""Prefill candidates of one request: each instance with its local prefix, and (paper,
step 3c) each instance fetching the longest prefix held anywhere first.

Estimates go through a per-decision memo: most instances share a cost model and a
cached length (often zero), so each distinct estimate is computed once.
:func:`least_ttft_candidates` is the kvcache-centric choice's pruned equivalent: the same
estimates for every instance at once, as arrays, keeping only those that can win.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from halfmoon.conductor.links import LinkBook
from halfmoon.conductor.loads import PrefillLoads
from halfmoon.conductor.messages import PrefillCandidate
from halfmoon.conductor.priorities import WHOLE_QUEUE, QueueView
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
    view: QueueView = WHOLE_QUEUE,
) -> list[PrefillCandidate]:
    """One candidate per instance, using the prefix it holds itself; its queue is the
    request's wait there as ``view`` sees it (:mod:`halfmoon.conductor.priorities`)."""
    block = request.block_size_tokens
    out = []
    for iid in instance_ids:
        state = states[iid]
        cached = min(matched_blocks[iid] * block, request.input_length - 1)
        raw_s = memo_prefill_s(memo, state.cost_model, request.input_length - cached, cached)
        prefill_s = raw_s * state.prefill_scale
        queue_s = view.state_s(state, now_s)
        out.append(PrefillCandidate(iid, cached, iid, queue_s, prefill_s, 0.0))
    return out


def remote_candidates(
    request: Request,
    states: Mapping[str, PrefillState],
    local: Sequence[PrefillCandidate],
    matched_blocks: Mapping[str, int],
    threshold: float,
    memo: Memo,
    links: LinkBook | None = None,
    now_s: float = 0.0,
    overlap: bool = False,
) -> list[PrefillCandidate]:
    """Candidates that first fetch the longest prefix held anywhere, for instances whose
    own prefix is shorter by more than ``threshold`` x prompt length. With ``links``, a
    fetch (ready when the instance's queue is through; with ``overlap``, now) also waits
    for both links."""
    block = request.block_size_tokens
    source = max(matched_blocks, key=matched_blocks.__getitem__)  # first on ties
    best_blocks = matched_blocks[source]
    threshold_tokens = threshold * request.input_length
    out = []
    for cand in local:
        missing_blocks = best_blocks - matched_blocks[cand.instance_id]
        if missing_blocks <= 0 or missing_blocks * block <= threshold_tokens:
            continue
        state = states[cand.instance_id]
        cm = state.cost_model
        cached = min(best_blocks * block, request.input_length - 1)
        transfer_s = cm.transfer_time_s(missing_blocks * block * cm.kv_bytes_per_token)
        if links is not None:
            ready_s = now_s if overlap else now_s + cand.queue_s
            transfer_s = links.wait_s(ready_s, source, cand.instance_id) + transfer_s
        out.append(
            PrefillCandidate(
                cand.instance_id,
                cached,
                source,
                cand.queue_s,
                memo_prefill_s(memo, cm, request.input_length - cached, cached)
                * state.prefill_scale,
                transfer_s,
                overlap=overlap,
            )
        )
    return out


#: Candidates of each kind (local, remote) a pruned decision keeps for its explanation.
KEEP_CANDIDATES = 4


def least_ttft_candidates(
    request: Request,
    loads: PrefillLoads,
    held_blocks: Mapping[str, int],
    threshold: float,
    now_s: float,
    memo: Memo,
    links: LinkBook | None = None,
    overlap: bool = False,
    view: QueueView = WHOLE_QUEUE,
) -> tuple[list[PrefillCandidate], int]:
    """What ``local_candidates + remote_candidates`` over ``loads.ids`` would list (the
    queues as ``view`` sees them), pruned
    to the :data:`KEEP_CANDIDATES` least-TTFT ones of each kind (ties: instance order), in
    that list's order; and the length of the full list.

    ``held_blocks``: the instances holding a prefix (``PrefixIndex.match_holders``); the
    others have nothing cached, so their estimates differ only by their queues. The full
    list's first least-TTFT candidate is always kept, so ``min(ttft)`` picks the same one.
    TTFTs are computed for every instance at once with the same float operations as
    :attr:`PrefillCandidate.ttft_s` (queue + transfer, or their maximum with ``overlap``,
    then + prefill), each prefill the
    cost model's times the instance's prefill scale, as the scalar lists do.
    """
    ids, position = loads.ids, loads.position
    block, length = request.block_size_tokens, request.input_length
    queue = view.loads_s(loads, now_s)
    local_s = loads.per_model(lambda cm: memo_prefill_s(memo, cm, length, 0))
    cached = {}
    for iid, num_blocks in held_blocks.items():
        i = position[iid]
        cached[i] = min(num_blocks * block, length - 1)
        local_s[i] = memo_prefill_s(memo, loads.states[i].cost_model, length - cached[i], cached[i])
    local_s = local_s * loads.scale
    local_ttft = (queue + 0.0) + local_s
    picked = np.argsort(local_ttft, kind="stable")[:KEEP_CANDIDATES]
    out = [
        PrefillCandidate(ids[i], cached.get(i, 0), ids[i], float(queue[i]), float(local_s[i]), 0.0)
        for i in sorted(picked.tolist())
    ]
    best_blocks = max(held_blocks.values(), default=0)
    if not best_blocks:
        return out, len(ids)
    remote, num_remote = _least_ttft_remote(
        request, loads, held_blocks, best_blocks, threshold, queue, memo, links, now_s, overlap
    )
    return out + remote, len(ids) + num_remote


def _least_ttft_remote(
    request: Request,
    loads: PrefillLoads,
    held_blocks: Mapping[str, int],
    best_blocks: int,
    threshold: float,
    queue: np.ndarray,
    memo: Memo,
    links: LinkBook | None,
    now_s: float,
    overlap: bool = False,
) -> tuple[list[PrefillCandidate], int]:
    """The remote half of :func:`least_ttft_candidates`: the least-TTFT candidates that
    fetch the longest prefix (``best_blocks``) first, and how many there are in all."""
    ids, position = loads.ids, loads.position
    block, length = request.block_size_tokens, request.input_length
    source = ids[min(position[iid] for iid, n in held_blocks.items() if n == best_blocks)]
    best_cached = min(best_blocks * block, length - 1)
    threshold_tokens = threshold * length

    def transfer_s(cm: CostModel, missing_blocks: int) -> float:
        return cm.transfer_time_s(missing_blocks * block * cm.kv_bytes_per_token)

    # Instances holding nothing miss all best_blocks; holders are set one by one.
    xfer_s = loads.per_model(lambda cm: transfer_s(cm, best_blocks))
    eligible = np.full(len(ids), best_blocks * block > threshold_tokens)
    for iid, num_blocks in held_blocks.items():
        i, missing = position[iid], best_blocks - num_blocks
        eligible[i] = missing > 0 and missing * block > threshold_tokens
        xfer_s[i] = transfer_s(loads.states[i].cost_model, missing) if eligible[i] else 0.0
    if links is not None:  # the same float operations as LinkBook.wait_s, at once
        free = np.fromiter((links.free_at_s(iid) for iid in ids), float, len(ids))
        ready = np.full(len(ids), now_s) if overlap else now_s + queue
        wait = np.maximum(0.0, np.maximum(links.free_at_s(source), free) - ready)
        wait[position[source]] = 0.0
        xfer_s = wait + xfer_s
    remote_s = loads.per_model(
        lambda cm: memo_prefill_s(memo, cm, length - best_cached, best_cached)
    )
    remote_s = remote_s * loads.scale
    before_s = np.maximum(queue, xfer_s) if overlap else queue + xfer_s
    remote_ttft = np.where(eligible, before_s + remote_s, np.inf)
    picked = np.argsort(remote_ttft, kind="stable")[:KEEP_CANDIDATES]
    out = [
        PrefillCandidate(
            ids[i],
            best_cached,
            source,
            float(queue[i]),
            float(remote_s[i]),
            float(xfer_s[i]),
            overlap=overlap,
        )
        for i in sorted(picked.tolist())
        if eligible[i]
    ]
    return out, int(eligible.sum())
