"""Transformer specs (Llama-family shapes) and their derived sizes: parameters, weight
bytes and KV-cache bytes per token.

The registry holds the paper's models (LLaMA2-70B in the arXiv version, Llama-3-70B in
FAST'25), two common small ones, and the engine presets ``tiny`` and ``small`` that
halfmoon's own engine instantiates. The presets run on CPU in fp32, so their
``dtype_bytes`` is 4; every other model is bf16 (2 bytes).

Parameter count of one decoder layer (SwiGLU MLP, RMSNorm, no biases unless
``attention_bias``; Qwen2 has biases on q/k/v)::

    q: hidden x (heads*head_dim)      o: (heads*head_dim) x hidden
    k, v: hidden x (kv_heads*head_dim) each
    gate, up, down: 3 x hidden x intermediate
    2 RMSNorm weights: 2 x hidden
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType

from halfmoon.core.errors import HalfmoonError


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a Llama-family decoder-only model; sizes derive from it."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_embeddings: bool = False
    dtype_bytes: int = 2
    max_position: int = 4096
    attention_bias: bool = False
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "dtype_bytes",
            "max_position",
        ):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"ModelSpec {self.name!r}: {field_name} must be a positive integer, got {value!r}"
                )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec {self.name!r}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def attention_dim(self) -> int:
        """Width of the concatenated query heads (``num_heads * head_dim``)."""
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of the concatenated key (or value) heads (``num_kv_heads * head_dim``)."""
        return self.num_kv_heads * self.head_dim

    @property
    def gqa_ratio(self) -> int:
        """Query heads per KV head (1 for plain multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @cached_property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (see the module docstring)."""
        attention = 2 * self.hidden_size * self.attention_dim + 2 * self.hidden_size * self.kv_dim
        if self.attention_bias:
            attention += self.attention_dim + 2 * self.kv_dim
        mlp = 3 * self.hidden_size * self.intermediate_size
        return attention + mlp + 2 * self.hidden_size

    @cached_property
    def embedding_params(self) -> int:
        """Input embedding plus, when untied, the output projection (LM head)."""
        table = self.vocab_size * self.hidden_size
        return table if self.tie_embeddings else 2 * table

    @cached_property
    def num_non_embedding_params(self) -> int:
        """Decoder layers plus the final norm: the part whose FLOPs scale as 2 per token."""
        return self.num_layers * self.layer_params + self.hidden_size

    @cached_property
    def num_params(self) -> int:
        """All parameters, counting a tied embedding once."""
        return self.num_non_embedding_params + self.embedding_params

    @cached_property
    def weight_bytes(self) -> int:
        """Bytes the weights occupy in memory."""
        return self.num_params * self.dtype_bytes

    @cached_property
    def step_weight_read_bytes(self) -> int:
        """Weight bytes one forward pass streams from memory: every layer plus the full
        LM-head matrix (the input embedding is only gathered row by row)."""
        return (
            self.num_non_embedding_params + self.vocab_size * self.hidden_size
        ) * self.dtype_bytes

    @cached_property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token: K and V, every layer, every KV head."""
        return 2 * self.num_layers * self.kv_dim * self.dtype_bytes


def _build_registry() -> Mapping[str, ModelSpec]:
    llama2_70b = ModelSpec(
        "llama2-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
        head_dim=128, intermediate_size=28672, vocab_size=32000, max_position=4096,
    )  # fmt: skip
    specs = (
        llama2_70b,
        ModelSpec(
            "llama3-70b", num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
            head_dim=128, intermediate_size=28672, vocab_size=128256, max_position=8192,
            rope_theta=500000.0,
        ),
        ModelSpec(
            "llama3-8b", num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
            head_dim=128, intermediate_size=14336, vocab_size=128256, max_position=8192,
            rope_theta=500000.0,
        ),
        ModelSpec(
            "qwen2.5-7b", num_layers=28, hidden_size=3584, num_heads=28, num_kv_heads=4,
            head_dim=128, intermediate_size=18944, vocab_size=152064, max_position=32768,
            attention_bias=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        ),
        # Engine presets: random-weight models sized for a CPU box (fp32).
        ModelSpec(
            "tiny", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
            intermediate_size=1024, vocab_size=4096, tie_embeddings=True, dtype_bytes=4,
            max_position=32768,
        ),
        ModelSpec(
            "small", num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, head_dim=64,
            intermediate_size=2816, vocab_size=8192, tie_embeddings=True, dtype_bytes=4,
            max_position=32768,
        ),
    )  # fmt: skip
    return MappingProxyType({spec.name: spec for spec in specs})


#: Known models by canonical name (read-only).
MODELS: Mapping[str, ModelSpec] = _build_registry()

#: Other spellings (after normalisation) of the canonical names.
MODEL_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "llama-2-70b": "llama2-70b",
        "llama-3-70b": "llama3-70b",
        "meta-llama-3-70b": "llama3-70b",
        "llama-3-8b": "llama3-8b",
        "meta-llama-3-8b": "llama3-8b",
        "qwen2-5-7b": "qwen2.5-7b",
    }
)

_DROPPED_SUFFIXES = ("-hf", "-instruct", "-chat")


def _normalise(name: str) -> str:
    # "meta-llama/Llama-2-70b-chat-hf" -> "llama-2-70b": the org and the fine-tune
    # suffixes do not change the shape.
    key = name.strip().lower().replace("_", "-").rsplit("/", 1)[-1]
    changed = True
    while changed:
        changed = False
        for suffix in _DROPPED_SUFFIXES:
            if key.endswith(suffix):
                key = key[: -len(suffix)]
                changed = True
    return MODEL_ALIASES.get(key, key)


def get_model(name: str | ModelSpec) -> ModelSpec:
    """The spec for ``name`` (case-insensitive; aliases such as ``llama-3-70b`` and Hugging
    Face ids such as ``meta-llama/Llama-2-70b-hf`` work), or a :class:`HalfmoonError`
    listing the known names. A :class:`ModelSpec` is returned as is."""
    if isinstance(name, ModelSpec):
        return name
    if not isinstance(name, str):
        raise HalfmoonError(f"model name must be a string, got {name!r}")
    spec = MODELS.get(_normalise(name))
    if spec is None:
        raise HalfmoonError(f"unknown model {name!r}; known models: {', '.join(sorted(MODELS))}")
    return spec
