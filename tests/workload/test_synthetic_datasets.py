"""Synthetic datasets: Table 2 averages, prefix sharing, Poisson arrivals, determinism."""

from __future__ import annotations

import statistics
from collections import Counter

import numpy as np
import pytest

from halfmoon.core.request import Request
from halfmoon.workload.datasets import DATASETS, generate_dataset
from halfmoon.workload.stats import trace_stats


def _mean_input(requests: list[Request]) -> float:
    return float(np.mean([r.input_length for r in requests]))


def _mean_output(requests: list[Request]) -> float:
    return float(np.mean([r.output_length for r in requests]))


def _shared_token_fraction(requests: list[Request]) -> float:
    """Share of prompt tokens lying in full blocks that at least two requests contain."""
    uses = Counter(b for r in requests for b in set(r.block_hashes))
    shared_tokens = sum(
        512 * sum(1 for b in r.block_hashes[: r.num_full_blocks] if uses[b] > 1) for r in requests
    )
    return shared_tokens / sum(r.input_length for r in requests)


@pytest.fixture(scope="module")
def arxiv() -> list[Request]:
    return generate_dataset("arxiv", rate=2.0, num_requests=500, seed=1)


@pytest.fixture(scope="module")
def leval() -> list[Request]:
    return generate_dataset("leval", rate=2.0, num_requests=500, seed=1)


def test_registry_names() -> None:
    assert list(DATASETS) == [
        "arxiv",
        "leval",
        "longctx-16k",
        "longctx-32k",
        "longctx-64k",
        "longctx-128k",
        "mixshift",
    ]
    assert all(spec.description for spec in DATASETS.values())


def test_mixshift_changes_its_mix_half_way() -> None:
    requests = generate_dataset("mixshift", 4.0, 400, seed=0)
    chat, summaries = requests[:200], requests[200:]
    mean = statistics.mean
    assert mean(r.input_length for r in chat) == pytest.approx(1024, rel=0.01)
    assert mean(r.output_length for r in chat) == pytest.approx(768, rel=0.01)
    assert mean(r.input_length for r in summaries) == pytest.approx(12288, rel=0.01)
    assert mean(r.output_length for r in summaries) == pytest.approx(48, rel=0.02)
    blocks = [h for r in requests for h in r.block_hashes]
    assert len(blocks) == len(set(blocks))  # no prefix sharing
    assert [r.arrival_time_s for r in requests] == sorted(r.arrival_time_s for r in requests)


def test_arxiv_matches_table_2(arxiv: list[Request]) -> None:
    assert _mean_input(arxiv) == pytest.approx(8088, rel=0.03)
    assert _mean_output(arxiv) == pytest.approx(229, rel=0.03)
    assert _shared_token_fraction(arxiv) == 0.0
    assert trace_stats(arxiv)["hit_ratio_infinite"] == 0.0
    # Lengths vary like a real dataset, not one fixed size.
    assert np.std([r.input_length for r in arxiv]) > 1000


def test_leval_matches_table_2(leval: list[Request]) -> None:
    assert _mean_input(leval) == pytest.approx(19019, rel=0.03)
    assert _mean_output(leval) == pytest.approx(72, rel=0.05)
    assert _shared_token_fraction(leval) > 0.8
    assert trace_stats(leval)["hit_ratio_infinite"] > 0.8
    # A few long documents, each asked many questions.
    first_blocks = Counter(r.block_hashes[0] for r in leval)
    assert len(first_blocks) <= 40
    assert min(first_blocks.values()) >= 5


@pytest.mark.parametrize("context_k", [16, 32, 64, 128])
def test_longctx_half_shared(context_k: int) -> None:
    requests = generate_dataset(f"longctx-{context_k}k", rate=1.0, num_requests=200, seed=3)
    assert {r.input_length for r in requests} == {context_k * 1024}
    assert {r.output_length for r in requests} == {512}
    assert _shared_token_fraction(requests) == pytest.approx(0.5)
    # Every request's first half is a shared prefix, its second half unique.
    half = context_k  # blocks: context_k * 1024 / 2 / 512
    uses = Counter(b for r in requests for b in r.block_hashes)
    assert all(uses[r.block_hashes[half - 1]] > 1 for r in requests)
    assert all(uses[r.block_hashes[half]] == 1 for r in requests)
    assert trace_stats(requests)["hit_ratio_infinite"] == pytest.approx(0.5, abs=0.02)


def test_poisson_arrivals(arxiv: list[Request]) -> None:
    arrivals = np.array([r.arrival_time_s for r in arxiv])
    assert arrivals[0] == 0.0
    assert np.all(np.diff(arrivals) >= 0)
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(0.5, rel=0.1)
    # Exponential gaps: standard deviation close to the mean.
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.15)


def test_requests_are_well_formed(leval: list[Request]) -> None:
    assert len({r.request_id for r in leval}) == len(leval)
    assert leval[0].request_id == "leval-0"
    for r in leval:
        assert r.block_size_tokens == 512
        assert len(r.block_hashes) == -(-r.input_length // 512)


def test_same_seed_same_dataset_and_generator_accepted() -> None:
    a = generate_dataset("leval", 1.0, 50, seed=7)
    b = generate_dataset("leval", 1.0, 50, seed=7)
    c = generate_dataset("leval", 1.0, 50, seed=8)
    d = generate_dataset("leval", 1.0, 50, seed=np.random.default_rng(7))
    assert a == b == d
    assert a != c


def test_single_request() -> None:
    (only,) = generate_dataset("arxiv", 1.0, 1, seed=0)
    assert only.arrival_time_s == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "sharegpt"}, "unknown dataset 'sharegpt'; choose from arxiv, leval, longctx-16k"),
        ({"rate": 0.0}, "rate must be a positive number"),
        ({"rate": -2.0}, "rate must be a positive number"),
        ({"rate": float("nan")}, "rate must be a positive number"),
        ({"num_requests": 0}, "num_requests must be an integer >= 1"),
    ],
)
def test_bad_arguments(kwargs: dict, message: str) -> None:
    args = {"name": "arxiv", "rate": 1.0, "num_requests": 10, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate_dataset(**args)
