"""``halfmoon model import``: a GGUF file (llama.cpp's format) as an HF-format directory.

The file is read with the ``gguf`` package of the llama.cpp project, which also
dequantizes its tensors; this module maps names and metadata onto what transformers and
:func:`halfmoon.engine.loader.load_dir` read::

    config.json             from  {arch}.block_count, .embedding_length, .attention.*, .rope.*
    model*.safetensors      from  token_embd / blk.N.* / output_norm / output tensors,
                                  dequantized to float32 and cast to ``dtype``
    tokenizer.json          from  tokenizer.ggml.* (see gguf_tokenizer.py)
    tokenizer_config.json   special tokens, chat template, add_bos_token
    generation_config.json  bos, the end-of-turn ids (eos, eot, eom) and the sampling the
                            file recommends (``general.sampling.*``: temperature, top_p,
                            top_k, min_p, repetition_penalty), if any

llama.cpp's converter permutes the rows of ``attn_q`` / ``attn_k`` of Llama-architecture
models (it stores RoPE pairs interleaved, per head: rows ``[x0, x1, ..., x_{d-1}]`` of
halves ``a = x[:d/2]``, ``b = x[d/2:]`` become ``a0 b0 a1 b1 ...``); importing undoes
that. Qwen2 files are stored unpermuted.

The directory is written under a temporary name beside ``out`` and renamed when
complete, so a failure (unsupported architecture or tensor type, a truncated file)
leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.catalog import TensorProgress, tensor_lines
from halfmoon.engine.config import DTYPES, ModelConfig, RopeScaling
from halfmoon.engine.gguf_tokenizer import build_tokenizer
from halfmoon.engine.kv_cache import torch_dtype
from halfmoon.engine.weights import INDEX_FILE, SINGLE_FILE, hf_targets

#: GGUF ``general.architecture`` -> HF ``model_type``.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
#: Tensor types imported (dequantized by gguf-py). The K-quants are read by the same
#: maintained dequantizer, but gguf-py cannot write them, so no test file exercises them.
TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip
#: Safetensors shard size: a larger model is split into model-0000i-of-0000n files.
SHARD_BYTES = 2 * 2**30
#: Per-layer GGUF tensor suffix -> HF name under ``model.layers.N.``.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
#: Token types in tokenizer.ggml.token_type (llama.cpp's llama_token_type).
_END_OF_TURN_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")
Progress = Callable[[str], None]


class GGUFFile:
    """A GGUF file opened for import: metadata values by key and tensors by name."""

    def __init__(self, path: Path) -> None:
        if not path.is_file():
            raise HalfmoonError(f"no such GGUF file: {path}")
        try:
            from gguf import GGUFReader
        except ImportError:  # pragma: no cover - a dependency of halfmoon
            raise HalfmoonError(
                "reading GGUF needs the 'gguf' package (pip install gguf)"
            ) from None
        try:
            self._reader = GGUFReader(path)
        except Exception as exc:  # the reader raises ValueError / IndexError / KeyError alike
            raise HalfmoonError(f"{path} is not a readable GGUF file: {exc}") from None
        self.path = path
        self.tensors = {t.name: t for t in self._reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` (arrays as lists), or ``default``."""
        field = self._reader.get_field(key)
        if field is None:
            return default
        value = field.contents()
        return value if value is not None else default

    @property
    def architecture(self) -> str:
        """``general.architecture``."""
        return str(self.get("general.architecture", ""))

    def check_tensor_types(self) -> None:
        """Refuse the file when a tensor is of a type this importer does not read."""
        from gguf import GGMLQuantizationType

        for name, tensor in self.tensors.items():
            kind = GGMLQuantizationType(tensor.tensor_type).name
            if kind not in TENSOR_TYPES:
                raise HalfmoonError(
                    f"{self.path.name}: tensor {name} has type {kind}, which this importer "
                    f"does not read; supported: {', '.join(TENSOR_TYPES)}"
                )

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantized to float32, in HF's ``[out, in]`` row order."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        try:
            data = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        except (ValueError, NotImplementedError) as exc:
            raise HalfmoonError(f"{self.path.name}: cannot dequantize {name}: {exc}") from None
        return np.asarray(data, dtype=np.float32).reshape(shape)


def model_config(gguf: GGUFFile, dtype: str = "float32") -> ModelConfig:
    """The :class:`ModelConfig` a GGUF file's metadata describes."""
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise HalfmoonError(
            f"{gguf.path.name}: unsupported architecture {arch!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )

    def need(key: str) -> Any:
        value = gguf.get(f"{arch}.{key}")
        if value is None:
            raise HalfmoonError(f"{gguf.path.name}: metadata lacks {arch}.{key}")
        if isinstance(value, list):  # per-layer values: only uniform layers are supported
            if len(set(value)) != 1:
                raise HalfmoonError(f"{gguf.path.name}: {arch}.{key} varies per layer")
            value = value[0]
        return value

    if "rope_freqs.weight" in gguf.tensors:
        raise HalfmoonError(
            f"{gguf.path.name}: carries rope_freqs (Llama 3.1 long-context RoPE factors), "
            "which this importer does not map"
        )
    embed = gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise HalfmoonError(f"{gguf.path.name}: no token_embd.weight tensor")
    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    kv_heads = gguf.get(f"{arch}.attention.head_count_kv")
    kv_heads = need("attention.head_count_kv") if kv_heads is not None else num_heads
    head_dim = int(gguf.get(f"{arch}.attention.key_length") or hidden // num_heads)
    bos = gguf.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        model_type=ARCHITECTURES[arch],
        vocab_size=int(embed.shape[1]),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        rope_theta=float(gguf.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(gguf, arch),
        max_position=int(need("context_length")),
        tie_embeddings="output.weight" not in gguf.tensors,
        qkv_bias="blk.0.attn_q.bias" in gguf.tensors,
        sliding_window=_sliding_window(gguf, arch),
        bos_token_id=int(bos) if bos is not None else None,
        eos_token_ids=end_of_turn_ids(gguf),
        torch_dtype=dtype,
    )


def _rope_scaling(gguf: GGUFFile, arch: str) -> RopeScaling | None:
    kind = gguf.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise HalfmoonError(f"{gguf.path.name}: unsupported RoPE scaling {kind!r}")
    return RopeScaling("linear", factor=float(gguf.get(f"{arch}.rope.scaling.factor", 1.0)))


def _sliding_window(gguf: GGUFFile, arch: str) -> int | None:
    window = gguf.get(f"{arch}.attention.sliding_window")
    return int(window) if window and ARCHITECTURES[arch] == "mistral" else None


def end_of_turn_ids(gguf: GGUFFile) -> tuple[int, ...]:
    """The ids that end generation: eos, and eot / eom where the file names them."""
    ids = (gguf.get(f"tokenizer.ggml.{key}") for key in _END_OF_TURN_KEYS)
    return tuple(sorted({int(i) for i in ids if i is not None}))


#: GGUF's recommended-sampling keys -> the generation_config.json fields a server takes
#: as defaults (halfmoon.serve.gateway.generation); the rest (mirostat, xtc, ...) have
#: no counterpart here.
SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def sampling_defaults(gguf: GGUFFile) -> dict[str, float | int]:
    """The sampling the file recommends (``general.sampling.*``), as generation-config
    fields; empty when it names none."""
    out: dict[str, float | int] = {}
    for key, name in SAMPLING_KEYS.items():
        value = gguf.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = int(value) if name == "top_k" else float(value)
    return out


def _unpermute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head RoPE interleave of q/k rows (weights or biases)."""
    half = rows.shape[0] // num_heads // 2
    split = rows.reshape(num_heads, half, 2, *rows.shape[1:])
    return split.swapaxes(1, 2).reshape(rows.shape)


def hf_tensors(gguf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array) for every tensor of the file, q/k un-permuted for llama."""
    expected = hf_targets(config)
    permuted = gguf.architecture != "qwen2"  # llama.cpp permutes llama and mistral q/k
    for name in gguf.tensors:
        hf_name = _GLOBAL_NAMES.get(name)
        if hf_name is None and name.startswith("blk."):
            _, layer, suffix = name.split(".", 2)
            local = _LAYER_NAMES.get(suffix)
            hf_name = f"model.layers.{layer}.{local}" if local else None
        if hf_name is None or hf_name not in expected:
            raise HalfmoonError(
                f"{gguf.path.name}: unexpected tensor {name} for {config.model_type}"
            )
        array = gguf.array(name)
        if permuted and suffix_of(name) in ("attn_q", "attn_k"):
            heads = config.num_heads if suffix_of(name) == "attn_q" else config.num_kv_heads
            array = _unpermute(array, heads)
        yield hf_name, array


def suffix_of(name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``attn_q`` (``""`` for non-layer tensors)."""
    parts = name.split(".")
    return parts[2] if len(parts) == 4 and parts[0] == "blk" else ""


def import_gguf(
    path: str | Path,
    out: str | Path,
    dtype: str = "float32",
    progress: Progress | None = None,
    tensor_progress: TensorProgress | None = None,
) -> Path:
    """Write the GGUF file ``path`` as an HF directory ``out``; returns ``out``.

    ``out`` must not exist (or be empty). Everything is written to a temporary sibling
    first and renamed at the end, so an error leaves no half-written directory.
    ``progress`` gets what is happening as lines; ``tensor_progress`` gets (tensors done,
    tensors in all) after each tensor (without it, ``progress`` gets a line every 50).
    """
    if dtype not in DTYPES:
        raise HalfmoonError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    path, out = Path(path), Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise HalfmoonError(f"{out} already exists and is not empty")
    say = progress or (lambda _msg: None)
    if path.is_file():
        say(f"reading {path.name} ({path.stat().st_size / 2**20:.0f} MiB)")
    gguf = GGUFFile(path)
    config = model_config(gguf, dtype)
    gguf.check_tensor_types()
    say(
        f"importing {path.name}: {gguf.architecture}, {config.num_layers} layers, "
        f"hidden {config.hidden_size}, vocab {config.vocab_size} -> {dtype}"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        tokenizer, tokenizer_config = build_tokenizer(gguf, config.max_position)
        tick = tensor_progress or tensor_lines(say)
        _write_weights(gguf, config, tmp, dtype, tick)
        (tmp / "config.json").write_text(json.dumps(config.to_hf(), indent=2) + "\n")
        generation = {
            "bos_token_id": config.bos_token_id,
            "eos_token_id": list(config.eos_token_ids),
            **sampling_defaults(gguf),
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        tokenizer.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_weights(
    gguf: GGUFFile, config: ModelConfig, out: Path, dtype: str, tick: TensorProgress
) -> None:
    """Safetensors files (sharded past ``SHARD_BYTES``) holding every expected tensor."""
    from safetensors.torch import save_file

    expected = set(hf_targets(config))
    target = torch_dtype(dtype)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    seen: set[str] = set()
    for i, (name, array) in enumerate(hf_tensors(gguf, config)):
        tensor = torch.from_numpy(np.require(array, requirements=("C", "W"))).to(target)
        if shard_bytes and shard_bytes + tensor.nbytes > SHARD_BYTES:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += tensor.nbytes
        seen.add(name)
        tick(i + 1, len(gguf.tensors))
    missing = sorted(expected - seen)
    if missing:
        raise HalfmoonError(
            f"{gguf.path.name}: missing tensor(s) for {missing[0]}"
            + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
        )
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(out / SINGLE_FILE), metadata=metadata)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.nbytes for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
