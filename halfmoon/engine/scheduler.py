"""Sequences and the step scheduler (no tensors here).

Every step hands each scheduled sequence a chunk of its not-yet-computed tokens: a
prompt is ``len(prompt)`` tokens behind (cut into ``chunk_tokens`` pieces), a decoding
sequence exactly one (its last sampled token), plus any draft tokens to check with it
(speculative decoding, :mod:`halfmoon.engine.speculative`: given after every running
sequence has its own token, while the budget and free blocks allow, never preempting).
Running sequences go first, oldest first, then waiting ones are admitted (taking their cached prefix) while the token budget,
``max_num_seqs`` and free blocks allow. When a running sequence cannot get a block for
its next token, the youngest running sequence is preempted: its blocks are freed (full
ones stay in the prefix cache) and it returns to the head of the queue to be recomputed
from its prompt plus the tokens it already generated.

Under the ``priority`` policy (vLLM's ``--scheduling-policy priority``) the queue is
ordered by each request's ``priority`` (lower first), then by arrival; running sequences
are still stepped in the order they were admitted, and the one preempted for room is
the running sequence of the highest priority value (the latest to arrive among equals),
which goes back to its place in the queue.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from halfmoon.core.request import SCHEDULING_POLICIES, SamplingParams, TokenLogprob
from halfmoon.engine.block_manager import BlockManager
from halfmoon.engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from halfmoon.engine.structured import Constraint


class Status(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable state of one request inside the engine."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    stop_token_ids: frozenset[int]
    detokenizer: IncrementalDetokenizer | None = None
    keep_kv: bool = False
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    text: str = field(default="")
    #: Roots its blocks' hash chain: prefix-cache hits only among requests with the same.
    cache_salt: str | None = None
    #: The prompt's log-probabilities computed so far (of prompt tokens 1, 2, ...), when
    #: the request asked for them (``params.prompt_logprobs``).
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Its place in its structured output's grammar (``params.structured``), or None.
    constraint: Constraint | None = None
    #: ``params.bad_words`` as token sequences.
    bad_words: tuple[tuple[int, ...], ...] = ()
    #: Its arrival order in its scheduler (set when queued; kept across preemptions).
    arrival: int = -1

    @property
    def rank(self) -> tuple[int, int]:
        """Its place under the ``priority`` policy: ``(priority, arrival)``, lower first."""
        return self.params.priority, self.arrival

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt log-probabilities remain to be computed: then the prompt
        positions they need are computed, never taken from the prefix cache."""
        return self.params.prompt_logprobs is not None and (
            len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens."""
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens ``[start, start + num_tokens)`` of ``seq`` this step."""

    seq: Sequence
    start: int
    num_tokens: int
    #: Draft tokens checked after the chunk's one token (speculative decoding,
    #: :mod:`halfmoon.engine.speculative`); computed at positions ``end..``.
    draft: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        """One past the last of the sequence's own tokens computed (drafts aside)."""
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token (so a token is sampled)."""
        return self.end == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's work, and the sequences preempted to make room for it."""

    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]


class Scheduler:
    """Continuous batching with chunked prefill and recompute preemption, first come
    first served or by priority (``policy``, see the module docstring)."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        chunk_tokens: int,
        policy: str = "fcfs",
    ):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunk_tokens = chunk_tokens
        self.by_priority = policy == "priority"
        self.waiting: deque[Sequence] = deque()
        #: Draft tokens for a decoding sequence, at most the given number (speculative
        #: decoding: :class:`~halfmoon.engine.speculative.NgramProposer`), or None.
        self.proposer: Callable[[Sequence, int], tuple[int, ...]] | None = None
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._arrivals = itertools.count()

    def _queue(self, seq: Sequence, front: bool = False) -> None:
        """Put ``seq`` in the waiting queue: at its place by rank under ``priority``; else
        at the back, or at the front (``front``: a preempted sequence)."""
        seq.status = Status.WAITING
        if seq.arrival < 0:
            seq.arrival = next(self._arrivals)
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=lambda s: s.rank)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        self._queue(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join a sequence whose blocks are already allocated (KV import)."""
        seq.status = Status.RUNNING
        if seq.arrival < 0:
            seq.arrival = next(self._arrivals)
        self.running.append(seq)

    def num_prefill_tokens(self) -> int:
        """Tokens still to prefill: all of each waiting sequence's, the rest of each
        running prompt (see :class:`~halfmoon.engine.engine.EngineStats`)."""
        waiting = sum(seq.num_tokens - seq.num_computed_tokens for seq in self.waiting)
        running = sum(
            seq.num_prompt_tokens - seq.num_computed_tokens
            for seq in self.running
            if seq.num_computed_tokens < seq.num_prompt_tokens
        )
        return waiting + running

    def has_unfinished(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop ``seq`` (abort) from the queues and free any blocks it holds."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        if self.block_manager.has_request(seq.request_id):
            self.block_manager.free(seq.request_id)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` finished; its blocks are freed unless it keeps its KV for export."""
        self.running.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        if not seq.keep_kv:
            self.block_manager.free(seq.request_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(seq, front=True)

    def _victim(self) -> Sequence:
        """The running sequence to preempt for room: the youngest, or under ``priority``
        the one of the highest rank."""
        if self.by_priority:
            return max(self.running, key=lambda s: s.rank)
        return self.running[-1]

    def schedule(self) -> SchedulerOutput:
        """Pick this step's chunks (see the module docstring)."""
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_tokens - seq.num_computed_tokens, self.chunk_tokens, budget)
            while not self.block_manager.grow(seq.request_id, seq.num_computed_tokens + num_new):
                victim = self._victim()
                self._preempt(victim)
                preempted.append(victim.request_id)
                # (under ``priority`` it may have been scheduled earlier in this loop)
                for k, chunk in enumerate(chunks):
                    if chunk.seq is victim:
                        budget += chunk.num_tokens
                        del chunks[k]
                        break
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, num_new))
                budget -= num_new
        if not preempted:
            budget = self._add_drafts(chunks, budget)
            budget = self._admit(chunks, budget)
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _add_drafts(self, chunks: list[ScheduledChunk], budget: int) -> int:
        """Give the running sequences' decode chunks their draft tokens (speculative
        decoding) in order, while ``budget`` and the free blocks hold them: drafts come
        after every running sequence's own token and never preempt anyone."""
        if self.proposer is None:
            return budget
        for i, chunk in enumerate(chunks):
            if budget <= 0:
                break
            seq = chunk.seq
            draft = self.proposer(seq, budget)
            if draft and self.block_manager.grow(seq.request_id, seq.num_tokens + len(draft)):
                chunks[i] = ScheduledChunk(seq, chunk.start, chunk.num_tokens, draft)
                budget -= len(draft)
        return budget

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            wanted = min(seq.num_tokens, self.chunk_tokens, budget)
            # Positions whose prompt log-probabilities are still due are computed, not
            # taken from the cache (those of the first ``len(prompt_logprobs)`` are known).
            limit = len(seq.prompt_logprobs) if seq.wants_prompt_logprobs else None
            num_cached = self.block_manager.admit(
                seq.request_id, seq.token_ids, wanted, seq.cache_salt, max_cached_tokens=limit
            )
            if num_cached is None:
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
            seq.num_computed_tokens = num_cached
            seq.status = Status.RUNNING
            self.running.append(seq)
            num_new = min(wanted, seq.num_tokens - num_cached)
            chunks.append(ScheduledChunk(seq, num_cached, num_new))
            budget -= num_new
        return budget
