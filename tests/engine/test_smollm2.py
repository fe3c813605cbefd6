"""The real default model: SmolLM2-135M-Instruct imported from its Q4_1 GGUF, against
transformers loading the same file (float32 on both sides).

Tolerance: logits within 1e-4 of the largest logit's magnitude (measured: ~3e-6, i.e.
1e-4 absolute on logits of scale ~38; a wrong q/k permutation, tokenizer or norm moves
them by O(1)). Greedy continuations must be identical token for token.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from engine_testlib import BLOCK_SIZE, assert_logits_close, engine_config, prefill

from halfmoon.core.request import SamplingParams
from halfmoon.engine.engine import LLMEngine

pytestmark = pytest.mark.slow  # the real model: ~55 s here

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "In 2024, 12345 people paid $3.50 (or €3,20) each.",
    "  leading spaces,\ttabs\t\tand\n\n\nnewline runs   ",
    "naïve café, 日本語のテキスト, emoji 🤖🎉, Ελληνικά and ß",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|> inline specials",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "",
]


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf: Path):
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(
            smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
        ).eval()


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    return LLMEngine(engine_config(smollm2_dir, kv_cache_mb=64))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' argmax continuation (through EOS, like ``ignore_eos``), with its cache."""
    out: list[int] = []
    step, past = torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(n):
            result = model(step, cache=past, use_cache=True)
            past = result.past_key_values
            out.append(int(result.logits[0, -1].argmax()))
            step = torch.tensor([[out[-1]]])
    return out


def test_chat_answer_is_paris(engine: LLMEngine) -> None:
    prompt = engine.tokenizer.apply_chat_template(QUESTION)
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=32, temperature=0))
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"  # <|im_end|> ends the turn
    engine.check_integrity()


def test_logits_match_transformers(engine: LLMEngine, hf_model) -> None:
    # Plain text: a chat prompt would share its system-prompt blocks with the cache.
    tokens = engine.tokenizer.encode(
        "Copper is a soft, malleable and ductile metal with very high thermal and electrical "
        "conductivity. It is used in wires, pipes and coins."
    )
    ours = prefill(engine, "logits", tokens, [16, 5, len(tokens) - 21])  # chunks off the grid
    with torch.no_grad():
        theirs = hf_model(torch.tensor([tokens])).logits[0]
    assert_logits_close(ours, theirs)
    engine.block_manager.free("logits")
    engine.check_integrity()


def test_greedy_32_tokens_identical_including_a_reused_prefix(engine: LLMEngine, hf_model) -> None:
    tok = engine.tokenizer
    shared = "You are a careful assistant. Answer in one short paragraph. " * 3
    prompts = [
        tok.apply_chat_template(QUESTION),
        tok.encode("The three primary colors are"),
        tok.apply_chat_template([{"role": "user", "content": shared + "Why is the sky blue?"}]),
        tok.apply_chat_template([{"role": "user", "content": shared + "Name a large mammal."}]),
    ]
    # The last two share more than two blocks of prompt: the fourth reuses cached blocks.
    common = next(i for i, (a, b) in enumerate(zip(prompts[2], prompts[3], strict=False)) if a != b)
    assert common > 2 * BLOCK_SIZE
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for prompt in prompts:
        (out,) = engine.generate([prompt], params)
        assert list(out.token_ids) == hf_greedy(hf_model, prompt, 32), tok.decode(prompt)
    assert out.num_cached_tokens == (common // BLOCK_SIZE) * BLOCK_SIZE
    engine.check_integrity()


def test_tokenizer_matches_transformers_gguf_tokenizer(engine: LLMEngine, smollm2_gguf) -> None:
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    tok = engine.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids)
    rendered = ref.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert tok.apply_chat_template(QUESTION) == ref.encode(rendered)
    assert tok.eos_token_id == ref.eos_token_id == 2
