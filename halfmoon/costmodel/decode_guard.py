"""The decode TBT guard: may a request whose KV reached a decode instance join its batch
now, must it wait, or is it refused? One rule for the simulator's decode instances
(:mod:`halfmoon.sim.decode`) and the live decode worker (:mod:`halfmoon.serve.worker.decode`),
so the two cannot drift.

The estimate is the step the batch would take with the request in it::

    step_s = engine step (batch, context)          # the cost model / profile's decode fit,
                                                   # of the rows speculation adds (below)
           + serving.decode_overhead_s(batch)      # per-step + per-sequence serving terms
           + imported_tokens * kv_import_s_per_token   (the simulator's running step only)

and the verdict compares it with the TBT SLO (:func:`decode_guard_verdict`). A batch that
is empty admits anything: a lone request is never refused for its own step. An instance
that speculates (``--speculative-config``) runs more rows a step than it has sequences:
its engine step is the one of :meth:`SpeculationRates.step_s
<halfmoon.costmodel.speculation.SpeculationRates.step_s>` (the per-sequence serving term
still counts sequences).
"""

from __future__ import annotations

from collections.abc import Callable

from halfmoon.costmodel.serving import ServingTerms
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates

#: What a decode instance does with a request whose joining would make the estimated
#: step exceed the TBT SLO: refuse it (the paper's "decoding instance rejects": its
#: prefill is wasted), hold it until it fits, or admit it anyway.
DECODE_GUARDS = ("reject", "wait", "off")
#: The verdicts of :func:`decode_guard_verdict`.
ADMIT, WAIT, REJECT = "admit", "wait", "reject"


def decode_step_estimate_s(
    engine_step_s: Callable[[int, int], float],
    serving: ServingTerms,
    batch_size: int,
    context_tokens: int,
    imported_tokens: int = 0,
    speculation: SpeculationRates = NO_SPECULATION,
) -> float:
    """A decode step of ``batch_size`` sequences holding ``context_tokens`` in all:
    ``engine_step_s(batch, context)`` (a cost model's ``decode_step_time_s`` or a
    profile's ``decode_step_s``; of the rows ``speculation`` checks) plus the serving
    path's per-step and per-sequence terms and the KV import of ``imported_tokens``
    joining tokens; 0 for an empty batch."""
    if batch_size <= 0:
        return 0.0
    return (
        speculation.step_s(engine_step_s, batch_size, context_tokens)
        + serving.decode_overhead_s(batch_size)
        + imported_tokens * serving.kv_import_s_per_token
    )


def decode_guard_verdict(guard: str, *, busy: bool, step_s: float, tbt_slo_s: float) -> str:
    """:data:`ADMIT`, :data:`WAIT` or :data:`REJECT` for a request under ``guard`` (one
    of :data:`DECODE_GUARDS`): ``step_s`` is the estimated step with it joined, ``busy``
    whether anything runs (or, for ``reject``, waits to run) ahead of it. Admitted when
    the guard is off, the batch is idle or the step stays within ``tbt_slo_s``; else the
    guard's own verdict. A ``tbt_slo_s`` of 0 or less means no SLO is known: admitted."""
    if guard not in DECODE_GUARDS:
        raise ValueError(f"unknown decode guard {guard!r}; choose from {', '.join(DECODE_GUARDS)}")
    if guard == "off" or not busy or tbt_slo_s <= 0 or step_s <= tbt_slo_s:
        return ADMIT
    return REJECT if guard == "reject" else WAIT


def guard_refusal(instance_id: str, step_s: float, tbt_slo_s: float) -> str:
    """The reason a ``reject`` guard gives (a simulated request's record and a live
    client's error say the same)."""
    return (
        f"decode instance {instance_id} refused the request after its prefill: the decode "
        f"step would take ~{step_s * 1e3:.1f}ms with it, over the {tbt_slo_s * 1e3:g}ms TBT "
        f"SLO (decode guard 'reject')"
    )
