"""Fixtures of the engine tests (helpers live in engine_testlib, a uniquely named module)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_testlib import Reference, build_reference, random_prompt

from halfmoon.engine.loader import create_preset_dir


@pytest.fixture(scope="session")
def reference_builder(tmp_path_factory: pytest.TempPathFactory):
    """``get(name)``: the session's ``llama``, ``qwen2`` or ``mistral`` checkpoint, built once."""
    built: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in built:
            torch.manual_seed(1234)
            built[name] = build_reference(name, tmp_path_factory.mktemp(f"ref-{name}"))
        return built[name]

    return get


@pytest.fixture(scope="session", params=["llama", "qwen2", "mistral"])
def reference(request: pytest.FixtureRequest, reference_builder) -> Reference:
    """Llama (llama3 rope scaling), Qwen2 (q/k/v biases) and Mistral checkpoints."""
    return reference_builder(request.param)


@pytest.fixture(scope="session")
def llama_ref(reference_builder) -> Reference:
    """The Llama reference checkpoint alone (behaviour tests)."""
    return reference_builder("llama")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``halfmoon model create --preset tiny`` output (seed 0)."""
    return create_preset_dir("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture
def prompts():
    """``prompts(seed, lengths, vocab_size)`` -> list of random prompts."""

    def make(seed: int, lengths: list[int], vocab_size: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return [random_prompt(generator, n, vocab_size) for n in lengths]

    return make
