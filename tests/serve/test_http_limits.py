"""The gateway's connection limits on a real uvicorn server (127.0.0.1, short timeouts):
silent and slow clients are closed, slow bodies get a 408, good requests still work."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from halfmoon.serve.gateway.http_limits import BodyLimit, ConnectionLimits, server_config
from halfmoon.serve.runtime import free_port

LIMITS = ConnectionLimits(header_timeout_s=0.5, body_timeout_s=0.5, keep_alive_s=1)


async def echo_app(scope, receive, send):
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server_port():
    import uvicorn

    port = free_port()
    app = BodyLimit(echo_app, 1000, body_timeout_s=LIMITS.body_timeout_s)
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, LIMITS))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(5)


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """True when the server closes ``sock`` (read returns EOF) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_the_gateway_keeps_idle_connections_longer_than_httpx_does():
    """A pooled client must drop an idle connection before the gateway closes it, or a
    request sent on it as it closes dies with a ReadError (the OpenAI SDK uses httpx)."""
    import httpx

    limits = ConnectionLimits()
    assert limits.keep_alive_s > httpx.Limits().keepalive_expiry
    assert limits.header_timeout_s > httpx.Limits().keepalive_expiry  # it closes idle ones too


def test_silent_and_slow_header_connections_are_closed(server_port):
    silent = [socket.create_connection(("127.0.0.1", server_port)) for _ in range(20)]
    slow = socket.create_connection(("127.0.0.1", server_port))
    slow.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # and never the rest of the head
    start = time.monotonic()
    assert all(_closed_within(s, 3.0) for s in [*silent, slow])
    assert time.monotonic() - start < 3.0
    for s in [*silent, slow]:
        s.close()


def test_a_slow_body_gets_a_408_and_a_good_request_works(server_port):
    with socket.create_connection(("127.0.0.1", server_port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789")
        s.settimeout(3)
        reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 408"), reply
    with socket.create_connection(("127.0.0.1", server_port)) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello")
        s.settimeout(3)
        reply = s.recv(4096)
        while not reply.endswith(b"hello"):
            reply += s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 200"), reply
        # kept alive, then idle: closed after the keep-alive timeout, not held forever
        assert _closed_within(s, 3.0)


def test_over_the_connection_limit_a_request_gets_a_json_503_not_a_reset():
    """Beyond ``max_connections`` a request is answered with a 503 whose JSON body says
    why, with Retry-After, once its body is read; the limit counts open connections.
    (uvicorn's own 503 was plain text without Retry-After, sent before the body was read:
    20 clients sending 3 MB bodies over the limit all saw a reset instead of any answer.)"""
    import httpx
    import uvicorn

    limits = ConnectionLimits(header_timeout_s=30.0, max_connections=2)
    port = free_port()
    server = uvicorn.Server(server_config(BodyLimit(echo_app, 8 << 20), "127.0.0.1", port, limits))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()

    def wait_for_connections(count: int) -> None:
        deadline = time.monotonic() + 30
        while len(server.server_state.connections) != count:
            assert time.monotonic() < deadline, f"never {count} connections"
            time.sleep(0.02)

    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        with socket.create_connection(("127.0.0.1", port)):  # holds one of the two
            wait_for_connections(1)
            url = f"http://127.0.0.1:{port}/v1/completions"
            r = httpx.post(url, content=b"x" * (3 << 20), timeout=60)
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["message"] == "server busy: too many connections"
        wait_for_connections(0)
        assert httpx.post(url, content=b"hello", timeout=60).text == "hello"
    finally:
        server.should_exit = True
        thread.join(5)
