"""Process plumbing shared by every serving process: the shared secret, free ports,
signal handling, logging and the garbage collector."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


#: Where the kernel hands out ports for ``bind(0)`` and outgoing connections.
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
#: Lowest port :func:`free_port` draws from.
_LOWEST_DRAWN_PORT = 20000
#: Ports :func:`free_port` handed out or :func:`reserve_port` was told of, in this process.
_TAKEN: set[int] = set()
_TAKEN_LOCK = threading.Lock()
#: Ports any process of this user on this machine drew lately (port -> time drawn), kept
#: in one file under an exclusive lock: another process's draw is skipped for
#: ``_HOLD_S``, the time its owner may take to bind it (a vLLM server binds its KV-event
#: ports tens of seconds after its worker drew them, and lost one to a draw of another
#: test's cluster: "Address already in use").
_REGISTRY = Path(tempfile.gettempdir()) / f"halfmoon-ports-{os.getuid()}.json"
_HOLD_S = 600.0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` and on every interface, and that
    this process has not handed out before (nor been told of, :func:`reserve_port`).

    Drawn at random below the kernel's ephemeral range where it can: a port that
    ``bind(0)`` returns is free only until the kernel hands it to the next ``bind(0)`` or
    outgoing connection, and a process started later (vLLM binding its KV-event
    endpoints on every interface) lost such a race. Falls back to ``bind(0)``.

    A port handed out stays free until its owner binds it, which may be seconds later (a
    worker binds its command port once its model is loaded): without the record, the
    launcher once gave a worker the port it had just given the Conductor, and the worker
    died on start with "Address already in use". Other processes of this machine skip it
    too for ``_HOLD_S`` (the registry file, :func:`_machine_draws`): two test clusters
    starting at once drew the same port that way.
    """
    low, high = _LOWEST_DRAWN_PORT, _ephemeral_start()
    with _TAKEN_LOCK, _machine_draws() as drawn:
        for _ in range(64 if high - low >= 1000 else 0):
            port = low + secrets.randbelow(high - low)
            if port not in _TAKEN and port not in drawn and _bindable(host, port):
                _TAKEN.add(port)
                drawn[port] = time.time()
                return port
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        _TAKEN.add(port)
        drawn[port] = time.time()
        return port


@contextlib.contextmanager
def _machine_draws() -> Iterator[dict[int, float]]:
    """The ports this machine's processes drew in the last ``_HOLD_S`` (port -> time),
    under an exclusive lock on the registry file, written back at the end; a map no
    other process sees where no registry can be kept (no fcntl, an unwritable /tmp)."""
    try:
        import fcntl

        fd = os.open(_REGISTRY, os.O_RDWR | os.O_CREAT, 0o600)
    except (ImportError, OSError):
        yield {}
        return
    with os.fdopen(fd, "r+", encoding="ascii") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        try:
            drawn = {int(k): float(v) for k, v in json.loads(f.read() or "{}").items()}
        except (ValueError, AttributeError, TypeError):  # a damaged file: start over
            drawn = {}
        now = time.time()
        drawn = {port: t for port, t in drawn.items() if 0 <= now - t < _HOLD_S}
        yield drawn
        f.seek(0)
        f.truncate()
        f.write(json.dumps(drawn))


def reserve_port(port: int) -> None:
    """Keep :func:`free_port` from handing out ``port`` in this process (one another
    process will bind, such as the gateway's port a launcher was given)."""
    with _TAKEN_LOCK:
        _TAKEN.add(port)


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default when unknown)."""
    try:
        with open(_EPHEMERAL_RANGE_FILE, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``host`` and on the wildcard address now."""
    for address in {host, "0.0.0.0"}:
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                return False
    return True


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


#: Largest control message a ROUTER socket accepts (a 128k-token prompt with its block
#: hashes is ~1 MiB): ZMQ drops a peer that sends more before the message is buffered.
MAX_CONTROL_MESSAGE_BYTES = 16 * 2**20


def bind_router(endpoint: str) -> Any:
    """A ROUTER socket bound to ``endpoint`` that refuses oversized messages."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_MESSAGE_BYTES)
    sock.bind(endpoint)
    return sock


class RateLimitedLog:
    """Warnings about rejected input, at most ``per_interval`` every ``interval_s``; what
    was held back is counted in the next warning (a flood of junk once wrote 2.36M lines)."""

    def __init__(self, log: logging.Logger, per_interval: int = 5, interval_s: float = 10.0):
        self.log = log
        self.per_interval = per_interval
        self.interval_s = interval_s
        self._window_start_s = -interval_s
        self._in_window = 0
        self.num_suppressed = 0

    def warning(self, message: str, *args: Any) -> None:
        """Log like ``log.warning`` unless over the rate."""
        now_s = time.monotonic()
        if now_s - self._window_start_s >= self.interval_s:
            self._window_start_s, self._in_window = now_s, 0
        self._in_window += 1
        if self._in_window > self.per_interval:
            self.num_suppressed += 1
            return
        if self.num_suppressed:
            message += f" ({self.num_suppressed} similar messages suppressed)"
            self.num_suppressed = 0
        self.log.warning(message, *args)


def read_config_document(text: str) -> str:
    """A ``--config-json`` value: the JSON document itself, or the path of a file holding it
    (never the secret: that stays in ``$HALFMOON_SECRET``)."""
    if text.lstrip().startswith("{"):
        return text
    try:
        with open(text, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise HalfmoonError(f"--config-json: cannot read {text}: {exc.strerror}") from None


_PR_SET_PDEATHSIG = 1
# Resolved here, in the parent: a child between fork and exec should not load a library
# (another thread of the parent may have held the loader's lock at the fork).
try:
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except OSError:  # no glibc: nothing to ask of the kernel
    _PRCTL = None


def die_with_parent() -> None:
    """In a child, before exec (``preexec_fn``): get SIGTERM when the parent dies, so no
    orphan survives even a SIGKILL of it (Linux; elsewhere the parent's own cleanup
    still stops its children)."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)
