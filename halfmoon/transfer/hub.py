"""The in-process transport's registry: which engine in this process owns an endpoint."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from halfmoon.transfer.errors import TransferError

if TYPE_CHECKING:
    from halfmoon.transfer.server import TransferServer


class InProcessHub:
    """Pass one hub to every engine of a test; ``inproc`` peers find each other here."""

    def __init__(self) -> None:
        self._servers: dict[str, TransferServer] = {}
        self._lock = threading.Lock()

    def add(self, endpoint: str, server: TransferServer) -> None:
        """Make ``server`` reachable as ``endpoint``."""
        with self._lock:
            self._servers[endpoint] = server

    def remove(self, endpoint: str) -> None:
        """Forget ``endpoint`` (its engine closed)."""
        with self._lock:
            self._servers.pop(endpoint, None)

    def get(self, endpoint: str) -> TransferServer:
        """The server behind ``endpoint``; :class:`TransferError` when not in this process."""
        with self._lock:
            server = self._servers.get(endpoint)
        if server is None:
            raise TransferError(f"no in-process peer at {endpoint}")
        return server
