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
size, block size, dtype, device) and torch version, kept in the package cache
(:mod:`halfmoon.engine.packages`, under ``$HALFMOON_CACHE/kernels/``); batch size, blocks
per sequence and pool size stay dynamic. Building takes 15-40 s on 2 CPU cores, once per
shape; loading a built package takes milliseconds. The shape is static because dynamic
inner sizes cost the generated loops their vectorization (measured 2-5x slower). This
module also names packages (:func:`package_key`: their spec, torch, the CPU and a digest
of the sources that go into them) and holds what every compiled piece (this kernel, the
glue, the fused decode call, the KV codecs) is made from (:class:`Recipe`) and how: a
package built ahead of time, or, where torch cannot load packages as halfmoon does
(before 2.13) or ``HALFMOON_COMPILE=jit`` asks, the same recipe under ``torch.compile``
in the process (:func:`compile_mode`, :class:`CompiledPiece`).

Measured on 2 CPU cores (SmolLM2's shape, contexts 512 and 2,048, batch 1-32): 1.3-6x
faster than gather + SDPA; results differ from it by float32 rounding (~1e-7).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.config import check_attention_backend
from halfmoon.engine.packages import (
    PackageSpec,
    failure_reason,
    load_package,
    loads_unpacked_packages,
)

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


@dataclass(frozen=True)
class Recipe:
    """What one piece of compiled code is made from: ``module`` run on ``example_inputs``
    (their sizes are the compiler's hints), the dimensions of each input that stay
    dynamic (``{index: torch.export.Dim}``, one dict per input) and the thread count
    inductor plans its parallel loops for (None: the building process's; the threads
    used at run time are the caller's either way)."""

    module: torch.nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    dynamic_shapes: tuple[dict[int, object], ...]
    thread_hint: int | None = None


def inductor_options(thread_hint: int | None) -> dict[str, object]:
    """The inductor settings every piece is compiled with, ahead of time or in process."""
    return {
        # Threads: the caller's OpenMP count at run time, not the build's.
        "cpp.dynamic_threads": True,
        # No bounds check on indexed loads (a test per vector in the inner loop, 2x
        # slower): the engine's block tables and slots hold valid pool positions only.
        "assert_indirect_indexing": False,
        "cpp.threads": thread_hint or -1,
        # In bfloat16 / float16, round every intermediate the eager ops round (inductor
        # would keep fused intermediates in float32): the compiled pieces then compute
        # what the eager reference does, so a low-precision model's greedy tokens do not
        # hinge on which path ran (SmolLM2 in bfloat16: "The" and "L" tied otherwise).
        # No effect in float32.
        "emulate_precision_casts": True,
    }


def export_and_compile(recipe: Recipe, path: Path) -> None:
    """Export ``recipe``'s module with its dynamic dimensions and AOT-compile it into the
    package ``path`` (a ``.pt2``)."""
    from torch._inductor import aoti_compile_and_package  # only to build: ~2 s to import

    with torch.no_grad(), warnings.catch_warnings():
        # torch's own deprecations inside export/inductor, not ours to act on.
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        program = torch.export.export(
            recipe.module, recipe.example_inputs, dynamic_shapes=recipe.dynamic_shapes
        )
        aoti_compile_and_package(
            program,
            package_path=str(path),
            inductor_configs=inductor_options(recipe.thread_hint),
        )


#: A compiled piece's runner: its inputs as a list in, its outputs as a list out.
Runner = Callable[[list[torch.Tensor]], list[torch.Tensor]]

#: ``$HALFMOON_COMPILE``'s values (see :func:`compile_mode`).
COMPILE_MODES = ("auto", "aot", "jit")


def compile_mode() -> str:
    """How compiled pieces are made, from ``$HALFMOON_COMPILE``: ``aot``, packages built
    ahead of time into the cache and loaded from it; ``jit``, ``torch.compile`` in the
    process (nothing in the package cache; a compile, seconds, in every process that loads
    it, sped up by inductor's own cache in ``$TMPDIR``); ``auto`` (the
    default), ``aot`` where this torch loads packages as halfmoon does (2.13+) and
    ``jit`` on an older one (GPU machines' own torch, 2.11 on the one lent so far)."""
    mode = os.environ.get("HALFMOON_COMPILE", "auto") or "auto"
    if mode not in COMPILE_MODES:
        raise HalfmoonError(f"HALFMOON_COMPILE={mode!r} is not one of {', '.join(COMPILE_MODES)}")
    if mode == "auto":
        return "aot" if loads_unpacked_packages() else "jit"
    return mode


#: The recompiles per code object torch allows once a piece is compiled in process.
RECOMPILE_LIMIT = 64


def compile_in_process(recipe: Recipe) -> Runner:
    """``recipe``'s module under ``torch.compile`` (the same inductor settings as a
    package), compiled now on its example inputs with the package's dynamic dimensions
    marked, so that a failure shows here as a package's would at its load. Other sizes
    recompile once where torch specialises them (a batch of one)."""
    import torch._dynamo
    from torch._inductor import config as inductor_config

    known = inductor_config.get_config_copy()
    options = {k: v for k, v in inductor_options(recipe.thread_hint).items() if k in known}
    # Pieces of one kind share their module's code object, and torch counts recompiles
    # per code object: every shape a process compiles the kernel for (and a batch of one
    # for each) counts against one limit, 8 by default, past which a full-graph compile
    # fails. Raised for the process (a test process compiles a dozen shapes).
    dynamo = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the name before torch 2.6
        if hasattr(dynamo, name):
            setattr(dynamo, name, max(getattr(dynamo, name), RECOMPILE_LIMIT))
            break
    compiled = torch.compile(recipe.module, fullgraph=True, options=options)

    def run(args: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            out = compiled(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]

    inputs = [t.clone() for t in recipe.example_inputs]
    for tensor, dims in zip(inputs, recipe.dynamic_shapes, strict=True):
        for index in dims:
            torch._dynamo.mark_dynamic(tensor, index)
    with warnings.catch_warnings():
        # torch's own deprecations inside its compiler, not ours to act on.
        warnings.simplefilter("ignore", DeprecationWarning)
        run(inputs)
    return run


#: Pieces compiled in this process, by key (:meth:`CompiledPiece.load`).
_IN_PROCESS: dict[str, Runner] = {}
_IN_PROCESS_LOCK = threading.Lock()


@dataclass(frozen=True)
class CompiledPiece:
    """One piece of compiled code (the decode kernel, a glue step, the fused decode
    call, a KV codec): its package key, its recipe, and optionally its own build (a
    package of the recipe when None). :meth:`load` makes it as :func:`compile_mode`
    says."""

    key: str
    recipe: Callable[[], Recipe]
    build: Callable[[Path], None] | None = None

    def package(self) -> PackageSpec:
        """The package to build ahead of time (see :func:`packages.build_missing`)."""
        return self.key, self.build or (lambda path: export_and_compile(self.recipe(), path))

    def load(self, directory: Path | None = None) -> Runner:
        """The runner: the package from the cache (built first when missing), or the
        recipe compiled in this process (once per process and key: every engine of the
        process shares it, and with it torch's compiled code). Raises on any failure."""
        if compile_mode() != "jit":
            return load_package(*self.package(), directory)
        with _IN_PROCESS_LOCK:
            run = _IN_PROCESS.get(self.key)
            if run is None:
                run = _IN_PROCESS[self.key] = compile_in_process(self.recipe())
        return run

    def load_function(self, directory: Path | None = None) -> Callable[..., torch.Tensor]:
        """:meth:`load` for a piece with one output, as a function of its inputs."""
        run = self.load(directory)

        def function(*args: torch.Tensor) -> torch.Tensor:
            return run(list(args))[0]

        return function


def decode_recipe(shape: KernelShape) -> Recipe:
    """The decode kernel of ``shape``: its example inputs and dynamic dimensions."""
    dim = torch.export.Dim
    seqs, blocks, pool = dim("num_seqs", min=1), dim("max_blocks", min=1), dim("pool", min=1)
    dynamic = ({0: seqs}, {0: pool}, {0: pool}, {0: seqs, 1: blocks}, {0: seqs}, {})
    # Planned for many threads, inductor splits the loops over sequences and blocks, not
    # over sequences only: a batch of one then runs on every thread (batch 1 x 2,048 on 2
    # threads: 297 -> 208 us), larger batches unchanged.
    return Recipe(PagedDecodeAttention(), example_inputs(shape), dynamic, 32)


def build_package(shape: KernelShape, path: Path) -> None:
    """Export and AOT-compile the kernel for ``shape`` into ``path`` (a ``.pt2``)."""
    export_and_compile(decode_recipe(shape), path)


DecodeKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor,
]


def decode_kernel_piece(shape: KernelShape) -> CompiledPiece:
    """The decode kernel of ``shape`` as a compiled piece."""
    return CompiledPiece(
        shape.key(), lambda: decode_recipe(shape), lambda path: build_package(shape, path)
    )


def decode_kernel_spec(shape: KernelShape) -> PackageSpec:
    """The package of the decode kernel for ``shape`` (see
    :func:`halfmoon.engine.packages.build_missing`)."""
    return decode_kernel_piece(shape).package()


def load_decode_kernel(shape: KernelShape, directory: Path | None = None) -> DecodeKernel:
    """The compiled kernel for ``shape``: loaded from the cache (built first when
    missing) or compiled in process, as :func:`compile_mode` says. Raises on any failure."""
    return decode_kernel_piece(shape).load_function(directory)


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
    how = "compiled in process" if compile_mode() == "jit" else "compiled"
    return kernel, f"{how} ({shape.key()})"
