"""Presets, HF directories (transformers can read ours, we read theirs), tokenizer and
chat template, and clear errors for bad model input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from engine_testlib import Reference, engine_config

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.costmodel.models import get_model
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.loader import load_model, preset_config
from halfmoon.engine.tokenizer import build_preset_tokenizer
from halfmoon.engine.weights import empty_model

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there!"}]


def test_preset_dir_loads_in_transformers(tiny_dir: Path) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    engine = LLMEngine(engine_config(tiny_dir))
    assert engine.tokenizer is not None
    text = "Hello world, 123 héllo"
    assert hf_tok(text)["input_ids"] == engine.tokenizer.encode(text)
    chat = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert hf_tok(chat, add_special_tokens=False)[
        "input_ids"
    ] == engine.tokenizer.apply_chat_template(MESSAGES)
    prompt = engine.tokenizer.encode(text)
    params = SamplingParams(max_tokens=6, temperature=0.0, min_tokens=6)
    (ours,) = engine.generate([prompt], params)
    theirs = hf.generate(
        torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False
    )
    assert list(ours.token_ids) == theirs[0, len(prompt) :].tolist()
    engine.check_integrity()


def test_in_memory_preset_equals_written_dir(tiny_dir: Path) -> None:
    from_dir = load_model(str(tiny_dir))
    in_memory = load_model("tiny", seed=0)
    for (name, a), (_, b) in zip(
        from_dir.model.named_parameters(), in_memory.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    assert from_dir.eos_token_ids == in_memory.eos_token_ids == (1, 4)
    other_seed = load_model("tiny", seed=1)
    assert not torch.equal(
        other_seed.model.embed_tokens.weight, in_memory.model.embed_tokens.weight
    )


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_preset_shapes_match_cost_model(name: str) -> None:
    config = preset_config(name)
    model = empty_model(config, torch.float32, "meta")
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params == get_model(name).num_params
    if name == "small":
        assert 95e6 < num_params < 110e6


def test_preset_tokenizer_is_deterministic_with_exact_vocab() -> None:
    first, second = build_preset_tokenizer(4096), build_preset_tokenizer(4096)
    assert first.get_vocab_size() == 4096
    assert first.to_str() == second.to_str()
    ids = first.encode("def f(x): return x + 1").ids
    assert first.decode(ids) == "def f(x): return x + 1"


def test_sharded_checkpoint_loads(llama_ref: Reference, tmp_path: Path) -> None:
    llama_ref.hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded = load_model(str(tmp_path))
    single = load_model(str(llama_ref.path))
    for (name, a), (_, b) in zip(
        sharded.model.named_parameters(), single.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def _edited_copy(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"intermediate_size": 192}, "has shape"),
        ({"num_hidden_layers": 3}, "missing model.layers.2"),
        ({"num_hidden_layers": 1}, "unexpected tensor 'model.layers.1"),
        ({"model_type": "gpt2"}, "unsupported model_type"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act"),
    ],
)
def test_mismatched_config_and_weights(
    llama_ref: Reference, tmp_path: Path, changes, message
) -> None:
    bad = _edited_copy(llama_ref.path, tmp_path / "bad", **changes)
    with pytest.raises(HalfmoonError, match=message):
        load_model(str(bad))


def test_unknown_model_missing_files_and_corrupt_weights(
    llama_ref: Reference, tmp_path: Path
) -> None:
    with pytest.raises(HalfmoonError, match="unknown model"):
        load_model("huge")
    with pytest.raises(HalfmoonError, match="unknown model"):
        load_model(str(tmp_path / "does-not-exist"))
    with pytest.raises(HalfmoonError, match="no config.json"):
        load_model(str(tmp_path))
    broken = _edited_copy(llama_ref.path, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HalfmoonError, match="cannot read weights"):
        load_model(str(broken))
    (broken / "model.safetensors").unlink()
    with pytest.raises(HalfmoonError, match="no model.safetensors"):
        load_model(str(broken))


def test_a_preset_written_by_two_processes_at_once_is_kept_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two clusters starting on one cache both write the tiny preset: the one that
    finishes second keeps the first's copy, raises nothing and leaves no temporary dir."""
    from halfmoon.engine import catalog, loader

    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path))
    real_create = loader.create_preset_dir

    def create_while_another_finishes(name: str, out: Path, seed: int) -> None:
        real_create(name, out, seed)
        if not out.name.endswith("other"):  # the other process gets there first
            other = out.with_name(out.name.split(".tmp")[0] + ".tmpother")
            real_create(name, other, seed)
            other.rename(out.with_name(out.name.split(".tmp")[0]))

    monkeypatch.setattr(loader, "create_preset_dir", create_while_another_finishes)
    out = catalog._preset_once("tiny", 0)
    assert (out / "model.safetensors").is_file()
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_every_tensor_of_a_preset_is_on_its_device(tmp_path: Path) -> None:
    """The RoPE frequencies too (a plain attribute, which ``Module.to`` skips): a model on a
    GPU holding them on the host copies them over in every forward, which CUDA graph
    capture refuses. The meta device stands in for a GPU here."""
    from halfmoon.engine.loader import build_preset, create_preset_dir, load_dir

    for loaded in (
        build_preset("tiny", 0, device="meta"),
        load_dir(create_preset_dir("tiny", tmp_path / "tiny"), device="meta"),
    ):
        model = loaded.model
        assert model.inv_freq.device.type == "meta" and model.inv_freq.dtype == torch.float32
        assert {p.device.type for p in model.parameters()} == {"meta"}


def test_dtype_auto_picks_as_vllm_does(tmp_path: Path) -> None:
    from halfmoon.engine.config import resolve_dtype

    for named, picked in [("float32", "bfloat16"), ("bfloat16", "bfloat16"),
                          ("float16", "float16"), (None, "bfloat16")]:  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": named}))
        assert resolve_dtype("auto", tmp_path) == picked
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "float16"}))  # newer name
    assert resolve_dtype("auto", tmp_path) == "float16"
    assert resolve_dtype("auto", tmp_path / "missing") == "bfloat16"
    assert resolve_dtype("half", None) == "float16" and resolve_dtype("float", None) == "float32"
    assert resolve_dtype("float32", None) == "float32"
    with pytest.raises(HalfmoonError, match="unknown dtype 'fp8'"):
        resolve_dtype("fp8", tmp_path)
