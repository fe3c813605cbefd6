"""Incremental load summaries, so that a decision does not look at every instance.

:class:`PrefillLoads` holds the prefill queues of the disaggregated instances as arrays
in instance order, refreshed by each :class:`PrefillState`'s change hook; one decision
computes every T_queue with a few vector operations (bit for bit what
``PrefillState.queue_s`` returns) instead of a Python call per instance.

:class:`DecodeLoads` keeps the decode instances sorted by the batch they would read
(context tokens, then requests) with the running and incoming requests counted, so the
snapshot choice of a decode instance (``min est_tbt_s``) evaluates only the instances
whose lower bound can beat the best estimate so far::

    sorted by (context, requests, rows, rank):  D7 (0, 0)  D2 (9k, 3)  D5 (12k, 1)  D1 (80k, 9) ...
    bound(D) = step(min requests + 1, context(D) + prompt) <= est(D)   (step is monotone)
    evaluate D7, D2, ...; stop once bound(next) > best est: no later instance can beat it

(An instance that speculates estimates its step over more rows and context than it has
requests and tokens, never less than the plain step, so the bound holds for it too; its
rows per sequence are part of its key, so only instances with the same batch *and* the
same rows tie.)

The prediction (``early_reject="predict"``) weighs each request by time, so it has no
such order; :class:`DecodeForecast` instead evaluates it for every instance at once, as
arrays (``admission.predicted_decode_candidate`` stays the reference, one instance at a
time). Its sums must be the scalar's to the last bit (an expected batch is rounded to
whole requests and tokens), so they are accumulated in the same order::

    idx     = [0 1 .. D-1 | 0    0    0   | 1    1   | ...]   (instance of each weight)
    weights = [1 1 .. 1   | p_r1 p_r2 p_i1 | p_r1 p_i1 | ...]   (running, then incoming)
    requests(i) = bincount(idx, weights)[i] = ((1 + p_r1) + p_r2) + p_i1

(bincount adds in array order; an instance's running and then incoming requests are
listed in their dicts' order, as the scalar loops visit them.)
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from halfmoon.conductor.admission import DecodeTimes, kv_need_tokens
from halfmoon.conductor.messages import DecodeCandidate
from halfmoon.conductor.state import DecodeState, PrefillState
from halfmoon.core.request import Request
from halfmoon.costmodel.base import CostModel
from halfmoon.costmodel.roofline import RooflineCostModel
from halfmoon.costmodel.speculation import SpeculationRates
from halfmoon.costmodel.throughput import ThroughputCostModel

#: Cost models whose decode step time never decreases with the batch or its context.
MONOTONE_DECODE_MODELS = (RooflineCostModel, ThroughputCostModel)
#: Decode candidates a forecast decision keeps for its explanation.
KEEP_DECODE_CANDIDATES = 4


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
        #                    reported - (now - reported_at))
        # run_s: booked seconds of the started prefills; run_start: the busy mark.
        self._total = np.zeros(n)
        self._run_s = np.zeros(n)
        self._run_start = np.zeros(n)
        self._reported = np.zeros(n)
        self._reported_at = np.zeros(n)
        # The highest priority value booked (-inf: nothing booked); an instance with one
        # above a request's priority has its queue from PrefillState.queue_s.
        self._max_priority = np.full(n, -np.inf)
        #: Each instance's ``PrefillState.prefill_scale``, in instance order.
        self.scale = np.ones(n)
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
        self.scale[i] = state.prefill_scale
        self._max_priority[i] = state.max_priority
        self._run_s[i] = self._run_start[i] = 0.0
        if state.busy_mark_s is not None:
            self._run_s[i] = state.started_pending_s
            self._run_start[i] = state.busy_mark_s

    def queue_s(self, now_s: float, priority: int | None = None) -> np.ndarray:
        """Every instance's ``PrefillState.queue_s(now_s, priority)``, in instance order:
        as arrays, but for the instances holding a booking of a higher priority value
        than ``priority`` (asked one by one; none under ``fcfs``)."""
        done = np.minimum(self._run_s, np.maximum(0.0, now_s - self._run_start))
        booked = self._total - done
        reported = self._reported - (now_s - self._reported_at)
        queue = np.maximum(np.maximum(booked, reported), 0.0)
        if priority is not None:  # none holds more than 0 under fcfs
            for i in np.flatnonzero(self._max_priority > priority).tolist():
                queue[i] = self.states[i].queue_s(now_s, priority)
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
    request by time, so it has no such summary: :attr:`forecast` evaluates every
    instance at once instead (touched alongside).
    """

    def __init__(self, states: Sequence[DecodeState]) -> None:
        self.states = tuple(states)
        self.rank = {s.instance_id: i for i, s in enumerate(states)}
        models = {id(s.cost_model): s.cost_model for s in states}
        self.cost_model = next(iter(models.values()), None)
        self.usable = len(models) == 1 and isinstance(self.cost_model, MONOTONE_DECODE_MODELS)
        self._key_of: list[tuple[int, int, float, int] | None] = [None] * len(states)
        # (context, requests, rows per sequence, rank), sorted
        self._keys: list[tuple[int, int, float, int]] = []
        self._nums: list[int] = []  # requests per instance, sorted
        self._dirty: set[int] = set(range(len(states)))
        self.forecast = DecodeForecast(states)

    def touch(self, instance_id: str) -> None:
        """``instance_id``'s batch may have changed."""
        rank = self.rank.get(instance_id)
        if rank is not None:
            self._dirty.add(rank)
            self.forecast.touch(rank)

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
                s.speculation.rows_per_seq,
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
            context, requests, rows, rank = keys[i]
            if step(min_batch, context + input_length) > best_s:
                break  # sorted by context: every later bound is at least this one
            cand = evaluate(self.states[rank])
            out.append(cand)
            best_s = min(best_s, cand.est_tbt_s)
            # The same batch on a later instance has the same estimate and loses the tie.
            i = bisect_right(keys, (context, requests, rows, len(keys)), i + 1)
        return out


def decode_step_times_s(
    cost_model: CostModel, batch_sizes: np.ndarray, contexts: np.ndarray
) -> np.ndarray:
    """``cost_model.decode_step_time_s`` of each (batch, context) pair: its vector method
    (``decode_step_times_s``) when it has one, else one call per pair."""
    vector = getattr(cost_model, "decode_step_times_s", None)
    if vector is not None:
        return vector(batch_sizes, contexts)
    step = cost_model.decode_step_time_s
    return np.array(
        [step(b, c) for b, c in zip(batch_sizes.tolist(), contexts.tolist(), strict=True)]
    )


class DecodeForecast:
    """``admission.predicted_decode_candidate`` on every decode instance at once.

    Per instance it keeps what changes only by events and placements (its running and
    incoming requests, the step of its batch now, its free KV); :meth:`touch` marks an
    instance stale and it is re-read before the next :meth:`choose`. Only the
    time-dependent part (who stays, who joins, what they generated) is computed per
    decision, with vector operations that repeat the scalar's floats exactly.
    """

    def __init__(self, states: Sequence[DecodeState]) -> None:
        self.states = tuple(states)
        self.ids = tuple(s.instance_id for s in states)
        n = len(states)
        self._stale: set[int] = set(range(n))
        self._requests = _Entries(n)
        # seconds per token of the batch as it is now (its step, over a step's tokens
        # when it speculates: the t_d fallback and the tokens' rate)
        self._step_s = np.zeros(n)
        self._free = np.zeros(n, dtype=np.int64)  # KV capacity - committed tokens
        self._init_ones = np.ones(n)
        self._rates = [s.speculation for s in states]
        self._group()
        self._update()

    def _group(self) -> None:
        """The instances by cost model and speculation rates (one vector call each)."""
        groups: dict[tuple[int, SpeculationRates], list[int]] = {}
        for i, state in enumerate(self.states):
            groups.setdefault((id(state.cost_model), self._rates[i]), []).append(i)
        self._models = [
            (self.states[ix[0]].cost_model, rates, np.array(ix))
            for (_, rates), ix in groups.items()
        ]

    def touch(self, position: int) -> None:
        """The instance at ``position`` (in the states' order) may have changed."""
        self._stale.add(position)

    def _update(self) -> None:
        entries = {}
        regroup = False
        for i in sorted(self._stale):
            s = self.states[i]
            nan, predicted = float("nan"), s.predicted_s
            entries[i] = [(t, k, 1.0, predicted.get(r, nan)) for r, (t, k) in s.running.items()]
            entries[i] += [(t, k, 0.0, predicted.get(r, nan)) for r, (t, k) in s.incoming.items()]
            self._step_s[i] = s.token_time_s(s.num_running, s.context_tokens)
            self._free[i] = s.kv_capacity_tokens - s.committed_tokens
            if s.speculation != self._rates[i]:
                self._rates[i] = s.speculation
                regroup = True
        if regroup:
            self._group()
        self._stale.clear()
        requests = self._requests
        requests.replace(entries)
        self._idx = np.concatenate((np.arange(len(self.states)), requests.inst))
        self._is_running = requests.kinds > 0.0
        self._any_predicted = not np.isnan(requests.predicted).all()
        self._entry_step_s = self._step_s[requests.inst]
        self._all_steps = bool((self._step_s > 0.0).all())

    def choose(
        self,
        request: Request,
        now_s: float,
        ready_s: float,
        times: DecodeTimes,
        booking: str = "output",
    ) -> tuple[DecodeCandidate, list[DecodeCandidate]] | None:
        """The instance with the least predicted step (ties: the earlier instance) and the
        :data:`KEEP_DECODE_CANDIDATES` best candidates in instance order; None when some
        batch's step is zero (then the scalar path decides, with its own divisions)."""
        if self._stale:
            self._update()
        if not len(self.states) or not self._all_steps:
            return None
        num, ctx = self._expected_batches(request, now_s, ready_s, times)
        n = np.maximum(np.rint(num).astype(np.int64), 1)  # num >= 1 (the request itself)
        c = np.rint(ctx).astype(np.int64)
        if len(self._models) == 1:
            cm, rates, _ = self._models[0]
            est = rates.steps_s(partial(decode_step_times_s, cm), n, c)
        else:
            est = np.empty(len(n))
            for cm, rates, ix in self._models:
                est[ix] = rates.steps_s(partial(decode_step_times_s, cm), n[ix], c[ix])
        est[kv_need_tokens(request, booking) > self._free] = np.inf  # the KV check rejects it there
        kept = np.sort(np.argsort(est, kind="stable")[:KEEP_DECODE_CANDIDATES]).tolist()
        out = [DecodeCandidate(self.ids[i], int(n[i]), int(c[i]), float(est[i])) for i in kept]
        best = min(out, key=lambda d: d.est_tbt_s)  # argmin of est is always kept
        return best, out

    def _expected_batches(
        self, request: Request, now_s: float, ready_s: float, times: DecodeTimes
    ) -> tuple[np.ndarray, np.ndarray]:
        """Expected requests and context tokens of every instance's batch at ``ready_s``
        with the request in it (the scalar's ``num`` and ``ctx``, before rounding)::

            running (since t):        age = now - t, span = ready - t,
                                      stays with P(D > age + h | D > age)
            incoming (prefill end t): joins if t <= ready, age = 0, span = ready - max(t, now),
                                      stays with P(D > 0 + span)
            weight p, tokens p * (its tokens + span / step)   (one per step since)
            a request with a predicted duration d: the same with D scaled to median d
        """
        requests, running = self._requests, self._is_running
        t, step_s = requests.times, self._entry_step_s
        age_s = np.where(running, now_s - t, 0.0)
        span_s = ready_s - np.where(running, t, np.maximum(t, now_s))
        horizon_s = np.where(running, max(0.0, ready_s - now_s), span_s)
        fallback_s = request.output_length * step_s  # t_d before any observation
        p = times.stay_probabilities(age_s, horizon_s, fallback_s)
        if self._any_predicted:
            t_d = requests.predicted
            p = np.where(np.isnan(t_d), p, times.own_stay_probabilities(age_s, horizon_s, t_d))
        p = np.where(running | (t <= ready_s), p, 0.0)
        tokens = p * (requests.tokens + span_s / step_s)
        length = np.full(len(self.states), float(request.input_length))
        num = np.bincount(self._idx, np.concatenate((self._init_ones, p)))
        ctx = np.bincount(self._idx, np.concatenate((length, tokens)))
        return num, ctx


class _Entries:
    """(time, tokens, kind, predicted duration or NaN) of the requests of every
    instance, flat in instance order (each instance's in the order given) with ``inst``,
    the instance of each::

        counts  [2, 0, 1]          times  [t0a t0b | t2a]   inst  [0 0 | 2]
        replace({1: [(t1a, k, 1.0, nan)]})   times  [t0a t0b | t1a | t2a]   (one splice)
    """

    def __init__(self, num_instances: int) -> None:
        self.counts = np.zeros(num_instances, dtype=np.intp)
        self._table = np.zeros((0, 4))
        self.times, self.tokens, self.kinds, self.predicted = self._table.T
        self.inst = np.zeros(0, dtype=np.intp)

    def replace(self, entries: dict[int, list[tuple[float, int, float, float]]]) -> None:
        """Set the entries of some instances (``entries`` in ascending instance order)."""
        if not entries:
            return
        ends = np.cumsum(self.counts).tolist()
        old = self._table
        parts, pos = [], 0
        for i, new in entries.items():
            parts.append(old[pos : ends[i] - int(self.counts[i])])
            if new:
                parts.append(np.array(new, dtype=np.float64))
            self.counts[i] = len(new)
            pos = ends[i]
        parts.append(old[pos:])
        self._table = np.concatenate(parts)
        self.times, self.tokens, self.kinds, self.predicted = self._table.T
        self.inst = np.repeat(np.arange(len(self.counts)), self.counts)
