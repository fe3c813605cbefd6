"""The fingerprint that keys a worker's SSD tier names the KV a model computes: the same
for a copy of the weights, different for any changed weight byte, dtype, block size or
adapter, blind to what does not touch the KV (the tokenizer)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.catalog import model_fingerprint


def _adapter(root: Path, weights: bytes) -> str:
    root.mkdir()
    (root / "adapter_config.json").write_text('{"r": 4}')
    (root / "adapter_model.safetensors").write_bytes(weights)
    return str(root)


def test_fingerprint_follows_the_weights(tiny_dir: Path, tmp_path: Path) -> None:
    base = model_fingerprint(tiny_dir, "float32", 16)
    assert len(base) == 16
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)
    assert model_fingerprint(copy, "float32", 16) == base
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text() + " ")
    assert model_fingerprint(copy, "float32", 16) == base  # the KV does not depend on it
    assert model_fingerprint(copy, "bfloat16", 16) != base
    assert model_fingerprint(copy, "float32", 32) != base
    (weights,) = copy.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[-3] ^= 1  # one bit of the last tensor
    weights.write_bytes(bytes(data))
    assert model_fingerprint(copy, "float32", 16) != base


def test_fingerprint_follows_the_adapters(tiny_dir: Path, tmp_path: Path) -> None:
    one = _adapter(tmp_path / "one", b"\x01" * 64)
    other = _adapter(tmp_path / "other", b"\x02" * 64)
    with_one = model_fingerprint(tiny_dir, "float32", 16, [("sql", one)])
    assert with_one != model_fingerprint(tiny_dir, "float32", 16)
    assert with_one != model_fingerprint(tiny_dir, "float32", 16, [("sql", other)])
    assert with_one != model_fingerprint(tiny_dir, "float32", 16, [("chat", one)])
    both = [("sql", one), ("chat", other)]
    assert model_fingerprint(tiny_dir, "float32", 16, both) == model_fingerprint(
        tiny_dir, "float32", 16, both[::-1]
    )
    shutil.rmtree(other)
    with pytest.raises(HalfmoonError, match="cannot read .*adapter_config.json"):
        model_fingerprint(tiny_dir, "float32", 16, both)
