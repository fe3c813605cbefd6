"""Decode-side estimates and early rejection (the paper's admission control).

``snapshot`` looks at the decode batch as it is now; ``predict`` forecasts it for the
moment the request's prefill ends: running requests whose decode (assumed to last a
uniform t_d) ends before then leave, placed requests whose prefill ends before then join.
"""

from __future__ import annotations

from halfmoon.conductor.config import ConductorConfig
from halfmoon.conductor.messages import DecodeCandidate, PrefillCandidate, RejectCode
from halfmoon.conductor.state import DecodeState
from halfmoon.core.request import Request


def uniform_decode_time_s(request: Request, dstate: DecodeState, learned_s: float | None) -> float:
    """t_d: the learned average, or before any observation this request's own estimate."""
    if learned_s is not None:
        return learned_s
    step = dstate.step_time_s(dstate.num_running + 1, dstate.context_tokens)
    return request.output_length * step


def decode_candidate(
    request: Request, dstate: DecodeState, ready_s: float, predict: bool, t_d: float
) -> DecodeCandidate:
    """Estimated TBT on ``dstate`` once the request joins (predicted at ``ready_s`` when
    ``predict``, else counting running and incoming requests as they are now)."""
    if predict:
        members = [c for start, c in dstate.running.values() if start + t_d > ready_s]
        members += [c for done, c in dstate.incoming.values() if done <= ready_s]
        num, ctx = len(members), sum(members)
    else:
        num = dstate.num_running + len(dstate.incoming)
        ctx = dstate.committed_tokens
    num += 1
    ctx += request.input_length
    return DecodeCandidate(dstate.instance_id, num, ctx, dstate.step_time_s(num, ctx))


def rejection_reason(
    config: ConductorConfig,
    request: Request,
    chosen: PrefillCandidate,
    decode: DecodeCandidate,
    dstate: DecodeState,
) -> tuple[str, str]:
    """Why the request must be rejected before any prefill work: (a
    :class:`RejectCode`, the text), or ("", "") to admit it."""
    mode = config.early_reject
    if mode == "none":
        return "", ""
    slo = config.slo
    if chosen.ttft_s > slo.ttft_s:
        return RejectCode.TTFT, (
            f"estimated TTFT {chosen.ttft_s:.2f}s on {chosen.label} exceeds the {slo.ttft_s:g}s SLO"
        )
    if mode == "snapshot":
        num = dstate.num_running + 1
        tbt_s = dstate.step_time_s(num, dstate.context_tokens + request.input_length)
    else:
        tbt_s = decode.est_tbt_s
    if tbt_s > slo.tbt_s:
        return RejectCode.TBT, (
            f"estimated TBT {tbt_s * 1e3:.1f}ms on {decode.instance_id} ({mode}) "
            f"exceeds the {slo.tbt_s * 1e3:g}ms SLO"
        )
    need = request.input_length + request.output_length
    if dstate.committed_tokens + need > dstate.kv_capacity_tokens:
        return RejectCode.KV_FULL, (
            f"decode KV full on {decode.instance_id}: {dstate.committed_tokens}+{need} "
            f"tokens > capacity {dstate.kv_capacity_tokens}"
        )
    return "", ""
