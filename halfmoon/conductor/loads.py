"""Incremental load summaries, so that a decision does not look at every instance.

:class:`PrefillLoads` holds the prefill queues of the disaggregated instances as arrays
in instance order, refreshed by each :class:`PrefillState`'s change hook; one decision
computes every T_queue with a few vector operations (bit for bit what
``PrefillState.queue_s`` returns) instead of a Python call per instance.

:class:`DecodeLoads` keeps the decode instances sorted by the batch they would read
(context tokens, then requests) with the running and incoming requests counted, so the
snapshot choice of a decode instance (``min est_tbt_s``) evaluates only the instances
whose lower bound can beat the best estimate so far::

    sorted by (context, requests, rank):  D7 (0, 0)  D2 (9k, 3)  D5 (12k, 1)  D1 (80k, 9) ...
    bound(D) = step(min requests + 1, context(D) + prompt) <= est(D)   (step is monotone)
    evaluate D7, D2, ...; stop once bound(next) > best est: no later instance can beat it
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Callable, Sequence

import numpy as np

from halfmoon.conductor.messages import DecodeCandidate
from halfmoon.conductor.state import DecodeState, PrefillState
from halfmoon.costmodel.base import CostModel
from halfmoon.costmodel.roofline import RooflineCostModel
from halfmoon.costmodel.throughput import ThroughputCostModel

#: Cost models whose decode step time never decreases with the batch or its context.
MONOTONE_DECODE_MODELS = (RooflineCostModel, ThroughputCostModel)


class PrefillLoads:
    """T_queue of a fixed list of prefill instances, as arrays in the list's order.

    Each state's ``on_change`` hook is pointed at :meth:`refresh`; :meth:`detach` undoes
    it (the Conductor builds a new one whenever the instances change).
    """

    def __init__(self, states: Sequence[PrefillState]) -> None:
        self.ids = tuple(s.instance_id for s in states)
        self.position = {iid: i for i, iid in enumerate(self.ids)}
        self.states = tuple(states)
        n = len(states)
        # queue_s(now) = max(0, total - min(run_s, max(0, now - run_start)),
        #                    reported - (now - reported_at))    for <= 1 started request
        self._total = np.zeros(n)
        self._run_s = np.zeros(n)
        self._run_start = np.zeros(n)
        self._reported = np.zeros(n)
        self._reported_at = np.zeros(n)
        self._multi: dict[int, PrefillState] = {}  # > 1 started: state.queue_s itself
        self.cost_models: list[CostModel] = []
        model_index: list[int] = []
        for state in states:
            cm = state.cost_model
            known = [i for i, m in enumerate(self.cost_models) if m is cm]
            if not known:
                self.cost_models.append(cm)
            model_index.append(known[0] if known else len(self.cost_models) - 1)
        self._model_index = np.array(model_index, dtype=np.intp)
        for state in states:
            state.on_change = self.refresh
            self.refresh(state)

    def detach(self) -> None:
        """Stop following the states."""
        for state in self.states:
            if state.on_change == self.refresh:
                state.on_change = None

    def refresh(self, state: PrefillState) -> None:
        """Copy one state's bookings into the arrays (its change hook)."""
        i = self.position[state.instance_id]
        self._total[i] = state.total_pending_s
        self._reported[i] = state.reported_queue_s
        self._reported_at[i] = state.reported_at_s
        self._multi.pop(i, None)
        self._run_s[i] = self._run_start[i] = 0.0
        if len(state.started_at_s) == 1:
            ((rid, start_s),) = state.started_at_s.items()
            self._run_s[i] = state.pending_s[rid]
            self._run_start[i] = start_s
        elif state.started_at_s:
            self._multi[i] = state

    def queue_s(self, now_s: float) -> np.ndarray:
        """Every instance's ``PrefillState.queue_s(now_s)``, in instance order."""
        done = np.minimum(self._run_s, np.maximum(0.0, now_s - self._run_start))
        booked = self._total - done
        reported = self._reported - (now_s - self._reported_at)
        queue = np.maximum(np.maximum(booked, reported), 0.0)
        for i, state in self._multi.items():
            queue[i] = state.queue_s(now_s)
        return queue

    def per_model(self, value: Callable[[CostModel], float]) -> np.ndarray:
        """``value(cost model of each instance)``, in instance order (one call per model)."""
        return np.array([value(cm) for cm in self.cost_models])[self._model_index]


class DecodeLoads:
    """Decode instances sorted by their snapshot batch, for a pruned ``min est_tbt_s``.

    The batch of an instance is what ``admission.decode_candidate`` counts without
    prediction: ``num_running + len(incoming)`` requests, ``committed_tokens`` tokens. It
    changes only through events and placements; the Conductor calls :meth:`touch` for
    each instance they concern and the order is brought up to date before the next
    choice. Only valid when every instance shares one cost model whose step time is
    monotone (:attr:`usable`). The prediction (``early_reject="predict"``) weighs each
    request by time, so it has no such summary: the Conductor evaluates every instance.
    """

    def __init__(self, states: Sequence[DecodeState]) -> None:
        self.states = tuple(states)
        self.rank = {s.instance_id: i for i, s in enumerate(states)}
        models = {id(s.cost_model): s.cost_model for s in states}
        self.cost_model = next(iter(models.values()), None)
        self.usable = len(models) == 1 and isinstance(self.cost_model, MONOTONE_DECODE_MODELS)
        self._key_of: list[tuple[int, int, int] | None] = [None] * len(states)
        self._keys: list[tuple[int, int, int]] = []  # (context, requests, rank), sorted
        self._nums: list[int] = []  # requests per instance, sorted
        self._dirty: set[int] = set(range(len(states)))

    def touch(self, instance_id: str) -> None:
        """``instance_id``'s batch may have changed."""
        rank = self.rank.get(instance_id)
        if rank is not None:
            self._dirty.add(rank)

    def _update(self) -> None:
        for rank in self._dirty:
            old = self._key_of[rank]
            if old is not None:
                del self._keys[bisect_right(self._keys, old) - 1]
                del self._nums[bisect_right(self._nums, old[1]) - 1]
            s = self.states[rank]
            key = self._key_of[rank] = (
                s.committed_tokens,
                s.num_running + len(s.incoming),
                rank,
            )
            insort(self._keys, key)
            insort(self._nums, key[1])
        self._dirty.clear()

    def best(
        self, input_length: int, evaluate: Callable[[DecodeState], DecodeCandidate]
    ) -> list[DecodeCandidate]:
        """The candidates worth evaluating, in evaluation order; the one with the least
        ``est_tbt_s`` (ties: the earlier instance) is the exhaustive choice."""
        self._update()
        keys = self._keys
        step = self.cost_model.decode_step_time_s
        min_batch = max(1, self._nums[0] + 1) if self._nums else 1
        out: list[DecodeCandidate] = []
        best_s = float("inf")
        i = 0
        while i < len(keys):
            context, requests, rank = keys[i]
            if step(min_batch, context + input_length) > best_s:
                break  # sorted by context: every later bound is at least this one
            cand = evaluate(self.states[rank])
            out.append(cand)
            best_s = min(best_s, cand.est_tbt_s)
            # The same batch on a later instance has the same estimate and loses the tie.
            i = bisect_right(keys, (context, requests, len(keys)), i + 1)
        return out
