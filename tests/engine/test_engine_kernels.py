"""The compiled paged decode-attention kernel against the reference gather + SDPA."""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from test_packages import _age

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.engine import kernels, packages
from halfmoon.engine.attention import AttentionBatch, build_decode_group, decode_attention
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.kernels import KernelShape, PagedDecodeAttention, load_decode_kernel

#: Building a kernel needs a C++ compiler (inductor's); without one `auto` falls back to
#: the reference path, which the fallback test below checks.
needs_compiler = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler to build kernels"
)


@pytest.fixture
def aot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Packages built ahead of time, whatever ``$HALFMOON_COMPILE`` says; skipped on a
    torch that cannot load them (older than 2.13: pieces compile in process there)."""
    if not packages.loads_unpacked_packages():
        pytest.skip(f"torch {torch.__version__} loads no package directory")
    monkeypatch.setenv("HALFMOON_COMPILE", "aot")


#: The attention shape of the engine reference checkpoints (engine_testlib): 2 KV heads,
#: 2 queries per KV head, head size 16, blocks of 16 — built once, shared with them.
SHAPE = KernelShape(2, 2, 16, 16, torch.float32, "cpu")


def random_case(seed: int, lengths: list[int], shape: KernelShape):
    """A pool with a leading layer (so the layer's view has a storage offset), random
    distinct blocks per sequence, tables padded with a random valid block, random q."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // shape.block_size) for n in lengths) + 8
    pool_shape = (2, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    pool = torch.randn(pool_shape, generator=gen).to(shape.dtype)
    keys, values = pool[1, 0], pool[1, 1]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lengths:
        need = -(-n // shape.block_size)
        tables.append(perm[used : used + need])
        used += need
    group = build_decode_group(tables, lengths, shape.block_size, torch.device("cpu"))
    pad = perm[-1]
    padded = torch.tensor([t + [pad] * (group.max_blocks - len(t)) for t in tables])
    num_heads = shape.num_kv_heads * shape.group
    q = torch.randn(len(lengths), num_heads, shape.head_dim, generator=gen).to(shape.dtype)
    return q, keys, values, group, padded


def reference(q, keys, values, group, block_size: int) -> torch.Tensor:
    batch = AttentionBatch(torch.empty(0, dtype=torch.long), group, ())
    return decode_attention(q, keys, values, batch, q.shape[-1] ** -0.5)


def run_kernel(kernel, q, keys, values, group, tables, shape: KernelShape) -> torch.Tensor:
    qg = q.view(q.shape[0], shape.num_kv_heads, shape.group, shape.head_dim)
    scale = torch.tensor(shape.head_dim**-0.5)
    out = kernel(qg.contiguous(), keys, values, tables, group.context_lens, scale)
    return out.reshape(q.shape[0], -1)


CASES = [[1], [16], [17, 5, 48, 33, 1], [200] * 3 + [7] * 29, [511, 3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_kernel_math_matches_the_reference(dtype: torch.dtype) -> None:
    shape = KernelShape(3, 3, 32, 8, dtype, "cpu")
    for seed, lengths in enumerate(CASES):
        q, keys, values, group, tables = random_case(seed, lengths, shape)
        got = run_kernel(PagedDecodeAttention(), q, keys, values, group, tables, shape)
        want = reference(q, keys, values, group, shape.block_size)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_compiler
def test_compiled_kernel_matches_the_reference_on_random_block_tables() -> None:
    kernel = load_decode_kernel(SHAPE)
    for seed, lengths in enumerate(CASES * 2):
        q, keys, values, group, tables = random_case(100 + seed, lengths, SHAPE)
        got = run_kernel(kernel, q, keys, values, group, tables, SHAPE)
        want = reference(q, keys, values, group, SHAPE.block_size)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Whatever the padding blocks hold, it stays masked out.
    q, keys, values, group, tables = random_case(7, [3, 40], SHAPE)
    before = run_kernel(kernel, q, keys, values, group, tables, SHAPE)
    keys[tables[0, -1]] = 1e4
    values[tables[0, -1]] = -3e4
    after = run_kernel(kernel, q, keys, values, group, tables, SHAPE)
    torch.testing.assert_close(after[0], before[0], atol=0, rtol=0)


@needs_compiler
@pytest.mark.usefixtures("aot")
def test_a_kernel_builds_from_scratch(tmp_path: Path) -> None:
    """The shared cache above is usually warm; this builds a package in an empty
    directory (one small shape, 15-40 s) so that the build path itself stays tested."""
    shape = KernelShape(1, 2, 16, 4, torch.float32, "cpu")
    stale = tmp_path / "paged-decode-old.d"  # not loaded for a month: pruned by a build
    stale.mkdir()
    _age(stale, days=30)
    kernel = load_decode_kernel(shape, tmp_path)
    assert [p.suffix for p in tmp_path.glob("*.pt2")] == [".pt2"]
    assert [p.suffix for p in tmp_path.glob("*.d")] == [".d"]  # unpacked beside it
    assert not list(tmp_path.glob("*partial*")) and not stale.exists()
    unpacked = next(tmp_path.glob("*.d"))
    _age(unpacked, days=30)
    load_decode_kernel(shape, tmp_path)  # a load marks the package as in use
    assert time.time() - unpacked.stat().st_mtime < 3600
    for seed, lengths in enumerate(CASES[:3]):
        q, keys, values, group, tables = random_case(300 + seed, lengths, shape)
        got = run_kernel(kernel, q, keys, values, group, tables, shape)
        want = reference(q, keys, values, group, shape.block_size)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def generate_tiny(model_dir: Path, attention: str) -> tuple[str, list[list[int]]]:
    """The tiny preset's greedy tokens for six prompts of different lengths (decode-only
    and mixed steps, batches of one and more), and the engine's attention backend."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), attention=attention, kv_cache_mb=2.0, max_num_batched_tokens=96
        )  # fmt: skip
    )
    prompts = [[(7 * i + 3 * j) % 4000 + 5 for j in range(9 + 13 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    engine.check_integrity()
    return engine.attention_backend, [list(o.token_ids) for o in outs]


@needs_compiler
def test_engines_on_both_paths_generate_the_same_tokens(tiny_dir: Path) -> None:
    backend, compiled = generate_tiny(tiny_dir, "compiled")
    how = "compiled" if kernels.compile_mode() == "aot" else "compiled in process"
    assert backend.startswith(f"{how} (paged-decode-2x2x64-b16-float32-cpu")
    assert backend.endswith(", compiled glue, fused decode attention")
    ref_backend, ref = generate_tiny(tiny_dir, "reference")
    assert ref_backend.startswith("reference")
    assert compiled == ref


@needs_compiler
@pytest.mark.slow
def test_compiled_in_process_gives_the_reference_tokens(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HALFMOON_COMPILE=jit``, what a torch older than 2.13 gets (GPU machines' own):
    the kernel, the glue and the fused call compiled by torch.compile in the process,
    nothing built into the package cache, and the reference's greedy tokens."""
    monkeypatch.setenv("HALFMOON_COMPILE", "jit")
    monkeypatch.setenv("HALFMOON_KERNEL_CACHE", str(tmp_path / "kernels"))
    backend, compiled = generate_tiny(tiny_dir, "compiled")
    assert backend.startswith("compiled in process (paged-decode-2x2x64-b16-float32-cpu")
    assert backend.endswith(", compiled glue, fused decode attention")
    assert not list(tmp_path.rglob("*.pt2"))
    shared = dict(kernels._IN_PROCESS)
    assert len(shared) >= 5  # the kernel, three glue steps, the fused call
    # Every shape compiled in a process counts against one limit per module's code: 8
    # by default, which a process compiling a dozen shapes (gpu_check's tests) exceeded.
    assert torch._dynamo.config.recompile_limit >= kernels.RECOMPILE_LIMIT
    assert generate_tiny(tiny_dir, "compiled")[1] == compiled  # a second engine...
    assert kernels._IN_PROCESS == shared  # ...shares what the first compiled
    monkeypatch.setenv("HALFMOON_COMPILE", "aot")
    assert generate_tiny(tiny_dir, "reference")[1] == compiled


def test_the_compile_mode_follows_the_environment_and_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HALFMOON_COMPILE", raising=False)
    assert kernels.compile_mode() == ("aot" if packages.loads_unpacked_packages() else "jit")
    monkeypatch.setattr(kernels, "loads_unpacked_packages", lambda: False)  # torch < 2.13
    assert kernels.compile_mode() == "jit"
    monkeypatch.setenv("HALFMOON_COMPILE", "aot")
    assert kernels.compile_mode() == "aot"
    monkeypatch.setenv("HALFMOON_COMPILE", "fast")
    with pytest.raises(HalfmoonError, match="HALFMOON_COMPILE='fast' is not one of auto, aot, jit"):
        kernels.compile_mode()


@pytest.mark.usefixtures("aot")
def test_auto_falls_back_and_compiled_refuses_when_the_build_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path))
    monkeypatch.delenv("HALFMOON_KERNEL_CACHE", raising=False)  # a fresh, empty cache

    def broken(shape: KernelShape, path: Path) -> None:
        path.write_bytes(b"half a package")
        raise RuntimeError("C++ compile error: g++ not found")

    monkeypatch.setattr(kernels, "build_package", broken)
    shape = KernelShape(2, 2, 16, 16, torch.float32, "cpu")
    kernel, backend = kernels.select_decode_kernel("auto", shape)
    assert kernel is None
    assert (
        backend
        == "reference (compiled kernel unavailable: RuntimeError: C++ compile error: g++ not found)"
    )
    with pytest.raises(HalfmoonError, match="compiled attention kernel is unavailable.*g\\+\\+"):
        kernels.select_decode_kernel("compiled", shape)
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".lock"]  # no partial package
    assert kernels.select_decode_kernel("reference", shape) == (None, "reference (gather + SDPA)")
    on_gpu = kernels.select_decode_kernel("auto", dataclasses.replace(shape, device="cuda"))
    assert on_gpu == (None, "reference (the compiled kernel is not yet verified on cuda)")
    with pytest.raises(HalfmoonError, match="unknown attention backend 'fast'"):
        kernels.select_decode_kernel("fast", shape)
    with pytest.raises(HalfmoonError, match="unknown attention backend 'fast'"):
        EngineConfig(attention="fast")


KILLED_LOADER = """
import os, signal, sys
from halfmoon.engine.kernels import KernelShape, load_decode_kernel
import torch
load_decode_kernel(KernelShape(2, 2, 16, 16, torch.float32, "cpu"))
os.kill(os.getpid(), signal.SIGKILL)
"""


@needs_compiler
@pytest.mark.usefixtures("aot")
def test_a_killed_process_leaves_no_extracted_package(tmp_path: Path) -> None:
    """Packages load from their unpacked directory in the cache: given the archive, torch's
    loader extracts it into $TMPDIR/aotinductor_* per process and a killed process leaves
    that behind (thousands had piled up in /tmp)."""
    import subprocess
    import sys

    load_decode_kernel(SHAPE)  # built and unpacked in the shared cache
    own_tmp = tmp_path / "tmp"
    own_tmp.mkdir()
    proc = subprocess.run([sys.executable, "-c", KILLED_LOADER], timeout=120,
                          env={**os.environ, "TMPDIR": str(own_tmp)})  # fmt: skip
    assert proc.returncode == -9
    assert not list(own_tmp.iterdir())


@needs_compiler
@pytest.mark.usefixtures("aot")
def test_concurrent_loaders_build_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    built = packages.kernel_dir() / f"{SHAPE.key()}.pt2"
    load_decode_kernel(SHAPE)  # the real package, built or cached
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path))
    monkeypatch.delenv("HALFMOON_KERNEL_CACHE", raising=False)  # a fresh, empty cache
    calls: list[int] = []
    release = threading.Event()

    def slow_copy(shape: KernelShape, path: Path) -> None:
        calls.append(1)
        release.wait(10)
        shutil.copyfile(built, path)

    monkeypatch.setattr(kernels, "build_package", slow_copy)
    results: list[object] = []
    threads = [
        threading.Thread(target=lambda: results.append(load_decode_kernel(SHAPE))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    time.sleep(0.3)  # the other two now wait on the lock
    release.set()
    for t in threads:
        t.join(30)
    assert len(results) == 3 and len(calls) == 1
    q, keys, values, group, tables = random_case(3, [20, 9], SHAPE)
    got = run_kernel(results[0], q, keys, values, group, tables, SHAPE)
    torch.testing.assert_close(got, reference(q, keys, values, group, 16), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_kernel_on_cuda_matches_the_reference() -> None:
    # `auto` keeps the reference on a GPU until this has passed on one; this is the check
    # (on a torch older than 2.13 with the kernel compiled in process).
    shape = KernelShape(2, 2, 16, 16, torch.float32, "cuda")
    kernel = load_decode_kernel(shape)
    for seed, lengths in enumerate(CASES):
        q, keys, values, group, tables = random_case(200 + seed, lengths, SHAPE)
        want = reference(q, keys, values, group, SHAPE.block_size)
        cuda = [t.cuda() for t in (q, keys, values, tables, group.context_lens)]
        q_c, keys_c, values_c, tables_c, lens_c = cuda
        qg = q_c.view(q.shape[0], 2, 2, 16).contiguous()
        got = kernel(qg, keys_c, values_c, tables_c, lens_c, torch.tensor(0.25, device="cuda"))
        torch.testing.assert_close(got.reshape(q.shape[0], -1).cpu(), want, atol=1e-5, rtol=1e-5)


def test_a_package_key_follows_the_kernels_source(monkeypatch) -> None:
    """The test suite keeps one kernel cache across runs (tests/conftest.py): an edit to
    a kernel's code, version constant bumped or not, must give its package a new key.
    Every engine module that builds or loads a package is among the digested sources."""
    engine_dir = Path(kernels.__file__).parent
    # packages.py keeps the packages (build, lock, load, prune): nothing of it goes into one
    calls = ("export_and_compile(", "load_package(", "load_function(")
    builders = {p.name for p in engine_dir.glob("*.py") if p.name != "packages.py"
                and any(call in p.read_text() for call in calls)}  # fmt: skip
    assert builders and builders <= set(kernels.KERNEL_SOURCES)
    key = SHAPE.key()
    assert key == SHAPE.key()  # stable within a version of the code
    monkeypatch.setattr(kernels, "source_digest", lambda: "an-edited-source")
    assert SHAPE.key() != key
    assert SHAPE.key().rsplit("-", 1)[0] == key.rsplit("-", 1)[0]  # same readable name
