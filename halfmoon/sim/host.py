"""CPU sharing on one host (instances that are processes on the same few cores), and
the jitter of steps that time-share a processor.

A single-machine deployment (``halfmoon serve`` on a laptop or a small VM) runs every
instance as one single-threaded process, plus the gateway, the Conductor and the
client, on ``cores`` CPUs. When more of them want a CPU than there are, each gets a
share (the kernel's time slicing), so every busy instance runs slower::

    demand   = busy instances + background cores
    slowdown = max(1, demand / cores)            (applied to the step that starts now)
    background cores = tokens/s being emitted * cpu_s_per_token   (gateway, client...)

Each instance tells the host when a step (or prefill) starts, with the tokens per second
that step will emit, and when it goes idle. A step's slowdown is fixed when it starts (a
step that outlives a change in load keeps its factor: steps are milliseconds, prefills
rarely span many changes). On a cluster of GPU nodes nothing is shared: no host.
"""

from __future__ import annotations

import random

from halfmoon.costmodel.serving import ServingTerms


class Host:
    """The CPUs shared by a deployment's processes (see the module docstring)."""

    def __init__(self, cores: float, cpu_s_per_token: float = 0.0) -> None:
        if not cores > 0:
            raise ValueError(f"host cores must be > 0, got {cores}")
        if not cpu_s_per_token >= 0:
            raise ValueError(f"cpu_s_per_token must be >= 0, got {cpu_s_per_token}")
        self.cores = float(cores)
        self.cpu_s_per_token = float(cpu_s_per_token)
        self._tokens_per_s: dict[str, float] = {}  # busy instance -> its emission rate
        self.max_slowdown = 1.0

    @property
    def num_busy(self) -> int:
        """Instances in a step now."""
        return len(self._tokens_per_s)

    def background_cores(self) -> float:
        """Cores the serving path (gateway, client) needs at the current token rate."""
        return sum(self._tokens_per_s.values()) * self.cpu_s_per_token

    def start(self, instance_id: str, tokens_per_s: float = 0.0) -> float:
        """``instance_id`` starts a step emitting ``tokens_per_s``; returns the factor its
        duration is multiplied by (>= 1)."""
        self._tokens_per_s[instance_id] = max(0.0, tokens_per_s)
        demand = self.num_busy + self.background_cores()
        slowdown = max(1.0, demand / self.cores)
        self.max_slowdown = max(self.max_slowdown, slowdown)
        return slowdown

    def stop(self, instance_id: str) -> None:
        """``instance_id`` has nothing to run."""
        self._tokens_per_s.pop(instance_id, None)


def host_slowdown(host: Host | None, instance_id: str, step_s: float, num_tokens: int) -> float:
    """``step_s`` as it runs on ``host`` (unchanged without one); the step emits
    ``num_tokens`` tokens, which sets its share of the background load."""
    if host is None or step_s <= 0:
        return step_s
    return step_s * host.start(instance_id, num_tokens / step_s)


def shared_step_s(
    step_s: float,
    terms: ServingTerms,
    rng: random.Random,
    host: Host | None,
    instance_id: str,
    num_tokens: int,
) -> float:
    """How long a step of ``step_s`` takes as one of several processes on ``host``:
    times a lognormal jitter factor (median 1, log-space deviation
    ``terms.step_jitter_sigma``), slowed by the host's CPU sharing (:func:`host_slowdown`;
    the step emits ``num_tokens``), plus an exponential wait with mean
    ``terms.step_wait_mean_s``. A term that is 0 draws nothing from ``rng``."""
    if terms.step_jitter_sigma > 0:
        step_s *= rng.lognormvariate(0.0, terms.step_jitter_sigma)
    step_s = host_slowdown(host, instance_id, step_s, num_tokens)
    if terms.step_wait_mean_s > 0:
        step_s += rng.expovariate(1.0 / terms.step_wait_mean_s)
    return step_s
