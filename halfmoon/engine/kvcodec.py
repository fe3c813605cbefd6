"""KV compression for the wire (``halfmoon serve --kv-compression MODE``).

A codec turns one *stream layer* of KV (the K or the V of one model layer for a request's
blocks: ``[n, block_size, H_kv, head_dim]`` elements in the engine's dtype, handed over as
host bytes) into a payload for the wire, and back. Modes:

- ``none``: the raw bytes (streams skip the codec altogether).
- ``int8``: symmetric 8-bit per *group* of ``head_dim`` values (one token's one KV head),
  with a float32 scale ``max|x| / 127`` per group: 3.76x fewer bytes than float32 KV at
  head_dim 64, 1.88x fewer than bfloat16. The error per value is at most half a step
  (``max|x| / 254`` of its group).
- ``fp8``: float8 e4m3 per group with a float32 scale ``max|x| / 448``: the same size as
  ``int8``, a relative rather than absolute error (3 mantissa bits: ~6% of the value at
  worst, 2^-9 of the group's max for the smallest normals).
- ``zstd``: lossless; the bytes of each element split into planes (all first bytes,
  then all second bytes, ...: the sign/exponent planes of floats compress, their low
  mantissa planes barely do) and compressed with Zstandard level 1. Its size varies:
  :meth:`KVCodec.max_encoded_bytes` bounds it.

Groups follow the KV layout, so a codec needs only the element dtype and ``head_dim``.
Payload of ``int8`` / ``fp8`` for ``G`` groups: ``G * head_dim`` one-byte codes, then ``G``
float32 scales (little-endian). ``int8`` and ``fp8`` encode with the same torch module
eager or, after :meth:`KVCodec.compile` (what serving workers do,
:func:`compiled_or_eager`), compiled into one fused pass (built once per mode, dtype and
head size into the kernel cache, like the engine's kernels). ``int8`` decodes in place,
two of torch's own vectorized passes over the destination (the codes converted into it,
then scaled: 10-20 GiB/s of float32 KV on one thread, where the compiled pass, whose
loads of 8 one-byte codes at a time convert slowly, made ~2); ``fp8``, whose codes this
CPU converts in software, decodes through its compiled pass too. ``decode_into`` writes
a payload straight into a strided host tensor (a block of the engine's pool, where a
pulled prefix block goes): ``int8`` and ``fp8`` as they decode, the others through a
buffer. All work is on the host, on the calling thread
(torch ops release the GIL).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from halfmoon.core.buffers import buffer_address, span_at
from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.kv_cache import KVLayout, from_bytes, torch_dtype

logger = logging.getLogger(__name__)

#: Bump when the compiled codec modules change.
CODEC_VERSION = 1
#: The modes of ``--kv-compression``, in the order help texts list them.
MODES = ("none", "int8", "fp8", "zstd")

_FP8 = getattr(torch, "float8_e4m3fn", None)
_FP8_MAX = 448.0
_ZSTD_LEVEL = 1
#: Smallest scale (all-zero groups decode to zeros, never to NaN).
_TINY = 1e-30


def _contiguous_span(blocks: Sequence[memoryview]) -> memoryview | None:
    """The blocks as one view without a copy when they lie back to back in memory (the
    engine hands out slices of one tensor); None when they do not, or are read-only."""
    if len(blocks) == 1:
        return memoryview(blocks[0]).cast("B")
    addresses = [buffer_address(b) for b in blocks]
    if addresses[0] is None:
        return None
    position = addresses[0]
    for address, block in zip(addresses, blocks, strict=True):
        if address != position:
            return None
        position += block.nbytes
    # Every byte of the span belongs to one of the blocks, which the caller keeps alive
    # while the view is used.
    return span_at(addresses[0], position - addresses[0])


def _as_tensor(blocks: Sequence[memoryview] | memoryview, dtype: torch.dtype) -> torch.Tensor:
    """One flat host tensor of ``dtype`` over ``blocks`` (a copy only when they are not
    back to back in memory)."""
    if isinstance(blocks, memoryview):
        return from_bytes(blocks, dtype)
    span = _contiguous_span(blocks)
    if span is None:
        span = memoryview(np.concatenate([np.frombuffer(b, np.uint8) for b in blocks]))
    return from_bytes(span, dtype)


class KVCodec:
    """Encodes and decodes stream layers of one KV dtype and head size (see the module
    docstring); ``KVCodec.make(mode, layout)`` builds one."""

    #: The ``--kv-compression`` mode.
    name = "none"
    #: Whether ``decode(encode(x)) == x`` bit for bit.
    lossless = True
    #: ``"eager"`` or ``"compiled"`` per direction, for codecs that can be compiled.
    backend: dict[str, str] | None = None

    def __init__(self, dtype: torch.dtype, head_dim: int) -> None:
        if head_dim <= 0:
            raise HalfmoonError(f"head_dim must be positive, not {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.element_size = torch.empty((), dtype=dtype).element_size()

    @staticmethod
    def make(mode: str, layout: KVLayout) -> KVCodec:
        """The codec of ``mode`` for KV of ``layout`` (its dtype and head_dim)."""
        return make_codec(mode, torch_dtype(layout.dtype), layout.head_dim)

    def compile(self, directions: Sequence[str] = ("encode", "decode"),
                directory: Path | None = None) -> None:  # fmt: skip
        """Use compiled kernels where the codec has them (this one has none)."""

    @property
    def description(self) -> str:
        """The mode and how each direction runs, for logs."""
        if self.backend is None:
            return self.name
        return f"{self.name} (encode {self.backend['encode']}, decode {self.backend['decode']})"

    def _check_raw(self, num_bytes: int) -> int:
        """Groups in ``num_bytes`` raw bytes (raises unless a whole number)."""
        group_bytes = self.head_dim * self.element_size
        if num_bytes % group_bytes:
            raise HalfmoonError(
                f"{num_bytes} bytes of KV are not whole groups of {self.head_dim} "
                f"{self.dtype} values"
            )
        return num_bytes // group_bytes

    def ratio(self, raw_bytes: int = 1 << 20) -> float:
        """Raw bytes per wire byte (a lower bound for variable-size codecs)."""
        return raw_bytes / self.max_encoded_bytes(raw_bytes)

    def max_encoded_bytes(self, raw_bytes: int) -> int:
        """The largest payload for ``raw_bytes`` bytes of KV (exact for fixed-size codecs)."""
        self._check_raw(raw_bytes)
        return raw_bytes

    def encode(self, blocks: Sequence[memoryview] | memoryview) -> memoryview:
        """The payload of one stream layer given as its blocks' bytes (in order)."""
        if isinstance(blocks, memoryview):
            return blocks
        return memoryview(_as_tensor(blocks, torch.uint8).numpy())

    def decode(self, payload: memoryview, out: memoryview) -> None:
        """Write the KV of ``payload`` into ``out`` (its raw size, writable)."""
        if payload.nbytes != out.nbytes:
            raise HalfmoonError(f"a raw KV payload of {payload.nbytes} bytes for {out.nbytes}")
        out[:] = payload

    def decode_into(self, payload: memoryview, out: torch.Tensor) -> None:
        """Write the KV of ``payload`` into ``out``, a host tensor of this codec's dtype
        whose elements in row-major order are the payload's values; it may be strided
        (a block of the engine's pool, ``[L, 2, B, H_kv, D]``), so that a pulled block
        lands in the pool without a copy through a buffer where the codec allows it.
        This one decodes into a contiguous buffer, then copies."""
        buffer = torch.empty(out.shape, dtype=self.dtype)
        self.decode(payload, memoryview(buffer.view(-1).view(torch.uint8).numpy()))
        out.copy_(buffer)

    def encode_tensor(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (any shape whose last dimension is ``head_dim``) through the codec and
        back: what the receiver gets. For measuring the codec's error."""
        flat = x.detach().to("cpu", self.dtype).contiguous().reshape(-1)
        raw = memoryview(flat.view(torch.uint8).numpy())
        payload = self.encode(raw)
        out = torch.empty_like(flat)
        self.decode(payload, memoryview(out.view(torch.uint8).numpy()))
        return out.view(x.shape).to(x.device, x.dtype)


class QuantizeGroups(nn.Module):
    """``x`` ``[G, D]`` -> the payload of ``int8`` / ``fp8`` as ``G * D + 4 * G`` bytes
    (int8 tensor): the codes, then the float32 scales' bytes. The same module runs eager
    and AOT-compiled (:meth:`_Scaled.compile`), so both give the same bytes."""

    def __init__(self, code_max: float, fp8: bool) -> None:
        super().__init__()
        self.code_max = code_max
        self.fp8 = fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        amax = xf.abs().amax(1, keepdim=True).clamp_min(_TINY)
        scaled = xf * (self.code_max / amax)
        if self.fp8:
            codes = scaled.to(_FP8).view(torch.int8)
        else:
            codes = torch.round(scaled).to(torch.int8)
        scales = amax / self.code_max
        return torch.cat([codes.reshape(-1), scales.reshape(-1).view(torch.int8)])


class DequantizeGroups(nn.Module):
    """``(codes [G, D], scales [G])`` -> ``codes * scale`` in ``dtype``."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        return (codes.float() * scales.unsqueeze(1)).to(self.dtype)


class _Scaled(KVCodec):
    """One-byte codes per value and a float32 scale per group (``int8``, ``fp8``).

    Eager by default; :meth:`compile` swaps in compiled versions of the same modules for
    the directions in :attr:`compiled_directions` (measured on one thread, SmolLM2's
    737,280-byte blocks of float32 KV: ``int8`` encoding 2.5 -> 5.8 GiB/s; its decode
    stays in place, 19 GiB/s, where the compiled one made 2.1)."""

    lossless = False
    code_dtype: torch.dtype = torch.int8
    code_max = 127.0
    #: The directions :meth:`compile` compiles; a decode not among them runs in place.
    compiled_directions: tuple[str, ...] = ("encode", "decode")

    def __init__(self, dtype: torch.dtype, head_dim: int) -> None:
        super().__init__(dtype, head_dim)
        self._quantize: Callable[[torch.Tensor], torch.Tensor] = QuantizeGroups(
            self.code_max, self.name == "fp8"
        )
        #: None: decode in place (:meth:`decode`).
        self._dequantize: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = (
            DequantizeGroups(dtype) if "decode" in self.compiled_directions else None
        )
        decode = "eager" if self._dequantize is not None else "in place"
        self.backend = {"encode": "eager", "decode": decode}

    def max_encoded_bytes(self, raw_bytes: int) -> int:
        groups = self._check_raw(raw_bytes)
        return groups * (self.head_dim + 4)

    def compile(self, directions: Sequence[str] = ("encode", "decode"),
                directory: Path | None = None) -> None:  # fmt: skip
        """Use compiled kernels for ``directions`` (packages built once per mode, dtype and
        head size into the kernel cache, ~15-25 s each, or compiled in process as
        :func:`halfmoon.engine.kernels.compile_mode` says; raises when they cannot be)."""
        from halfmoon.engine.kernels import CompiledPiece, Recipe, package_key

        dtype = str(self.dtype).removeprefix("torch.")
        groups = torch.export.Dim("groups", min=2)
        for direction in directions:
            if direction == "decode" and direction not in self.compiled_directions:
                continue  # in place is faster (the class's docstring)
            spec = f"v{CODEC_VERSION}-{self.name}-{direction}-{dtype}-hd{self.head_dim}"
            key = package_key(f"kvcodec-{self.name}-{direction}-{dtype}", spec, "cpu")
            example = torch.randn(64, self.head_dim).to(self.dtype)
            if direction == "encode":
                module = QuantizeGroups(self.code_max, self.name == "fp8")
                recipe = Recipe(module, (example,), ({0: groups},), 1)
                self._quantize = CompiledPiece(key, lambda r=recipe: r).load_function(directory)
            elif direction == "decode":
                payload = QuantizeGroups(self.code_max, self.name == "fp8")(example)
                codes, scales = self._split(payload, 64)
                recipe = Recipe(DequantizeGroups(self.dtype), (codes, scales),
                                ({0: groups}, {0: groups}), 1)  # fmt: skip
                self._dequantize = CompiledPiece(key, lambda r=recipe: r).load_function(directory)
            else:
                raise ValueError(f"unknown direction {direction!r}")
            self.backend[direction] = "compiled"

    def _split(self, payload: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes [G, D], scales [G])`` viewed in an int8 / uint8 payload tensor."""
        body = groups * self.head_dim
        codes = payload[:body].view(self.code_dtype).view(groups, self.head_dim)
        return codes, payload[body:].view(torch.float32)

    def encode(self, blocks: Sequence[memoryview] | memoryview) -> memoryview:
        """The payload (a new buffer)."""
        x = _as_tensor(blocks, self.dtype)
        groups = self._check_raw(x.numel() * self.element_size)
        payload = self._quantize(x.view(groups, self.head_dim))
        return memoryview(payload.view(torch.uint8).numpy())

    def _parts(self, payload: memoryview, raw_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(codes [G, D], scales [G])`` of a payload for ``raw_bytes`` of KV (checked)."""
        groups = self._check_raw(raw_bytes)
        if payload.nbytes != groups * (self.head_dim + 4):
            raise HalfmoonError(
                f"a {self.name} KV payload of {payload.nbytes} bytes for {raw_bytes} raw "
                f"bytes (expected {groups * (self.head_dim + 4)})"
            )
        return self._split(from_bytes(payload, torch.uint8), groups)

    def decode_into(self, payload: memoryview, out: torch.Tensor) -> None:
        if out.shape[-1] != self.head_dim or out.dtype != self.dtype or out.device.type != "cpu":
            return super().decode_into(payload, out)
        codes, scales = self._parts(payload, out.numel() * self.element_size)
        shape, scale = out.shape, scales.view(*out.shape[:-1], 1)
        if self._dequantize is not None:
            out.copy_(self._dequantize(codes, scales).view(shape))
        else:
            # The same values as DequantizeGroups (codes are small integers, exact in any
            # float dtype; the product is computed in float32 and rounded once), strided
            # or not (one mixed-type multiply into it was slower: 27 against 21 ms for
            # 90 MiB of SmolLM2's blocks on one thread).
            out.copy_(codes.view(shape))
            out.mul_(scale)

    def decode(self, payload: memoryview, out: memoryview) -> None:
        groups = self._check_raw(out.nbytes)
        self.decode_into(payload, from_bytes(out, self.dtype).view(groups, self.head_dim))


class Int8Codec(_Scaled):
    """``int8``: round(x * 127 / max|x|) in [-127, 127], scale max|x| / 127 per group."""

    name = "int8"
    compiled_directions = ("encode",)


class Fp8Codec(_Scaled):
    """``fp8``: x * 448 / max|x| in float8 e4m3 (round to nearest), scale max|x| / 448."""

    name = "fp8"
    code_dtype = _FP8 if _FP8 is not None else torch.int8
    code_max = _FP8_MAX


class ZstdCodec(KVCodec):
    """``zstd``: byte planes, then Zstandard level 1 (lossless, variable size)."""

    name = "zstd"

    def __init__(self, dtype: torch.dtype, head_dim: int) -> None:
        super().__init__(dtype, head_dim)
        import zstandard

        self._zstd = zstandard
        # Compressor objects are not thread-safe: one per thread that uses the codec.
        self._local = threading.local()

    def _compressor(self):
        c = getattr(self._local, "c", None)
        if c is None:
            c = self._local.c = self._zstd.ZstdCompressor(level=_ZSTD_LEVEL)
            self._local.d = self._zstd.ZstdDecompressor()
        return c

    def max_encoded_bytes(self, raw_bytes: int) -> int:
        self._check_raw(raw_bytes)
        # Zstandard's bound for incompressible input: the size plus ~1/256 and a header.
        return raw_bytes + (raw_bytes >> 8) + 64 * 1024

    def encode(self, blocks: Sequence[memoryview] | memoryview) -> memoryview:
        raw = _as_tensor(blocks, torch.uint8).numpy()
        self._check_raw(raw.nbytes)
        planes = np.ascontiguousarray(raw.reshape(-1, self.element_size).T)
        return memoryview(self._compressor().compress(planes))

    def decode(self, payload: memoryview, out: memoryview) -> None:
        self._compressor()
        try:
            planes = self._local.d.decompress(payload, max_output_size=out.nbytes)
        except self._zstd.ZstdError as exc:
            raise HalfmoonError(f"a zstd KV payload does not decompress: {exc}") from exc
        if len(planes) != out.nbytes:
            raise HalfmoonError(f"a zstd KV payload holds {len(planes)} bytes, not {out.nbytes}")
        dest = np.frombuffer(out, np.uint8).reshape(-1, self.element_size)
        dest[:] = np.frombuffer(planes, np.uint8).reshape(self.element_size, -1).T


_CODECS: dict[str, type[KVCodec]] = {
    "none": KVCodec,
    "int8": Int8Codec,
    "fp8": Fp8Codec,
    "zstd": ZstdCodec,
}


def make_codec(mode: str, dtype: torch.dtype, head_dim: int) -> KVCodec:
    """The codec of ``mode`` for KV of ``dtype`` with ``head_dim`` values per head."""
    cls = _CODECS.get(mode)
    if cls is None:
        raise HalfmoonError(f"unknown KV compression {mode!r}; use one of {', '.join(MODES)}")
    if mode == "fp8" and _FP8 is None:
        raise HalfmoonError("this torch build has no float8_e4m3fn: use int8")
    if not dtype.is_floating_point and mode in ("int8", "fp8"):
        raise HalfmoonError(f"{mode} compresses floating-point KV, not {dtype}")
    return cls(dtype, head_dim)


def compiled_or_eager(codec: KVCodec, directions: Sequence[str]) -> KVCodec:
    """``codec`` with compiled kernels for ``directions`` when they build or load, else as
    it is, with a warning naming why (a compiler problem must not stop serving)."""
    from halfmoon.engine.packages import failure_reason

    try:
        codec.compile(directions)
    except Exception as exc:  # noqa: BLE001
        logger.warning("compiled KV codec unavailable (%s); using the eager one",
                       failure_reason(exc))  # fmt: skip
    return codec
