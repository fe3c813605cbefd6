"""Many simulations of one workload at once, one per core (the planner and sweeps).

Each job is a cluster (:class:`SimConfig`) and a Conductor configuration over the same
requests and cost model. Worker processes are forked where the platform allows it, so
the requests are shared with them, not pickled per job; elsewhere (spawn) they are
handed to each worker once. Results come back in job order, so a run is as
deterministic as one simulation.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from halfmoon.conductor.config import ConductorConfig
from halfmoon.core.request import Request
from halfmoon.costmodel.base import CostModel
from halfmoon.sim.config import SimConfig
from halfmoon.sim.simulator import Simulator


@dataclass(frozen=True)
class SimJob:
    """One simulation to run: the cluster and the Conductor's configuration."""

    sim: SimConfig
    conductor: ConductorConfig
    seed: int = 0


_shared: tuple[Sequence[Request], CostModel] | None = None


def _init(requests: Sequence[Request], cost_model: CostModel) -> None:
    global _shared
    _shared = (requests, cost_model)


def _run(job: SimJob) -> dict[str, Any]:
    assert _shared is not None, "worker not initialised"
    return _simulate(job, *_shared)


def _simulate(job: SimJob, requests: Sequence[Request], cost_model: CostModel) -> dict[str, Any]:
    return Simulator(job.sim, job.conductor, cost_model, seed=job.seed).run(requests).report


def default_processes() -> int:
    """One process per core this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def run_jobs(
    requests: Sequence[Request],
    cost_model: CostModel,
    jobs: Sequence[SimJob],
    processes: int | None = None,
) -> list[dict[str, Any]]:
    """Each job's report (:meth:`Simulator.run`), in the order of ``jobs``.

    ``processes``: worker processes (default: one per core); 1 runs them here, in turn.
    """
    requests = list(requests)
    processes = min(default_processes() if processes is None else processes, len(jobs))
    if processes <= 1 or len(jobs) <= 1:  # here (also: nested in a worker's simulation)
        return [_simulate(job, requests, cost_model) for job in jobs]
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with ProcessPoolExecutor(
        processes, mp_context=context, initializer=_init, initargs=(requests, cost_model)
    ) as pool:
        return list(pool.map(_run, jobs))
