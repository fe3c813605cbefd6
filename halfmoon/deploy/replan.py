"""Re-planning on the Ray deployment: the gateway's :class:`~halfmoon.serve.launch.replan.
LiveReplanner` moves workers between pools through the deployment's controller.

:class:`PoolMover` asks the controller to resize both pools at once (one more worker of
the role that gains, one fewer of the role that loses): the controller starts the new
worker and drains the leaving one (the Conductor places nothing more on it; it exits
once its requests finish, :mod:`halfmoon.deploy.controller`). The move counts as in
progress until the Conductor lists the pools at their new sizes with nothing draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from halfmoon.serve.control.messages import WorkloadWindow

log = logging.getLogger("replan")


class PoolMover:
    """Moves workers between the deployment's pools (``scale``: the controller's resize
    call, ``{role: size}`` -> its reply; ``backend``: the gateway's cluster client)."""

    def __init__(self, scale: Callable[[dict[str, int]], Awaitable[dict[str, Any]]],
                 backend: Any, settle_timeout_s: float = 600.0) -> None:  # fmt: skip
        self.scale = scale
        self.backend = backend
        self.settle_timeout_s = settle_timeout_s
        self._task: asyncio.Task | None = None
        self.moves: list[dict[str, Any]] = []

    def moving(self) -> bool:
        """Whether the last move has not settled yet."""
        return self._task is not None and not self._task.done()

    async def move(self, from_role: str, to_role: str, count: int,
                   window: WorkloadWindow) -> list[str]:  # fmt: skip
        """Resize the pools by ``count`` workers from ``from_role`` to ``to_role``."""
        sizes = {"prefill": len(window.prefill), "decode": len(window.decode)}
        targets = {from_role: sizes[from_role] - count, to_role: sizes[to_role] + count}
        reply = await self.scale(targets)
        record = {"targets": targets, "at": time.time(), "reply": reply, "done": False}
        self.moves.append(record)
        log.info("re-plan: pools resized to %s (%s)", targets, reply)
        self._task = asyncio.get_running_loop().create_task(self._settle(targets, record))
        return list(reply.get("draining", []))

    async def _settle(self, targets: dict[str, int], record: dict[str, Any]) -> None:
        deadline = time.monotonic() + self.settle_timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                window = await self.backend.workload_window(1.0)
                sizes = {"prefill": len(window.prefill), "decode": len(window.decode)}
                if sizes == targets and not window.draining:
                    record["done"] = True
                    return
            await asyncio.sleep(0.5)
        log.error("pools not at %s after %gs", targets, self.settle_timeout_s)
