"""What a model import says while it runs: (done, total) after every tensor for a bar, or
lines every 50 tensors without one (halfmoon.engine.gguf_import, halfmoon.engine.catalog)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_testlib import write_gguf

from halfmoon.engine.catalog import resolve_model, tensor_lines
from halfmoon.engine.gguf_import import import_gguf


def test_the_tensor_callback_counts_every_tensor_up_to_the_total(tmp_path: Path) -> None:
    hf = write_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    calls: list[tuple[int, int]] = []
    lines: list[str] = []
    import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=lines.append,
                tensor_progress=lambda done, total: calls.append((done, total)))  # fmt: skip
    total = len(hf)  # one GGUF tensor per HF tensor
    assert calls == [(i, total) for i in range(1, total + 1)]
    assert lines[0] == f"reading m.gguf ({(tmp_path / 'm.gguf').stat().st_size / 2**20:.0f} MiB)"
    assert lines[1].startswith("importing m.gguf: llama, 2 layers")
    assert not any("dequantized" in line for line in lines)  # the callback has the counts


def test_without_a_callback_the_lines_say_how_far(tmp_path: Path) -> None:
    hf = write_gguf(tmp_path / "m.gguf", "qwen2", "F32")
    lines: list[str] = []
    import_gguf(tmp_path / "m.gguf", tmp_path / "out", progress=lines.append)
    assert lines[-1] == f"dequantized {len(hf)}/{len(hf)} tensors"


def test_tensor_lines_every_n_and_at_the_end() -> None:
    said: list[str] = []
    tick = tensor_lines(said.append, every=4)
    for done in range(1, 11):
        tick(done, 10)
    assert said == ["dequantized 4/10 tensors", "dequantized 8/10 tensors",
                    "dequantized 10/10 tensors"]  # fmt: skip


def test_resolve_model_passes_both_callbacks_to_the_import_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "m.gguf", "llama", "F32")
    lines: list[str] = []
    counts: list[int] = []
    first = resolve_model(str(tmp_path / "m.gguf"), progress=lines.append,
                          tensor_progress=lambda done, _total: counts.append(done))  # fmt: skip
    assert lines[0] == "m.gguf is not in the model cache yet: loading the importer"
    assert lines[-1] == f"imported m.gguf into {first}"
    assert counts == sorted(counts) and counts[0] == 1 and len(counts) > 4
    lines.clear(), counts.clear()
    assert resolve_model(str(tmp_path / "m.gguf"), progress=lines.append) == first
    assert lines == [] and counts == []  # cached: nothing to say
