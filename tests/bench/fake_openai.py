"""A tiny OpenAI-compatible server for the benchmark client's tests.

Raw asyncio HTTP/1.1 on 127.0.0.1 in a background thread (its own event loop), so tests
can run the client with ``asyncio.run`` or through the CLI. ``/v1/completions`` streams
server-sent events with delays chosen by the test (a :class:`Reply` per request body),
chunked, and notes the monotonic time just before each event is written, so the client's
measurements can be checked against what the server actually did.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Reply:
    """How to answer one completion request.

    ``ttft_s`` before the first event, then ``gaps_s[i]`` before event ``i + 1``;
    ``tokens_per_event[i]`` tokens in event ``i`` (1 each by default) with text
    ``texts[i]`` ("x" by default); ``continuous_usage`` puts running usage on every output
    event. ``error_after`` / ``cut_after``: after that many events, send an error event /
    drop the connection without ``[DONE]``. ``status`` other than 200 answers with an
    OpenAI error body carrying ``message``.
    """

    ttft_s: float = 0.0
    gaps_s: Sequence[float] = ()
    tokens_per_event: Sequence[int] | None = None
    texts: Sequence[str] | None = None
    continuous_usage: bool = False
    cached_tokens: int | None = None
    status: int = 200
    message: str = "no"
    error_after: int | None = None
    cut_after: int | None = None

    @property
    def num_events(self) -> int:
        return len(self.gaps_s) + 1


@dataclass
class Exchange:
    """One completion request the server saw: when, its body and headers, and when each
    of its events was written (monotonic seconds)."""

    received_s: float
    body: dict[str, Any]
    headers: dict[str, str]
    event_times_s: list[float] = field(default_factory=list)


class FakeOpenAI:
    """``with FakeOpenAI(reply_for) as server: ... server.url ...``

    ``hold_first``: the first that many completion requests wait, before their first event,
    until that many are in flight at once (for up to 10 s), so a test shows concurrency by
    a condition rather than by timing.
    """

    def __init__(
        self,
        reply_for: Callable[[dict[str, Any]], Reply],
        model: str = "fake-model",
        hold_first: int = 0,
    ) -> None:
        self.reply_for = reply_for
        self.model = model
        self.hold_first = hold_first
        self.exchanges: list[Exchange] = []
        self.num_in_flight = 0
        self.max_in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        self.url = ""

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        future.result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in asyncio.all_tasks(self._loop) - {asyncio.current_task()}:
            task.cancel()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip()
                    for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
                }
                length = int(headers.get("content-length", "0"))
                body = json.loads(await reader.readexactly(length)) if length else {}
                if not await self._route(method, path, headers, body, writer):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _route(self, method: str, path: str, headers: dict, body: dict, writer) -> bool:
        """Answer one request; False when the connection must close."""
        if method == "GET" and path == "/v1/models":
            data = {"object": "list", "data": [{"id": self.model, "object": "model"}]}
            return await _json(writer, 200, data)
        if method == "POST" and path == "/v1/completions":
            exchange = Exchange(time.monotonic(), body, headers)
            self.exchanges.append(exchange)
            reply = self.reply_for(body)
            if reply.status != 200:
                error = {"error": {"message": reply.message, "type": "x", "code": reply.status}}
                return await _json(writer, reply.status, error)
            self.num_in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.num_in_flight)
            try:
                if len(self.exchanges) <= self.hold_first:
                    await self._until_in_flight(self.hold_first)
                return await self._stream(writer, reply, exchange)
            finally:
                self.num_in_flight -= 1
        return await _json(writer, 404, {"error": {"message": f"no route {path}"}})

    async def _until_in_flight(self, num: int, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.num_in_flight < num and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    async def _stream(self, writer, reply: Reply, exchange: Exchange) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        counts = list(reply.tokens_per_event or [1] * reply.num_events)
        texts = list(reply.texts or ["x"] * reply.num_events)
        delays = [reply.ttft_s, *reply.gaps_s]
        total = 0
        for index, delay_s in enumerate(delays):
            if reply.cut_after is not None and index == reply.cut_after:
                writer.write(b"0\r\n\r\n")  # end the body cleanly but without [DONE]
                await writer.drain()
                return False
            if reply.error_after is not None and index == reply.error_after:
                await _event(writer, {"error": {"message": "worker died", "code": 503}})
                break
            await asyncio.sleep(delay_s)
            total += counts[index]
            finish = "length" if index == len(delays) - 1 else None
            choice = {"index": 0, "text": texts[index], "finish_reason": finish}
            chunk: dict[str, Any] = {"choices": [choice]}
            if reply.continuous_usage:
                chunk["usage"] = {"completion_tokens": total}
            exchange.event_times_s.append(time.monotonic())
            await _event(writer, chunk)
        else:
            usage: dict[str, Any] = {"prompt_tokens": 1, "completion_tokens": total}
            if reply.cached_tokens is not None:
                usage["prompt_tokens_details"] = {"cached_tokens": reply.cached_tokens}
            await _event(writer, {"choices": [], "usage": usage})
        await _send_chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


async def _send_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


async def _event(writer: asyncio.StreamWriter, obj: dict) -> None:
    await _send_chunk(writer, f"data: {json.dumps(obj)}\n\n".encode())


async def _json(writer: asyncio.StreamWriter, status: int, obj: dict) -> bool:
    data = json.dumps(obj).encode()
    writer.write(
        f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n".encode()
        + data
    )
    await writer.drain()
    return True
