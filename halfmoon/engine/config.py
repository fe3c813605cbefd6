"""Model and engine configuration records.

:class:`ModelConfig` is the engine's view of a Hugging Face ``config.json`` for the
Llama family (Llama 2/3, Qwen2, Mistral); :class:`EngineConfig` holds the serving knobs
(block size, KV memory budget, batching limits, device and dtype).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SCHEDULING_POLICIES
from halfmoon.core.speculative import SpeculativeConfig

#: ``model_type`` values this engine runs, mapped to their HF architecture class name.
ARCHITECTURES: Mapping[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
}
#: RoPE variants implemented in :mod:`halfmoon.engine.rope`.
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16", "float16")
#: vLLM's other ``--dtype`` names.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def resolve_dtype(dtype: str, model_dir: Path | None) -> str:
    """The dtype ``--dtype`` names: one of :data:`DTYPES`, vLLM's aliases (``half``,
    ``float``), or ``auto``, which picks as vLLM's CPU backend does: the model's
    ``config.json`` ``torch_dtype`` (``dtype``), a float32 (or unnamed) model served in
    bfloat16. HalfmoonError for anything else."""
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype in DTYPES:
        return dtype
    if dtype != "auto":
        raise HalfmoonError(
            f"unknown dtype {dtype!r}; choose from auto, {', '.join(DTYPES)} (or half, float)"
        )
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text()) if model_dir else {}
    except (OSError, ValueError):
        config = {}
    named = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    named = named.removeprefix("torch.")
    return named if named in ("bfloat16", "float16") else "bfloat16"


#: Decode-attention backends (:mod:`halfmoon.engine.kernels`).
ATTENTION_BACKENDS = ("auto", "compiled", "reference")


def check_attention_backend(name: str) -> None:
    """Raise :class:`HalfmoonError` unless ``name`` is one of :data:`ATTENTION_BACKENDS`."""
    if name not in ATTENTION_BACKENDS:
        raise HalfmoonError(
            f"unknown attention backend {name!r}; choose from {', '.join(ATTENTION_BACKENDS)}"
        )


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``linear`` (positions / factor) or ``llama3`` (Llama-3.1
    long-context rule: low frequencies divided by ``factor``, high kept, smooth between)."""

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (one record for all three families:
    Qwen2 is Llama with q/k/v biases, Mistral is Llama with an optional sliding window)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position: int = 4096
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.model_type not in ARCHITECTURES:
            raise HalfmoonError(
                f"unsupported model_type {self.model_type!r}; supported: {', '.join(ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise HalfmoonError(
                    f"model config: {name} must be a positive integer, got {value!r}"
                )
        if self.num_heads % self.num_kv_heads:
            raise HalfmoonError(
                f"model config: num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise HalfmoonError(
                f"model config: head_dim must be even for RoPE, got {self.head_dim}"
            )
        if self.rope_scaling is not None and self.rope_scaling.rope_type not in ROPE_TYPES:
            raise HalfmoonError(
                f"unsupported rope_type {self.rope_scaling.rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
            )

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @property
    def max_context_tokens(self) -> int:
        """Longest context computed exactly: the position limit, or the sliding window when
        smaller (this engine attends to the full context, so it stops at the window)."""
        if self.sliding_window is not None:
            return min(self.max_position, self.sliding_window)
        return self.max_position

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict (transformers 4.x or 5.x spelling)."""
        model_type = config.get("model_type")
        if model_type not in ARCHITECTURES:
            raise HalfmoonError(
                f"unsupported model_type {model_type!r} in config.json; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise HalfmoonError(
                f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented"
            )
        try:
            hidden = int(config["hidden_size"])
            num_heads = int(config["num_attention_heads"])
            fields = dict(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=num_heads,
            )
        except KeyError as exc:
            raise HalfmoonError(f"config.json lacks required key {exc.args[0]!r}") from None
        head_dim = config.get("head_dim") or hidden // num_heads
        theta, scaling = _parse_rope(config)
        attention_bias = bool(config.get("attention_bias", False))
        window = config.get("sliding_window")
        if model_type == "qwen2" and not config.get("use_sliding_window", False):
            window = None
        return cls(
            model_type=model_type,
            num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position=int(config.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=attention_bias if model_type != "qwen2" else False,
            mlp_bias=bool(config.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=config.get("bos_token_id"),
            eos_token_ids=_as_id_tuple(config.get("eos_token_id")),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
            **fields,
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers loads (legacy rope keys, read by 4.x and 5.x)."""
        scaling = None
        if self.rope_scaling is not None:
            s = self.rope_scaling
            scaling = {"rope_type": s.rope_type, "factor": s.factor}
            if s.rope_type == "llama3":
                scaling.update(
                    low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position,
                )
        eos: int | list[int] | None = list(self.eos_token_ids) or None
        if eos is not None and len(eos) == 1:
            eos = eos[0]
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": scaling,
            "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": self.torch_dtype,
        }
        if self.model_type == "qwen2":
            out["use_sliding_window"] = False
            out["sliding_window"] = None
        else:
            out["attention_bias"] = self.qkv_bias
            out["mlp_bias"] = self.mlp_bias
        if self.model_type == "mistral":
            out["sliding_window"] = self.sliding_window
        return out


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _parse_rope(config: Mapping[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 folds theta and scaling into "rope_parameters"; 4.x has "rope_theta"
    # and "rope_scaling" (older files say "type" instead of "rope_type").
    params = config.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or (params if params else None)
    if not scaling:
        return theta, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise HalfmoonError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
    )


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs of one :class:`~halfmoon.engine.engine.LLMEngine`.

    ``model`` is an HF directory or a preset name (``tiny``, ``small``: random weights
    drawn from ``seed``). The KV pool holds ``kv_cache_mb`` MiB (like vLLM's memory
    fraction, but absolute). A step computes at most ``max_num_batched_tokens`` tokens
    over at most ``max_num_seqs`` sequences; one prompt contributes at most
    ``prefill_chunk_tokens`` per step (chunked prefill). ``max_model_len`` caps prompt +
    output (default: the model's context). ``num_threads`` sets torch's intra-op threads
    (None leaves torch's choice). ``prepack_weights``: on CPU in float32 (bfloat16 too
    where the CPU computes it natively), pack the linear layers' weights once for oneDNN (faster decode; see :mod:`halfmoon.engine.prepack`);
    ``prepack_lm_head`` the LM head's (a tied head keeps a second, packed copy).
    ``attention``: decode attention by the compiled kernel that reads the paged pool in
    place (``compiled``; built once per model shape, see :mod:`halfmoon.engine.kernels`),
    by the exact-math reference (``reference``: gather + SDPA), or ``auto`` (the kernel
    when it can be built, else the reference). ``cuda_graphs``: on a CUDA device, replay
    decode steps from captured CUDA graphs (:mod:`halfmoon.engine.graphs`; off by
    default until a GPU run has verified it). ``scheduling_policy``: the queue's order,
    ``fcfs`` or ``priority`` (:mod:`halfmoon.engine.scheduler`). ``lora_modules``: the
    LoRA adapters a request may name (``SamplingParams.lora``). ``speculative``: check
    draft tokens from prompt lookup with each decoded token (:mod:`halfmoon.engine.speculative`).
    """

    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    kv_cache_mb: float = 512.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None
    prepack_weights: bool = True
    prepack_lm_head: bool = True
    attention: str = "auto"
    cuda_graphs: bool = False
    scheduling_policy: str = "fcfs"
    #: LoRA adapters served beside the base model, as ``(name, PEFT directory)`` pairs
    #: (vLLM's ``--lora-modules``; :mod:`halfmoon.engine.lora`).
    lora_modules: tuple[tuple[str, str], ...] = ()
    #: Prompt-lookup speculative decoding (vLLM's ``--speculative-config``;
    #: :mod:`halfmoon.engine.speculative`), or None: one token a step.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise HalfmoonError(
                f"unknown scheduling policy {self.scheduling_policy!r}; use one of "
                f"{', '.join(SCHEDULING_POLICIES)}"
            )
        if self.dtype not in DTYPES:
            raise HalfmoonError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise HalfmoonError(f"unknown device {self.device!r}; use cpu or cuda[:N]")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise HalfmoonError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_mb <= 0:
            raise HalfmoonError(f"kv_cache_mb must be positive, got {self.kv_cache_mb}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise HalfmoonError(
                f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise HalfmoonError(f"max_model_len must be >= 2, got {self.max_model_len}")
        check_attention_backend(self.attention)
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise HalfmoonError(
                f"cuda_graphs (--cuda-graphs) needs a cuda device (--device cuda), not {self.device!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise HalfmoonError(f"num_threads must be >= 1, got {self.num_threads}")

    @property
    def chunk_tokens(self) -> int:
        """Per-sequence prefill chunk size actually used."""
        limit = self.prefill_chunk_tokens or self.max_num_batched_tokens
        return min(limit, self.max_num_batched_tokens)


#: Fields of a model's config (a weight update's checkpoint against the served one) that may differ between checkpoints of one served model.
_FREE_FIELDS = ("torch_dtype", "bos_token_id", "eos_token_ids")


def architecture_differences(served: ModelConfig, new: ModelConfig) -> list[str]:
    """What differs between two models' configs beyond what a weight update may change
    (dtype, special tokens), as ``field: new against served`` lines."""
    return [
        f"{f.name}: {getattr(new, f.name)!r} against {getattr(served, f.name)!r}"
        for f in dataclasses.fields(ModelConfig)
        if f.name not in _FREE_FIELDS and getattr(new, f.name) != getattr(served, f.name)
    ]


def read_config(model_dir: Path) -> ModelConfig:
    """The model config of an HF directory (HalfmoonError when it cannot be read)."""
    config_path = model_dir / "config.json"
    try:
        return ModelConfig.from_hf(json.loads(config_path.read_text()))
    except (OSError, ValueError) as exc:
        raise HalfmoonError(f"cannot read {config_path}: {exc}") from None


def checkpoint_of(served: ModelConfig, model_path: str) -> tuple[Path, ModelConfig]:
    """The directory ``model_path`` names (an HF directory, or what ``--model`` takes)
    and its config; HalfmoonError when it is not ``served``'s architecture."""
    from halfmoon.engine.catalog import resolve_model  # noqa: PLC0415 - catalog reads configs too

    path = resolve_model(model_path)
    config = read_config(path)
    differences = architecture_differences(served, config)
    if differences:
        raise HalfmoonError(
            f"{path} is not the served model's architecture ({'; '.join(differences)}): "
            "new weights must fit the served shapes"
        )
    return path, config
