"""Keeping the cyclic garbage collector's full collections short in long-running processes."""

from __future__ import annotations

import gc


def settle_gc() -> None:
    """Call once start-up is done: collect, then move every object that exists now (the
    model, imported modules, the tokenizer, the web framework) out of the cyclic garbage
    collector's reach (:func:`gc.freeze`). A full collection while serving then scans
    only what serving created.

    Without it a full collection took 100-230 ms in the gateway and in the workers (tiny
    preset, measured), and every token stream of that process stalled for as long: a TBT
    spike that no model of the engine predicts. In a transfer peer holding a store, full
    collections of 10-25 ms fell inside batched puts (a 1,024-block put of 4 KiB blocks
    took 14-22 ms instead of 8-12).
    """
    gc.collect()
    gc.freeze()
