"""The scheduler's policies (halfmoon/engine/scheduler.py): ``fcfs`` and vLLM's
``priority`` (the queue by priority then arrival; the running sequence of the highest
priority value preempted for room). No model: sequences and a block manager only."""

from __future__ import annotations

import pytest

from halfmoon.core.request import SamplingParams
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.scheduler import Scheduler, Sequence, Status


def _seq(name: str, prompt_len: int, priority: int = 0) -> Sequence:
    tokens = list(range(10, 10 + prompt_len))
    return Sequence(name, tokens, prompt_len, SamplingParams(priority=priority), 0, frozenset())


def _step(sched: Scheduler) -> tuple[list[str], list[str]]:
    """One step: (scheduled sequences, preempted ones); every chunk computed, and a token
    sampled where the chunk reached the end."""
    out = sched.schedule()
    for chunk in out.chunks:
        chunk.seq.num_computed_tokens = chunk.end
        if chunk.samples:
            chunk.seq.token_ids.append(7)
    return [c.seq.request_id for c in out.chunks], list(out.preempted)


def _served_order(policy: str) -> list[str]:
    sched = Scheduler(BlockManager(64, 4, False), 1, 1024, 1024, policy)
    seqs = {name: _seq(name, 4, prio) for name, prio in
            (("a", 0), ("b", 5), ("c", -1), ("d", 5), ("e", 0))}  # fmt: skip
    for seq in seqs.values():
        sched.add(seq)
    order = []
    while sched.has_unfinished():
        (name,), _ = _step(sched)  # one sequence at a time (max_num_seqs 1)
        order.append(name)
        sched.finish(seqs[name], "stop")  # one token each
    return order


def test_the_queue_follows_the_policy() -> None:
    assert _served_order("fcfs") == ["a", "b", "c", "d", "e"]
    # lower first; arrival among equals
    assert _served_order("priority") == ["c", "a", "e", "b", "d"]


@pytest.mark.parametrize(("policy", "kept", "evicted"),
                         [("fcfs", "low", "high"), ("priority", "high", "low")])  # fmt: skip
def test_room_is_made_by_preempting_by_policy(policy, kept, evicted) -> None:
    """Two decoding sequences fill the pool; ``high`` (priority 0, admitted second) needs
    a block. FCFS preempts the youngest (``high`` itself); ``priority`` preempts ``low``
    (priority 9) although it was already scheduled this step: its chunk is taken back."""
    sched, low, high = _full_pool(policy)
    scheduled, preempted = _step(sched)  # low fits its 8th token; high needs a 3rd block
    assert scheduled == [kept] and preempted == [evicted]
    victim = {"low": low, "high": high}[evicted]
    assert victim.status is Status.WAITING and victim.num_computed_tokens == 0
    assert sched.waiting[0] is victim and victim.num_preemptions == 1


def _full_pool(policy: str) -> tuple[Scheduler, Sequence, Sequence]:
    """A pool of 4 blocks of 4 filled by ``low`` (priority 9, running first, 7 of its 8
    tokens computed) and ``high`` (priority 0, 8 of 9 computed)."""
    sched = Scheduler(BlockManager(4, 4, False), 8, 1024, 1024, policy)
    low, high = _seq("low", 6, priority=9), _seq("high", 8, priority=0)
    sched.add(low)
    assert _step(sched) == (["low"], [])
    sched.add(high)
    assert _step(sched) == (["low", "high"], [])  # 2 blocks each: the pool is full
    return sched, low, high


def test_a_preempted_sequence_goes_back_to_its_place_by_priority() -> None:
    sched, low, high = _full_pool("priority")
    early, late = _seq("early", 4, priority=3), _seq("late", 4, priority=9)
    sched.add(late)
    sched.add(early)
    assert [s.request_id for s in sched.waiting] == ["early", "late"]
    _step(sched)  # low preempted: after early (3), before late (9, arrived after it)
    assert [s.request_id for s in sched.waiting] == ["early", "low", "late"]


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(BlockManager(4, 4), 1, 16, 16, "lifo")


def test_an_engine_under_the_priority_policy_serves_lower_values_first(tiny_dir) -> None:
    """``EngineConfig(scheduling_policy="priority")`` with one sequence at a time: queued
    together, requests finish in priority order (arrival among equals)."""
    from engine_testlib import engine_config

    from halfmoon.engine.engine import LLMEngine

    finished = {}
    for policy in ("fcfs", "priority"):
        engine = LLMEngine(engine_config(tiny_dir, max_num_seqs=1, scheduling_policy=policy))
        for name, priority in (("a", 2), ("b", 0), ("c", 2), ("d", -1)):
            engine.add_request(name, [5, 6, 7], SamplingParams(max_tokens=2, priority=priority))
        order = []
        while engine.has_unfinished_requests():
            order += [out.request_id for out in engine.step() if out.finished]
        finished[policy] = order
    assert finished == {"fcfs": ["a", "b", "c", "d"], "priority": ["d", "b", "a", "c"]}
