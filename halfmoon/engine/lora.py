"""LoRA adapters in PEFT's format, many of them in one batch (vLLM's multi-LoRA serving).

An adapter adds ``scale * B @ A`` to some of a decoder layer's linear maps (``A``:
``[r, in]``, ``B``: ``[out, r]``, ``scale = alpha / r``, or ``alpha / sqrt(r)`` with
rsLoRA). It is never merged into the base weights: requests of different adapters, and
requests of none, share one step. The engine's linears are fused (``qkv_proj`` = q|k|v
rows, ``gate_up_proj`` = gate|up), so an adapter's maps for one fused linear are joined
into one pair when it loads::

    A_cat = [A_q; A_k; A_v]            [r_q + r_k + r_v, in]
    B_cat = | s_q B_q              |   [q + k + v rows, r_q + r_k + r_v]
            |      s_k B_k         |   (block-diagonal; a map the adapter does not
            |           s_v B_v    |    target has no rows in A_cat, no columns here)

and a step adds ``(x @ A_cat^T) @ B_cat^T`` to the fused linear's output rows of the
requests that use it (:meth:`LoraBatch.apply`): two small matrix products per adapter
and fused linear, on contiguous row ranges (the runner orders a step's decode rows by
adapter). A step without adapters does no LoRA work at all.

What an adapter may hold (anything else is refused at load with the reason): LoRA
(``peft_type`` ``LORA``) on ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``
of any layers, any rank per module (``rank_pattern``), no DoRA, no trained biases, no
``modules_to_save``, no ``alpha_pattern``, safetensors weights.

The KV an adapter computes differs from the base model's for the same tokens, so a
request's prefix-cache chain is its adapter's (:func:`halfmoon.core.hashing.adapter_salt`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from halfmoon.core.adapters import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    LoraModule,
    check_adapter_dir,
    lora_key,
)
from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.config import ModelConfig
from halfmoon.engine.weights import hf_targets

#: PEFT's names of a decoder layer's linears (what an adapter may target).
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])\.weight$"
)


def _read_config(path: Path) -> dict:
    config_path = path / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text())
    except (ValueError, OSError) as exc:
        raise HalfmoonError(f"LoRA adapter {config_path}: {exc}") from None
    if not isinstance(config, dict):
        raise HalfmoonError(f"LoRA adapter {config_path}: not a JSON object")
    refusals = {
        "peft_type": config.get("peft_type", "LORA") not in ("LORA", "lora"),
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") not in ("none", None),
        "modules_to_save": bool(config.get("modules_to_save")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    refused = [k for k, bad in refusals.items() if bad]
    if refused:
        raise HalfmoonError(
            f"LoRA adapter {config_path}: not supported: "
            + ", ".join(f"{k}={config.get(k)!r}" for k in refused)
        )
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise HalfmoonError(f"LoRA adapter {config_path}: lora_alpha must be a positive number")
    return config


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    weights = path / WEIGHTS_FILE
    try:
        with safe_open(str(weights), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}
    except (OSError, ValueError, SafetensorError) as exc:
        raise HalfmoonError(f"LoRA adapter {weights}: {exc}") from None


@dataclass(frozen=True)
class _Slot:
    """Where a module lives in the engine: rows ``[start, stop)`` of fused linear
    ``fused`` (as the checkpoint loader puts them), input width ``in_features``."""

    hf_path: str  # e.g. "self_attn.q_proj"
    fused: str
    start: int
    stop: int
    in_features: int


def _slots(config: ModelConfig) -> dict[str, _Slot]:
    """Each module's :class:`_Slot`, from the loader's own map of HF tensor names
    (:func:`halfmoon.engine.weights.hf_targets`, layer 0: every layer is alike)."""
    widths = {"o_proj": config.num_heads * config.head_dim, "down_proj": config.intermediate_size}
    slots = {}
    for key, target in hf_targets(config).items():
        m = re.fullmatch(r"model\.layers\.0\.((?:self_attn|mlp)\.(\w+))\.weight", key)
        if m is not None and m.group(2) in MODULES:
            fused = target.param.split(".")[-2]  # "layers.0.qkv_proj.weight"
            in_features = widths.get(m.group(2), config.hidden_size)
            slots[m.group(2)] = _Slot(m.group(1), fused, target.start, target.stop, in_features)
    return slots


class LoraAdapter:
    """One loaded adapter: per layer and fused linear, the pair ``(A_cat^T, B_cat^T)``
    of the module docstring (scales folded into ``B_cat``), in the model's dtype."""

    def __init__(self, name: str, layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
                 rank: int, modules: tuple[str, ...], path: str = ""):  # fmt: skip
        self.name = name
        self.layers = layers
        #: The largest rank of any module.
        self.rank = rank
        #: The PEFT module names it adapts.
        self.modules = modules
        self.path = path

    @property
    def num_bytes(self) -> int:
        """Bytes of its joined matrices (the block-diagonal zeros included)."""
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for pair in layer.values() for t in pair)  # fmt: skip

    @classmethod
    def load(cls, module: LoraModule, config: ModelConfig, dtype: torch.dtype,
             device: torch.device | str = "cpu") -> LoraAdapter:  # fmt: skip
        """Read ``module``'s PEFT directory for a model of ``config``; HalfmoonError with
        the reason when it is not one this engine can apply."""
        check_adapter_dir(module)
        path = Path(module.path)
        peft = _read_config(path)
        tensors = _read_tensors(path)
        found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            m = _KEY.match(key)
            if m is None:
                raise HalfmoonError(
                    f"LoRA adapter {module.name!r}: tensor {key!r} is not LoRA on a decoder "
                    "linear (q/k/v/o/gate/up/down_proj); embeddings and the LM head are not supported"
                )
            layer = int(m.group(1))
            if layer >= config.num_layers:
                raise HalfmoonError(
                    f"LoRA adapter {module.name!r}: {key} names layer {layer}; the model has "
                    f"{config.num_layers}"
                )
            found.setdefault((layer, m.group(2)), {})[m.group(3)] = tensor
        if not found:
            raise HalfmoonError(
                f"LoRA adapter {module.name!r}: {WEIGHTS_FILE} holds no LoRA weights"
            )
        slots = _slots(config)
        use_rslora = bool(peft.get("use_rslora"))
        parts: dict[tuple[int, str], list[tuple[_Slot, torch.Tensor, torch.Tensor]]] = {}
        max_rank = 0
        for (layer, name), pair in sorted(found.items()):
            if set(pair) != {"A", "B"}:
                raise HalfmoonError(
                    f"LoRA adapter {module.name!r}: layer {layer} {name} has lora_{''.join(pair)} only"
                )
            a, b = pair["A"], pair["B"]
            slot = slots[name]
            in_f, out_f = slot.in_features, slot.stop - slot.start
            rank = a.shape[0] if a.dim() == 2 else -1
            if a.shape != (rank, in_f) or b.shape != (out_f, rank) or rank < 1:
                raise HalfmoonError(
                    f"LoRA adapter {module.name!r}: layer {layer} {name} has A {tuple(a.shape)} "
                    f"and B {tuple(b.shape)}; this model needs [r, {in_f}] and [{out_f}, r] "
                    "(an adapter of another model?)"
                )
            scale = peft["lora_alpha"] / (math.sqrt(rank) if use_rslora else rank)
            parts.setdefault((layer, slot.fused), []).append((slot, a.float(), b.float() * scale))
            max_rank = max(max_rank, rank)
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [
            {} for _ in range(config.num_layers)
        ]
        rows = {fused: max(s.stop for s in slots.values() if s.fused == fused)
                for fused in {s.fused for s in slots.values()}}  # fmt: skip
        for (layer, fused), pieces in parts.items():
            layers[layer][fused] = _join(pieces, rows[fused], dtype, device)
        modules = tuple(sorted({name for _, name in found}, key=MODULES.index))
        return cls(module.name, layers, max_rank, modules, str(path))


def _join(
    pieces: list[tuple[_Slot, torch.Tensor, torch.Tensor]], out_rows: int,
    dtype: torch.dtype, device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(A_cat^T [in, R], B_cat^T [R, out_rows])`` of a fused linear's slices."""
    pieces = sorted(pieces, key=lambda p: p[0].start)
    total = sum(a.shape[0] for _, a, _ in pieces)
    a_cat = torch.cat([a for _, a, _ in pieces])
    b_cat = torch.zeros(out_rows, total)
    col = 0
    for slot, a, b in pieces:
        b_cat[slot.start : slot.stop, col : col + a.shape[0]] = b
        col += a.shape[0]
    return (
        a_cat.t().contiguous().to(device=device, dtype=dtype),
        b_cat.t().contiguous().to(device=device, dtype=dtype),
    )


@dataclass(frozen=True)
class LoraBatch:
    """A step's adapters: ``(adapter, first row, end row)`` per run of rows that use it."""

    runs: tuple[tuple[LoraAdapter, int, int], ...]

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, fused: str) -> torch.Tensor:
        """Add each run's adapter delta for ``fused`` of ``layer`` to ``out`` (the linear's
        output for input ``x``) in place; returns ``out``."""
        for adapter, start, end in self.runs:
            pair = adapter.layers[layer].get(fused)
            if pair is not None:
                a_t, b_t = pair
                out[start:end].addmm_(torch.mm(x[start:end], a_t), b_t)
        return out


class LoraSet:
    """The adapters an engine serves, by name; one loaded while it serves carries its
    load's tag (:class:`~halfmoon.core.adapters.RuntimeAdapter`), which marks its
    prefix-cache chain (:meth:`key`)."""

    def __init__(self, adapters: Sequence[LoraAdapter] = ()):
        self._by_name: dict[str, LoraAdapter] = {a.name: a for a in adapters}
        self._tags: dict[str, str] = {}

    @classmethod
    def load(cls, modules: Sequence[LoraModule], config: ModelConfig, dtype: torch.dtype,
             device: torch.device | str = "cpu") -> LoraSet:  # fmt: skip
        """Every adapter of ``modules`` loaded for a model of ``config``."""
        return cls([LoraAdapter.load(m, config, dtype, device) for m in modules])

    def __bool__(self) -> bool:
        return bool(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    @property
    def names(self) -> tuple[str, ...]:
        """The adapters' names, in load order."""
        return tuple(self._by_name)

    def add(self, adapter: LoraAdapter, tag: str) -> None:
        """Serve ``adapter`` (loaded while serving, under ``tag``); HalfmoonError when its
        name is taken."""
        if adapter.name in self._by_name:
            raise HalfmoonError(f"LoRA adapter {adapter.name!r} is already loaded")
        self._by_name[adapter.name] = adapter
        self._tags[adapter.name] = tag

    def remove(self, name: str) -> None:
        """Stop serving ``name`` (HalfmoonError when it is not served)."""
        self.get(name)
        del self._by_name[name]
        self._tags.pop(name, None)

    def tag(self, name: str) -> str:
        """The tag ``name`` was loaded under ("" for an adapter the engine started with)."""
        return self._tags.get(name, "")

    def key(self, name: str | None) -> str | None:
        """What marks the prefix-cache chain of a request of adapter ``name`` (None: no
        adapter): :func:`~halfmoon.core.adapters.lora_key`."""
        return None if name is None else lora_key(name, self.tag(name))

    def get(self, name: str) -> LoraAdapter:
        """The adapter called ``name``; HalfmoonError when there is none."""
        adapter = self._by_name.get(name)
        if adapter is None:
            known = ", ".join(self._by_name) or "none"
            raise HalfmoonError(f"unknown LoRA adapter {name!r} (this engine serves: {known})")
        return adapter

    def batch(self, rows: Sequence[tuple[str | None, int]]) -> LoraBatch | None:
        """The :class:`LoraBatch` of a step whose rows come in runs of ``(adapter name or
        None, row count)``, in row order (adjacent runs of one adapter joined); None
        when no row uses an adapter."""
        runs: list[tuple[LoraAdapter, int, int]] = []
        row = 0
        for name, count in rows:
            if name is not None and count:
                adapter = self.get(name)
                if runs and runs[-1][0] is adapter and runs[-1][2] == row:
                    runs[-1] = (adapter, runs[-1][1], row + count)
                else:
                    runs.append((adapter, row, row + count))
            row += count
        return LoraBatch(tuple(runs)) if runs else None

    def describe(self) -> Mapping[str, dict]:
        """Per adapter: its path, modules, rank and the MiB it holds (for the log)."""
        return {
            a.name: {
                "path": a.path,
                "modules": list(a.modules),
                "rank": a.rank,
                "mib": a.num_bytes / 2**20,
            }  # fmt: skip
            for a in self._by_name.values()
        }


def write_random_adapter(
    config: ModelConfig, out_dir: Path | str, *, rank: int = 8, alpha: float = 16.0,
    modules: Sequence[str] = MODULES, seed: int = 0, std: float = 0.05,
) -> Path:  # fmt: skip
    """Write a random LoRA adapter for a model of ``config`` in PEFT's format (both
    matrices drawn from N(0, ``std``), so that it changes the model's outputs): what the
    tests and benchmarks serve where no trained adapter can be downloaded."""
    from safetensors.torch import save_file

    unknown = sorted(set(modules) - set(MODULES))
    if unknown:
        raise HalfmoonError(f"unknown LoRA modules {unknown}; choose from {list(MODULES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    slots = _slots(config)
    tensors = {}
    for layer in range(config.num_layers):
        for name in modules:
            slot = slots[name]
            key = f"base_model.model.model.layers.{layer}.{slot.hf_path}"
            a = torch.randn(rank, slot.in_features, generator=generator) * std
            tensors[f"{key}.lora_A.weight"] = a
            b = torch.randn(slot.stop - slot.start, rank, generator=generator) * std
            tensors[f"{key}.lora_B.weight"] = b
    save_file(tensors, str(out / WEIGHTS_FILE))
    peft = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
            "target_modules": list(modules), "task_type": "CAUSAL_LM", "use_rslora": False}  # fmt: skip
    (out / CONFIG_FILE).write_text(json.dumps(peft, indent=2) + "\n")
    return out
