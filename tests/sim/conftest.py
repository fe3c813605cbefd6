"""Shared helpers for simulator tests: a predictable cost model and hand-made requests."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest

from halfmoon.conductor import ConductorConfig
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request
from halfmoon.costmodel.throughput import ThroughputCostModel
from halfmoon.sim import ClusterSpec, SimConfig, SimResult, Simulator

BLOCK = 512
KV_BYTES_PER_TOKEN = 320 * 1024
LINK_BYTES_PER_S = 100e9


@pytest.fixture
def cost_model() -> ThroughputCostModel:
    """2,000 tok/s prefill, 100 GB/s link, decode step 12.5 ms + 27 ns per context token."""
    return ThroughputCostModel(2000.0, KV_BYTES_PER_TOKEN, LINK_BYTES_PER_S)


@pytest.fixture
def make_request() -> Callable[..., Request]:
    """Requests with 512-token blocks; ``prefix`` blocks first, then fresh unique ones."""
    fresh = itertools.count(10_000_000)

    def make(
        rid: str,
        arrival_s: float,
        input_length: int,
        output_length: int,
        prefix: Sequence[int] = (),
    ) -> Request:
        num_blocks = -(-input_length // BLOCK)
        hashes = tuple(prefix[:num_blocks]) + tuple(
            next(fresh) for _ in range(num_blocks - min(len(prefix), num_blocks))
        )
        return Request(rid, arrival_s, input_length, output_length, hashes, BLOCK)

    return make


@pytest.fixture
def run_sim(cost_model: ThroughputCostModel) -> Callable[..., tuple[SimResult, Simulator]]:
    """Run requests on a cluster; keyword arguments go to SimConfig or ConductorConfig."""
    conductor_keys = set(ConductorConfig.__dataclass_fields__)

    def run(
        cluster: str,
        requests: Sequence[Request],
        slo: SLOConfig | None = None,
        model=None,
        seed: int = 0,
        **options,
    ) -> tuple[SimResult, Simulator]:
        slo = slo or SLOConfig(ttft_s=30.0, tbt_s=0.1, tbt_metric="top10mean")
        conductor_options = {k: v for k, v in options.items() if k in conductor_keys}
        sim_options = {k: v for k, v in options.items() if k not in conductor_keys}
        config = SimConfig(ClusterSpec.parse(cluster), slo=slo, **sim_options)
        conductor = ConductorConfig(slo=slo, **conductor_options)
        simulator = Simulator(config, conductor, model or cost_model, seed=seed)
        result = simulator.run(requests)
        simulator.check_integrity()  # every run leaves consistent, idle instances
        return result, simulator

    return run
