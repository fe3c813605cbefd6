"""Beam search (vLLM's ``use_beam_search`` on completions and chat), run by the gateway.

A request with ``use_beam_search`` keeps ``n`` beams (the beam width, 1 to
:data:`~halfmoon.serve.gateway.openai_api.MAX_BEAM_WIDTH`). Each step
asks the cluster for the next token's ``2n`` likeliest alternatives after every live
beam: one request per beam with ``max_tokens`` 1, which a prefill worker answers alone
from its prefix cache (each beam's prompt is the request's prompt plus the beam's
tokens, so only the last partial block is computed again). Of all the extensions the
``n`` best by score go on; one that ends in an end-of-sequence token (unless
``ignore_eos``) is finished and leaves the search. The search ends when no beam is left
or after ``max_tokens`` steps; the ``n`` best of the finished and the remaining beams are
the answer's choices, best first.

A beam's score is its summed log-probability over its length raised to
``length_penalty`` (generated tokens, an end token not counted; 1.0 by default: the
mean log-probability per token; 0: the plain sum, which favours short answers). The
log-probabilities are the model's own: ``temperature``, ``top_p``, ``top_k`` and
``min_p`` do not change the search, as in vLLM. Options that would change the output
token by token (stop strings, penalties, biases, structured outputs, tools, log
probabilities in the answer, streaming) are refused with a 400 naming them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from halfmoon.core.request import SamplingParams
from halfmoon.serve.gateway.access_log import note_generation
from halfmoon.serve.gateway.backend import BackendError, GenerationChunk
from halfmoon.serve.gateway.openai_api import choice_body, completion_body, usage
from halfmoon.serve.gateway.responses import Prepared

if TYPE_CHECKING:
    from halfmoon.serve.gateway.gateway import Gateway


@dataclass(frozen=True)
class Beam:
    """One hypothesis: its generated tokens, their summed log-probability, and why it
    ended (``stop``: an end token, ``length``: ``max_tokens``; None: still growing)."""

    tokens: tuple[int, ...]
    logprob: float
    finish: str | None = None

    def score(self, length_penalty: float, end_ids: frozenset[int]) -> float:
        """Summed log-probability over length ** ``length_penalty`` (an end token not
        counted in the length)."""
        length = len(self.tokens) - (1 if self.tokens and self.tokens[-1] in end_ids else 0)
        return self.logprob / max(length, 1) ** length_penalty


@dataclass
class Searched:
    """A search's result: the best beams, best first, and the prompt tokens its first
    step found cached."""

    beams: list[Beam]
    cached_tokens: int


#: ``chunks(p)``: a one-token request's chunks from the cluster (the gateway's ``chunks``).
Chunks = Callable[[Prepared], AsyncIterator[GenerationChunk]]


async def _alternatives(chunks: Chunks, p: Prepared) -> tuple[list[tuple[int, float]], int]:
    """The next token's likeliest alternatives after ``p.prompt_ids`` as ``[(token id,
    log-probability)]``, likeliest first, and the prompt tokens the cluster found cached."""
    tops: list[tuple[int, float]] | None = None
    cached = 0
    async with aclosing(chunks(p)) as stream:
        async for chunk in stream:
            cached = chunk.cached_tokens if chunk.cached_tokens is not None else cached
            if chunk.logprobs and tops is None:
                tops = list(chunk.logprobs[0].top)
    if not tops:
        raise BackendError("the cluster sent no log-probabilities for a beam search step")
    return tops, cached


async def beam_search(
    p: Prepared, chunks: Chunks, end_ids: Sequence[int], length_penalty: float
) -> Searched:
    """The ``p.n`` best beams after ``p.prompt_ids`` (see the module docstring)."""
    width = p.n
    ends = frozenset(() if p.params.ignore_eos else end_ids)
    step_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                                 logprobs=2 * width)  # fmt: skip
    live = [Beam((), 0.0)]
    done: list[Beam] = []
    cached = 0

    def key(beam: Beam) -> float:
        return beam.score(length_penalty, ends)

    for step in range(p.params.max_tokens):
        steps = [
            replace(p, request_id=f"{p.request_id}.b{step}.{i}",
                    prompt_ids=[*p.prompt_ids, *beam.tokens], params=step_params, n=1, more=())
            for i, beam in enumerate(live)
        ]  # fmt: skip
        results = await asyncio.gather(*(_alternatives(chunks, s) for s in steps))
        if step == 0:
            cached = results[0][1]
        candidates = [
            Beam((*beam.tokens, token), beam.logprob + logprob)
            for beam, (tops, _) in zip(live, results, strict=True)
            for token, logprob in tops
        ]
        live = []
        for beam in sorted(candidates, key=key, reverse=True)[:width]:
            if beam.tokens[-1] in ends:
                done.append(replace(beam, finish="stop"))
            else:
                live.append(beam)
        if not live:
            break
    done += [replace(beam, finish="length") for beam in live]
    return Searched(sorted(done, key=key, reverse=True)[:width], cached)


async def search_beams(
    p: Prepared, model: str, length_penalty: float, gw: Gateway
) -> dict[str, Any]:
    """The whole response to a ``use_beam_search`` request: a search per prompt (a
    batched completion's run side by side), each prompt's ``n`` best beams as its
    choices, best first (Rejected / BackendError propagate)."""
    prompts = [p, *(replace(p, request_id=f"{p.request_id}.p{j}", prompt_ids=ids, echo=echo)
                    for j, (ids, echo) in enumerate(p.more, 1))]  # fmt: skip
    results = await asyncio.gather(
        *(beam_search(q, gw.chunks, gw.end_token_ids, length_penalty) for q in prompts)
    )
    choices, prompt_tokens, generated, cached = [], 0, 0, 0
    for q, result in zip(prompts, results, strict=True):
        prompt_tokens += len(q.prompt_ids)
        cached += result.cached_tokens
        for beam in result.beams:
            text = gw.tokenizer.decode(beam.tokens, q.skip_special_tokens)
            choices.append(choice_body(len(choices), text, beam.finish, p.chat, None))
            generated += len(beam.tokens)
            gw.metrics.requests.labels(finished_reason=beam.finish).inc()
    gw.metrics.prompt_tokens.inc(prompt_tokens)
    gw.metrics.generation_tokens.inc(generated)
    note_generation(prompt_tokens, generated, None)
    return completion_body(p.public_id, model, choices, usage(prompt_tokens, generated, cached),
                           p.chat)  # fmt: skip
