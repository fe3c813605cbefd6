"""Synthetic datasets shaped like the Mooncake paper's Table 2.

| name            | avg input | avg output | prefix sharing                                   |
|-----------------|-----------|------------|--------------------------------------------------|
| ``arxiv``       | ~8088     | ~229       | none: every block is unique                      |
| ``leval``       | ~19019    | ~72        | >80%: ~18.5k-token documents, 16 questions each  |
| ``longctx-16k`` | 16384     | 512        | first half of each prompt is one of 4 prefixes   |
| ``longctx-32k`` | 32768     | 512        | same                                             |
| ``longctx-64k`` | 65536     | 512        | same                                             |
| ``longctx-128k``| 131072    | 512        | same                                             |
| ``mixshift``    | ~1024, then ~12288 | ~768, then ~48 | none; the mix changes half-way (decode-   |
|                 |           |            | heavy chat, then prefill-heavy summaries)        |

Requests carry Mooncake-style integer block ids at 512 tokens per block (fresh ids count
up from 0), so a dataset can be written as a Mooncake JSONL trace and
expanded into real tokens by :mod:`halfmoon.workload.tokens`. A shared prefix covers
only its *full* blocks: the block where a document ends and its question begins is unique
to the request, as it would be with chained content hashes.

Lengths are drawn from a lognormal and rescaled so that their sample mean is the target
(then clipped to a plausible range), so even a few hundred requests match Table 2's
averages. Arrivals are a Poisson process at ``rate`` requests/s starting at t = 0.
Everything is drawn from one ``numpy`` Generator, so a seed fixes the whole dataset.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from halfmoon.core.ids import IdGenerator
from halfmoon.core.request import Request
from halfmoon.workload.trace import TRACE_BLOCK_SIZE_TOKENS

_BLOCK = TRACE_BLOCK_SIZE_TOKENS


@dataclass(frozen=True)
class Prompt:
    """A request's shape before it gets an arrival time: lengths and block ids."""

    input_length: int
    output_length: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class DatasetSpec:
    """A named dataset: ``build(rng, num_requests, next_block_id)`` returns its prompts."""

    name: str
    description: str
    build: Callable[[np.random.Generator, int, Callable[[int], tuple[int, ...]]], list[Prompt]]


def _block_allocator() -> Callable[[int], tuple[int, ...]]:
    """A function handing out ``n`` fresh consecutive block ids per call."""
    counter = itertools.count()
    return lambda n: tuple(itertools.islice(counter, n))


def _num_blocks(num_tokens: int) -> int:
    return -(-num_tokens // _BLOCK)


def _calibrated_lengths(
    rng: np.random.Generator, num: int, mean: float, sigma: float, low: int, high: int
) -> np.ndarray:
    """``num`` lognormal lengths rescaled to sample mean ``mean``, clipped to [low, high]."""
    raw = rng.lognormal(mean=0.0, sigma=sigma, size=num)
    lengths = np.rint(raw * (mean / raw.mean()))
    return np.clip(lengths, low, high).astype(np.int64)


def _arxiv_prompts(
    rng: np.random.Generator, num_requests: int, new_blocks: Callable[[int], tuple[int, ...]]
) -> list[Prompt]:
    # Summarisation of distinct papers: no two prompts share a block.
    inputs = _calibrated_lengths(rng, num_requests, 8088, 0.45, 1024, 32768)
    outputs = _calibrated_lengths(rng, num_requests, 229, 0.35, 16, 1024)
    return [
        Prompt(int(n_in), int(n_out), new_blocks(_num_blocks(int(n_in))))
        for n_in, n_out in zip(inputs, outputs, strict=True)
    ]


def _leval_prompts(
    rng: np.random.Generator,
    num_requests: int,
    new_blocks: Callable[[int], tuple[int, ...]],
    questions_per_document: int = 16,
) -> list[Prompt]:
    # Long documents, each asked many questions; questions about different documents
    # arrive interleaved (a random permutation), which is what stresses a finite cache.
    num_documents = math.ceil(num_requests / questions_per_document)
    doc_lengths = _calibrated_lengths(rng, num_documents, 18500, 0.3, 4096, 65536)
    doc_blocks = [new_blocks(int(n) // _BLOCK) for n in doc_lengths]
    doc_of = rng.permutation(np.repeat(np.arange(num_documents), questions_per_document))
    questions = _calibrated_lengths(rng, num_requests, 519, 0.5, 16, 4096)
    outputs = _calibrated_lengths(rng, num_requests, 72, 0.5, 1, 512)
    prompts = []
    for doc, n_question, n_out in zip(doc_of[:num_requests], questions, outputs, strict=True):
        n_in = int(doc_lengths[doc] + n_question)
        shared = doc_blocks[doc]
        prompts.append(
            Prompt(n_in, int(n_out), shared + new_blocks(_num_blocks(n_in) - len(shared)))
        )
    return prompts


def _longctx_prompts(
    rng: np.random.Generator,
    num_requests: int,
    new_blocks: Callable[[int], tuple[int, ...]],
    context_tokens: int,
    num_prefixes: int = 4,
) -> list[Prompt]:
    # Half of each prompt is one of a few shared prefixes (a system prompt, a document),
    # the other half is unique: ~50% of prompt blocks hit an unbounded cache.
    prefix_blocks = [new_blocks(context_tokens // 2 // _BLOCK) for _ in range(num_prefixes)]
    choice = rng.integers(0, num_prefixes, size=num_requests)
    prompts = []
    for prefix in choice:
        shared = prefix_blocks[prefix]
        unique = new_blocks(_num_blocks(context_tokens) - len(shared))
        prompts.append(Prompt(context_tokens, 512, shared + unique))
    return prompts


def _mixshift_prompts(
    rng: np.random.Generator, num_requests: int, new_blocks: Callable[[int], tuple[int, ...]]
) -> list[Prompt]:
    # A workload whose mix changes half-way: chat first (short prompts, long answers:
    # decode-heavy), then summaries (long prompts, short answers: prefill-heavy).
    first = num_requests // 2
    second = num_requests - first
    shapes = [
        (_calibrated_lengths(rng, n, mean_in, 0.4, lo_in, hi_in),
         _calibrated_lengths(rng, n, mean_out, 0.4, lo_out, hi_out))
        for n, mean_in, lo_in, hi_in, mean_out, lo_out, hi_out in (
            (first, 1024, 128, 4096, 768, 64, 2048),
            (second, 12288, 2048, 32768, 48, 8, 256),
        )
        if n > 0
    ]  # fmt: skip
    return [
        Prompt(int(n_in), int(n_out), new_blocks(_num_blocks(int(n_in))))
        for inputs, outputs in shapes
        for n_in, n_out in zip(inputs, outputs, strict=True)
    ]


def _longctx_spec(context_k: int) -> DatasetSpec:
    return DatasetSpec(
        name=f"longctx-{context_k}k",
        description=f"{context_k * 1024}-token prompts, 512 output tokens, "
        "first half one of 4 shared prefixes",
        build=functools.partial(_longctx_prompts, context_tokens=context_k * 1024),
    )


#: Every dataset by name (read-only).
DATASETS: Mapping[str, DatasetSpec] = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            DatasetSpec(
                "arxiv",
                "ArXiv-summarisation-like: ~8088 input, ~229 output tokens, no sharing",
                _arxiv_prompts,
            ),
            DatasetSpec(
                "leval",
                "L-Eval-like: ~19019 input, ~72 output tokens, 16 questions per document",
                _leval_prompts,
            ),
            *(_longctx_spec(k) for k in (16, 32, 64, 128)),
            DatasetSpec(
                "mixshift",
                "first half chat (~1024 input, ~768 output tokens), second half summaries "
                "(~12288 input, ~48 output); no sharing: the best P:D split changes",
                _mixshift_prompts,
            ),
        )
    }
)


def poisson_arrivals_s(rng: np.random.Generator, rate: float, num_requests: int) -> np.ndarray:
    """Arrival times (s) of a Poisson process at ``rate``/s, the first at t = 0."""
    gaps_s = rng.exponential(1.0 / rate, size=num_requests)
    return np.round(np.cumsum(gaps_s) - gaps_s[0], 6)


def generate_dataset(
    name: str, rate: float, num_requests: int, seed: int | np.random.Generator = 0
) -> list[Request]:
    """``num_requests`` requests of dataset ``name`` arriving at ``rate`` requests/s.

    ``seed`` is an integer or a ``numpy.random.Generator`` to draw from; the same seed
    gives the same dataset.
    """
    spec = DATASETS.get(name)
    if spec is None:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive number of requests/s, got {rate}")
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests}")
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    prompts = spec.build(rng, num_requests, _block_allocator())
    arrivals_s = poisson_arrivals_s(rng, rate, num_requests)
    ids = IdGenerator(name)
    return [
        Request(
            request_id=ids.next(),
            arrival_time_s=float(arrival_s),
            input_length=prompt.input_length,
            output_length=prompt.output_length,
            block_hashes=prompt.block_ids,
            block_size_tokens=_BLOCK,
        )
        for prompt, arrival_s in zip(prompts, arrivals_s, strict=True)
    ]
