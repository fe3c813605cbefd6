"""One request's state in a pipeline stage (see :mod:`halfmoon.serve.worker.pipeline`), and the
names of its transfer sessions."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from halfmoon.core.request import SamplingParams
from halfmoon.engine.connector import StageConnector
from halfmoon.serve.control.messages import Endpoints, WireLogprobs
from halfmoon.serve.worker.kvstream import OutStream
from halfmoon.serve.worker.prefix_cache import PrefixFetch


def hidden_session(request_id: str, stage: int) -> str:
    """Transfer session carrying hidden states into ``stage``."""
    return f"{request_id}@h{stage}"


def kv_session(request_id: str, stage: int, num_stages: int) -> str:
    """Transfer session carrying ``stage``'s KV to the decode worker (the plain request id
    without CPP, so a single prefill worker and a group use the same decode code)."""
    return request_id if num_stages == 1 else f"{request_id}@kv{stage}"


@dataclass
class StageJob:
    """One request's progress through one pipeline stage of this worker: the agreement on
    its start, its chunks, its streams (hidden states out, KV to decode) and timings."""

    rid: str
    identity: bytes
    tokens: list[int]
    params: SamplingParams
    executor: StageConnector
    stage: int
    num_stages: int
    chunk_tokens: int
    next_transfer: str
    decode: Endpoints
    commands: list[str]  # the stages' command endpoints, in pipeline order
    suspects: tuple[str, str]  # (previous stage, next stage) instance ids
    offered_blocks: int  # prefix blocks this stage can provide (its cache, or the store's)
    cache_source: Endpoints | None
    cache_salt: str | None = None  # roots its blocks' hashes (its tenant's prefix cache)
    matches: dict[int, int] = field(default_factory=dict)  # stage 0: every stage's offer
    began: bool = False
    start: int = 0
    region: str = ""
    receiver: Any = None
    hidden_out: OutStream | None = None  # hidden states to the next stage
    kv_out: OutStream | None = None  # this stage's layers' KV to the decode worker
    next_chunk: int = 0
    first_token: int | None = None
    first_logprob: WireLogprobs | None = None  # its log-probability, wire form (if asked)
    prompt_logprobs: WireLogprobs | None = None  # the prompt's, wire form (if asked)
    #: Its agreed prefix blocks on their way (a peer's pulled on a pull thread), and
    #: which: (blocks it had, blocks agreed).
    prefix_fetch: PrefixFetch | None = None
    prefix_blocks: tuple[int, int] = (0, 0)
    error: str = ""
    suspect: str = ""
    seed: int = 0
    #: ``stop`` / ``length`` when the request ends with its first token.
    first_finish: str | None = None
    sent: threading.Event = field(default_factory=threading.Event)
    progress_s: float = field(default_factory=time.monotonic)
    created_s: float = field(default_factory=time.monotonic)
    began_s: float = 0.0
    computed_s: float = 0.0
    compute_s: float = 0.0  # time inside the model

    @property
    def num_chunks(self) -> int:
        """Chunks of the tokens after the agreed start."""
        return -(-(len(self.tokens) - self.start) // self.chunk_tokens)

    @property
    def computed(self) -> bool:
        """Whether every chunk went through this stage."""
        return self.began and self.next_chunk >= self.num_chunks
