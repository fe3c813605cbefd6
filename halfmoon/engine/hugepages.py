"""Transparent huge pages for torch's CPU memory (KV pool, packed weights, activations).

torch's CPU allocator backs each allocation of 2 MiB or more with transparent huge pages
(2 MiB-aligned and ``madvise(MADV_HUGEPAGE)``) when ``THP_MEM_ALLOC_ENABLE`` is set in
the environment. It reads the variable once, at its first such allocation, so it must be
set before a process allocates anything large. Decode steps that sweep the pool and the
weights then take fewer TLB misses: SmolLM2's steps at batch 8 and 32 ran 4-14% faster,
batch 1 unchanged, peak memory no higher (docs/engine.md, "Huge pages").

Every ``halfmoon`` command turns it on for itself and the processes it starts, unless the
environment already names a value (``THP_MEM_ALLOC_ENABLE=0`` keeps it off). Code that
builds an :class:`~halfmoon.engine.engine.LLMEngine` in its own process decides for
itself: call :func:`enable_by_default` first. Without kernel support
(``/sys/kernel/mm/transparent_hugepage/enabled`` set to ``never``) nothing changes.

Torch-free, so that the CLI can call it before anything imports torch.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

#: The variable torch's CPU allocator reads.
ENV = "THP_MEM_ALLOC_ENABLE"


def enable_by_default(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``THP_MEM_ALLOC_ENABLE=1`` unless ``environ`` (default: this process's)
    already names a value; whether huge pages are now asked for."""
    env = os.environ if environ is None else environ
    env.setdefault(ENV, "1")
    return requested(env)


def requested(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether ``environ`` asks torch for huge pages (a value other than empty or 0)."""
    env = os.environ if environ is None else environ
    return env.get(ENV, "").strip() not in ("", "0")


def resident_mib(pid: int | str = "self") -> float | None:
    """MiB of a process's memory in transparent huge pages (``AnonHugePages`` of
    ``/proc/PID/smaps_rollup``); None where the kernel does not report it."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None
