"""Client-side completion handles: wait, poll, cancel, callbacks."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from halfmoon.transfer.errors import TransferTimeout


class CancelFlag:
    """Says a batch should stop at its next frame boundary; set from any thread, polled
    by the batch's connection threads. (A ``threading.Event`` costs ~2 us to make, a
    tenth of a one-block push's own work; nobody waits on this one.)"""

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        """Ask the batch to stop."""
        self._set = True

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._set


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
        self, transfer_id: str, future: Future[TransferResult], cancel_event: CancelFlag
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
