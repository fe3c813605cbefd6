"""Streaming a request's tokens back to the gateway that asked for it (shared by the
roles that produce tokens), and the handoff timeouts both sides of a handoff use."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

from halfmoon.serve.control.messages import Batch, Error, Tokens, logprobs_to_wire
from halfmoon.serve.worker.process import Worker

if TYPE_CHECKING:
    from halfmoon.engine.connector import RequestOutput

#: A decode worker drops an expected KV handoff that has not come within this; a prefill
#: worker fails a handoff whose stream has not finished within it (a backstop: every
#: stream step has its own, shorter, deadline).
HANDOFF_TIMEOUT_S = 60.0
#: A decode worker waits for a handoff this many times the Conductor's TTFT estimate on
#: top of HANDOFF_TIMEOUT_S (a long prompt's prefill may take minutes on a CPU).
HANDOFF_TTFT_FACTOR = 4.0


@dataclass
class StreamClient:
    """A gateway waiting for a request's tokens; ``index`` counts tokens already sent."""

    identity: bytes
    prompt_token_ids: list[int]
    index: int = 0


class TokenStreaming:
    """Shared by the roles that stream tokens to the gateway."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.clients: dict[str, StreamClient] = {}
        self._outbox: dict[bytes, list[Tokens]] = {}

    def send_tokens(
        self,
        rid: str,
        client: StreamClient,
        out: RequestOutput,
        finish: str | None,
        kv_bytes: int = 0,
        batch: bool = False,
        cached_at_finish: bool = False,
    ) -> None:
        """Send a request's new tokens; with ``batch`` they wait for :meth:`flush_tokens`,
        which sends a step's tokens for one gateway as one message. ``cached_at_finish``:
        the cached prompt tokens go with the last tokens (an engine that learns them at the
        end), not the first."""
        first = client.index == 0
        with_cached = finish is not None if cached_at_finish else first
        msg = Tokens(
            request_id=rid, index=client.index, token_ids=list(out.new_token_ids),
            finish_reason=finish,
            logprobs=logprobs_to_wire(out.new_logprobs) if out.new_logprobs else None,
            cached_tokens=out.num_cached_tokens if with_cached else None,
            kv_bytes=kv_bytes if first else 0,
            prompt_logprobs=(
                logprobs_to_wire(out.prompt_logprobs) if out.prompt_logprobs is not None else None
            ),
            embedding=None if out.embedding is None
            else struct.pack(f"<{len(out.embedding)}f", *out.embedding),
        )  # fmt: skip
        client.index += len(out.new_token_ids)
        if batch:
            self._outbox.setdefault(client.identity, []).append(msg)
        else:
            self.worker.send(client.identity, msg)

    def end_failed(
        self, identity: bytes, rid: str, error: str, retryable: bool = False, suspect: str = ""
    ) -> None:
        """``rid`` ends here, failed: the gateway at ``identity`` hears ``error``
        (``retryable``: it places the request again, reporting ``suspect`` to the Conductor
        when one is named), the Conductor that the request finished."""
        self.worker.send(identity, Error(
            request_id=rid, error=error, retryable=retryable, suspect=suspect,
        ))  # fmt: skip
        self.worker.conductor.event("request_finished", request_id=rid)

    def flush_tokens(self) -> None:
        """One message per gateway for the tokens batched since the last flush (one
        signed message per step instead of one per running request)."""
        for identity, msgs in self._outbox.items():
            self.worker.send(identity, msgs[0] if len(msgs) == 1 else Batch(messages=msgs))
        self._outbox.clear()
