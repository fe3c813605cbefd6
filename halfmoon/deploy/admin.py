"""The gateway's admin routes of a Ray deployment (mounted under ``/admin``; the gateway
lets them through only with the API key).

- ``POST /admin/scale`` ``{"prefill": N, "decode": M}`` (or ``{"instances": K}`` for a
  coupled deployment): resize pools; new workers join, removed ones drain first. Answers
  with the plan (``added``, ``draining``) and the pool sizes.
- ``GET /admin/status``: the controller's view (workers, nodes, states).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from halfmoon.core.errors import HalfmoonError
from halfmoon.serve.gateway.openai_api import error_body

Call = Callable[..., Awaitable[dict[str, Any]]]


class ScaleRequest(BaseModel):
    """Target sizes; pools not named keep their size."""

    model_config = ConfigDict(extra="forbid")
    prefill: int | None = Field(None, ge=1, le=1024)
    decode: int | None = Field(None, ge=1, le=1024)
    instances: int | None = Field(None, ge=1, le=1024, description="coupled workers")

    def targets(self) -> dict[str, int]:
        """{role: size} of the pools named."""
        named = {"prefill": self.prefill, "decode": self.decode, "coupled": self.instances}
        return {role: n for role, n in named.items() if n is not None}


def admin_router(scale: Call, status: Call) -> APIRouter:
    """Routes that resize the deployment through ``scale(targets)`` and report
    ``status()`` (both coroutines; a HalfmoonError becomes HTTP 400 with its message)."""
    router = APIRouter()

    @router.post("/scale")
    async def post_scale(body: ScaleRequest) -> JSONResponse:
        targets = body.targets()
        if not targets:
            return JSONResponse(error_body("name at least one pool size", "BadRequestError", 400),
                                status_code=400)  # fmt: skip
        try:
            return JSONResponse(await scale(targets))
        except (HalfmoonError, ValueError) as exc:
            return JSONResponse(error_body(str(exc), "BadRequestError", 400), status_code=400)

    @router.get("/status")
    async def get_status() -> JSONResponse:
        try:
            return JSONResponse(await status())
        except HalfmoonError as exc:
            return JSONResponse(error_body(str(exc), "ServiceUnavailable", 503), status_code=503)

    return router
