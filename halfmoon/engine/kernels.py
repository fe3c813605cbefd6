"""Compiled kernels: decode attention that reads the paged KV pool in place.

The reference decode path (:func:`halfmoon.engine.attention.decode_attention`) first
copies every sequence's blocks out of the pool into a padded workspace, then runs SDPA
on the copy: on every layer of every step it writes and re-reads the whole context, a
cost that grows with the context. The kernel here does the same math without the copy:

    scores[s, t, g] = q[s, g] . K[table[s, t // B], t % B] * scale,   t < len[s]
    out[s, g]       = softmax_t(scores[s, :, g]) . V[table[s, t // B], t % B]

written as plain tensor code (indexed loads, a reduction over ``head_dim``, the
exponentials, a weighted sum of V per block and then over blocks) that TorchInductor
turns into a few C++ (CUDA: Triton) loop nests, parallel over sequences, that load K and
V straight from their blocks and accumulate in float32.

It is built ahead of time with AOTInductor (``torch.export`` + ``aoti_compile_and_package``)
into a ``.pt2`` package per attention shape (KV heads, query heads per KV head, head
size, block size, dtype, device) and torch version, cached under
``$HALFMOON_CACHE/kernels/``; batch size, blocks per sequence and pool size stay dynamic.
Building takes 15-40 s on 2 CPU cores, once per shape (a file lock per package: processes
starting together build different ones, then wait for the rest); loading a built package
takes milliseconds. The shape is static because dynamic inner sizes cost the generated
loops their vectorization (measured 2-5x slower).

Measured on 2 CPU cores (SmolLM2's shape, contexts 512 and 2,048, batch 1-32): 1.3-6x
faster than gather + SDPA; results differ from it by float32 rounding (~1e-7).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import time
import warnings
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.config import check_attention_backend

logger = logging.getLogger(__name__)

#: Bump when the kernel's code or signature changes: cached packages of other versions
#: are then ignored (and rebuilt).
KERNEL_VERSION = 5


class PagedDecodeAttention(torch.nn.Module):
    """The exported computation (also runnable eagerly: that is how tests check it).

    ``q`` ``[S, H_kv, G, D]`` contiguous; ``keys`` / ``values`` one layer of the pool,
    ``[N, B, H_kv, D]`` contiguous; ``block_tables`` ``[S, M]`` int64, padded with any
    valid block id; ``context_lens`` ``[S]`` int64, each in ``1..M*B``; ``scale`` a 0-d
    float32 tensor. Returns ``[S, H_kv, G, D]`` in ``q``'s dtype.
    """

    def forward(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: torch.Tensor,
    ) -> torch.Tensor:
        num_seqs, max_blocks = block_tables.shape
        block_size, num_kv_heads, head_dim = keys.shape[1:]
        group = q.shape[2]
        # [S, M, B, H_kv, D], fused into the loads below. Built without inductor's bounds
        # check on these loads (a test per vector in the inner loop, 2x slower): the
        # engine's block tables hold pool block ids only.
        k = keys[block_tables].float()
        v = values[block_tables].float()
        qg = q.float().view(num_seqs, 1, 1, num_kv_heads, group, head_dim)
        scores = (qg * k.unsqueeze(4)).sum(-1) * scale  # [S, M, B, H_kv, G]
        positions = torch.arange(max_blocks * block_size, device=q.device)
        visible = positions.view(1, max_blocks, block_size, 1, 1) < context_lens.view(
            num_seqs, 1, 1, 1, 1
        )
        scores = torch.where(visible, scores, float("-inf"))
        weights = torch.exp(scores - scores.amax((1, 2), keepdim=True))
        # The weighted sum of V block by block (each block's rows stay in cache while every
        # query head and lane of head_dim reads them), then over the blocks; normalised last.
        per_block = (weights.unsqueeze(-1) * v.unsqueeze(4)).sum(2)  # [S, M, H_kv, G, D]
        out = per_block.sum(1) / weights.sum((1, 2)).unsqueeze(-1)
        return out.to(q.dtype)


@dataclass(frozen=True)
class KernelShape:
    """What one built package is specialised for."""

    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: str  # "cpu" or "cuda"

    def spec(self) -> str:
        """The shape as a name part, e.g. ``3x3x64-b16-float32``."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.num_kv_heads}x{self.group}x{self.head_dim}-b{self.block_size}-{dtype}"

    def key(self) -> str:
        """File-name key: the shape, the kernel and torch versions, the CPU's vector ISA."""
        shape = self.spec()
        return package_key(
            f"paged-decode-{shape}-{self.device}", f"v{KERNEL_VERSION}-{shape}", self.device
        )


#: The engine's files whose code ends up in a compiled package (the exported modules and
#: the functions they call, the build and export settings): their text is part of every
#: package's key.
KERNEL_SOURCES = ("kernels.py", "glue.py", "rope.py", "kvcodec.py", "fused.py")


@functools.cache
def source_digest() -> str:
    """A digest of :data:`KERNEL_SOURCES`' text: any edit to them, even one that forgot
    to bump a version constant, gives every package a new key, so a cache kept across
    versions (a developer's, the test suite's) never serves a stale build."""
    digest = hashlib.sha256()
    for name in KERNEL_SOURCES:
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:16]


def package_key(name: str, spec: str, device: str) -> str:
    """``name-<digest>``, a package's file name: the digest covers ``spec`` (what the
    package is specialised for, with its code's version), the device, the CPU's vector
    ISA, torch's version and the kernels' source (:func:`source_digest`), so that a
    change to any of them builds a new package."""
    isa = torch.backends.cpu.get_cpu_capability() if device == "cpu" else "cuda"
    text = f"{spec}-{device}-{isa}-torch{torch.__version__}-src{source_digest()}"
    return f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def failure_reason(exc: BaseException) -> str:
    """One line naming why a build or load failed (type and first line of the message)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else 'no message'}"


def kernel_dir() -> Path:
    """Where built packages live: ``$HALFMOON_KERNEL_CACHE``, else
    ``$HALFMOON_CACHE/kernels`` (see ``catalog.cache_dir``)."""
    from halfmoon.engine.catalog import cache_dir

    return Path(os.environ.get("HALFMOON_KERNEL_CACHE") or cache_dir() / "kernels")


def example_inputs(shape: KernelShape) -> tuple[torch.Tensor, ...]:
    """The kernel's export inputs ``(q, keys, values, block_tables, context_lens, scale)``."""
    device = torch.device(shape.device)
    # Sizes of a typical decode step: inductor takes them as hints when it decides how to
    # split the loops over threads (tiny hints give a single-threaded kernel).
    num_seqs, max_blocks, num_blocks = 8, 32, 512
    pool = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    return (
        torch.randn(num_seqs, shape.num_kv_heads, shape.group, shape.head_dim).to(
            device, shape.dtype
        ),
        torch.randn(pool).to(device, shape.dtype),
        torch.randn(pool).to(device, shape.dtype),
        torch.randint(0, num_blocks, (num_seqs, max_blocks), device=device),
        torch.full((num_seqs,), max_blocks * shape.block_size, device=device),
        torch.tensor(shape.head_dim**-0.5, device=device),
    )


def export_and_compile(
    module: torch.nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    dynamic_shapes: tuple[dict[int, object], ...],
    path: Path,
    thread_hint: int | None = None,
) -> None:
    """Export ``module`` on ``example_inputs`` (their sizes are the compiler's hints) with
    the given dynamic dimensions and AOT-compile it into the package ``path`` (a ``.pt2``).

    ``thread_hint``: the thread count inductor plans its parallel loops for (default: the
    building process's); the threads used at run time are the caller's either way."""
    from torch._inductor import aoti_compile_and_package  # only to build: ~2 s to import

    with torch.no_grad(), warnings.catch_warnings():
        # torch's own deprecations inside export/inductor, not ours to act on.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.export.export(module, example_inputs, dynamic_shapes=dynamic_shapes)
        aoti_compile_and_package(
            program,
            package_path=str(path),
            # Threads: the caller's OpenMP count at run time, not the build's.
            inductor_configs={
                "cpp.dynamic_threads": True,
                "assert_indirect_indexing": False,
                "cpp.threads": thread_hint or -1,
            },
        )


def build_package(shape: KernelShape, path: Path) -> None:
    """Export and AOT-compile the kernel for ``shape`` into ``path`` (a ``.pt2``)."""
    dim = torch.export.Dim
    seqs, blocks, pool = dim("num_seqs", min=1), dim("max_blocks", min=1), dim("pool", min=1)
    dynamic = ({0: seqs}, {0: pool}, {0: pool}, {0: seqs, 1: blocks}, {0: seqs}, {})
    # Planned for many threads, inductor splits the loops over sequences and blocks, not
    # over sequences only: a batch of one then runs on every thread (batch 1 x 2,048 on 2
    # threads: 297 -> 208 us), larger batches unchanged.
    export_and_compile(PagedDecodeAttention(), example_inputs(shape), dynamic, path, 32)


@contextlib.contextmanager
def _locked(path: Path, wait: bool = True):
    """Hold the file lock ``path``; yields whether it is held (``wait=False``: False at
    once when another process holds it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


#: A package to build: its cache key and the function that builds it into a path.
PackageSpec = tuple[str, Callable[[Path], None]]


def _build_locked(path: Path, build: Callable[[Path], None]) -> None:
    """Build ``path`` unless it exists (the caller holds its lock): into a partial file
    first, so a crash leaves no half-written package under the real name."""
    if path.exists():
        return
    logger.info(
        "building the compiled package %s (once per model shape; 15-40 s on a small CPU)",
        path.name,
    )
    started = time.monotonic()
    partial = path.with_name(f"{path.stem}.{os.getpid()}.partial.pt2")
    try:
        build(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    logger.info("built %s in %.1f s", path.name, time.monotonic() - started)


def build_missing(specs: list[PackageSpec], directory: Path | None = None) -> None:
    """Build the packages of ``specs`` that are missing and that no other process is
    building now, in order, skipping those whose lock is held.

    Workers of one cluster start together and need the same packages: without this each
    waits for the first package while one process builds it, then for the second, so the
    builds run one after another (a build uses one core: 33 s for SmolLM2's four here).
    Called first, it has each process take a different package, so they build side by
    side; :func:`load_package` then waits for the rest. Raises what a build raises."""
    directory = directory or kernel_dir()
    for key, build in specs:
        path = directory / f"{key}.pt2"
        if path.exists():
            continue
        with _locked(directory / f"{key}.lock", wait=False) as held:
            if held:
                _build_locked(path, build)


DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor,
]


#: The first torch whose AOTI loader takes an unpacked package directory. On 2.11 (a GPU
#: machine, 2026-12-04) the directory failed ("failed finding central directory") and a
#: fallback to the archive crashed the process (SIGSEGV), so older torch runs the reference.
UNPACKED_LOADER_TORCH = (2, 13)


def loads_unpacked_packages() -> bool:
    """Whether this torch's AOTI loader takes a package directory (2.13 and later)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= UNPACKED_LOADER_TORCH


def load_package(
    key: str, build: Callable[[Path], None], directory: Path | None = None
) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    """The compiled package ``key`` from the cache (``directory``, else :func:`kernel_dir`),
    built first by ``build(path)`` when missing (one process builds, concurrent ones wait
    for it); returns its runner: a list of tensors in, a list out. Raises on any failure."""
    if not loads_unpacked_packages():
        raise RuntimeError(
            f"torch {torch.__version__} loads compiled packages from archives only; halfmoon "
            f"loads them unpacked, which needs torch {'.'.join(map(str, UNPACKED_LOADER_TORCH))}+"
        )
    directory = directory or kernel_dir()
    path = directory / f"{key}.pt2"
    unpacked = directory / f"{key}.d"
    if not unpacked.exists():
        with _locked(directory / f"{key}.lock"):
            _build_locked(path, build)
            _unpack_locked(path, unpacked)
    # The C++ loader directly, not ``torch._inductor.aoti_load_package``: importing
    # inductor costs ~2 s of every engine start, loading the package 10 ms. Its ``run``
    # skips the packaged model's Python argument checks (12 us a call against 40 us).
    # From the unpacked directory: given the archive, the loader extracts it into a new
    # /tmp/aotinductor_* for every process and removes that only if the process exits
    # cleanly; killed workers had left 6,000 of them (10 GB) there.
    return torch._C._aoti.AOTIModelPackageLoader(str(unpacked), "model", False, 1, -1).run


def _unpack_locked(path: Path, unpacked: Path) -> None:
    """Extract package ``path`` into directory ``unpacked`` unless it exists (the caller
    holds the package's lock): into a partial directory first, then renamed."""
    if unpacked.exists():
        return
    partial = unpacked.with_name(f"{unpacked.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with zipfile.ZipFile(path) as archive:
            archive.extractall(partial)
        os.replace(partial, unpacked)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def decode_kernel_spec(shape: KernelShape) -> PackageSpec:
    """The package of the decode kernel for ``shape`` (see :func:`build_missing`)."""
    return shape.key(), lambda path: build_package(shape, path)


def load_decode_kernel(shape: KernelShape, directory: Path | None = None) -> DecodeKernel:
    """The compiled kernel for ``shape``: loaded from the cache, built first when missing.
    Raises on any failure."""
    run = load_package(*decode_kernel_spec(shape), directory)

    def kernel(*args: torch.Tensor) -> torch.Tensor:
        return run(list(args))[0]

    return kernel


def uses_compiled(backend: str, device_type: str) -> bool:
    """Whether attention backend ``backend`` on ``device_type`` tries the compiled kernel
    (and its glue): ``compiled`` everywhere, ``auto`` on the CPU only."""
    return backend == "compiled" or (backend == "auto" and device_type == "cpu")


def select_decode_kernel(backend: str, shape: KernelShape) -> tuple[DecodeKernel | None, str]:
    """The decode-attention kernel ``backend`` asks for, and a one-line account of what
    was chosen: ``reference`` gives None (gather + SDPA); ``compiled`` the kernel or an
    error; ``auto`` on the CPU the kernel when it can be built or loaded, else None with
    the reason, and on a GPU None (until the kernel has run on one, ``compiled`` is
    the way to try it there).
    """
    check_attention_backend(backend)
    if backend == "reference":
        return None, "reference (gather + SDPA)"
    if not uses_compiled(backend, shape.device):
        # Inductor would build it through Triton, but no GPU has run it yet.
        return None, f"reference (the compiled kernel is not yet verified on {shape.device})"
    try:
        kernel = load_decode_kernel(shape)
    except Exception as exc:  # noqa: BLE001 - a compiler problem must not stop serving
        reason = failure_reason(exc)
        if backend == "compiled":
            raise HalfmoonError(f"the compiled attention kernel is unavailable: {reason}") from exc
        logger.warning("compiled decode attention unavailable (%s); using gather + SDPA", reason)
        return None, f"reference (compiled kernel unavailable: {reason})"
    return kernel, f"compiled ({shape.key()})"
