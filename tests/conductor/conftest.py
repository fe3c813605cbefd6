import pytest

from halfmoon.conductor import Conductor, ConductorConfig
from halfmoon.core.clock import ManualClock
from halfmoon.costmodel.throughput import (
    PAPER_KV_BYTES_PER_TOKEN,
    PAPER_LINK_BYTES_PER_S,
    ThroughputCostModel,
)


@pytest.fixture
def paper_cost_model():
    """2,000 tok/s prefill, 320 KiB/token, 100 GB/s: the worked example's numbers."""
    return ThroughputCostModel(2000.0, PAPER_KV_BYTES_PER_TOKEN, PAPER_LINK_BYTES_PER_S)


@pytest.fixture
def make_conductor(paper_cost_model):
    def make(num_prefill=2, num_decode=1, clock=None, **config):
        config.setdefault("block_size_tokens", 16)
        conductor = Conductor(ConductorConfig(**config), paper_cost_model, clock or ManualClock())
        for i in range(num_prefill):
            conductor.add_prefill_instance(f"P{i + 1}")
        for i in range(num_decode):
            conductor.add_decode_instance(f"D{i + 1}", kv_capacity_tokens=1_000_000)
        return conductor

    return make
