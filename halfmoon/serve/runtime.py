"""Process plumbing shared by every serving process: the shared secret, free ports,
signal handling, logging and the garbage collector."""

from __future__ import annotations

import gc
import logging
import os
import secrets
import signal
import socket
import sys
import threading

from halfmoon.core.errors import HalfmoonError

SECRET_ENV = "HALFMOON_SECRET"


def load_secret() -> bytes:
    """The cluster's shared secret from ``$HALFMOON_SECRET`` (never from argv: ps shows it)."""
    value = os.environ.get(SECRET_ENV, "")
    if not value:
        raise HalfmoonError(
            f"${SECRET_ENV} is not set: internal channels need a shared secret "
            "(halfmoon serve generates one for the processes it starts)"
        )
    return value.encode()


def new_secret() -> str:
    """A fresh random secret for a cluster."""
    return secrets.token_hex(32)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stop_event_on_signals() -> threading.Event:
    """An event set by SIGTERM / SIGINT, for a main loop to poll."""
    stop = threading.Event()

    def _handler(signum: int, _frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)
    return stop


def setup_logging(name: str, level: str = "INFO") -> logging.Logger:
    """Log lines prefixed with the process role, to stderr."""
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
    )
    return logging.getLogger(name)


def warn_if_public(host: str, log: logging.Logger) -> None:
    """Say so when a server binds beyond the loopback interface."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: reachable from other machines; protect it", host)


def settle_gc() -> None:
    """Call once start-up is done: collect, then move every object that exists now (the
    model, imported modules, the tokenizer, the web framework) out of the cyclic garbage
    collector's reach (:func:`gc.freeze`). A full collection while serving then scans
    only what serving created. Without it a full collection took 100-230 ms in the
    gateway and in the workers (tiny preset, measured), and every token stream of that
    process stalled for as long: a TBT spike that no model of the engine predicts."""
    gc.collect()
    gc.freeze()
