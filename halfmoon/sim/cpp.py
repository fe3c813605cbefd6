"""A chunked-pipeline (CPP) prefill over a group of simulated prefill instances.

When a Decision names a group, the request is queued on every member (in the same
arrival order on all of them, so groups never wait on each other in a cycle). Each member
that reaches it at the head of its queue holds itself for it; once all are held::

    fetch:    each member lacking part of the planned prefix fetches its layers' share
              (1/K of the bytes) from the source (NIC reservations: one share after
              another on the source's NIC)
    compute:  PrefillStarted on every member; the pipeline of
              halfmoon.costmodel.pipeline.cpp_prefill_estimate runs from now
    release:  member s is released at its stage's end (PrefillFinished, next job)
    KV:       every stage streams its layers' KV (1/K of it) to the decode instance as
              it computes; the request reaches decode when the last stage's tail is in

A stage holds only its layers' KV, so a group prefill inserts no full blocks into the
members' prefix caches (the prefix it reuses is the one every member fully holds).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from halfmoon.conductor.messages import PrefillFinished, PrefillStarted
from halfmoon.costmodel.pipeline import PipelineEstimate, cpp_prefill_estimate
from halfmoon.sim.events import NO_EVENTS, Event
from halfmoon.sim.job import Job
from halfmoon.sim.network import kv_stream_tail_s, reserve_transfer

if TYPE_CHECKING:
    from halfmoon.sim.prefill import PrefillInstance


class CPPRun:
    """One request's pipelined prefill over ``members`` (stage order), in chunks of
    ``chunk_tokens`` with ``hidden_bytes_per_token`` between stages; each stage holds
    ``num_layers // len(members)`` of the model's layers."""

    def __init__(
        self,
        job: Job,
        members: Sequence[PrefillInstance],
        *,
        chunk_tokens: int,
        hidden_bytes_per_token: int,
        num_layers: int,
    ) -> None:
        self.job = job
        self.members = tuple(members)
        self._chunk_tokens = chunk_tokens
        self._hidden_bytes = hidden_bytes_per_token
        self._layers_per_stage = max(1, num_layers // len(self.members))
        self._held: set[str] = set()
        self.estimate: PipelineEstimate | None = None

    def member_ready(self, member: PrefillInstance) -> Sequence[Event]:
        """``member`` reached this request at the head of its queue and holds for it."""
        self._held.add(member.instance_id)
        if len(self._held) < len(self.members):
            return NO_EVENTS
        return self._start()

    def _start(self) -> Sequence[Event]:
        job = self.job
        first = self.members[0]
        hashes = job.full_block_hashes
        local = {m.instance_id: m.cache.match(hashes) for m in self.members}
        common = min(local.values())
        source = job.cache_source
        held = 0
        if source is not None and job.planned_cached_blocks > common:
            held = source.cache.match(hashes[: job.planned_cached_blocks])
        if held <= common:
            return self._compute(common)
        k = len(self.members)
        block_bytes = job.request.block_size_tokens * first.cost_model.kv_bytes_per_token
        now = first.clock.now()
        end_s = now
        for m in self.members:
            missing = held - min(local[m.instance_id], held)
            if missing > 0 and m is not source:
                xfer_s = m.cost_model.transfer_time_s(missing * block_bytes / k)
                end_s = max(end_s, reserve_transfer(now, xfer_s, source.nic, m.nic))
        first.num_fetches += 1
        return (Event(end_s, lambda: self._compute(held)),)

    def _compute(self, num_cached_blocks: int) -> Sequence[Event]:
        job = self.job
        request = job.request
        first = self.members[0]
        cached = min(num_cached_blocks * request.block_size_tokens, request.input_length - 1)
        job.record.cached_tokens = cached
        est = cpp_prefill_estimate(
            first.cost_model,
            len(self.members),
            request.input_length - cached,
            cached,
            self._chunk_tokens,
            self._hidden_bytes,
        )
        self.estimate = est
        start_s = first.clock.now()
        for m in self.members:
            m.notify(PrefillStarted(m.instance_id, job.request_id))
        return tuple(
            Event(start_s + end_s, lambda s=s: self._release(s, start_s))
            for s, end_s in enumerate(est.stage_end_s)
        )

    def _release(self, stage: int, start_s: float) -> Sequence[Event]:
        member = self.members[stage]
        est = self.estimate
        assert est is not None
        member.busy_s += est.stage_busy_s[stage]
        member.notify(PrefillFinished(member.instance_id, self.job.request_id))
        events = list(member.release())
        if stage == len(self.members) - 1:
            events.extend(self._finish(start_s))
        return events

    def _finish(self, start_s: float) -> Sequence[Event]:
        """The last chunk left the last stage: hand the KV of every stage to decode."""
        job = self.job
        est = self.estimate
        assert est is not None
        now = self.members[-1].clock.now()
        job.record.prefill_done_s = now
        self.members[-1].num_prefilled += 1
        decode = job.decode
        if decode is None:
            raise RuntimeError(f"request {job.request_id} has no decode instance")
        arrive_s = now
        for s, m in enumerate(self.members):
            stage_end_s = start_s + est.stage_end_s[s]
            tail_s = self._stage_stream_end_s(m, s) - est.stage_end_s[s]
            end_s = reserve_transfer(stage_end_s, max(0.0, tail_s), m.nic, decode.nic)
            arrive_s = max(arrive_s, end_s)
        return (Event(arrive_s, lambda: decode.kv_arrived(job)),)

    def _stage_stream_end_s(self, member: PrefillInstance, stage: int) -> float:
        """When stage ``stage``'s layers' KV (1/K of the prompt's) is all at the decode
        instance, in seconds from the pipeline's start: the layer-wise stream of
        ``kv_stream_tail_s`` over the stage's last chunk, never before the stage's
        share of the whole prompt has crossed the link from its first chunk on."""
        est = self.estimate
        assert est is not None
        k = len(self.members)
        xfer = member.cost_model.transfer_time_s
        per_token = member.cost_model.kv_bytes_per_token / k
        input_tokens = self.job.request.input_length
        last_tokens = est.chunk_sizes[-1] if est.chunk_sizes else 0
        tail_s = kv_stream_tail_s(
            est.last_chunk_stage_s,
            xfer((input_tokens - last_tokens) * per_token),
            xfer(last_tokens * per_token),
            self._layers_per_stage,
        )
        whole_s = est.stage_start_s[stage] + xfer(input_tokens * per_token)
        return max(whole_s, est.stage_end_s[stage] + tail_s)
