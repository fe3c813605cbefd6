"""What ``halfmoon serve`` says while it starts, and the line that says it is ready.

A first start on a fresh machine takes a minute or more; each phase is told as it begins::

    model      a named model or .gguf file is imported once into the model cache,
               dequantized tensor by tensor (a bar on a terminal, else a line every 50)
    conductor  the Conductor process starts
    workers    each worker process starts, loads the model, builds its compiled kernels
               (once per model shape, cached in $HALFMOON_KERNEL_CACHE) and measures its
               cost profile (once per engine shape, cached in <cache>/profiles); the workers
               log these steps themselves, on the launcher's stderr which they share
    register   the launcher waits for every worker to register with the Conductor, saying
               how many have whenever that changes and every HEARTBEAT_S seconds
    ready      one line with the URL of the server, its OpenAI API and its live page

Every line goes to the launcher's ``serve`` logger at INFO (stderr), so ``--log-level
WARNING`` keeps a start quiet; the bar is drawn only when stderr is a terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

from halfmoon.engine.catalog import TensorProgress, tensor_lines


@contextlib.contextmanager
def tensor_progress(log: logging.Logger, stream: TextIO | None = None) -> Iterator[TensorProgress]:
    """The progress of a model import: a tqdm bar on ``stream`` (stderr) when it is a
    terminal and ``log`` shows INFO, else lines on ``log``; the bar is closed at the last
    tensor, or on exit (an import that failed)."""
    stream = stream or sys.stderr
    if not (log.isEnabledFor(logging.INFO) and stream.isatty()):
        yield tensor_lines(log.info)
        return
    from tqdm import tqdm  # only for interactive starts

    bars: list[Any] = []

    def tick(done: int, total: int) -> None:
        if not bars:
            bars.append(tqdm(total=total, desc="dequantizing", unit="tensor", file=stream))
        bars[0].update(done - bars[0].n)
        if done >= total:  # closed before the next log line, which would share its line
            bars[0].close()

    try:
        yield tick
    finally:
        for bar in bars:
            bar.close()


class WaitReport:
    """When the wait for the workers says something: when their count changes, and every
    ``heartbeat_s`` while it does not (so a long first start never looks hung)."""

    HEARTBEAT_S = 15.0

    def __init__(self, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.heartbeat_s = heartbeat_s
        self._last = ""
        self._last_s = 0.0

    def line(self, report: str, waited_s: float) -> str | None:
        """The line to print for ``report`` (the Conductor's "k of n workers registered")
        after ``waited_s`` seconds of waiting, or None."""
        if report == self._last and waited_s - self._last_s < self.heartbeat_s:
            return None
        self._last, self._last_s = report, waited_s
        return f"{report} ({waited_s:.0f}s)"


def waiting_line(num_workers: int) -> str:
    """What the launcher says when it starts waiting for the workers."""
    return (
        f"waiting for {num_workers} workers to register: each loads the model, builds its "
        "compiled kernels and measures its cost profile (both only the first time on this "
        "machine)"
    )


def ready_line(model_name: str, base_url: str, mode: str, num_workers: int, dashboard: bool) -> str:
    """The one line that says the server is up, with its URLs."""
    page = f", live page {base_url}/" if dashboard else ""
    return (
        f"serving {model_name!r} at {base_url} (OpenAI API {base_url}/v1{page}; "
        f"{mode}, {num_workers} workers)"
    )


def has_page(app: Any) -> bool:
    """Whether ``app`` answers ``GET /`` (the live cluster page), asked the way the router
    asks its routes (included routers are not flattened into ``app.routes``)."""
    from starlette.routing import Match

    scope = {"type": "http", "method": "GET", "path": "/", "root_path": "", "path_params": {}}
    return any(route.matches(scope)[0] == Match.FULL for route in app.routes)


def bound_port(server: Any, default: int) -> int:
    """The port a started uvicorn server listens on (the chosen one for ``--port 0``)."""
    for listener in getattr(server, "servers", ()):
        for sock in listener.sockets or ():
            return int(sock.getsockname()[1])
    return default


async def announce_when_listening(
    server: Any, host: str, port: int, describe: Callable[[str], str], log: logging.Logger,
    poll_s: float = 0.05, scheme: str = "http",
) -> None:  # fmt: skip
    """Log ``describe(base URL)`` once ``server`` (uvicorn) accepts connections: the URL
    is printed only when it works, with the real port (``scheme``: https with TLS)."""
    while not server.started:
        if server.should_exit:
            return
        await asyncio.sleep(poll_s)
    log.info("%s", describe(f"{scheme}://{host}:{bound_port(server, port)}"))
