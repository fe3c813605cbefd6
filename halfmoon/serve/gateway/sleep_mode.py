"""vLLM's sleep mode over a cluster (``POST /sleep``, ``POST /wake_up``, ``GET
/is_sleeping``, ``POST /release_kv_cache_memory``; served, as by vLLM, under its
development switch ``VLLM_SERVER_DEV_MODE=1``), what an RL trainer sharing the machines
with the server drives between rollouts.

- ``/sleep?level=0``: generation pauses (``mode``: ``abort`` the running requests, or
  ``wait`` for them, as ``/pause``); new requests wait.
- ``/sleep?level=1`` (the default): paused, then every worker forgets its cached
  prefixes and releases its KV pool's memory (the Conductor hears the evictions; the
  block stores keep their blocks). All or none. The weights stay in place: on vLLM they
  move to host memory, which is where this server keeps them on a CPU (on a GPU they stay
  on it). ``level=2`` (the weights discarded too) is a 400.
- ``/wake_up`` (``tags``: ``weights``, ``kv_cache``, ``scheduling``; none: all): the KV
  pools come back with ``kv_cache``; generation resumes once neither ``weights`` nor
  ``kv_cache`` sleeps (``{"status": "awake"}``; else ``"sleeping"``), as vLLM's
  partial wake-ups (a trainer wakes ``weights``, loads new ones, then ``kv_cache``).
- ``/is_sleeping``: paused or any memory asleep, as vLLM's.
- ``/release_kv_cache_memory``: after a ``/pause``, the KV pools alone released (woken
  with ``kv_cache``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from halfmoon.serve.gateway.backend import BackendError, BackendRefused
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.responses import HTTPError

log = logging.getLogger(__name__)
#: What sleeps at level 1, and what ``/wake_up`` may name.
MEMORY_TAGS = ("weights", "kv_cache")
WAKE_TAGS = (*MEMORY_TAGS, "scheduling")


class SleepMode:
    """The cluster's sleep state as this gateway drives it."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        #: The memory tags asleep (level 1: both), kept on the gateway (``/resume``
        #: refuses while any is).
        self.asleep: set[str] = gw.memory_asleep
        self._lock = asyncio.Lock()

    @property
    def sleeping(self) -> bool:
        """vLLM's ``is_sleeping``: generation paused, or any memory asleep."""
        return self.gw.paused or bool(self.asleep)

    def _ops(self, name: str) -> Callable[[], Awaitable[Any]]:
        operation = getattr(self.gw.backend, name, None)
        if operation is None:
            raise BackendRefused("this server's backend has no sleep mode")
        return operation

    async def sleep(self, level: int, mode: str) -> int:
        """Pause generation (``mode``), and at level 1 release every worker's KV pool
        (:meth:`ClusterOperations.sleep_workers`); the bytes released. A failed sleep
        leaves the cluster awake, and as paused as it was before."""
        if level not in (0, 1):
            raise HTTPError(400, f"sleep level {level}: this server sleeps at level 0 (paused) "
                            "or 1 (paused, KV pools released; the weights stay); level 2, "
                            "which discards the weights, is not supported", "BadRequestError",
                            param="level")  # fmt: skip
        async with self._lock:
            was_paused = self.gw.paused
            release = None
            if level == 1 and "kv_cache" not in self.asleep:
                release = self._ops("sleep_workers")
            await self.gw.pause(mode)
            freed = 0
            if release is not None:
                try:
                    freed = await release()
                except BaseException:
                    if not was_paused:
                        self.gw.resume()
                    raise
                log.info("asleep: %.1f MiB of KV pools released", freed / 2**20)
            if level == 1:
                self.asleep.update(MEMORY_TAGS)
            return freed

    async def release_kv_cache(self) -> int:
        """vLLM's ``/release_kv_cache_memory``: the KV pools released, generation being
        paused already (a 400 otherwise); the bytes released."""
        async with self._lock:
            if not self.gw.paused:
                raise HTTPError(400, "the KV cache is released once generation is paused "
                                "(POST /pause or /sleep first)", "BadRequestError")  # fmt: skip
            if "kv_cache" in self.asleep:
                return 0
            freed = await self._ops("sleep_workers")()
            self.asleep.add("kv_cache")
            return freed

    async def wake_up(self, tags: list[str] | None) -> bool:
        """Wake ``tags`` (None: all); whether fully awake (generation resumed then)."""
        unknown = sorted(set(tags or ()) - set(WAKE_TAGS))
        if unknown:
            raise HTTPError(400, f"unknown wake-up tags {unknown}: use {', '.join(WAKE_TAGS)}",
                            "BadRequestError", param="tags")  # fmt: skip
        wake = set(WAKE_TAGS if tags is None else tags)
        async with self._lock:
            if "kv_cache" in wake and "kv_cache" in self.asleep:
                await self._ops("wake_workers")()
            self.asleep.difference_update(wake)
            if self.asleep:
                return False
            self.gw.resume()
            return True


def sleep_router(gw: Gateway) -> APIRouter:
    """The sleep-mode routes over ``gw`` (mounted with vLLM's development endpoints)."""
    router = APIRouter()
    state = SleepMode(gw)

    async def answered(call: Awaitable[Any]) -> Any:
        try:
            return await call
        except BackendRefused as exc:
            raise HTTPError(400, str(exc), "BadRequestError") from None
        except BackendError as exc:
            raise HTTPError(503, f"sleep mode failed: {exc}", "ServiceUnavailable") from None

    @router.post("/sleep")
    async def sleep(level: int = 1, mode: str = "abort") -> dict[str, Any]:
        """Pause generation (``mode`` ``abort`` or ``wait``); at ``level`` 1 every worker
        also releases its KV pool."""
        if mode not in ("abort", "wait"):
            raise HTTPError(400, f"mode {mode!r}: this server sleeps with 'abort' or 'wait'",
                            "BadRequestError", param="mode")  # fmt: skip
        await answered(state.sleep(level, mode))
        return {"status": "sleeping", "level": level}

    @router.post("/wake_up")
    async def wake_up(request: Request) -> dict[str, Any]:
        """Wake the ``tags`` given (repeated query parameter; none: all)."""
        tags = request.query_params.getlist("tags") or None
        awake = await answered(state.wake_up(tags))
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    @router.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        """Whether generation is paused or any memory asleep."""
        return {"is_sleeping": state.sleeping}

    @router.post("/release_kv_cache_memory")
    async def release_kv_cache_memory() -> dict[str, str]:
        """Release every worker's KV pool (generation paused already)."""
        await answered(state.release_kv_cache())
        return {"status": "kv_cache_released"}

    return router
