"""Conversions between control-plane maps and the records they carry."""

from __future__ import annotations

from typing import Any

from halfmoon.core.request import SamplingParams, TokenLogprob

_PARAM_FIELDS = ("max_tokens", "temperature", "top_p", "seed", "ignore_eos", "min_tokens")


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """Sampling parameters as a plain map (stop strings stay with the gateway)."""
    out = {name: getattr(params, name) for name in _PARAM_FIELDS}
    out["top_k"] = params.top_k
    out["stop_token_ids"] = list(params.stop_token_ids)
    if params.logprobs is not None:
        out["logprobs"] = params.logprobs
    if params.logit_bias:
        out["logit_bias"] = [[t, b] for t, b in params.logit_bias]
    if params.has_penalties:
        out["penalties"] = [
            params.presence_penalty, params.frequency_penalty, params.repetition_penalty
        ]  # fmt: skip
    return out


def params_from_wire(data: dict[str, Any]) -> SamplingParams:
    """The engine's sampling parameters from :func:`params_to_wire`'s map."""
    presence, frequency, repetition = data.get("penalties", (0.0, 0.0, 1.0))
    seed = data.get("seed")
    return SamplingParams(
        max_tokens=int(data["max_tokens"]),
        temperature=float(data["temperature"]),
        top_p=float(data["top_p"]),
        seed=None if seed is None else int(seed),
        ignore_eos=bool(data.get("ignore_eos", False)),
        min_tokens=int(data.get("min_tokens", 0)),
        top_k=int(data.get("top_k", 0)),
        stop_token_ids=tuple(int(t) for t in data.get("stop_token_ids", ())),
        logprobs=None if data.get("logprobs") is None else int(data["logprobs"]),
        logit_bias=tuple((int(t), float(b)) for t, b in data.get("logit_bias", ())),
        presence_penalty=float(presence),
        frequency_penalty=float(frequency),
        repetition_penalty=float(repetition),
    )


def cache_salt_from_wire(message: dict[str, Any]) -> str | None:
    """A command's ``cache_salt`` (None when absent); anything but a non-empty string is
    refused (the gateway sends only those)."""
    salt = message.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r:.40}")
    return salt


def logprobs_to_wire(entries: tuple[TokenLogprob, ...]) -> list[list[Any]]:
    """Token log-probabilities as ``[[logprob, [[token, logprob], ...]], ...]``."""
    return [[e.logprob, [[t, lp] for t, lp in e.top]] for e in entries]


def logprobs_from_wire(data: list[list[Any]]) -> tuple[TokenLogprob, ...]:
    """The records of :func:`logprobs_to_wire`'s lists."""
    return tuple(
        TokenLogprob(float(lp), tuple((int(t), float(v)) for t, v in top)) for lp, top in data
    )
