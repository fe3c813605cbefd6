"""vLLM's ``POST /start_profile`` and ``POST /stop_profile`` over a cluster, served when
the server has a profiler config (``halfmoon serve --profiler-config``, vLLM's flag;
halfmoon.core.profiling).

- ``/start_profile`` (optional body, vLLM's: ``profile_prefix``, ``delay_iterations``,
  ``max_iterations``): every worker records its engine's coming steps with torch's
  profiler (all or none). A start while profiling changes nothing, as on vLLM.
- ``/stop_profile``: every worker ends its session and writes one Chrome trace into the
  config's directory (on its own host), named ``<prefix>.<worker>.<time>.pt.trace.json.gz``;
  the answer lists them by worker (a session that reached its ``max_iterations`` wrote
  its trace then, listed here too). A stop while not profiling changes nothing.

A worker that restarts meanwhile starts without a session; one that joins (a re-plan's
new worker) too, until the next start.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.profiling import ProfilerConfig, parse_profile_session
from halfmoon.serve.gateway.backend import BackendError, BackendRefused
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.responses import HTTPError

log = logging.getLogger(__name__)


class StartProfileRequest(BaseModel):
    """vLLM's ``/start_profile`` body (every field optional; others ignored): the traces'
    file-name prefix (1-128 ASCII letters, digits, ``.``, ``_``, ``-``, starting with a
    letter or digit), the engine steps to skip before recording and the most recorded
    (0: until ``/stop_profile``); unset, the server's ``--profiler-config`` says."""

    model_config = ConfigDict(extra="ignore", strict=True)
    profile_prefix: str | None = None
    delay_iterations: int | None = None
    max_iterations: int | None = None


def profiler_router(gw: Gateway, config: ProfilerConfig) -> APIRouter:
    """The profiler's routes over ``gw``'s cluster, writing as ``config`` says."""
    router = APIRouter()
    lock = asyncio.Lock()  # (one start or stop at a time)

    def operation(name: str) -> Any:
        found = getattr(gw.backend, name, None)
        if found is None:
            raise HTTPError(400, "this server's backend has no profiler", "BadRequestError")
        return found

    @router.post("/start_profile")
    async def start_profile(body: StartProfileRequest | None = None) -> dict[str, Any]:
        """Every worker records its engine's coming steps with torch's profiler."""
        try:
            session = parse_profile_session(None if body is None else body.model_dump())
        except HalfmoonError as exc:
            raise HTTPError(400, str(exc), "BadRequestError") from None
        async with lock:
            try:
                workers = await operation("start_profile")(config, session)
            except BackendRefused as exc:
                raise HTTPError(400, str(exc), "BadRequestError") from None
            except BackendError as exc:
                raise HTTPError(503, f"the profiler did not start: {exc}",
                                "ServiceUnavailable") from None  # fmt: skip
        log.info("profiling %s into %s", ", ".join(workers), config.torch_profiler_dir)
        return {"status": "profiling", "workers": workers}

    @router.post("/stop_profile")
    async def stop_profile() -> dict[str, Any]:
        """Every worker ends its session and writes its trace; the traces by worker."""
        async with lock:
            try:
                traces, errors = await operation("stop_profile")()
            except BackendError as exc:
                raise HTTPError(503, f"the profiler did not stop: {exc}",
                                "ServiceUnavailable") from None  # fmt: skip
        for instance, error in errors.items():
            log.warning("the profiler of %s did not stop cleanly: %s", instance, error)
        written = {i: t for i, t in traces.items() if t}
        if written:
            log.info(
                "profiler traces written: %s", "; ".join(p for t in written.values() for p in t)
            )
        return {"status": "stopped", "traces": written, "errors": errors}

    return router
