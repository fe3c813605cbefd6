"""Tokenizers: loading a model directory's ``tokenizer.json`` (+ chat template), building
the presets' byte-level BPE locally, and incremental detokenization for streaming.

The chat template comes from, in order: the one given (``--chat-template``, a file or the
template text, :func:`load_chat_template`), the model directory's ``chat_template.jinja``
(what recent transformers writes), ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of named templates: ``default`` else the first).

The preset tokenizer is trained with ``tokenizers`` on a corpus generated from a seeded
RNG (pseudo-words, numbers, punctuation, a little code), so it is the same on every
machine and needs no download. Its vocabulary is exactly the preset's ``vocab_size``.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from halfmoon.core.errors import HalfmoonError

BOS, EOS, PAD, IM_START, IM_END = "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"
#: Special tokens of the preset tokenizer, in id order (ids 0..4).
PRESET_SPECIAL_TOKENS = (BOS, EOS, PAD, IM_START, IM_END)
#: ChatML-style template; the BOS comes from the template, so encode it without specials.
PRESET_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS_SEED = 20240611


def _corpus(num_lines: int, seed: int = _CORPUS_SEED) -> Iterator[str]:
    """Deterministic training text: Zipf-distributed pseudo-words plus numbers and code."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v",
              "w", "st", "tr", "ch", "sh", "th", "pl", "gr"]  # fmt: skip
    vowels = ["a", "e", "i", "o", "u", "ai", "ou", "ea", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "ng", "ck"]
    words = []
    for _ in range(30000):
        syllables = rng.choice((1, 1, 2, 2, 2, 3, 3, 4))
        words.append("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                             for _ in range(syllables)))  # fmt: skip
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(words))))
    snippets = ["def f(x):", "return x + 1", "for i in range(10):", "{\"key\": [1, 2, 3]}",
                "if (a < b) { c = d; }", "import numpy as np", "# comment", "x = y * 2"]  # fmt: skip
    for _ in range(num_lines):
        line = rng.choices(words, cum_weights=cum_weights, k=rng.randint(6, 18))
        if rng.random() < 0.3:
            line.insert(rng.randrange(len(line)), str(rng.randint(0, 99999)))
        text = " ".join(line)
        text = text[0].upper() + text[1:] + rng.choice((".", ".", "?", "!", ",", ";", ":"))
        if rng.random() < 0.1:
            text += "\n" + rng.choice(snippets)
        yield text


def build_preset_tokenizer(vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of exactly ``vocab_size`` tokens, trained deterministically."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(PRESET_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(max(4000, vocab_size * 3)), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise HalfmoonError(
            f"preset tokenizer reached {tok.get_vocab_size()} tokens, expected {vocab_size}"
        )
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


def preset_tokenizer_config(max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` for the preset tokenizer (AutoTokenizer can load it)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": PRESET_CHAT_TEMPLATE,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }


#: The file recent transformers versions write the chat template to (beside tokenizer.json).
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def chat_template_from_config(value: Any) -> str | None:
    """The chat template of a ``tokenizer_config.json`` ``chat_template`` entry: a string,
    or a list of ``{"name", "template"}`` (the ``default`` one, else the first: a
    ``tool_use`` one needs tools this server does not take); None when there is none."""
    if isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {e.get("name"): e.get("template") for e in value if isinstance(e, Mapping)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) and chosen else None
    return None


def load_chat_template(value: str) -> str:
    """The template ``--chat-template`` names: a file's text, or ``value`` itself when it
    is template text (it holds ``{{`` or ``{%``), as vLLM's flag takes both; else a
    HalfmoonError naming it."""
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # unreadable, or a name too long to be a file
        if "{{" not in value and "{%" not in value:
            raise HalfmoonError(f"--chat-template {value!r}: cannot read it: {exc}") from None
    if "{{" in value or "{%" in value:
        return value
    raise HalfmoonError(f"--chat-template {value!r}: no such file, and not a Jinja template either")


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells special tokens as strings or {"content": ...} objects.
    if isinstance(value, Mapping):
        return value.get("content")
    return value


class Tokenizer:
    """Text <-> token ids for one model, with its chat template."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
    ):
        """``chat_template`` replaces the one ``config`` (a ``tokenizer_config.json``) has."""
        config = config or {}
        self._tok = tokenizer
        #: Its ``tokenizer_config.json`` (what vLLM's ``/tokenizer_info`` answers).
        self.config: dict[str, Any] = dict(config)
        self.chat_template: str | None = chat_template or chat_template_from_config(
            config.get("chat_template")
        )
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        eos_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id: int | None = eos_id

    @classmethod
    def from_dir(cls, model_dir: Path, chat_template: str | None = None) -> Tokenizer:
        """Load ``tokenizer.json``, ``tokenizer_config.json`` (optional) and the chat
        template (see the module docstring; ``chat_template``: the one given) from a
        model dir."""
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise HalfmoonError(f"no tokenizer.json in {model_dir}")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception on bad files
            raise HalfmoonError(f"cannot load {path}: {exc}") from None
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template_path = model_dir / CHAT_TEMPLATE_FILE
        if chat_template is None and template_path.is_file():
            chat_template = template_path.read_text(encoding="utf-8")
        return cls(tok, config, chat_template)

    @property
    def vocab_size(self) -> int:
        """Number of token ids (added tokens included)."""
        return self._tok.get_vocab_size()

    def backend_json(self) -> str:
        """The whole tokenizer as ``tokenizer.json`` text (what llguidance loads)."""
        return self._tok.to_str()

    def bad_word_ids(self, words: Iterable[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's ``bad_words`` as token sequences: each word as it stands at the start of
        a text, and after a space where that is another token sequence of the same length
        (so it is banned mid-text too). ValueError for a word that is no token."""
        out: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(self.encode(word.lstrip(), add_special_tokens=False))
            if not alone:
                raise ValueError(f"bad_words entry {word!r} is no token")
            out.append(alone)
            spaced = tuple(self.encode(" " + word.lstrip(), add_special_tokens=False))
            if spaced and spaced[0] != alone[0] and len(spaced) == len(alone):
                out.append(spaced)
        return tuple(out)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with BOS etc. when the tokenizer's post-processor adds them)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``."""
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Render ``messages`` with the chat template and tokenize the result.

        ``continue_final_message``: cut the text right after the final message's content,
        so that the model goes on with it (the template must render that content as it
        is). ``template_kwargs``: more variables for the template (not the names it is
        given here, :data:`RESERVED_TEMPLATE_NAMES`)."""
        if not self.chat_template:
            raise HalfmoonError(
                "this model has no chat template: give one with --chat-template (a file or "
                f"the template text), or add {CHAT_TEMPLATE_FILE} to the model directory"
            )
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise HalfmoonError(f"chat template: {message}")

        reserved = sorted(set(template_kwargs or {}) & RESERVED_TEMPLATE_NAMES)
        if reserved:
            raise HalfmoonError(f"chat template variables cannot set {', '.join(reserved)}")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            text = env.from_string(self.chat_template).render(
                **dict(template_kwargs or {}),
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise HalfmoonError(f"chat template failed: {exc}") from None
        if continue_final_message:
            final = str(messages[-1].get("content", "")) if messages else ""
            end = text.rfind(final) if final else -1
            if end < 0:
                raise HalfmoonError(
                    "continue_final_message needs a final message with text that the chat "
                    "template renders as it is"
                )
            text = text[: end + len(final)]
        return self.encode(text, add_special_tokens=False)

    def save(self, model_dir: Path, config: Mapping[str, Any]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``model_dir``."""
        self._tok.save(str(model_dir / "tokenizer.json"))
        (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


#: Names the chat template is always given (``chat_template_kwargs`` cannot set them).
RESERVED_TEMPLATE_NAMES = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}
)


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas.

    Decodes a short window (``prefix_offset..``) and emits only what extends the text of
    the already-emitted part; a window that ends inside a multi-byte character (U+FFFD)
    waits for the next token. A few prompt tokens seed the window so tokenizers that
    drop a leading space at the start of a decode (SentencePiece) stay right.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], context: int = 4,
        skip_special_tokens: bool = True,
    ) -> None:  # fmt: skip
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-context:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one id; returns the new text (possibly empty) and extends ``self.text``."""
        self._ids.append(token_id)
        skip = self._skip_special
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip)
        full_text = decode(self._ids[self._prefix_offset :], skip)
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta
