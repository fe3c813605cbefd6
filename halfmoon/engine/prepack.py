"""CPU weight prepacking for the decoder's linear layers (oneDNN blocked layout).

MKL's sgemm re-packs the weight matrix on every call; at decode batch sizes that costs
about as much as the multiply itself. Packing once at load time (the op PyTorch's own
compiler uses when it freezes a CPU model) measured, over the small preset's 12 layers
on 2 threads: 34 -> 20 ms at 8 rows, 43 -> 34 ms at 32 rows, unchanged at prefill sizes
(512-2048 rows), 9% slower at 1 row (13.7 -> 15.0 ms). On a CPU without native
bfloat16 (AVX2) bfloat16 gains nothing (its ``F.linear`` already goes through oneDNN);
on one with it (AVX512-BF16 or AMX), packed bfloat16 weights run oneDNN's AMX kernels on
a straight read: SmolLM2's four linears streamed from memory, 2 threads, 0.73x the plain
``F.linear``'s time at 1 row, 0.79x at 8, 0.90x at 32, its LM head 0.60-0.82x
(``benchmarks/micro/linears.py``; docs/benchmarks.md, "bfloat16 against vLLM's CPU
default"). So float32 is packed on any CPU, bfloat16 where the CPU computes it natively.
A packed
call also costs ~15-20 us more, which loses on the smallest matrices: weights of at
least 1 MiB are packed (the tiny preset's 4 layers, side by side: steps 1.12x faster at
batch 1, 1.13-1.29x at 8 and 32; its 0.5 MiB q|k|v and 0.25 MiB o lose 20-50 us a call
packed at 1-8 rows and stay plain), and every weight of a model whose decoder linears add
up to 32 MiB or more: then no step finds them in cache (each is streamed from memory),
and packed wins at every size. Measured with SmolLM2's 30 layers streamed from memory,
2 threads, per layer: q|k|v 405 -> 248 us and o 248 -> 166 us at 8 rows, 200 -> 170 and
129 -> 128 us at 1 row.

The LM head is packed too (:func:`prepack_lm_head`): at 8-32 rows its 49,152 x 576
matrix (SmolLM2) went from MKL's re-pack on every call to a straight read. A tied head
shares its matrix with the embedding table, which the lookup still needs in plain form,
so packing it keeps a second, packed copy (``vocab x hidden`` floats, like vLLM's
oneDNN handle); an untied head is replaced.

Results differ from ``F.linear`` by float32 rounding only (~3e-6 relative); in
bfloat16 they measured equal to it.
"""

from __future__ import annotations

import torch
from torch import nn

from halfmoon.engine.model import LlamaForCausalLM

#: Row-count hint for oneDNN's weight layout; any row count works with the packed weight.
_BATCH_HINT = 8
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
_MIN_PACKED_BYTES = 2**20
#: Decoder linears of this many bytes in all are streamed from memory on every step.
_STREAMED_MODEL_BYTES = 32 * 2**20


def native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16 on x86, as
    ``/proc/cpuinfo`` lists them; False where it cannot be read)."""
    global _NATIVE_BF16
    if _NATIVE_BF16 is None:
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line for line in f if line.startswith("flags")), "").split()
        except OSError:
            flags = []
        _NATIVE_BF16 = "avx512_bf16" in flags or "amx_bf16" in flags
    return _NATIVE_BF16


_NATIVE_BF16: bool | None = None


def can_prepack(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether this torch build can pack ``dtype`` weights for ``device``: float32 on
    any CPU, bfloat16 on one that computes it natively (:func:`native_bf16`)."""
    return (
        torch.device(device).type == "cpu"
        and (dtype == torch.float32 or (dtype == torch.bfloat16 and native_bf16()))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


_LINEAR_POINTWISE = (
    torch.ops.mkldnn._linear_pointwise.default
    if hasattr(torch.ops.mkldnn, "_linear_pointwise")
    else None
)


class PackedLinear(nn.Module):
    """``x @ W.T + b`` with ``W`` held in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        # A plain attribute, not a buffer: the opaque tensor must not enter state dicts.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach(), _BATCH_HINT
        )
        self.bias = linear.bias
        self._bias = None if linear.bias is None else linear.bias.detach()

    def repack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Take new values (a weight update): ``weight`` packed anew, ``bias`` copied into
        the one held (same shapes as at construction)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a packed "
                             f"{self.out_features} x {self.in_features} linear")  # fmt: skip
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        if self.bias is not None and bias is not None:
            with torch.no_grad():
                self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The overload itself: no overload resolution per call (30 layers x 4 a step).
        return _LINEAR_POINTWISE(x, self.packed_weight, self._bias, "none", [], "")


def prepack_linears(model: LlamaForCausalLM) -> int:
    """Replace the decoder layers' linear layers by :class:`PackedLinear` (see the module
    docstring for which), in place,
    when :func:`can_prepack` allows; returns how many were replaced. Those weights are then
    no longer parameters (pack only models that will not be saved)."""
    weight = model.embed_tokens.weight
    if not can_prepack(weight.device, weight.dtype):
        return 0

    def plain_bytes():
        for layer in model.layers:
            for name in _LINEARS:
                module = getattr(layer, name)
                if isinstance(module, nn.Linear):  # else packed already
                    yield layer, name, module.weight.numel() * module.weight.element_size()

    total = sum(size for _, _, size in plain_bytes())
    threshold = 0 if total >= _STREAMED_MODEL_BYTES else _MIN_PACKED_BYTES
    count = 0
    # One matrix at a time: each plain weight is freed as soon as its packed copy is in
    # place (holding them all would raise the load's peak memory by the packed size).
    for layer, name, size in list(plain_bytes()):
        if size >= threshold:
            setattr(layer, name, PackedLinear(getattr(layer, name)))
            count += 1
    return count


def prepack_lm_head(model: LlamaForCausalLM) -> bool:
    """Give ``model`` a packed LM head (``packed_lm_head``, which
    :meth:`LlamaForCausalLM.compute_logits` then uses) when :func:`can_prepack` allows;
    returns whether it did. An untied head's plain weight is dropped."""
    weight = model.embed_tokens.weight
    if not can_prepack(weight.device, weight.dtype) or model.packed_lm_head is not None:
        return False
    head = model.lm_head
    if head is None:  # tied: the embedding keeps its plain copy for the lookup
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        head.weight = weight
    model.packed_lm_head = PackedLinear(head)
    model.lm_head = None
    return True
