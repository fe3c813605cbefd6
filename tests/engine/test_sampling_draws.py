"""The sampler's draws (halfmoon/engine/sampling.py): top-p's nucleus, found by ranking
only the likeliest tokens, is the one a full sort finds; draws follow the distribution
they are made from, with top-p, with temperature alone, and never pick a token of
probability 0; the tiled searches (argmax, whole-vocabulary draws) agree with whole
ones."""

from __future__ import annotations

import torch

from halfmoon.core.request import SamplingParams
from halfmoon.engine.sampling import (
    NUCLEUS_FIRST,
    TILE,
    _argmax,
    _Cumulative,
    _nuclei,
    _Tiled,
    row_for,
    sample,
)


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


def test_the_tiled_argmax_is_torchs() -> None:
    generator = torch.Generator().manual_seed(2)
    # vocabularies on and off the tile grid, rows enough for the tiled path, many ties
    # (the first index wins), NaNs (the first NaN wins, also past the last whole tile)
    for rows, vocab in ((32, 16 * TILE), (8, 16 * TILE + 37), (5, 600), (4, 3 * TILE)):
        for trial in range(12):
            logits = torch.randint(-3, 4, (rows, vocab), generator=generator).float()
            if trial % 3 == 0:
                logits[1, torch.randint(0, vocab, (2,), generator=generator)] = float("nan")
            if trial % 4 == 0:
                logits[2, vocab - 1] = float("nan")
            assert torch.equal(_argmax(logits), torch.argmax(logits, dim=-1)), (vocab, trial)


def test_a_tiled_draw_finds_the_token_a_whole_search_finds() -> None:
    generator = torch.Generator().manual_seed(3)
    for vocab in (6, 3 * TILE + 88, 16 * TILE):
        probs = torch.softmax(torch.randn(2, vocab, generator=generator) * 4, dim=-1)
        probs[0, ::3] = 0.0  # tokens (and, at vocab 6, most of a tile) of probability 0
        tiled = _Tiled(probs)
        for r in range(2):
            row = tiled.row(r)
            whole = _Cumulative(torch.cumsum(probs[r], -1, dtype=torch.float64))
            assert abs(float(row.total) - float(whole.total)) < 1e-6
            for _ in range(400):
                point = torch.rand(1, generator=generator, dtype=torch.float64) * row.total
                token = row.index(point)
                assert probs[r, token] > 0
                # the same token, or (at a rounding's distance from a boundary) a neighbour
                assert abs(token - whole.index(point * whole.total / row.total)) <= 1
            # a point that rounded up to the total, or past it: a token of probability > 0
            for point in (row.total, row.total * (1 + 1e-7)):
                assert probs[r, row.index(point)] > 0


def test_draws_from_a_vocabulary_of_several_tiles_follow_the_softmax() -> None:
    vocab = 4 * TILE + 10
    logits = torch.full((1, vocab), -30.0)
    likely = [0, TILE - 1, TILE, 3 * TILE + 5, vocab - 1]  # tiles' edges, the partial tile
    logits[0, likely] = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.8])
    seen = _frequencies(logits, SamplingParams(temperature=1.0))
    expected = torch.softmax(logits[0].double(), dim=-1)
    assert float((seen - expected).abs().max()) < 0.03
    assert float(seen[likely].sum()) == 1.0
