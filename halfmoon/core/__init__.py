"""L0: ids, requests, chained block hashing, eviction policies, config dataclasses, clocks.

Stdlib + numpy + xxhash only; every other layer may import from here.
"""

from halfmoon.core.clock import Clock, ManualClock, WallClock
from halfmoon.core.hashing import NONE_HASH, BlockHashes, chain_root, hash_blocks
from halfmoon.core.ids import IdGenerator
from halfmoon.core.request import Request, SamplingParams

__all__ = [
    "NONE_HASH",
    "BlockHashes",
    "Clock",
    "IdGenerator",
    "ManualClock",
    "Request",
    "SamplingParams",
    "WallClock",
    "chain_root",
    "hash_blocks",
]
