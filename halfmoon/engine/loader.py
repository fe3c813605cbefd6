"""Loading a model by name: an HF directory, or a preset built in memory; and writing a
preset out as a complete HF directory (``halfmoon model create``).

Preset shapes come from :func:`halfmoon.costmodel.models.get_model` so the cost model
and the engine describe the same networks. A preset's weights are a pure function of
its seed, so ``--model tiny`` in memory equals ``model create --preset tiny`` on disk.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel.models import get_model
from halfmoon.engine.catalog import PRESETS, resolve_model
from halfmoon.engine.config import ModelConfig
from halfmoon.engine.kv_cache import torch_dtype
from halfmoon.engine.model import LlamaForCausalLM
from halfmoon.engine.tokenizer import (
    BOS,
    EOS,
    IM_END,
    Tokenizer,
    build_preset_tokenizer,
    preset_tokenizer_config,
)
from halfmoon.engine.weights import empty_model, init_random_weights, load_weights, save_weights

__all__ = ["PRESETS", "LoadedModel", "build_preset", "create_preset_dir", "load_dir", "load_model"]


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run, its tokenizer (None if the directory has none) and the ids
    that end generation (config, generation_config and tokenizer EOS, merged)."""

    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]


def preset_config(name: str) -> ModelConfig:
    """The :class:`ModelConfig` of preset ``name`` (bos 0, eos 1 and ``<|im_end|>`` 4)."""
    if name not in PRESETS:
        raise HalfmoonError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    spec = get_model(name)
    return ModelConfig(
        model_type="llama",
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        max_position=spec.max_position,
        tie_embeddings=spec.tie_embeddings,
        qkv_bias=spec.attention_bias,
        bos_token_id=0,
        eos_token_ids=(1, 4),
    )


def _preset_tokenizer(config: ModelConfig) -> Tokenizer:
    tok = build_preset_tokenizer(config.vocab_size)
    if (tok.token_to_id(BOS), tok.token_to_id(EOS), tok.token_to_id(IM_END)) != (0, 1, 4):
        raise HalfmoonError("preset tokenizer special-token ids drifted from the config")
    return Tokenizer(tok, preset_tokenizer_config(config.max_position))


def build_preset(name: str, seed: int, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Preset ``name`` with random weights drawn from ``seed``, in memory."""
    config = preset_config(name)
    model = empty_model(config, torch.float32, "cpu")
    init_random_weights(model, seed)
    model = model.to(device=device, dtype=torch_dtype(dtype)).eval()
    # A plain attribute (kept float32), which `.to` leaves behind: on a GPU every forward
    # would copy it over, which a CUDA graph's capture refuses.
    model.inv_freq = model.inv_freq.to(device)
    return LoadedModel(config, model, _preset_tokenizer(config), config.eos_token_ids)


def create_preset_dir(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Write preset ``name`` as an HF directory (config.json, generation_config.json,
    model.safetensors, tokenizer.json, tokenizer_config.json); returns ``out_dir``."""
    loaded = build_preset(name, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = loaded.config
    (out_dir / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_ids)}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_weights(loaded.model, out_dir)
    assert loaded.tokenizer is not None
    loaded.tokenizer.save(out_dir, preset_tokenizer_config(config.max_position))
    return out_dir


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise HalfmoonError(f"{path} is not valid JSON: {exc}") from None


def load_dir(model_dir: Path, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load an HF-format directory (config.json + safetensors [+ tokenizer])."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise HalfmoonError(f"no config.json in {model_dir}")
    config = ModelConfig.from_hf(_read_json(config_path))
    model = empty_model(config, torch_dtype(dtype), device)
    load_weights(model, model_dir)
    model.eval()
    tokenizer = Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
    eos = list(config.eos_token_ids)
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        gen_eos = _read_json(gen_path).get("eos_token_id")
        eos += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.append(tokenizer.eos_token_id)
    return LoadedModel(config, model, tokenizer, tuple(sorted(set(eos))))


def load_model(
    model: str, dtype: str = "float32", device: str = "cpu", seed: int = 0
) -> LoadedModel:
    """Load what ``model`` names (:func:`halfmoon.engine.catalog.resolve_model`): a
    directory, a named model or a ``.gguf`` file (imported once into the cache), or a
    preset (built in memory from ``seed``)."""
    if model in PRESETS and not Path(model).is_dir():
        return build_preset(model, seed, dtype, device)
    return load_dir(resolve_model(model, seed), dtype, device)
