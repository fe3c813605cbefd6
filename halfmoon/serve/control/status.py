"""The cluster as the Conductor service sees it, for the live cluster page.

:func:`cluster_status` answers a ``status_query`` (:class:`ClusterStatus`) from the
service's own books: its registered instances with their last load reports, the
Conductor's state, and its latest placement decisions turned into plain maps by
:func:`decision_record` (what a browser shows; the objects stay in the service).

An instance's ``state``: ``draining`` (out of placement, finishing its requests), else
``silent`` when not heard from for more than ``SILENT_AFTER_S`` (workers beat ~4/s; the
service drops it after its heartbeat timeout), else ``healthy``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from halfmoon.conductor import Decision
from halfmoon.serve.control.messages import ClusterStatus, InstanceStatus

if TYPE_CHECKING:
    from halfmoon.serve.control.conductor_service import ConductorService

#: Seconds without a heartbeat after which an instance shows as ``silent``.
SILENT_AFTER_S = 1.0


def instance_state(draining: bool, seen_s_ago: float) -> str:
    """``draining``, ``silent`` or ``healthy`` (see the module docstring)."""
    if draining:
        return "draining"
    return "silent" if seen_s_ago > SILENT_AFTER_S else "healthy"


def cluster_status(service: ConductorService, num_decisions: int) -> ClusterStatus:
    """Every registered instance, the Conductor's state and its latest ``num_decisions``
    decisions, newest first."""
    rows = []
    for iid, ends in sorted(service.instances.items()):
        seen_s_ago = service.seen_s_ago(iid)
        load = service.last_load.get(iid)
        figures: dict[str, Any] = {}
        if load is not None:
            figures = {
                "num_running": load.num_running, "num_waiting": load.num_waiting,
                "kv_used_tokens": load.kv_used_tokens,
                "kv_capacity_tokens": load.kv_capacity_tokens,
                "queued_prefill_tokens": load.queued_prefill_tokens,
                "spec_rows_per_seq": round(load.spec_rows_per_seq, 3),
                "spec_tokens_per_step": round(load.spec_tokens_per_step, 3),
            }  # fmt: skip
        rows.append(InstanceStatus(
            instance_id=iid, role=ends.role,
            state=instance_state(iid in service.draining, seen_s_ago),
            seen_s_ago=round(seen_s_ago, 3), index_blocks=service.conductor.index.num_held(iid),
            est_queue_s=_queue_s(service, iid),
            store=dict(service.store_stats.get(iid, {})), **figures,
        ))  # fmt: skip
    recent = list(service.recent_decisions)
    newest = recent[::-1][: max(0, num_decisions)]
    return ClusterStatus(
        instances=rows,
        conductor=conductor_state(service, recent),
        decisions=[decision_record(at_s, d, took_s) for at_s, d, took_s in newest],
    )


def _queue_s(service: ConductorService, iid: str) -> float:
    """The Conductor's queueing estimate on a prefill or coupled instance (0 elsewhere)."""
    conductor = service.conductor
    if iid in conductor.prefill_instances or iid in conductor.coupled_instances:
        return round(conductor.queue_s(iid), 4)
    return 0.0


def conductor_state(
    service: ConductorService, recent: list[tuple[float, Decision, float]]
) -> dict[str, Any]:
    """The Conductor's own figures: policy, SLOs, requests placed and not finished,
    balancing, calibration, priorities, integrity, and what its ``recent`` decisions did
    (rejections by code, mean decision time)."""
    conductor = service.conductor
    config = conductor.config
    rejected: dict[str, int] = {}
    for _, decision, _ in recent:
        if not decision.accepted:
            code = decision.reject_code or "other"
            rejected[code] = rejected.get(code, 0) + 1
    took = [s for _, _, s in recent]
    return {
        "policy": config.policy,
        "slo": {
            "ttft_s": config.slo.ttft_s,
            "tbt_s": config.slo.tbt_s,
            "tbt_metric": config.slo.tbt_metric,
        },  # fmt: skip
        "num_placements": conductor.num_placements,
        "num_instances": len(service.instances),
        "draining": sorted(service.draining),
        "balancing": dict(conductor.balancing),
        "prefill_calibration": conductor.prefill_calibration,
        "ttft_lateness_s": conductor.ttft_lateness_s,
        "ttft_lateness_spread": conductor.ttft_lateness_spread,
        "priorities": conductor.priorities,
        "integrity": service.integrity(),
        "cluster": dataclasses.asdict(service.cluster),
        "num_recent_decisions": len(recent),
        "recent_rejections": rejected,
        "mean_decision_s": sum(took) / len(took) if took else 0.0,
    }


def decision_record(at_s: float, decision: Decision, decision_s: float) -> dict[str, Any]:
    """One decision as a plain map: when (wall time ``at_s``), its outcome and reason,
    every candidate with its estimates (``chosen`` marks the winner), the replications it
    planned, and :meth:`Decision.explain`'s text."""
    chosen_p, chosen_d = decision.prefill, decision.decode
    return {
        "request_id": decision.request_id,
        "at_s": at_s,
        "decision_s": decision_s,
        "accepted": decision.accepted,
        "policy": decision.policy,
        "why": decision.why,
        "reject_code": decision.reject_code,
        "reject_reason": decision.reject_reason,
        "prefill": None if chosen_p is None else chosen_p.label,
        "decode": None if chosen_d is None else chosen_d.instance_id,
        "cached_tokens": None if chosen_p is None else chosen_p.cached_tokens,
        "est_ttft_s": decision.est_ttft_s,
        "est_tbt_s": None if chosen_d is None else chosen_d.est_tbt_s,
        "candidates": [
            {
                "instance": c.label,
                "cache_source": c.cache_source,
                "cached_tokens": c.cached_tokens,
                "queue_s": c.queue_s,
                "transfer_s": c.transfer_s,
                "prefill_s": c.prefill_s,
                "ttft_s": c.ttft_s,
                "chosen": c == chosen_p,
            }  # fmt: skip
            for c in decision.candidates
        ],
        "num_candidates": decision.num_candidates or len(decision.candidates),
        "decode_candidates": [
            {
                "instance": d.instance_id,
                "num_running": d.num_running,
                "context_tokens": d.context_tokens,
                "est_tbt_s": d.est_tbt_s,
                "chosen": d == chosen_d,
            }  # fmt: skip
            for d in decision.decode_candidates
        ],
        "replications": [
            {
                "source": r.source,
                "target": r.target,
                "num_blocks": len(r.block_hashes),
                "reason": r.reason,
            }  # fmt: skip
            for r in decision.replications
        ],
        "explain": decision.explain(),
    }
