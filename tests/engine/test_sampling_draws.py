"""The sampler's draws (halfmoon/engine/sampling.py): top-p's nucleus, found by ranking
only the likeliest tokens, is the one a full sort finds; draws follow the distribution
they are made from, with top-p, with temperature alone, and never pick a token of
probability 0."""

from __future__ import annotations

import torch

from halfmoon.core.request import SamplingParams
from halfmoon.engine.sampling import NUCLEUS_FIRST, _nuclei, row_for, sample


def _reference_nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """top-p as written in its definition: sort everything, keep each token that the
    tokens ranked above it do not already reach ``top_p`` with (the first always)."""
    probs = torch.softmax(logits.double(), dim=-1)
    ranked, order = torch.sort(probs, descending=True)
    before = torch.cumsum(ranked, dim=-1) - ranked
    keep = before < top_p
    keep[0] = True
    return {int(t) for t, k, p in zip(order, keep, ranked, strict=True) if k and p > 0}


def test_the_nucleus_is_the_one_a_full_sort_finds() -> None:
    generator = torch.Generator().manual_seed(0)
    vocab = 5000
    # peaked rows (the nucleus among the first few) and flat ones (thousands of tokens:
    # ranked past the first NUCLEUS_FIRST, grown), at several top_p
    rows = [torch.randn(vocab, generator=generator) * scale for scale in (8.0, 3.0, 0.3, 0.01)]
    top_ps = [0.5, 0.9, 0.95, 0.999]
    scaled = torch.stack([r for r in rows for _ in top_ps])
    wanted = [p for _ in rows for p in top_ps]
    nuclei = _nuclei(scaled, torch.softmax(scaled, dim=-1), wanted)
    sizes = []
    for logits, top_p, nucleus in zip(scaled, wanted, nuclei, strict=True):
        assert nucleus is not None
        ids, probs = nucleus
        assert {int(t) for t in ids} == _reference_nucleus(logits, top_p)
        assert bool((probs[:-1] >= probs[1:]).all())  # likeliest first
        sizes.append(len(ids))
    assert min(sizes) < NUCLEUS_FIRST < max(sizes)  # both ways were taken
    assert _nuclei(scaled[:2], torch.softmax(scaled[:2], dim=-1), [1.0, 1.0]) == [None, None]


def _frequencies(logits: torch.Tensor, params: SamplingParams, n: int = 4000) -> torch.Tensor:
    rows = [row_for(params, seed, 0, ()) for seed in range(n)]
    tokens = sample(logits.repeat(n, 1), rows)
    return torch.bincount(torch.tensor(tokens), minlength=logits.shape[-1]).double() / n


def test_draws_follow_the_nucleus_renormalized() -> None:
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    logits = torch.log(probs)[None]
    seen = _frequencies(logits, SamplingParams(temperature=1.0, top_p=0.75))
    # 0.4 + 0.25 < 0.75: the third is kept too; the rest are dropped
    expected = torch.tensor([0.4, 0.25, 0.15, 0, 0, 0], dtype=torch.float64) / 0.8
    assert float((seen - expected).abs().max()) < 0.03


def test_draws_at_a_temperature_follow_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, float("-inf")]])
    seen = _frequencies(logits, SamplingParams(temperature=0.7))
    expected = torch.softmax(logits[0].double() / 0.7, dim=-1)
    assert float((seen - expected).abs().max()) < 0.03
    assert seen[4] == 0  # a token of probability 0 is never drawn


def test_a_draw_is_the_same_whatever_else_is_in_the_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 3000, generator=generator) * 4
    params = [SamplingParams(temperature=0.2, top_p=0.9), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=20),
              SamplingParams(temperature=1.2, top_p=0.5, min_p=0.01),
              SamplingParams(temperature=0.5, top_p=0.99)]  # fmt: skip
    rows = [row_for(p, 7 + i, 3, ()) for i, p in enumerate(params)]
    together = sample(logits.clone(), rows)
    alone = [sample(logits[i : i + 1].clone(), [row])[0] for i, row in enumerate(rows)]
    assert together == alone
