"""The live cluster page: ``GET /`` (a redirect), ``GET /dashboard`` and its state.

The page (``static/dashboard.html`` with its script and style, served from the package:
no CDN, no outside library) carries no data and is public; every 2 s its script reads
``GET /dashboard/state``, which needs the API key when the server has keys (the page asks
for it on a 401). The state is one JSON document:

- ``workers``: each worker as the Conductor sees it (role, state, load, KV pool, store
  figures, index blocks), its state ``restarting`` while the launcher waits to restart its
  process, and workers whose process runs but has not registered (``starting``);
- ``conductor``: the Conductor's figures (policy, SLOs, placements, balancing,
  integrity, recent rejections), or ``reachable: false`` with the error;
- ``decisions``: its latest placement decisions, newest first, with their explanation;
- ``series``: the gateway's own recent history (:mod:`halfmoon.serve.gateway.timeseries`);
- ``slo``, ``model``, ``uptime_s``, ``gateway`` (requests in flight) and ``processes``.

A backend without ``cluster_status`` (an in-process test backend) gets the gateway's own
series and no cluster.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import RedirectResponse, Response

from halfmoon.serve.control.messages import ClusterStatus
from halfmoon.serve.gateway.backend import BackendError
from halfmoon.serve.gateway.responses import HTTPError

#: ``name -> {"state": "running" | "restarting" | "stopped", "num_restarts": n, ...}``
ProcessStates = Callable[[], dict[str, dict[str, Any]]]
#: The page's files: (name, media type).
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
#: Only this server's own files: the page works offline and loads nothing from elsewhere.
CSP = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"


def _asset(name: str) -> str:
    return (resources.files(__package__) / "static" / name).read_text(encoding="utf-8")


def finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has no inf or NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def merge_workers(
    status: ClusterStatus | None, processes: dict[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per worker: the Conductor's view of it, with its launcher process state
    (``restarting`` wins over what the Conductor last heard), then workers whose process
    the Conductor does not know (``starting``, or the process's own state)."""
    rows = []
    for inst in status.instances if status is not None else ():
        row = dataclasses.asdict(inst)
        proc = processes.get(inst.instance_id)
        if proc is not None and proc.get("state") != "running":
            row["state"] = proc.get("state", row["state"])
        rows.append({**row, "process": proc, "registered": True})
    known = {r["instance_id"] for r in rows}
    for name, proc in sorted(processes.items()):
        if name == "conductor" or name in known:
            continue
        state = "starting" if proc.get("state") == "running" else proc.get("state", "unknown")
        rows.append({"instance_id": name, "role": name.rsplit("-", 1)[0], "state": state,
                     "process": proc, "registered": False})  # fmt: skip
    return rows


async def cluster_view(
    backend: Any, num_decisions: int, timeout_s: float = 1.5
) -> tuple[ClusterStatus | None, str]:
    """(the Conductor's ClusterStatus or None, why it is missing: "" when present or
    when the backend has no cluster)."""
    ask = getattr(backend, "cluster_status", None)
    if ask is None:
        return None, ""
    try:
        return await asyncio.wait_for(ask(num_decisions, timeout_s), timeout_s + 0.5), ""
    except (TimeoutError, BackendError) as exc:
        return None, str(exc) or "the Conductor did not answer"


def dashboard_router(
    gateway: Any, process_states: ProcessStates | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> APIRouter:  # fmt: skip
    """The page's routes over ``gateway`` (a :class:`~halfmoon.serve.gateway.gateway.Gateway`);
    ``process_states`` (optional) names the launcher's child processes' states."""
    router = APIRouter(include_in_schema=False)
    started_s = clock()
    html = _asset("dashboard.html")
    assets = {name: (_asset(name), kind) for name, kind in ASSETS.items()}

    @router.get("/")
    async def root() -> RedirectResponse:
        return RedirectResponse("/dashboard", status_code=307)

    @router.get("/dashboard")
    async def page() -> Response:
        headers = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache"}
        return Response(html, media_type="text/html; charset=utf-8", headers=headers)

    @router.get("/dashboard/assets/{name}")
    async def asset(name: str) -> Response:
        if name not in assets:
            raise HTTPError(404, f"no dashboard asset {name!r}", "NotFoundError")
        text, kind = assets[name]
        return Response(text, media_type=kind, headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/state")
    async def state(decisions: int = Query(20, ge=0, le=100)) -> dict[str, Any]:
        status, error = await cluster_view(gateway.backend, decisions)
        processes = process_states() if process_states is not None else {}
        conductor: dict[str, Any] = {
            "reachable": status is not None, "error": error, "process": processes.get("conductor"),
            **(status.conductor if status is not None else {}),
        }  # fmt: skip
        return finite({
            "model": gateway.config.model_name,
            "uptime_s": clock() - started_s,
            "clustered": hasattr(gateway.backend, "cluster_status"),
            "gateway": {"in_flight": gateway.in_flight,
                        "max_concurrent_requests": gateway.config.max_concurrent_requests,
                        "paused": gateway.paused, "weight_version": gateway.weight_version},
            "slo": conductor.get("slo"),
            "conductor": conductor,
            "workers": merge_workers(status, processes),
            "decisions": status.decisions if status is not None else [],
            "series": gateway.series.snapshot(),
            "processes": processes,
            "replan": list(gateway.replan_rounds)[-1:],
        })  # fmt: skip

    return router
