"""A ``tokenizers`` tokenizer (and its ``tokenizer_config.json``) from a GGUF file's
``tokenizer.ggml.*`` metadata.

Two vocabulary kinds (``tokenizer.ggml.model``):

- ``gpt2``: byte-level BPE (SmolLM2, Qwen2, Llama 3). Tokens are stored in the byte-level
  alphabet; merges are given. Text is split before BPE by the regex of the file's
  pre-tokenizer type (``tokenizer.ggml.pre``: the split the merges were learned on).
- ``llama``: SentencePiece BPE (Llama 2, Mistral). Tokens use ``▁`` for spaces, scores
  rank them and no merges are stored: they are recovered from the vocabulary (every
  split of a token into two tokens is a merge, ranked by the merged token's score).
  Unknown bytes fall back to ``<0xNN>`` tokens.

Tokens typed CONTROL become special tokens (whole in text, skipped when decoding with
``skip_special_tokens``); USER_DEFINED ones are matched whole but are not special.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from halfmoon.core.errors import HalfmoonError

_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizer split patterns of the vocabularies (as the models' own tokenizer.json state
# them); a type not listed falls back to GPT-2's byte-level split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}  # fmt: skip
#: Pre-tokenizer types with GPT-2's split (``smollm``: the same, every digit apart).
_GPT2_TYPES = ("default", "gpt2", "")


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(gguf: Any, max_length: int) -> tuple[HFTokenizer, dict[str, Any]]:
    """The tokenizer and ``tokenizer_config.json`` dict a GGUF file's metadata describes."""
    kind = gguf.get("tokenizer.ggml.model")
    tokens = gguf.get("tokenizer.ggml.tokens")
    if not tokens:
        raise HalfmoonError(f"{gguf.path.name}: no tokenizer in the file (tokenizer.ggml.tokens)")
    types = gguf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok, add_bos = (
            _byte_level(gguf, tokens),
            bool(gguf.get("tokenizer.ggml.add_bos_token", False)),
        )
    elif kind == "llama":
        tok, add_bos = (
            _sentencepiece(gguf, tokens, types),
            bool(gguf.get("tokenizer.ggml.add_bos_token", True)),
        )
    else:
        raise HalfmoonError(
            f"{gguf.path.name}: unsupported tokenizer model {kind!r}; supported: gpt2, llama"
        )
    byte_level = kind == "gpt2"
    alphabet = set(_byte_alphabet().values())
    vocab = tok.get_vocab()
    tok.add_special_tokens([
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        # a "control" token outside the byte alphabet is not in a byte-level vocabulary
        if ty == _CONTROL and (not byte_level or set(t) <= alphabet)
    ])  # fmt: skip
    tok.add_tokens([
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _USER_DEFINED and t in vocab
    ])  # fmt: skip

    def name(key: str) -> str | None:
        index = gguf.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos = name("bos_token_id")
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": name("eos_token_id"),
        "unk_token": name("unknown_token_id"),
        "pad_token": name("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    template = gguf.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return tok, config


def _byte_level(gguf: Any, tokens: list[str]) -> HFTokenizer:
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # Tokens are stored byte-level spelled; a few files store some (specials) as plain text.
    spelled = [t if set(t) <= letters else "".join(alphabet[b] for b in t.encode()) for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges") or []]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges))
    pre = str(gguf.get("tokenizer.ggml.pre", "default") or "")
    if pre in _SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    elif pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])  # fmt: skip
    elif pre in _GPT2_TYPES:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise HalfmoonError(
            f"{gguf.path.name}: unsupported pre-tokenizer type {pre!r}; supported: "
            f"{', '.join(sorted({*_SPLITS, *_GPT2_TYPES, 'smollm'} - {''}))}"
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def recover_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a scored vocabulary.

    Each way of writing a token as two tokens is a merge; merges rank by the merged
    token's score (higher first), then by the longer left part, then the longer right
    part; ties keep vocabulary order (of the merged token, then of its parts' ids).
    """
    ids = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, int, int, int, str, str]] = []
    for index, (token, score) in enumerate(zip(tokens, scores, strict=True)):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                found.append(
                    (-score, -len(left), -len(right), index, ids[left], ids[right], left, right)
                )
    found.sort(key=lambda m: m[:6])
    return [(m[6], m[7]) for m in found]


def _sentencepiece(gguf: Any, tokens: list[str], types: list[int]) -> HFTokenizer:
    scores = gguf.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise HalfmoonError(f"{gguf.path.name}: a llama tokenizer needs tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = gguf.get("tokenizer.ggml.merges")
    pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else recover_merges(tokens, scores)
    unk_id = gguf.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    tok = HFTokenizer(
        models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    prefix_space = bool(gguf.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(steps)
    return tok
