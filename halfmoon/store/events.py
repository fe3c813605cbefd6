"""Cache-state events a store emits (the vocabulary of :mod:`halfmoon.core.events`): the
Conductor's only view of what a worker holds.

The store calls its listener synchronously, after the operation that caused the event has
finished and with no store lock held, so a listener may call back into the store. The
worker forwards the events (adding its instance id) to the Conductor.
"""

from __future__ import annotations

from collections.abc import Callable

from halfmoon.core.events import TIER_DRAM as TIER_DRAM
from halfmoon.core.events import TIER_SSD as TIER_SSD
from halfmoon.core.events import TIERS as TIERS
from halfmoon.core.events import BlockEvicted, BlockStored

StoreEvent = BlockStored | BlockEvicted
#: A callback receiving every event, in the order the store produced them.
EventListener = Callable[[StoreEvent], None]
