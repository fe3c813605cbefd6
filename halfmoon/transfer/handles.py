"""Client-side completion handles: wait, poll, cancel, callbacks."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from halfmoon.transfer.errors import TransferTimeout


@dataclass(frozen=True)
class TransferResult:
    """A finished push or put: how much moved and how long it took."""

    transfer_id: str
    num_blocks: int
    num_bytes: int
    elapsed_s: float


class TransferHandle:
    """An in-flight transfer. ``wait`` returns its result or raises its error."""

    def __init__(
        self, transfer_id: str, future: Future[TransferResult], cancel_event: threading.Event
    ) -> None:
        self.transfer_id = transfer_id
        self._future = future
        self._cancel_event = cancel_event

    def wait(self, timeout_s: float | None = None) -> TransferResult:
        """Block until done; :class:`TransferTimeout` if still running after ``timeout_s``."""
        try:
            return self._future.result(timeout_s)
        except FutureTimeout:
            raise TransferTimeout(
                f"transfer {self.transfer_id} still running after {timeout_s} s"
            ) from None

    def done(self) -> bool:
        """Whether it finished (successfully or not)."""
        return self._future.done()

    def cancel(self) -> None:
        """Stop sending at the next frame boundary; ``wait`` then raises ``TransferCancelled``."""
        self._cancel_event.set()

    def add_done_callback(self, callback: Callable[[TransferHandle], None]) -> None:
        """Call ``callback(handle)`` once done (immediately if already done)."""
        self._future.add_done_callback(lambda _future: callback(self))
