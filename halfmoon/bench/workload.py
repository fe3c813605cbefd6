"""What the benchmark client sends: trace or dataset requests, time- and length-scaled,
and the real token ids of each prompt.

Requests keep their trace shape (lengths, block ids) until the moment they are sent;
only then are their prompts expanded into token ids by a
:class:`~halfmoon.workload.tokens.TokenSynthesizer`, so a long trace never holds millions
of token ids in memory. Two requests whose block ids agree on a prefix send the same
prefix tokens, so the server sees the trace's prefix sharing for real.

Arrivals are shifted so that the first request is sent at once (``send_at_s = 0``), then
divided by ``time_scale`` (2 = twice as fast), as ``halfmoon simulate`` does.
``length_scale`` shrinks every length by scaling the tokens per trace block
(``512 * length_scale`` tokens, an integer >= 1): a quarter keeps the number of blocks and
the sharing structure but sends 128 tokens per block; output lengths scale the same way
(:func:`halfmoon.workload.tokens.scale_request`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass

from halfmoon.core.request import Request
from halfmoon.workload.tokens import TokenSynthesizer, scale_request
from halfmoon.workload.trace import block_tokens_for_scale


@dataclass(frozen=True)
class PromptSpec:
    """How prompts are made: the token universe (``vocab_size``, ``min_token_id`` to skip
    a tokenizer's special ids) and a ``salt`` (another salt, unrelated prompts: a rerun
    against a warm server finds nothing cached from the previous run)."""

    vocab_size: int = 4096
    min_token_id: int = 16
    salt: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.min_token_id < self.vocab_size:
            raise ValueError(
                f"need 0 <= min token id < vocab size, got {self.min_token_id} and "
                f"{self.vocab_size}"
            )
        if self.salt < 0:
            raise ValueError(f"salt must be >= 0, got {self.salt}")


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: when (seconds after the run starts) and its scaled shape."""

    request: Request
    send_at_s: float

    @property
    def request_id(self) -> str:
        """The trace's request id."""
        return self.request.request_id


def plan_requests(
    requests: Iterable[Request],
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_requests: int | None = None,
) -> list[BenchRequest]:
    """The first ``max_requests`` of ``requests`` (in arrival order), scaled, with send
    times starting at 0. Raises ValueError for a bad scale or count, or no requests."""
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"--time-scale must be a positive number, got {time_scale}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"--max-requests must be >= 1, got {max_requests}")
    block_tokens = block_tokens_for_scale(length_scale)
    planned: list[BenchRequest] = []
    first_s: float | None = None
    for request in requests:
        if max_requests is not None and len(planned) >= max_requests:
            break
        if not request.block_hashes:
            raise ValueError(f"request {request.request_id} has no block ids to build a prompt")
        first_s = request.arrival_time_s if first_s is None else first_s
        scaled = scale_request(request, block_tokens)
        send_at_s = (request.arrival_time_s - first_s) / time_scale
        planned.append(
            BenchRequest(dataclasses.replace(scaled, arrival_time_s=send_at_s), send_at_s)
        )
    if not planned:
        raise ValueError("the workload has no requests")
    return planned


class PromptMaker:
    """Token ids of planned requests (one synthesizer, so shared blocks are made once)."""

    def __init__(self, spec: PromptSpec, block_tokens: int) -> None:
        self.spec = spec
        self._synth = TokenSynthesizer(
            spec.vocab_size, block_tokens, salt=spec.salt, min_token_id=spec.min_token_id
        )

    def prompt_ids(self, request: Request) -> list[int]:
        """The prompt of ``request`` (already scaled to this maker's block size)."""
        if request.block_size_tokens != self._synth.tokens_per_block:
            raise ValueError(
                f"request {request.request_id} has {request.block_size_tokens}-token blocks, "
                f"this prompt maker {self._synth.tokens_per_block}"
            )
        tokens = self._synth.prompt_tokens(request.block_hashes, request.input_length)
        return tokens.tolist()
