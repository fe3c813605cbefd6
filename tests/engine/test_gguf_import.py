"""``halfmoon model import``: GGUF files written by gguf-py, against the weights they were
made from and against transformers loading the same file."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from engine_testlib import assert_logits_close, engine_config, prefill
from gguf_testlib import write_gguf
from safetensors.numpy import load_file

from halfmoon.cli import main
from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.catalog import NAMED_MODELS, add_sampling, resolve_model
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.gguf_import import import_gguf
from halfmoon.engine.loader import load_dir

TEXTS = [
    "Hello world 123, 4567 and 3.14!",
    "  leading spaces,\ttabs\t\tand\n\n\nnewline runs   ",
    "naïve café, 日本語のテキスト, emoji 🤖🎉 and ß",
    "<|im_start|>user\nhi<|im_end|>\n<s> and </s> inline",
    "Stais tra ma lou! def f(x):\n    return x + 1",
    "",
]


def transformers_model(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()


def transformers_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("tied", [False, True])
def test_f32_import_restores_the_original_weights(tmp_path: Path, arch: str, tied: bool) -> None:
    """Exact names and values: q/k rows un-permuted for llama and mistral, biases for qwen2."""
    hf = write_gguf(tmp_path / "m.gguf", arch, "F32", tied=tied)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    written = load_file(out / "model.safetensors")
    assert sorted(written) == sorted(hf)
    for name, array in hf.items():
        np.testing.assert_array_equal(written[name], array, err_msg=name)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == arch and config["tie_word_embeddings"] is tied
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [4]
    assert "temperature" not in generation  # the file recommends no sampling
    load_dir(out).model  # the engine loads it  # noqa: B018


def test_the_files_recommended_sampling_goes_into_the_generation_config(tmp_path: Path) -> None:
    """``general.sampling.*`` -> the fields a server takes as defaults; keys without a
    counterpart (mirostat) are left out."""
    sampling = {"general.sampling.temp": 0.6, "general.sampling.top_p": 0.95,
                "general.sampling.top_k": 20, "general.sampling.penalty_repeat": 1.1,
                "general.sampling.min_p": 0.05, "general.sampling.mirostat": 2}  # fmt: skip
    write_gguf(tmp_path / "m.gguf", metadata=sampling)
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["temperature"] == pytest.approx(0.6)
    assert generation["top_p"] == pytest.approx(0.95)
    assert generation["top_k"] == 20
    assert generation["min_p"] == pytest.approx(0.05)
    assert generation["repetition_penalty"] == pytest.approx(1.1)
    assert "mirostat" not in generation


def test_a_named_models_sampling_is_added_once_and_never_over_the_files(tmp_path: Path) -> None:
    config = tmp_path / "generation_config.json"
    config.write_text(json.dumps({"eos_token_id": [2]}))
    add_sampling(tmp_path, {"temperature": 0.2, "top_p": 0.9})
    assert json.loads(config.read_text()) == {"eos_token_id": [2], "temperature": 0.2,
                                              "top_p": 0.9}  # fmt: skip
    add_sampling(tmp_path, {"temperature": 0.5})  # sampling named already: kept whole
    assert json.loads(config.read_text())["temperature"] == 0.2
    config.write_text(json.dumps({"eos_token_id": [2], "top_k": 40}))  # the file's own
    add_sampling(tmp_path, {"temperature": 0.2})
    assert json.loads(config.read_text()) == {"eos_token_id": [2], "top_k": 40}
    assert [p.name for p in tmp_path.iterdir()] == ["generation_config.json"]  # no temp file
    assert dict(NAMED_MODELS["smollm2-135m-instruct"].sampling) == {"temperature": 0.2,
                                                                    "top_p": 0.9}  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "tensor_type", "tokenizer"),
    [
        ("llama", "F32", "gpt2"),
        ("llama", "F16", "gpt2"),
        ("llama", "BF16", "llama"),
        ("llama", "Q8_0", "gpt2"),
        ("llama", "Q4_0", "llama"),
        ("llama", "Q4_1", "gpt2"),
        ("qwen2", "Q8_0", "gpt2"),
        ("qwen2", "Q5_1", "gpt2"),
    ],
)
def test_logits_and_tokenizer_match_transformers_reading_the_same_file(
    tmp_path: Path, arch: str, tensor_type: str, tokenizer: str
) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, arch, tensor_type, tokenizer)
    out = import_gguf(path, tmp_path / "out")
    # The reference attention and eager glue: the import is on trial, not the kernels (and
    # this shape, eps 1e-5, would have its own packages built for this test alone).
    engine = LLMEngine(engine_config(out, attention="reference"))
    tokens = list(range(5, 70))
    ours = prefill(engine, "a", tokens, [16, 30, 19])
    with torch.no_grad():
        theirs = transformers_model(path)(torch.tensor([tokens])).logits[0]
    assert_logits_close(ours, theirs)
    engine.block_manager.free("a")
    engine.check_integrity()
    ref_tok = transformers_tokenizer(path)
    for text in TEXTS:
        ids = engine.tokenizer.encode(text)
        assert ids == ref_tok.encode(text), text
        assert engine.tokenizer.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True)


def test_quantized_weights_are_the_dequantized_values(tmp_path: Path) -> None:
    hf = write_gguf(tmp_path / "m.gguf", "qwen2", "Q4_1")
    out = import_gguf(tmp_path / "m.gguf", tmp_path / "out", dtype="bfloat16")
    from safetensors.torch import load_file as load_torch

    written = load_torch(out / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    assert written[name].dtype == torch.bfloat16
    q = gguf.quants.quantize(hf[name], gguf.GGMLQuantizationType.Q4_1)
    expected = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_1)
    torch.testing.assert_close(written[name], torch.from_numpy(expected).bfloat16())
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def _raw_tensor_file(path: Path, arch: str, qtype: gguf.GGMLQuantizationType) -> None:
    """A file whose only matrix is stored as raw zero bytes of ``qtype``."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([chr(ord("a") + i) for i in range(8)])
    writer.add_token_merges([])
    shape = gguf.quants.quant_shape_to_byte_shape((8, 256), qtype)
    writer.add_tensor("token_embd.weight", np.zeros(shape, np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _assert_one_line_error(capsys: pytest.CaptureFixture, argv: list[str], *words: str) -> None:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # progress lines may come first
    err = lines[-1]
    assert err.startswith("halfmoon: error: ") and "Traceback" not in "".join(lines), lines
    for word in words:
        assert word in err, err


def test_unsupported_architecture_and_tensor_type_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    _raw_tensor_file(tmp_path / "phi.gguf", "phi2", gguf.GGMLQuantizationType.F32)
    out = tmp_path / "out"
    _assert_one_line_error(
        capsys, ["model", "import", str(tmp_path / "phi.gguf"), "--out", str(out)],
        "unsupported architecture 'phi2'", "llama, qwen2, mistral",
    )  # fmt: skip
    _raw_tensor_file(tmp_path / "iq.gguf", "llama", gguf.GGMLQuantizationType.IQ2_XXS)
    _assert_one_line_error(
        capsys, ["model", "import", str(tmp_path / "iq.gguf"), "--out", str(out)],
        "token_embd.weight", "IQ2_XXS",
    )  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iq.gguf", "phi.gguf"]


def test_corrupt_and_truncated_files_are_clear_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    write_gguf(tmp_path / "good.gguf", "llama", "Q8_0")
    data = (tmp_path / "good.gguf").read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (tmp_path / "header.gguf").write_bytes(data[:200])
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all" * 10)
    for name in ("truncated", "header", "junk"):
        out = tmp_path / f"out-{name}"
        _assert_one_line_error(
            capsys, ["model", "import", str(tmp_path / f"{name}.gguf"), "--out", str(out)],
            f"{name}.gguf",
        )  # fmt: skip
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_existing_output_and_unknown_names_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    write_gguf(tmp_path / "m.gguf", "llama", "Q8_0")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(HalfmoonError, match="not empty"):
        import_gguf(tmp_path / "m.gguf", tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep me"
    _assert_one_line_error(
        capsys, ["generate", "--model", "no-such-model", "--prompt", "hi"],
        "unknown model 'no-such-model'", "smollm2-135m-instruct", "tiny",
    )  # fmt: skip
    _assert_one_line_error(
        capsys, ["model", "import", "no-such-model", "--out", str(tmp_path / "o")], "unknown model"
    )


def test_a_gguf_path_is_imported_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path / "cache"))
    write_gguf(tmp_path / "m.gguf", "qwen2", "Q8_0")
    first = resolve_model(str(tmp_path / "m.gguf"))
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("gguf-m-")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(tmp_path / "m.gguf")) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert main(["model", "list", "--json"]) == 0
