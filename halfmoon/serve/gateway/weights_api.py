"""Weight updates while serving, as RL trainers drive SGLang's and vLLM's servers:
``POST /update_weights_from_disk`` (SGLang's: a new checkpoint installed on every worker,
all or none, and every block of KV computed with the old weights forgotten, cluster-wide),
``POST /update_weight_version`` (both servers': a new version label), ``GET /weight_info``
(vLLM's: the label), SGLang's ``/pause_generation`` / ``/continue_generation`` and its
``/flush_cache`` (every cached prefix forgotten, pools and block stores).
Served only under ``VLLM_SERVER_DEV_MODE=1``, with vLLM's other RL controls
(:attr:`~halfmoon.serve.gateway.config.GatewayConfig.dev_endpoints`): changing what a
server computes is an operator's act.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from halfmoon.serve.gateway.backend import BackendError
from halfmoon.serve.gateway.gateway import Gateway
from halfmoon.serve.gateway.responses import HTTPError

log = logging.getLogger(__name__)

#: ``load_format`` values meaning an HF-format checkpoint (safetensors), what is read here.
LOAD_FORMATS = (None, "auto", "safetensors")


class UpdateWeightsFromDiskRequest(BaseModel):
    """The body of SGLang's ``/update_weights_from_disk`` (fields of SGLang's that do not
    apply on this server, such as ``recapture_cuda_graph``, are taken and ignored)."""

    model_config = ConfigDict(extra="ignore")

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    keep_pause: bool = False
    is_async: bool = False
    torch_empty_cache: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    manifest: dict[str, Any] | None = None


class UpdateWeightsResponse(BaseModel):
    """SGLang's answer to ``/update_weights_from_disk`` (400 with ``success`` false when
    the update failed and the old weights still serve)."""

    success: bool
    message: str
    num_paused_requests: int


class UpdateWeightVersionRequest(BaseModel):
    """The body of ``/update_weight_version`` (vLLM's and SGLang's; SGLang aborts running
    requests unless told not to, vLLM never does: here only when asked)."""

    new_version: str
    abort_all_requests: bool = False


class PauseGenerationRequest(BaseModel):
    """The body of SGLang's ``/pause_generation``."""

    mode: str = "abort"


async def forget_cached_prefixes(gw: Gateway, external: bool, what: str) -> dict[str, str]:
    """Have every worker forget its cached prefixes (``external``: its block store's
    too): per instance, why not ("" where all went); an HTTPError where the server
    cannot (400) or the cluster does not answer (503), ``what`` naming the operation."""
    reset = getattr(gw.backend, "reset_prefix_cache", None)
    if reset is None:
        raise HTTPError(400, f"this server cannot reset its prefix cache ({what})",
                        "BadRequestError")  # fmt: skip
    try:
        return await reset(external)
    except BackendError as exc:
        raise HTTPError(503, f"{what}: {exc}", "ServiceUnavailable") from None


def _refusal(body: UpdateWeightsFromDiskRequest) -> str | None:
    """Why this server cannot do what ``body`` asks (None: it can)."""
    if not body.model_path.strip():
        return "model_path is empty"
    if body.load_format not in LOAD_FORMATS:
        return (f"load_format {body.load_format!r}: this server reads HF-format checkpoints "
                "(safetensors: 'auto' or 'safetensors')")  # fmt: skip
    if not body.flush_cache:
        return ("flush_cache false is not supported: KV cached with the old weights would "
                "answer requests under the new ones")  # fmt: skip
    if body.manifest is not None:
        return "manifest is not supported: the checkpoint's own files say what it holds"
    return None


def weights_router(gw: Gateway) -> APIRouter:
    """The weight-update routes over ``gw`` (see the module docstring)."""
    router = APIRouter()

    @router.post("/update_weights_from_disk", response_model=UpdateWeightsResponse)
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest) -> JSONResponse:
        """Install the checkpoint at ``model_path`` (an HF-format directory on every
        worker's host, the served model's architecture) on every worker, all or none:
        generation pauses meanwhile (running requests finish first, or end with
        ``abort_all_requests``), then every worker's cached KV is forgotten. SGLang's
        answer: ``success``, ``message``, ``num_paused_requests`` (400 when it failed)."""
        refusal = _refusal(body)
        if refusal is not None:
            raise HTTPError(400, refusal, "BadRequestError")
        if body.keep_pause and not gw.paused:
            await gw.pause("abort" if body.abort_all_requests else "wait")
        try:
            waited = await gw.update_weights(
                body.model_path, body.weight_version, body.abort_all_requests
            )
        except BackendError as exc:
            log.warning("weight update from %s failed: %s", body.model_path, exc)
            return JSONResponse({"success": False, "message": str(exc),
                                 "num_paused_requests": 0}, status_code=400)  # fmt: skip
        version = (await gw.served_weights())[1]
        message = f"Succeeded to update model weights from {body.model_path}."
        if body.weight_version is not None:
            message += f" Weight version updated to {version}."
        log.info("weights updated from %s (version %s)", body.model_path, version)
        return JSONResponse({"success": True, "message": message,
                             "num_paused_requests": waited})  # fmt: skip

    @router.post("/update_weight_version")
    async def update_weight_version(body: UpdateWeightVersionRequest) -> dict[str, Any]:
        """A new version label for the served weights (they stay as they are); with
        ``abort_all_requests`` running requests end first."""
        try:
            await gw.label_weights(body.new_version, body.abort_all_requests)
        except BackendError as exc:
            raise HTTPError(400, f"weight version not updated: {exc}",
                            "BadRequestError") from None  # fmt: skip
        return {"success": True, "message": f"Weight version updated to {body.new_version}",
                "new_version": body.new_version}  # fmt: skip

    @router.get("/weight_info")
    async def weight_info() -> dict[str, str]:
        """The served weights' version label (vLLM's)."""
        return {"weight_version": (await gw.served_weights())[1]}

    @router.post("/pause_generation")
    async def pause_generation(body: PauseGenerationRequest | None = None) -> dict[str, str]:
        """Pause generation (SGLang's; mode ``abort``: running requests end at once, new
        ones wait until ``/continue_generation``)."""
        mode = "abort" if body is None else body.mode
        if mode != "abort":
            raise HTTPError(400, f"mode {mode!r}: this server pauses with 'abort' (use "
                            "/pause?mode=wait to let running requests finish)",
                            "BadRequestError", param="mode")  # fmt: skip
        await gw.pause("abort")
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def flush_cache() -> PlainTextResponse:
        """Forget every cached prefix, in every worker's pool and block store (SGLang's
        radix-cache flush); a 400 naming the workers where running requests hold
        blocks (nothing of those is forgotten)."""
        reasons = await forget_cached_prefixes(gw, True, "cache not flushed")
        failed = "; ".join(f"{iid}: {why}" for iid, why in reasons.items() if why)
        if failed:
            return PlainTextResponse(f"Cache not flushed everywhere: {failed}\n", 400)
        return PlainTextResponse("Cache flushed.\n")

    for method in ("GET", "POST"):  # (SGLang takes both)
        router.add_api_route("/flush_cache", flush_cache, methods=[method],
                             operation_id=f"flush_cache_{method.lower()}")  # fmt: skip

    @router.post("/continue_generation")
    async def continue_generation() -> dict[str, str]:
        """Resume generation after ``/pause_generation`` (or ``/pause``)."""
        gw.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    return router
