"""KV codecs for the wire (``--kv-compression``): sizes, exactness, error bounds, bad input."""

from __future__ import annotations

import pytest
import torch

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.kv_cache import KVLayout
from halfmoon.engine.kvcodec import MODES, DequantizeGroups, KVCodec, make_codec

HEAD_DIM = 64


def kv(n_blocks: int = 3, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """``[n, block 16, 2 heads, 64]`` values with outliers and an all-zero group."""
    g = torch.Generator().manual_seed(seed)
    x = (
        torch.randn(n_blocks, 16, 2, HEAD_DIM, generator=g)
        * torch.rand(n_blocks, 16, 2, 1, generator=g)
        * 8
    )
    x[0, 0, 0] = 0.0
    x[0, 1, 1, 5] = 300.0  # one outlier: its group's scale is large
    return x.to(dtype)


def block_views(x: torch.Tensor) -> list[memoryview]:
    """One byte view per block, like the engine's prompt-KV hook hands out."""
    return [memoryview(b.contiguous().view(torch.uint8).reshape(-1).numpy()) for b in x]


def roundtrip(codec: KVCodec, x: torch.Tensor, blocks: list[memoryview] | None = None):
    payload = codec.encode(blocks if blocks is not None else block_views(x))
    payload = bytes(payload)  # the wire: the receiver owns a copy
    out = torch.empty_like(x)
    codec.decode(memoryview(payload), memoryview(out.view(torch.uint8).reshape(-1).numpy()))
    return payload, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["none", "zstd"])
def test_lossless_modes_give_back_every_bit(mode, dtype):
    codec = make_codec(mode, dtype, HEAD_DIM)
    x = kv(dtype=dtype)
    payload, out = roundtrip(codec, x)
    assert codec.lossless and torch.equal(out.view(torch.uint8), x.view(torch.uint8))
    raw = x.numel() * x.element_size()
    assert len(payload) <= codec.max_encoded_bytes(raw)
    if mode == "zstd":  # sign/exponent planes of real-valued KV compress
        assert len(payload) < raw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_error_is_at_most_half_a_step_of_each_group(dtype):
    codec = make_codec("int8", dtype, HEAD_DIM)
    x = kv(dtype=dtype)
    payload, out = roundtrip(codec, x)
    groups = x.numel() // HEAD_DIM
    assert len(payload) == codec.max_encoded_bytes(x.numel() * x.element_size()) == groups * 68
    ref = x.float().reshape(groups, HEAD_DIM)
    step = ref.abs().amax(1, keepdim=True) / 127
    err = (out.float().reshape(groups, HEAD_DIM) - ref).abs()
    slack = 1e-6 if dtype == torch.float32 else 2**-7  # bfloat16 rounds the decoded value
    assert (err <= step / 2 * (1 + 1e-5) + slack * ref.abs() + 1e-30).all()
    assert torch.equal(out[0, 0, 0], torch.zeros(HEAD_DIM, dtype=dtype))  # zeros stay zeros
    assert codec.ratio() == pytest.approx(4 * 64 / 68 if dtype == torch.float32 else 2 * 64 / 68)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_decodes_in_place_to_the_modules_values(dtype):
    """int8 decodes in place (codes converted into the destination, then scaled), the
    same values, bit for bit, as the dequantizing module that fp8 compiles."""
    codec = make_codec("int8", dtype, HEAD_DIM)
    assert codec.backend == {"encode": "eager", "decode": "in place"}
    x = kv(dtype=dtype)
    payload, out = roundtrip(codec, x)
    groups = x.numel() // HEAD_DIM
    codes, scales = codec._split(torch.frombuffer(bytearray(payload), dtype=torch.uint8), groups)
    expected = DequantizeGroups(dtype)(codes, scales)
    assert torch.equal(out.reshape(groups, HEAD_DIM), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_decode_into_a_strided_pool_block_gives_the_decoded_values(mode, dtype):
    """``decode_into`` writes a payload straight into a block of the engine's pool (a
    strided view ``[L, 2, B, H_kv, D]``), the same values, bit for bit, as ``decode``
    into a buffer; neighbouring blocks are left alone."""
    if mode == "fp8" and not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("no float8 in this torch")
    codec = make_codec(mode, dtype, HEAD_DIM)
    layout = KVLayout(num_layers=3, block_size=16, num_kv_heads=2, head_dim=HEAD_DIM,
                      dtype=str(dtype).removeprefix("torch."))  # fmt: skip
    pool = torch.zeros(layout.buffer_shape(4), dtype=dtype)
    x = torch.randn(layout.buffer_shape(1), generator=torch.Generator().manual_seed(3))
    x = x.to(dtype)
    payload = bytes(codec.encode(memoryview(x.view(-1).view(torch.uint8).numpy())))
    expected = torch.empty_like(x)
    codec.decode(memoryview(payload), memoryview(expected.view(-1).view(torch.uint8).numpy()))
    codec.decode_into(memoryview(payload), pool[:, :, 2])
    assert torch.equal(pool[:, :, 2], expected[:, :, 0])
    assert not pool[:, :, [0, 1, 3]].any()


def test_fp8_error_is_relative_to_each_value():
    codec = make_codec("fp8", torch.float32, HEAD_DIM)
    x = kv()
    payload, out = roundtrip(codec, x)
    assert len(payload) == x.numel() // HEAD_DIM * 68
    groups = x.numel() // HEAD_DIM
    ref, got = x.reshape(groups, HEAD_DIM), out.reshape(groups, HEAD_DIM)
    amax = ref.abs().amax(1, keepdim=True)
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals below 2^-6 of 448.
    bound = ref.abs() * 2**-4 + amax / 448 * 2**-9 + 1e-30
    assert ((got - ref).abs() <= bound * (1 + 1e-5)).all()
    assert torch.equal(out[0, 0, 0], torch.zeros(HEAD_DIM))


@pytest.mark.parametrize("mode", MODES)
def test_scattered_blocks_encode_like_contiguous_ones(mode):
    """Blocks that are not back to back in memory (a gathered, non-consecutive table)
    encode to the same payload as one contiguous span."""
    codec = make_codec(mode, torch.float32, HEAD_DIM)
    x = kv(4)
    scattered = [block_views(x[i : i + 1].clone())[0] for i in range(4)]
    assert bytes(codec.encode(scattered)) == bytes(codec.encode(block_views(x)))
    _, out = roundtrip(codec, x, scattered)
    assert torch.allclose(out, x, atol=float(x.abs().max()) / 100)


def test_encode_tensor_is_what_the_receiver_sees():
    codec = make_codec("int8", torch.float32, HEAD_DIM)
    x = kv()
    _, out = roundtrip(codec, x)
    assert torch.equal(codec.encode_tensor(x), out)
    assert torch.equal(make_codec("none", torch.float32, HEAD_DIM).encode_tensor(x), x)


def test_codec_from_a_layout():
    layout = KVLayout(num_layers=2, block_size=16, num_kv_heads=2, head_dim=HEAD_DIM,
                      dtype="bfloat16")  # fmt: skip
    codec = KVCodec.make("int8", layout)
    assert (codec.name, codec.dtype, codec.head_dim) == ("int8", torch.bfloat16, HEAD_DIM)


def test_bad_modes_and_payloads_are_clear_errors():
    with pytest.raises(HalfmoonError, match="unknown KV compression 'lz9'"):
        make_codec("lz9", torch.float32, HEAD_DIM)
    with pytest.raises(HalfmoonError, match="floating-point KV"):
        make_codec("int8", torch.int32, HEAD_DIM)
    codec = make_codec("int8", torch.float32, HEAD_DIM)
    out = memoryview(bytearray(16 * HEAD_DIM * 4))
    with pytest.raises(HalfmoonError, match="expected 1088"):
        codec.decode(memoryview(bytes(100)), out)
    with pytest.raises(HalfmoonError, match="not whole groups"):
        codec.encode([memoryview(bytes(100))])
    zstd = make_codec("zstd", torch.float32, HEAD_DIM)
    with pytest.raises(HalfmoonError, match="does not decompress"):
        zstd.decode(memoryview(b"not a zstd frame"), out)
    short = zstd.encode([memoryview(bytes(HEAD_DIM * 4))])
    with pytest.raises(HalfmoonError, match="holds 256 bytes, not 4096|does not decompress"):
        zstd.decode(short, out)


def test_compiled_int8_gives_the_eager_bytes():
    """The AOT-compiled codec encodes to the very bytes of the eager one and decodes them
    to the same values (int8 decodes in place either way). From the run's kernel cache
    (tests/conftest.py, ``shared_kernels``: built there once, ~40 s, after each edit to
    the kernels' sources); building a package from scratch is tested by
    ``test_engine_kernels.py``."""
    eager = make_codec("int8", torch.float32, HEAD_DIM)
    compiled = make_codec("int8", torch.float32, HEAD_DIM)
    compiled.compile()
    assert compiled.description == "int8 (encode compiled, decode in place)"
    assert eager.description == "int8 (encode eager, decode in place)"
    x = kv(5)
    payload, out = roundtrip(compiled, x)
    assert payload == bytes(eager.encode(block_views(x)))
    assert torch.equal(out, roundtrip(eager, x)[1])
