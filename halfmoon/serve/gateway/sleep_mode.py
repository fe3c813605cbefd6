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
- SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` (``tags``:
  ``weights``, ``kv_cache``, ``cuda_graph``; none: all), what RL frameworks driving SGLang
  call: a release pauses generation (running requests finish first; new ones wait) and
  releases the KV pools with ``kv_cache``; the resume that wakes the last of them resumes
  generation, unless it was paused before the release (``/pause_generation``: then
  ``/continue_generation`` does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from halfmoon.serve.gateway.backend import BackendError, BackendRefused
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.responses import HTTPError

log = logging.getLogger(__name__)
#: What sleeps at level 1, and what ``/wake_up`` may name.
MEMORY_TAGS = ("weights", "kv_cache")
WAKE_TAGS = (*MEMORY_TAGS, "scheduling")
#: What SGLang's ``/release_memory_occupation`` and ``/resume_memory_occupation`` may name.
OCCUPATION_TAGS = (*MEMORY_TAGS, "cuda_graph")


class SleepMode:
    """The cluster's sleep state as this gateway drives it."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        #: The memory tags asleep (level 1: both), kept on the gateway (``/resume``
        #: refuses while any is).
        self.asleep: set[str] = gw.memory_asleep
        self._lock = asyncio.Lock()
        #: A release paused generation (it was not paused before): the resume that wakes
        #: the last memory resumes it.
        self._resume_when_awake = False

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
            return await self._pause_and_release(mode, set(MEMORY_TAGS) if level == 1 else set())

    async def _pause_and_release(self, mode: str, tags: set[str]) -> int:
        """Pause generation (``mode``), then release the memory ``tags`` names
        (``kv_cache``: every worker's KV pool, :meth:`ClusterOperations.sleep_workers`);
        the bytes released. A failure leaves the cluster awake, and as paused as it was
        before. Called under the lock."""
        was_paused = self.gw.paused
        release = None
        if "kv_cache" in tags and "kv_cache" not in self.asleep:
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
        self.asleep.update(tags & set(MEMORY_TAGS))
        self._resume_when_awake |= not was_paused
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
        wake = _chosen(tags, WAKE_TAGS, "wake-up")
        async with self._lock:
            await self._wake(wake)
            if self.asleep:
                return False
            self._resume_when_awake = False
            self.gw.resume()
            return True

    async def _wake(self, tags: set[str]) -> None:
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            await self._ops("wake_workers")()
        self.asleep.difference_update(tags)

    async def release_occupation(self, tags: list[str] | None) -> int:
        """SGLang's ``/release_memory_occupation``: generation paused (running requests
        finish first), then ``tags`` released (None: all; ``kv_cache``: every worker's KV
        pool, as at sleep level 1; ``weights`` stay in place, as there); the bytes freed."""
        release = _chosen(tags, OCCUPATION_TAGS, "memory occupation")
        async with self._lock:
            return await self._pause_and_release("wait", release)

    async def resume_occupation(self, tags: list[str] | None) -> bool:
        """SGLang's ``/resume_memory_occupation``: ``tags`` back (None: all); generation
        resumes once nothing sleeps, if a release paused it. Whether all is awake."""
        resume = _chosen(tags, OCCUPATION_TAGS, "memory occupation")
        async with self._lock:
            await self._wake(resume)
            if self.asleep:
                return False
            if self._resume_when_awake:
                self._resume_when_awake = False
                self.gw.resume()
            return True


def _chosen(tags: list[str] | None, known: tuple[str, ...], what: str) -> set[str]:
    """``tags`` as a set (None: all of ``known``); a 400 naming any unknown one."""
    unknown = sorted(set(tags or ()) - set(known))
    if unknown:
        raise HTTPError(400, f"unknown {what} tags {unknown}: use {', '.join(known)}",
                        "BadRequestError", param="tags")  # fmt: skip
    return set(known if tags is None else tags)


class OccupationRequest(BaseModel):
    """The body of SGLang's ``/release_memory_occupation`` and
    ``/resume_memory_occupation``: the tags (none: all)."""

    model_config = ConfigDict(extra="ignore")
    tags: list[str] | None = None


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

    async def release_memory_occupation(body: OccupationRequest | None = None) -> dict[str, Any]:
        """SGLang's: pause generation, then release the memory of the ``tags`` given."""
        tags = None if body is None else body.tags
        freed = await answered(state.release_occupation(tags))
        return {"status": "released", "tags": tags, "released_bytes": freed}

    async def resume_memory_occupation(body: OccupationRequest | None = None) -> dict[str, Any]:
        """SGLang's: the memory of the ``tags`` given back."""
        tags = None if body is None else body.tags
        awake = await answered(state.resume_occupation(tags))
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    for route in (release_memory_occupation, resume_memory_occupation):
        for method in ("GET", "POST"):  # (SGLang takes both)
            router.add_api_route(f"/{route.__name__}", route, methods=[method],
                                 operation_id=f"{route.__name__}_{method.lower()}")  # fmt: skip

    @router.post("/release_kv_cache_memory")
    async def release_kv_cache_memory() -> dict[str, str]:
        """Release every worker's KV pool (generation paused already)."""
        await answered(state.release_kv_cache())
        return {"status": "kv_cache_released"}

    return router
