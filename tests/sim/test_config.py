"""Cluster spec strings and simulator configuration checks."""

import pytest

from halfmoon.core.clock import ManualClock
from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel.throughput import ThroughputCostModel
from halfmoon.sim import ClusterSpec, InstanceSpec, SimConfig
from halfmoon.sim.cache import InstanceCache
from halfmoon.sim.coupled import CoupledInstance
from halfmoon.sim.decode import DecodeInstance
from halfmoon.sim.prefill import PrefillInstance


@pytest.mark.parametrize(
    ("text", "prefill", "decode", "coupled"),
    [
        ("8P8D", 8, 8, 0),
        ("3P1D", 3, 1, 0),
        ("10P10D", 10, 10, 0),
        ("16M", 0, 0, 16),
        ("4M", 0, 0, 4),
        ("3p1d", 3, 1, 0),
        (" 2P 1D ", 2, 1, 0),
    ],
)
def test_parse_valid(text: str, prefill: int, decode: int, coupled: int) -> None:
    spec = ClusterSpec.parse(text)
    assert (spec.num_prefill, spec.num_decode, spec.num_coupled) == (prefill, decode, coupled)
    assert spec.coupled == bool(coupled)
    assert ClusterSpec.parse(str(spec)) == spec


@pytest.mark.parametrize("text", ["8X", "0P1D", "1P0D", "", "0M", "8P8D4M", "P8D", "-1M", "8P"])
def test_parse_invalid_is_one_line_error(text: str) -> None:
    with pytest.raises(HalfmoonError) as info:
        ClusterSpec.parse(text)
    assert "\n" not in str(info.value)
    assert "cluster" in str(info.value)


def test_str_round_trip() -> None:
    assert str(ClusterSpec(num_prefill=8, num_decode=8)) == "8P8D"
    assert str(ClusterSpec(num_coupled=16)) == "16M"


@pytest.mark.parametrize(
    "options",
    [
        {"prefill_chunk_tokens": 0},
        {"cache_capacity_tokens": -1},
        {"cache_policy": "fifo"},
        {"decode_tbt_guard": "maybe"},
        {"time_scale": 0.0},
        {"time_scale": float("nan")},
        {"max_requests": 0},
        {"max_batch_size": 0},
        {"num_layers": 0},
        {"coupled_token_budget": 0},
    ],
)
def test_sim_config_rejects_bad_values(options: dict) -> None:
    with pytest.raises(HalfmoonError):
        SimConfig(ClusterSpec.parse("1P1D"), **options)


def test_instance_spec_resolves_kv_capacity() -> None:
    model = ThroughputCostModel(2000.0, 320 * 1024, 100e9, kv_capacity_tokens=5000)
    config = SimConfig(ClusterSpec.parse("1P1D"))
    assert InstanceSpec.for_config(config, model).kv_capacity_tokens == 5000
    config = SimConfig(ClusterSpec.parse("1P1D"), kv_capacity_tokens=1234)
    spec = InstanceSpec.for_config(config, model)
    assert (spec.config, spec.cost_model, spec.kv_capacity_tokens) == (config, model, 1234)
    with pytest.raises(HalfmoonError, match="no KV capacity"):
        InstanceSpec.for_config(SimConfig(ClusterSpec.parse("1M"), kv_capacity_tokens=0), model)
    with pytest.raises(TypeError):
        InstanceSpec(config, model, 10)  # type: ignore[misc]


def test_instances_take_a_spec_and_keywords() -> None:
    model = ThroughputCostModel(2000.0, 320 * 1024, 100e9)
    config = SimConfig(
        ClusterSpec.parse("1P1D"),
        num_layers=4,
        prefill_chunk_tokens=256,
        decode_tbt_guard="wait",
        max_batch_size=7,
        coupled_chunked_prefill=True,
        coupled_token_budget=99,
    )
    spec = InstanceSpec(config=config, cost_model=model, kv_capacity_tokens=10_000)
    clock, events = ManualClock(), []
    cache = InstanceCache("P1", capacity_blocks=8, policy="lru", notify=events.append)
    prefill = PrefillInstance("P1", spec, cache=cache, clock=clock, notify=events.append)
    assert (prefill._num_layers, prefill._chunk_tokens) == (4, 256)
    decode = DecodeInstance("D1", spec, clock=clock, notify=events.append)
    assert (decode.kv_capacity_tokens, decode._guard, decode._max_batch_size) == (10_000, "wait", 7)
    assert decode._tbt_slo_s == config.slo.tbt_s
    coupled = CoupledInstance("M1", spec, clock=clock, notify=events.append)
    assert (coupled._chunked, coupled._token_budget, coupled.cache) == (True, 99, None)
    with pytest.raises(TypeError):
        PrefillInstance("P2", spec, cache, clock, events.append)  # type: ignore[misc]
    with pytest.raises(TypeError):
        DecodeInstance("D2", spec, clock, events.append)  # type: ignore[misc]
    with pytest.raises(TypeError):
        InstanceCache("P3", 8, "lru", events.append)  # type: ignore[misc]
