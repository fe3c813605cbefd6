"""Token sampling: greedy, temperature, min-p, top-k, top-p, repetition penalties, logit bias,
allowed tokens and structured outputs' grammar masks, with per-request seeds.

Randomness never depends on the batch: the draw for a request's ``n``-th output token
uses a generator seeded from ``(seed, n)``. A request therefore samples the same tokens
whether it runs alone or batched, after a preemption, or continued in another engine
after a KV handoff.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

import torch

from halfmoon.core.request import SamplingParams, TokenLogprob

#: Temperatures below this are greedy, as in vLLM: the draw would be all but greedy, and
#: dividing float32 logits by, e.g., 1e-300 gives infinities (the draw then failed, and
#: took its worker down).
GREEDY_BELOW = 1e-5
log = logging.getLogger(__name__)
_FLOAT32_MAX = torch.finfo(torch.float32).max
#: Tokens ranked first for ``top_p`` (:func:`_nuclei`); 8x more while they fall short.
NUCLEUS_FIRST = 64
_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, n) over the seed space
_MASK_63 = (1 << 63) - 1


#: Kept for callers of the engine's earlier name: ``top_k`` and ``stop_token_ids`` now
#: live in :class:`halfmoon.core.request.SamplingParams` itself.
EngineSamplingParams = SamplingParams


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs about one request this step."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    num_output_tokens: int
    banned_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: Prompt + output so far (only when a penalty applies); the output is its tail of
    #: ``num_output_tokens``.
    token_ids: tuple[int, ...] = ()
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    allowed_token_ids: tuple[int, ...] = ()
    #: What a structured output admits next (bool over the vocabulary), or None.
    grammar_mask: torch.Tensor | None = field(default=None, compare=False)
    #: ``bad_words`` as token sequences (:meth:`Tokenizer.bad_word_ids`).
    bad_words: tuple[tuple[int, ...], ...] = ()
    #: The one token this row must draw (a thinking budget spent: its end tag's next
    #: token, :func:`thinking_forced`), or None.
    forced_token: int | None = None


#: A reasoning's start and end tags as token ids (the engine's tokenizer's).
ThinkingTags = tuple[tuple[int, ...], tuple[int, ...]]


def _rfind(token_ids: SequenceABC[int], tag: tuple[int, ...], start: int = 0) -> int:
    """The position of the last ``tag`` in ``token_ids[start:]``, or -1 (its first token
    sought by ``index``, at C speed: a step of a long context pays little for it)."""
    n, first, found = len(tag), tag[0], -1
    with contextlib.suppress(ValueError):
        i = start
        while True:
            i = token_ids.index(first, i)
            if tuple(token_ids[i : i + n]) == tag:
                found = i
            i += 1
    return found


def thinking_forced(token_ids: SequenceABC[int], tags: ThinkingTags, budget: int) -> int | None:
    """vLLM's ``thinking_token_budget`` on ``token_ids`` (prompt + output so far): inside
    a reasoning (its last start tag not yet followed by an end tag) that has had
    ``budget`` tokens since its start tag, the next token of the end tag, which the
    sampler then forces until the tag is whole; None elsewhere. Each reasoning (a start
    tag after an end tag) has a budget of its own, as on vLLM."""
    start, end = tags
    opened = _rfind(token_ids, start)
    if opened < 0:
        return None
    inside = opened + len(start)
    if _rfind(token_ids, end, inside) >= 0:
        return None  # (closed)
    over = len(token_ids) - inside - budget  # tokens past the budget
    if over < 0:
        return None
    # The end tag's tokens forced so far: the longest head of it that ends the tokens
    # within those past the budget (none where the prompt itself ran past it).
    done = next(j for j in range(min(over, len(end) - 1), -1, -1)
                if j == 0 or tuple(token_ids[-j:]) == end[:j])  # fmt: skip
    return end[done]


def row_for(
    params: SamplingParams,
    seed: int,
    num_output_tokens: int,
    stop_ids: tuple[int, ...],
    token_ids: SequenceABC[int] = (),
    grammar_mask: torch.Tensor | None = None,
    bad_words: tuple[tuple[int, ...], ...] = (),
    thinking: ThinkingTags | None = None,
) -> SamplingRow:
    """The :class:`SamplingRow` of a request; its stop ids are banned until ``min_tokens``.
    ``token_ids`` (prompt + output so far) matter only to penalties, ``bad_words``
    (:meth:`~halfmoon.engine.tokenizer.Tokenizer.bad_word_ids`) and a thinking budget
    (``thinking``: the reasoning's tags, :func:`thinking_forced`); ``grammar_mask`` is its
    structured output's :meth:`~halfmoon.engine.structured.Constraint.allowed`."""
    banned = stop_ids if num_output_tokens < params.min_tokens else ()
    forced = None
    if thinking is not None and params.thinking_token_budget is not None:
        forced = thinking_forced(token_ids, thinking, params.thinking_token_budget)
    return SamplingRow(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=seed,
        num_output_tokens=num_output_tokens,
        banned_token_ids=banned,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty,
        token_ids=tuple(token_ids) if params.has_penalties or bad_words else (),
        logit_bias=params.logit_bias,
        min_p=params.min_p,
        allowed_token_ids=params.allowed_token_ids,
        grammar_mask=grammar_mask,
        bad_words=bad_words,
        forced_token=forced,
    )


def _bad_word_bans(row: SamplingRow) -> tuple[int, ...]:
    """The last token of every bad word whose other tokens end the output so far."""
    if not row.bad_words:
        return ()
    output = row.token_ids[len(row.token_ids) - row.num_output_tokens :]
    bans = []
    for word in row.bad_words:
        head = len(word) - 1
        if head <= len(output) and (head == 0 or tuple(output[-head:]) == word[:-1]):
            bans.append(word[-1])
    return tuple(bans)


def stop_ids_for(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """The token ids that end a request: its ``stop_token_ids``, plus the model's EOS ids
    unless it asked to ``ignore_eos``."""
    stop = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop.update(eos_token_ids)
    return frozenset(stop)


def finish_reason(
    token: int,
    params: SamplingParams,
    stop_ids: frozenset[int],
    num_output_tokens: int,
    num_tokens: int,
    max_model_len: int,
) -> str | None:
    """Why a request ends with its newest ``token`` (``num_output_tokens`` generated,
    ``num_tokens`` in all), stop strings aside: ``stop`` (a stop id, once ``min_tokens``
    are out), ``length`` (``max_tokens`` or the context), else None. The one rule of the
    engine's steps and of a pipeline's first token."""
    if token in stop_ids and num_output_tokens >= params.min_tokens:
        return "stop"
    if num_output_tokens >= params.max_tokens or num_tokens >= max_model_len:
        return "length"
    return None


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:
    """Penalise, in place, the logits ``[vocab]`` of tokens the request already has."""
    vocab = logits.shape[-1]
    if row.presence_penalty or row.frequency_penalty:
        output = row.token_ids[len(row.token_ids) - row.num_output_tokens :]
        if output:
            ids = torch.tensor(output, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].float()
            logits -= row.frequency_penalty * counts + row.presence_penalty * (counts > 0)
    if row.repetition_penalty != 1.0 and row.token_ids:
        seen = torch.tensor(sorted(set(row.token_ids)), device=logits.device)
        seen = seen[seen < vocab]
        values = logits[seen]
        penalty = row.repetition_penalty
        logits[seen] = torch.where(values > 0, values / penalty, values * penalty)


def _filter(logits: torch.Tensor, min_p: float, top_k: int) -> torch.Tensor:
    """Mask, out of place, what ``min_p``, then ``top_k`` exclude from the
    temperature-scaled ``logits`` ``[vocab]`` (vLLM's order; ``top_p`` is
    :func:`_nuclei`'s)."""
    if min_p > 0.0:
        # p < min_p * p_max  <=>  logit < max logit + log(min_p): no softmax needed
        logits = logits.masked_fill(logits < logits.max() + math.log(min_p), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits


def _nuclei(
    scaled: torch.Tensor, probs: torch.Tensor, top_ps: list[float]
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per row of ``scaled`` ``[M, vocab]`` (temperature-scaled, masked logits; ``probs``
    their softmax): the tokens its ``top_p`` keeps, (their ids, their probabilities)
    likeliest first, or None for a row whose ``top_p`` is 1 (all of them). A token is
    dropped when the tokens ranked above it already reach ``top_p``; the first is always
    kept (also when ``top_p`` rounds to 0 in float32: 5e-324 once dropped them all).

    Only the likeliest few are ranked: the top :data:`NUCLEUS_FIRST` of every row at once
    (a row whose probabilities fall short of its ``top_p`` there: 8x more, up to the
    whole vocabulary), since the rest are dropped anyway. A full sort of a 49,152-token
    vocabulary took 3.3 ms a row on 2 CPU cores, half of a batch-8 decode step's time at
    the model's default ``top_p``."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(top_ps)
    wanted = [j for j, top_p in enumerate(top_ps) if top_p < 1.0]
    if not wanted:
        return out
    vocab = scaled.shape[-1]
    k = min(NUCLEUS_FIRST, vocab)
    ids = torch.topk(_rows(scaled, wanted), k).indices
    kept = _rows(probs, wanted).gather(1, ids)
    reached = torch.cumsum(kept, dim=-1)
    enough = reached[:, -1] >= torch.tensor([top_ps[j] for j in wanted], device=scaled.device)
    for r, j in enumerate(wanted):
        if k == vocab or bool(enough[r]):
            out[j] = _cut(ids[r], kept[r], reached[r], top_ps[j])
            continue
        grown = k
        while True:  # this row's nucleus reaches past the first k: rank more of it
            grown = min(vocab, grown * 8)
            row_ids = torch.topk(scaled[j], grown).indices
            row_kept = probs[j][row_ids]
            row_reached = torch.cumsum(row_kept, dim=-1)
            if grown == vocab or float(row_reached[-1]) >= top_ps[j]:
                out[j] = _cut(row_ids, row_kept, row_reached, top_ps[j])
                break
    return out


def _rows(tensor: torch.Tensor, index: list[int]) -> torch.Tensor:
    """Rows ``index`` of ``tensor``: the tensor itself when they are all of its rows (the
    usual batch: no copy, so writes go to it), else a copy of them."""
    return tensor if len(index) == tensor.shape[0] else tensor[index]


def _cut(
    ids: torch.Tensor, probs: torch.Tensor, reached: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head of ``ids`` (ranked, with their ``probs`` and cumulative sums) that
    ``top_p`` keeps (see :func:`_nuclei`), without tokens of probability 0."""
    keep = ((reached - probs) < top_p) & (probs > 0)
    keep[0] = True
    return ids[keep], probs[keep]


def _kept(row: SamplingRow, vocab: int, device: torch.device) -> torch.Tensor | None:
    """The tokens a row may draw (bool ``[vocab]``), None for all. A structured output's
    grammar wins over ``allowed_token_ids`` when they share no token, and either wins over
    ``min_tokens`` and ``bad_words``: stop tokens and bad words' tokens are banned only
    while something else is left. A forced token (a spent thinking budget) wins over all
    but a grammar that does not admit it (a structured output held from the start: the
    request then has no reasoning to end)."""
    forced, grammar = row.forced_token, row.grammar_mask
    if (
        forced is not None
        and forced < vocab
        and (grammar is None or (forced < grammar.shape[0] and bool(grammar[forced])))
    ):
        keep = torch.zeros(vocab, dtype=torch.bool, device=device)
        keep[forced] = True
        return keep
    keep = grammar = None
    if row.grammar_mask is not None:
        keep = grammar = torch.zeros(vocab, dtype=torch.bool, device=device)
        width = min(vocab, row.grammar_mask.shape[0])
        keep[:width] = row.grammar_mask[:width].to(device)
    if row.allowed_token_ids:
        listed = torch.zeros(vocab, dtype=torch.bool, device=device)
        listed[[t for t in row.allowed_token_ids if t < vocab]] = True
        keep = listed if keep is None else keep & listed
        if grammar is not None and not bool(keep.any()):
            keep = grammar
    banned = row.banned_token_ids + _bad_word_bans(row)
    if banned:
        unbanned = (
            torch.ones(vocab, dtype=torch.bool, device=device) if keep is None else keep.clone()
        )
        unbanned[[t for t in banned if t < vocab]] = False
        if bool(unbanned.any()):
            keep = unbanned
    return keep


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """One token id per row of ``logits`` ``[N, vocab]``, on any device (the seeded draw
    itself uses a CPU generator on every device). ``logits`` may change in place."""
    logits = logits.to(torch.float32)
    if logits.is_inference() and not torch.is_inference_mode_enabled():
        logits = logits.clone()  # masks and penalties write into it (a pipeline stage's)
    for i, row in enumerate(rows):
        if row.token_ids:
            _apply_penalties(logits[i], row)
        if row.logit_bias:
            ids, biases = zip(*row.logit_bias, strict=True)
            logits[i, list(ids)] += torch.tensor(biases, dtype=logits.dtype, device=logits.device)
        keep = _kept(row, logits.shape[-1], logits.device)
        if keep is not None:
            logits[i].masked_fill_(~keep, float("-inf"))
    tokens = _argmax(logits).tolist()
    drawn = [i for i, row in enumerate(rows) if row.temperature >= GREEDY_BELOW]
    if not drawn:
        return tokens
    # Every drawn row at once: scaled (kept finite, or the softmax makes NaNs of inf - inf:
    # a repetition penalty of 1e-40 divides a positive logit into +inf; the draw then
    # failed, taking its worker down), filtered, then its softmax and nucleus.
    temperatures = torch.tensor([rows[i].temperature for i in drawn], device=logits.device)
    scaled = _rows(logits, drawn).div_(temperatures[:, None]).clamp_(max=_FLOAT32_MAX)
    for j, i in enumerate(drawn):
        if rows[i].min_p > 0.0 or rows[i].top_k > 0:
            scaled[j] = _filter(scaled[j], rows[i].min_p, rows[i].top_k)
    probs = torch.softmax(scaled, dim=-1)
    nuclei = _nuclei(scaled, probs, [rows[i].top_p for i in drawn])
    # What to draw from (on the CPU): a nucleus's cumulative sums (float64), and the rows
    # drawn from the whole vocabulary all at once, in tiles.
    whole = [j for j, nucleus in enumerate(nuclei) if nucleus is None]
    tiled = _Tiled(_rows(probs, whole).cpu()) if whole else None
    for j, i in enumerate(drawn):
        row, nucleus = rows[i], nuclei[j]
        if nucleus is None:
            assert tiled is not None
            ids, cumulative = None, tiled.row(whole.index(j))
        else:
            ids = nucleus[0]
            cumulative = _Cumulative(torch.cumsum(nucleus[1].cpu(), -1, dtype=torch.float64))
        total = float(cumulative.total)  # NaN or inf when any probability is
        if not (math.isfinite(total) and total > 0.0):
            # Never expected (every input above is kept finite): the likeliest token, not
            # an exception that would take the whole batch's worker down.
            log.warning("sampling: no valid distribution for a row (temperature %g, seed "
                        "%d): drawn greedily", row.temperature, row.seed)  # fmt: skip
            continue
        generator = torch.Generator().manual_seed(
            (row.seed * _SEED_MIX + row.num_output_tokens) & _MASK_63
        )
        point = torch.rand(1, generator=generator, dtype=torch.float64) * cumulative.total
        token = cumulative.index(point)
        tokens[i] = token if ids is None else int(ids[token])
    return tokens


#: Tokens per tile of the two-level searches over a whole vocabulary (:func:`_argmax`,
#: :class:`_Tiled`).
TILE = 256


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` for ``logits`` ``[N, vocab]``: the first index of
    each row's maximum (of its first NaN, if any). On the CPU, for several rows, found
    tile by tile: each tile's maximum, the first tile holding the row's, the first index of
    it there. torch's CPU argmax does not vectorize: 2.0 ms for 32 rows of a
    49,152-token vocabulary on 2 cores, 0.18 ms this way (0.34 / 0.12 ms for 8 rows)."""
    rows, vocab = logits.shape
    whole = vocab // TILE
    if logits.device.type != "cpu" or rows < 4 or whole < 2:
        return torch.argmax(logits, dim=-1)
    tiles = logits[:, : whole * TILE].reshape(rows, whole, TILE)
    at = torch.arange(rows)
    first = torch.argmax(torch.amax(tiles, dim=-1), dim=-1)  # a row's first tile of its max
    index = first * TILE + torch.argmax(tiles[at, first], dim=-1)
    if whole * TILE < vocab:  # the tokens past the last whole tile: theirs if greater
        rest, rest_index = torch.max(logits[:, whole * TILE :], dim=-1)
        found = logits[at, index]
        beyond = (rest > found) | (rest.isnan() & ~found.isnan())
        index = torch.where(beyond, whole * TILE + rest_index, index)
    return index


class _Cumulative:
    """Probabilities' cumulative sums (float64, CPU) to draw an index from: the first
    whose sum passes a point in [0, :attr:`total`), never an index of probability 0.
    (``torch.multinomial`` took 1.2 ms for a 49,152-token vocabulary on 2 CPU cores;
    a search of the sums 0.05 ms.)"""

    def __init__(self, sums: torch.Tensor) -> None:
        self.sums = sums
        self.total = sums[-1:]

    def index(self, point: torch.Tensor) -> int:
        """The index whose cumulative range holds ``point`` (``[1]``, float64)."""
        index = int(torch.searchsorted(self.sums, point, right=True))
        if index == self.sums.shape[-1]:  # (the point rounded up to the total) the last
            index = int(torch.searchsorted(self.sums, self.total))  # of a probability > 0
        return index


class _Tiled:
    """Rows of probabilities ``[M, vocab]`` (float32, CPU) to draw from in two steps: the
    tile whose cumulative range holds the point (the tiles' sums, float64 cumulative
    sums of them), then the token within it (the tile's own float64 cumulative sums).
    Summing every row whole in float64 took 3.8 ms for 32 rows of a 49,152-token
    vocabulary on 2 cores, 1.2 times what the rest of a temperature-only draw costs."""

    def __init__(self, probs: torch.Tensor) -> None:
        rows, vocab = probs.shape
        pad = -vocab % TILE
        if pad:
            probs = torch.nn.functional.pad(probs, (0, pad))
        self.tiles = probs.reshape(rows, -1, TILE)
        self.sums = torch.cumsum(self.tiles.sum(dim=-1), dim=-1, dtype=torch.float64)

    def row(self, r: int) -> _TiledRow:
        """Row ``r`` to draw from."""
        return _TiledRow(self.tiles[r], _Cumulative(self.sums[r]))


class _TiledRow:
    """One row of :class:`_Tiled`: :attr:`total` and :meth:`index` as a
    :class:`_Cumulative` of the whole row would have them (to rounding)."""

    def __init__(self, tiles: torch.Tensor, tile_sums: _Cumulative) -> None:
        self.tiles = tiles
        self.tile_sums = tile_sums
        self.total = tile_sums.total

    def index(self, point: torch.Tensor) -> int:
        """The token whose cumulative range holds ``point``: in the tile whose range holds
        it (a tile of a sum above 0), at the point less the tiles before it."""
        tile = self.tile_sums.index(point)
        before = (
            self.tile_sums.sums[tile - 1 : tile] if tile else torch.zeros(1, dtype=torch.float64)
        )
        within = _Cumulative(torch.cumsum(self.tiles[tile], -1, dtype=torch.float64))
        # (the tile's own sums may total a hair below its float32 sum: such a point is
        # the tile's last token of a probability above 0, as _Cumulative reads it)
        return tile * TILE + within.index(torch.clamp(point - before, min=0.0))


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], num_top: list[int | None]
) -> list[TokenLogprob | None]:
    """Per row of ``logits`` ``[N, vocab]``: the log-probability of ``tokens[i]`` under
    the model's distribution (the raw logits: before temperature, top-k/top-p and banned
    tokens, as vLLM reports them) and the ``num_top[i]`` most likely tokens; None where
    ``num_top[i]`` is None."""
    wanted = [i for i, k in enumerate(num_top) if k is not None]
    if not wanted:
        return [None] * len(tokens)
    rows = torch.log_softmax(logits[wanted].to(torch.float32), dim=-1)
    out: list[TokenLogprob | None] = [None] * len(tokens)
    for row, i in zip(rows, wanted, strict=True):
        k = int(num_top[i] or 0)
        top: tuple[tuple[int, float], ...] = ()
        if k:
            values, ids = torch.topk(row, min(k, row.shape[-1]))
            top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
        out[i] = TokenLogprob(float(row[tokens[i]]), top)
    return out


#: Rows of prompt logits turned into log-probabilities at a time (bounds the float32
#: copy: 256 x a 150k vocabulary is 150 MB).
PROMPT_LOGPROB_ROWS = 256


def prompt_token_logprobs(
    logits: torch.Tensor, targets: list[int], num_top: int
) -> list[TokenLogprob]:
    """Per row ``i`` of ``logits`` ``[N, vocab]`` (the model's raw logits at a prompt
    position): the log-probability of ``targets[i]`` (the prompt's next token), its rank
    in the vocabulary (1 = the likeliest; ties share the best place) and the ``num_top``
    likeliest tokens, as vLLM's ``prompt_logprobs`` report them."""
    out: list[TokenLogprob] = []
    ids = torch.tensor(targets, dtype=torch.long, device=logits.device)
    for lo in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        hi = min(lo + PROMPT_LOGPROB_ROWS, len(targets))
        rows = torch.log_softmax(logits[lo:hi].to(torch.float32), dim=-1)
        chosen = rows.gather(1, ids[lo:hi, None])
        ranks = (rows > chosen).sum(dim=1) + 1
        values = chosen[:, 0].tolist()
        tops: list[tuple[tuple[int, float], ...]] = [()] * (hi - lo)
        if num_top:
            top_values, top_ids = torch.topk(rows, min(num_top, rows.shape[-1]), dim=-1)
            tops = [
                tuple(zip(i, v, strict=True))
                for i, v in zip(top_ids.tolist(), top_values.tolist(), strict=True)
            ]
        out += [
            TokenLogprob(value, top, rank)
            for value, top, rank in zip(values, tops, ranks.tolist(), strict=True)
        ]
    return out


def chunk_prompt_logprobs(
    logits_of: Callable[[int, int], torch.Tensor], token_ids: SequenceABC[int], num_prompt: int,
    start: int, end: int, have: int, num_top: int,
) -> list[TokenLogprob]:  # fmt: skip
    """The prompt log-probabilities a chunk of positions ``start..end-1`` adds past the
    ``have`` already known (of prompt tokens 1..have; ``start <= have``): row ``j`` of
    the chunk predicts token ``start + j + 1``, and the row at the prompt's last position
    predicts no prompt token. ``logits_of(lo, hi)``: the logits of the chunk's rows
    ``lo..hi-1`` (computed only for the rows wanted, where the caller can)."""
    last = min(end, num_prompt - 1)
    if last <= have:
        return []
    targets = list(token_ids[have + 1 : last + 1])
    return prompt_token_logprobs(logits_of(have - start, last - start), targets, num_top)


def sample_with_logprobs(
    logits: torch.Tensor, rows: list[SamplingRow], num_top: list[int | None]
) -> tuple[list[int], list[TokenLogprob | None]]:
    """:func:`sample`, plus :func:`token_logprobs` of the logits as the model gave them
    (``sample`` may penalise or mask them in place, so those rows are kept first)."""
    raw = logits.clone() if any(k is not None for k in num_top) else logits
    tokens = sample(logits, rows)
    return tokens, token_logprobs(raw, tokens, num_top)
