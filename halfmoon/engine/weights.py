"""Hugging Face safetensors checkpoints <-> the engine's fused parameters.

HF names (``model.layers.3.self_attn.k_proj.weight``) map onto row slices of the fused
parameters (``layers.3.qkv_proj.weight[q_dim : q_dim + kv_dim]``). Loading checks that
every expected tensor is present exactly once with the expected shape, so a config that
does not match its weights fails with the name of the first offending tensor.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.config import ModelConfig
from halfmoon.engine.model import LlamaForCausalLM
from halfmoon.engine.rope import inverse_frequencies

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some exporters include; they are derived from the config, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: rows ``[start, stop)`` of engine parameter ``param``."""

    param: str
    start: int
    stop: int


def hf_targets(config: ModelConfig) -> dict[str, Target]:
    """Every HF tensor name this config expects, with its destination."""
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    targets = {
        "model.embed_tokens.weight": Target("embed_tokens.weight", 0, config.vocab_size),
        "model.norm.weight": Target("norm.weight", 0, config.hidden_size),
    }
    if not config.tie_embeddings:
        targets["lm_head.weight"] = Target("lm_head.weight", 0, config.vocab_size)
    slices = {
        "self_attn.q_proj": ("qkv_proj", 0, q_dim, config.qkv_bias),
        "self_attn.k_proj": ("qkv_proj", q_dim, q_dim + kv_dim, config.qkv_bias),
        "self_attn.v_proj": ("qkv_proj", q_dim + kv_dim, q_dim + 2 * kv_dim, config.qkv_bias),
        "self_attn.o_proj": ("o_proj", 0, config.hidden_size, config.o_bias),
        "mlp.gate_proj": ("gate_up_proj", 0, inter, config.mlp_bias),
        "mlp.up_proj": ("gate_up_proj", inter, 2 * inter, config.mlp_bias),
        "mlp.down_proj": ("down_proj", 0, config.hidden_size, config.mlp_bias),
    }
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            targets[f"{src}{norm}.weight"] = Target(f"{dst}{norm}.weight", 0, config.hidden_size)
        for hf_name, (param, start, stop, has_bias) in slices.items():
            targets[f"{src}{hf_name}.weight"] = Target(f"{dst}{param}.weight", start, stop)
            if has_bias:
                targets[f"{src}{hf_name}.bias"] = Target(f"{dst}{param}.bias", start, stop)
    return targets


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise HalfmoonError(f"{index}: not a safetensors index ({exc})") from None
        files = sorted({model_dir / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise HalfmoonError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise HalfmoonError(f"no {SINGLE_FILE} or {INDEX_FILE} in {model_dir}")


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
        except (OSError, ValueError, SafetensorError) as exc:
            raise HalfmoonError(f"cannot read weights {path}: {exc}") from None


def load_weights(model: LlamaForCausalLM, model_dir: Path) -> None:
    """Fill ``model`` from the safetensors checkpoint in ``model_dir`` (single or sharded)."""
    targets = hf_targets(model.config)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    with torch.no_grad():
        for name, tensor in _iter_tensors(_weight_files(model_dir)):
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and model.config.tie_embeddings:
                continue  # some exporters store the tied head too
            target = targets.get(name)
            if target is None:
                raise HalfmoonError(
                    f"weights do not match config.json: unexpected tensor {name!r} "
                    f"{tuple(tensor.shape)}"
                )
            dest = params[target.param][target.start : target.stop]
            if tuple(tensor.shape) != tuple(dest.shape):
                raise HalfmoonError(
                    f"weights do not match config.json: {name} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            seen.add(name)
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise HalfmoonError(
            f"weights do not match config.json: missing {', '.join(missing[:3])}{more}"
        )


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under HF names (fused parameters split back), on the CPU."""
    params = dict(model.named_parameters())
    return {
        name: params[t.param][t.start : t.stop].detach().to("cpu").contiguous()
        for name, t in hf_targets(model.config).items()
    }


def save_weights(model: LlamaForCausalLM, model_dir: Path) -> Path:
    """Write ``model.safetensors`` (HF names) into ``model_dir``; returns its path."""
    path = model_dir / SINGLE_FILE
    save_file(hf_state_dict(model), str(path), metadata={"format": "pt"})
    return path


def init_random_weights(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    """Deterministic random weights: N(0, std) matrices, unit norms, zero biases.

    Drawn on the CPU in parameter order from one generator seeded with ``seed``, so the
    result is the same on every device.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = torch.empty(param.shape, dtype=torch.float32)
                values.normal_(0.0, std, generator=generator)
                param.copy_(values)


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Turns ``torch.nn.init`` calls into no-ops while modules are built: their
    parameters are allocated (untouched memory costs nothing) but not initialised."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


def empty_model(
    config: ModelConfig, dtype: torch.dtype, device: str | torch.device
) -> LlamaForCausalLM:
    """A model with uninitialised parameters of ``dtype`` on ``device`` (no random init cost).

    Built on the CPU with initialisation skipped rather than on the meta device: any op
    on a meta tensor imports torch's compiler stack (~2 s of every engine start).
    """
    with _SkipInit():
        model = LlamaForCausalLM(config)
    if torch.device(device).type != "cpu":
        model = model.to_empty(device=device)
    model = model.to(dtype)
    # The frequencies stay float32 whatever the weights' dtype.
    model.inv_freq = inverse_frequencies(config).to(device)
    return model
