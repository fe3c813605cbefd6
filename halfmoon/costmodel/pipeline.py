"""Chunked pipeline parallelism (CPP): the TTFT of a prefill pipelined over K instances.

A CPP group is ``K`` instances (stages) of the same deployment, stage ``s`` holding the
``L/K`` contiguous layers ``s*L/K .. (s+1)*L/K - 1``. The prompt's new tokens are cut into
chunks of ``chunk_tokens``; chunk ``i`` runs through stage 0, its hidden states
(``hidden_size x dtype`` bytes per token) cross the link to stage 1, and so on, while
stage 0 already computes chunk ``i+1``::

    stage 0 | c0 | c1 | c2 | c3 |
    stage 1      >| c0 | c1 | c2 | c3 |             > = hand-off of hidden states
    stage 2           >| c0 | c1 | c2 | c3 |  <- TTFT: the last chunk leaves the last stage

A stage computes a chunk in ``prefill_time_s(chunk, position) / K``: its share of the
layers, so of the dense FLOPs, of the attention over everything before the chunk (which
grows with the chunk's position) and of the per-pass overhead (kernel launches are per
layer). The exact pipeline recurrence, with ``handoff(i)`` the link time of chunk ``i``'s
hidden states::

    finish[i][s] = max(finish[i-1][s], finish[i][s-1] + handoff(i)) + t(i)     (s >= 1)
    finish[i][0] = finish[i-1][0] + t(i)
    TTFT         = finish[last][K-1]

So ``K = 1`` is exactly the chunked single-instance prefill; for long prompts the stages
overlap and TTFT tends to ``1/K`` of it plus the fill (the first chunk crossing ``K-1``
stages); a prompt of one chunk gains nothing and pays the hand-offs.
"""

from __future__ import annotations

from dataclasses import dataclass

from halfmoon.costmodel.base import CostModel, check_count


@dataclass(frozen=True)
class PipelineEstimate:
    """The schedule of one pipelined prefill; times are seconds from its start.

    ``stage_start_s[s]`` / ``stage_end_s[s]``: when stage ``s`` begins its first chunk and
    ends its last one (an instance is held by the group until its ``stage_end_s``);
    ``stage_busy_s[s]``: its compute time (the rest of the span is fill bubbles and
    waits on hand-offs); ``last_chunk_stage_s``: one stage's time on the last chunk (its KV
    is the part that streams out after the compute); ``chunk_sizes``: the chunks.
    """

    num_stages: int
    chunk_sizes: tuple[int, ...]
    stage_start_s: tuple[float, ...]
    stage_end_s: tuple[float, ...]
    stage_busy_s: tuple[float, ...]
    last_chunk_stage_s: float

    @property
    def ttft_s(self) -> float:
        """Seconds until the last chunk leaves the last stage (prefill part of TTFT)."""
        return self.stage_end_s[-1]


def pipeline_chunks(num_tokens: int, chunk_tokens: int) -> tuple[int, ...]:
    """Split ``num_tokens`` into chunks of ``chunk_tokens`` (the last one shorter)."""
    n = check_count("num_tokens", num_tokens)
    size = check_count("chunk_tokens", chunk_tokens)
    if size < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if n == 0:
        return ()
    full, rest = divmod(n, size)
    return (size,) * full + ((rest,) if rest else ())


def cpp_prefill_estimate(
    cost_model: CostModel,
    num_stages: int,
    num_new_tokens: int,
    num_cached_tokens: int,
    chunk_tokens: int,
    hidden_bytes_per_token: int,
) -> PipelineEstimate:
    """Schedule ``num_new_tokens`` after ``num_cached_tokens`` cached ones over
    ``num_stages`` instances like ``cost_model``'s (the recurrence in the module doc).

    Hand-offs move ``chunk x hidden_bytes_per_token`` bytes over
    ``cost_model.transfer_time_s`` (the stage's link). Zero new tokens cost nothing.
    """
    k = check_count("num_stages", num_stages)
    if k < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    cached = check_count("num_cached_tokens", num_cached_tokens)
    hidden = check_count("hidden_bytes_per_token", hidden_bytes_per_token)
    chunks = pipeline_chunks(num_new_tokens, chunk_tokens)
    starts = [0.0] * k
    finish = [0.0] * k  # finish[s]: when stage s ended its latest chunk
    busy = [0.0] * k
    done = cached
    stage_s = 0.0
    for i, size in enumerate(chunks):
        stage_s = cost_model.prefill_time_s(size, done) / k
        handoff_s = cost_model.transfer_time_s(size * hidden) if k > 1 else 0.0
        ready_s = 0.0  # chunk i's input is there from the start at stage 0
        for s in range(k):
            begin_s = max(finish[s], ready_s)
            if i == 0:
                starts[s] = begin_s
            finish[s] = begin_s + stage_s
            busy[s] += stage_s
            ready_s = finish[s] + handoff_s
        done += size
    return PipelineEstimate(k, chunks, tuple(starts), tuple(finish), tuple(busy), stage_s)


def cpp_prefill_time_s(
    cost_model: CostModel,
    num_stages: int,
    num_new_tokens: int,
    num_cached_tokens: int,
    chunk_tokens: int,
    hidden_bytes_per_token: int,
) -> float:
    """Prefill seconds of a ``num_stages``-stage pipelined prefill (its TTFT without
    queueing): :func:`cpp_prefill_estimate`'s ``ttft_s``."""
    return cpp_prefill_estimate(
        cost_model,
        num_stages,
        num_new_tokens,
        num_cached_tokens,
        chunk_tokens,
        hidden_bytes_per_token,
    ).ttft_s


def hidden_bytes_per_token(cost_model: CostModel, override: int | None = None) -> int:
    """Bytes of hidden state per token crossing a stage boundary: ``override`` if given,
    else the cost model's own ``hidden_bytes_per_token`` (a worker's profile), else
    ``hidden_size x dtype_bytes`` of its ``model`` (roofline models).
    A cost model without a model spec needs the override (``ValueError`` otherwise)."""
    if override is not None:
        return check_count("hidden_bytes_per_token", override)
    measured = getattr(cost_model, "hidden_bytes_per_token", None)
    if isinstance(measured, int) and measured > 0:  # a worker's profile says it
        return measured
    spec = getattr(cost_model, "model", None)
    hidden_size = getattr(spec, "hidden_size", None)
    dtype_bytes = getattr(spec, "dtype_bytes", None)
    if not isinstance(hidden_size, int) or not isinstance(dtype_bytes, int):
        raise ValueError(
            "this cost model has no model spec: set the hidden-state bytes per token "
            "(ConductorConfig.cpp_hidden_bytes_per_token) for chunked pipeline parallelism"
        )
    return hidden_size * dtype_bytes
