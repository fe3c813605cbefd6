"""The control plane's vocabulary: one frozen dataclass per message the serving
processes exchange, and the records those messages nest.

Each class names its wire ``type`` (``wire_name``) and, in its docstring, who sends it
to whom. :func:`to_wire` / :func:`from_wire` turn a message into the msgpack map that
travels and back, checking every field against the annotations; :func:`encode_message` /
:func:`decode_message` add the signed framing (:mod:`halfmoon.serve.control.codec`,
:mod:`halfmoon.serve.control.protocol`). Wire forms: token ids ``list[int]``; 128-bit
block hashes one ``bytes`` of 16 little-endian bytes each (``block_hashes`` unpacks
them); sampling parameters a :class:`WireParams`; log-probabilities
``[[logprob, [[token, logprob], ...]], ...]``::

    gateway --schedule, release, instance_failed, ping, status_query, metrics_query,
            workload_query--> Conductor
            Conductor --decision, pong, cluster_status, metrics_text, workload_window,
            error--> gateway
    worker  --register, events, heartbeat-->  Conductor --registered, refused, register_again, drain-->
    deploy  --drain, ping-->                  Conductor --draining, pong-->
    gateway --generate, expect, prefill, cpp_prefill, replicate, abort, ping, metrics_query--> worker
    worker  --tokens, batch, error, worker_pong, metrics_text--> gateway
    worker  --handoff, cpp_offer, cpp_start--> worker
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from halfmoon.core.adapters import RuntimeAdapter
from halfmoon.core.request import SamplingParams, StructuredOutput, TokenLogprob
from halfmoon.serve.control.codec import (
    MESSAGE_TYPES,
    MalformedMessage,
    Message,
    Record,
    decode_message,
    encode_message,
    from_wire,
    record_from_wire,
    record_to_wire,
    to_wire,
)
from halfmoon.serve.control.protocol import ProtocolError, hashes_from_wire

#: Log-probabilities of tokens: ``(logprob, ((token, logprob), ...))`` each, with the
#: token's rank as a third item where it is known (prompt log-probabilities).
WireLogprobs = list[
    tuple[float, list[tuple[int, float]]] | tuple[float, list[tuple[int, float]], int]
]
#: Lifecycle event kinds, in a request's order.
LIFECYCLE_KINDS = ("prefill_started", "prefill_finished", "decode_started", "request_finished")


# -- records ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Endpoints(Record):
    """Where to reach one worker a decision names (empty strings: not registered)."""

    instance_id: str
    command: str
    transfer: str
    incarnation: str = ""


NO_ENDPOINTS = Endpoints(instance_id="", command="", transfer="")


@dataclass(frozen=True, kw_only=True)
class Member(Endpoints):
    """A placeable worker as the Conductor's pong lists it (for the gateway's fallback):
    its endpoints and its role."""

    role: str

    def endpoints(self) -> Endpoints:
        """The member as a decision would name it (a plain :class:`Endpoints`: a decision's
        fields take no ``role``)."""
        return Endpoints(**{f.name: getattr(self, f.name) for f in fields(Endpoints)})


@dataclass(frozen=True, kw_only=True)
class Replication(Record):
    """Copy these blocks from ``source``'s store to ``target``'s (a replication plan)."""

    source: Endpoints
    target: Endpoints
    hashes: bytes
    reason: str = ""

    @property
    def block_hashes(self) -> list[int]:
        """The 128-bit hashes ``hashes`` packs."""
        return hashes_from_wire(self.hashes)


@dataclass(frozen=True, kw_only=True)
class WireParams(Record):
    """:class:`SamplingParams` as they travel (stop strings stay with the gateway);
    ``penalties`` is (presence, frequency, repetition), None when none applies."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    top_k: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    logit_bias: list[tuple[int, float]] = field(default_factory=list)
    penalties: tuple[float, float, float] | None = None
    min_p: float = 0.0
    allowed_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: int | None = None
    #: A structured output as (kind, spec, compact, closed, whitespace, reasoning), or None.
    structured: tuple[str, str, bool, bool, str, str] | None = None
    bad_words: list[str] = field(default_factory=list)
    priority: int = 0
    lora: str | None = None
    embed: bool = False
    thinking_token_budget: int | None = None

    @classmethod
    def of(cls, params: SamplingParams) -> WireParams:
        """The wire form of ``params``."""
        return cls(
            max_tokens=params.max_tokens, temperature=float(params.temperature),
            top_p=float(params.top_p), seed=params.seed, ignore_eos=params.ignore_eos,
            min_tokens=params.min_tokens, top_k=params.top_k,
            stop_token_ids=list(params.stop_token_ids), logprobs=params.logprobs,
            logit_bias=[(t, float(b)) for t, b in params.logit_bias],
            penalties=(float(params.presence_penalty), float(params.frequency_penalty),
                       float(params.repetition_penalty)) if params.has_penalties else None,
            min_p=float(params.min_p), allowed_token_ids=list(params.allowed_token_ids),
            prompt_logprobs=params.prompt_logprobs,
            structured=None if (so := params.structured) is None
            else (so.kind, so.spec, so.compact, so.closed, so.whitespace, so.reasoning),
            bad_words=list(params.bad_words), priority=params.priority, lora=params.lora,
            embed=params.embed, thinking_token_budget=params.thinking_token_budget,
        )  # fmt: skip

    def to_params(self) -> SamplingParams:
        """The engine's sampling parameters (ValueError when out of range)."""
        presence, frequency, repetition = self.penalties or (0.0, 0.0, 1.0)
        return SamplingParams(
            max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            seed=self.seed, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            top_k=self.top_k, stop_token_ids=tuple(self.stop_token_ids),
            logprobs=self.logprobs, logit_bias=tuple(self.logit_bias),
            presence_penalty=presence, frequency_penalty=frequency,
            repetition_penalty=repetition, min_p=self.min_p,
            allowed_token_ids=tuple(self.allowed_token_ids),
            prompt_logprobs=self.prompt_logprobs,
            structured=None if self.structured is None else StructuredOutput(*self.structured),
            bad_words=tuple(self.bad_words), priority=self.priority, lora=self.lora,
            embed=self.embed, thinking_token_budget=self.thinking_token_budget,
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ClusterIdentity(Record):
    """What every worker must compute with: the Conductor's block size, and the model,
    dtype and KV compression of the first worker that declared them (None until then)."""

    block_size: int
    model: str | None = None
    dtype: str | None = None
    kv_compression: str | None = None


@dataclass(frozen=True, kw_only=True)
class AdapterRecord(Record):
    """A LoRA adapter loaded while the cluster serves
    (:class:`~halfmoon.core.adapters.RuntimeAdapter`): its name, PEFT directory and the
    tag of its load."""

    name: str
    path: str
    tag: str

    @classmethod
    def of(cls, adapter: RuntimeAdapter) -> AdapterRecord:
        """The record of ``adapter``."""
        return cls(name=adapter.name, path=adapter.path, tag=adapter.tag)

    def adapter(self) -> RuntimeAdapter:
        """The adapter it records."""
        return RuntimeAdapter(self.name, self.path, self.tag)


@dataclass(frozen=True, kw_only=True)
class WeightsRecord(Record):
    """The weights a cluster serves since an update while serving (SGLang's
    ``/update_weights_from_disk``): the checkpoint's ``path`` (on every worker's host)
    and its ``version`` label."""

    path: str
    version: str


@dataclass(frozen=True, kw_only=True)
class HeldBlocks(Record):
    """Blocks a re-registering worker holds in one tier."""

    tier: str = "dram"
    hashes: bytes

    @property
    def block_hashes(self) -> list[int]:
        """The 128-bit hashes ``hashes`` packs."""
        return hashes_from_wire(self.hashes)


@dataclass(frozen=True, kw_only=True)
class BlockEvent(Record):
    """A worker's store (or engine cache) now holds (``stored``) or lost (``evicted``)
    these blocks in ``tier``."""

    kinds: ClassVar[tuple[str, ...]] = ("stored", "evicted")
    kind: str
    hashes: bytes
    tier: str = "dram"

    @property
    def block_hashes(self) -> list[int]:
        """The 128-bit hashes ``hashes`` packs."""
        return hashes_from_wire(self.hashes)


@dataclass(frozen=True, kw_only=True)
class LifecycleEvent(Record):
    """A request reached a step on this worker (:data:`LIFECYCLE_KINDS`);
    ``cached_tokens``: with ``prefill_finished``, the prompt tokens served from cache
    (None: not known yet); ``num_output_tokens``: with ``request_finished``, the tokens
    it generated (None: not known, e.g. aborted)."""

    kinds: ClassVar[tuple[str, ...]] = LIFECYCLE_KINDS
    kind: str
    request_id: str
    cached_tokens: int | None = None
    num_output_tokens: int | None = None


@dataclass(frozen=True, kw_only=True)
class LoadEvent(Record):
    """A worker's own view of its load (every 0.5 s); ``store``: its block store's
    counters (a prefill worker's), for ``/metrics``."""

    kinds: ClassVar[tuple[str, ...]] = ("load",)
    kind: str = "load"
    num_running: int = 0
    context_tokens: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    queued_prefill_tokens: int = 0
    store: dict[str, int] | None = None
    #: Requests accepted but not yet running (the engine's waiting queue).
    num_waiting: int = 0
    #: Its recent speculative decoding: rows computed and tokens gained per decoding
    #: sequence and step (:class:`~halfmoon.costmodel.speculation.SpeculationRates`).
    spec_rows_per_seq: float = 1.0
    spec_tokens_per_step: float = 1.0


Event = BlockEvent | LifecycleEvent | LoadEvent


def event_entry(kind: str, **fields: Any) -> Event:
    """The event record of ``kind`` (ProtocolError for an unknown kind or field)."""
    for cls in (BlockEvent, LifecycleEvent, LoadEvent):
        if kind in cls.kinds:
            try:
                return cls(kind=kind, **fields)
            except TypeError as exc:
                raise ProtocolError(f"bad {kind!r} event: {exc}") from None
    raise ProtocolError(f"unknown event kind {kind!r}")


# -- gateway <-> Conductor -------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Schedule(Message):
    """Gateway -> Conductor: place one request (answered by a ``decision``). ``admitted``:
    the request was placed before and its worker died; it is placed again without early
    rejection (a 429 now would break a stream the client already has). ``hashes`` is
    empty for a request that computes its whole prompt whatever is cached (prompt
    log-probabilities): it is placed and estimated as one without a cached prefix.
    ``priority``: the request's (vLLM's ``priority``, 0 under ``fcfs``), which its queue
    estimate follows. ``prefill_only``: an embedding (no decode instance is booked)."""

    wire_name: ClassVar[str] = "schedule"
    request_id: str
    input_length: int
    output_length: int
    block_size: int
    hashes: bytes
    coupled: bool = False
    admitted: bool = False
    priority: int = 0
    prefill_only: bool = False

    @property
    def block_hashes(self) -> list[int]:
        """The prompt's 128-bit block hashes."""
        return hashes_from_wire(self.hashes)


@dataclass(frozen=True, kw_only=True)
class PlacementDecision(Message):
    """Conductor -> gateway: where a request runs, with every endpoint the gateway and the
    workers need, or why it is refused (``reject_code``: a RejectCode). The gateway makes
    one itself (``fallback``) while the Conductor is away."""

    wire_name: ClassVar[str] = "decision"
    accepted: bool
    reject_reason: str = ""
    reject_code: str = ""
    why: str = ""
    prefill: Endpoints | None = None
    decode: Endpoints | None = None
    cache_source: Endpoints | None = None
    cached_tokens: int = 0
    est_ttft_s: float = 0.0
    replications: list[Replication] = field(default_factory=list)
    group: list[Endpoints] | None = None  # a CPP group's stages, in pipeline order
    cpp_chunk_tokens: int = 0
    decision_s: float | None = None  # timed inside the Conductor
    fallback: bool = False


@dataclass(frozen=True, kw_only=True)
class Release(Message):
    """Gateway -> Conductor: a placed request ended without its worker saying so."""

    wire_name: ClassVar[str] = "release"
    request_id: str


@dataclass(frozen=True, kw_only=True)
class FirstTokenSeen(Message):
    """Gateway -> Conductor: a placed request's first token has reached the gateway (the
    Conductor learns from it how late first tokens come against its TTFT estimates)."""

    wire_name: ClassVar[str] = "first_token"
    request_id: str


@dataclass(frozen=True, kw_only=True)
class InstanceFailed(Message):
    """Gateway -> Conductor: this worker (this process of it) failed a request."""

    wire_name: ClassVar[str] = "instance_failed"
    instance_id: str
    incarnation: str = ""


@dataclass(frozen=True, kw_only=True)
class Ping(Message):
    """Gateway, launcher or deploy controller -> Conductor (``pong``) or worker
    (``worker_pong``): are you there, and how are you?"""

    wire_name: ClassVar[str] = "ping"


@dataclass(frozen=True, kw_only=True)
class ConductorPong(Message):
    """Conductor -> whoever pinged: registered instances (role, endpoints, incarnation),
    the placeable ones, the draining ones, the block-store counters of the last load
    reports, the cluster's identity, and how many blocks its index holds per instance."""

    wire_name: ClassVar[str] = "pong"
    instances: dict[str, str] = field(default_factory=dict)  # id -> role
    endpoints: dict[str, str] = field(default_factory=dict)  # id -> command endpoint
    incarnations: dict[str, str] = field(default_factory=dict)
    members: dict[str, Member] = field(default_factory=dict)
    draining: list[str] = field(default_factory=list)
    integrity: str = ""
    num_placements: int = 0
    store_stats: dict[str, dict[str, int]] = field(default_factory=dict)
    cluster: ClusterIdentity | None = None
    #: Blocks the prefix index holds per instance (any tier): checks against the workers.
    index_blocks: dict[str, int] = field(default_factory=dict)
    #: The cache-balancing threshold in use and how it was learned (``Conductor.balancing``).
    balancing: dict[str, Any] = field(default_factory=dict)
    #: LoRA adapters loaded while serving (what a worker registering now is given, and
    #: what every gateway serves besides its ``--lora-modules``).
    adapters: list[AdapterRecord] = field(default_factory=list)
    #: Each prefill instance's learned prefill scale and its number of samples
    #: (``Conductor.prefill_calibration``; empty when calibration is off).
    prefill_calibration: dict[str, dict[str, float]] = field(default_factory=dict)
    #: Seconds added to every TTFT estimate (``Conductor.ttft_lateness_s``).
    ttft_lateness_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class InstanceStatus(Record):
    """One registered instance as the Conductor sees it (a :class:`ClusterStatus` row):
    ``state`` is ``healthy``, ``draining`` or ``silent`` (no heartbeat for over a second);
    the load fields are its last load report's, ``store`` its block store's figures."""

    instance_id: str
    role: str
    state: str
    seen_s_ago: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    kv_used_tokens: int = 0
    kv_capacity_tokens: int = 0
    queued_prefill_tokens: int = 0
    #: A speculating decode instance's recent rows checked and tokens gained per
    #: sequence and step (1 and 1 without speculation), as its step estimates use them.
    spec_rows_per_seq: float = 1.0
    spec_tokens_per_step: float = 1.0
    #: The Conductor's estimate of a new prompt's queueing time there (prefill, coupled).
    est_queue_s: float = 0.0
    index_blocks: int = 0
    store: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class StatusQuery(Message):
    """Gateway -> Conductor: the cluster's state and the last ``num_decisions`` placement
    decisions (``cluster_status``), for the live cluster page."""

    wire_name: ClassVar[str] = "status_query"
    num_decisions: int = 20


@dataclass(frozen=True, kw_only=True)
class ClusterStatus(Message):
    """Conductor -> gateway: every registered instance, the Conductor's own state
    (``conductor``: placements, rejections by code, SLOs, balancing, integrity) and its
    latest decisions, newest first (``decisions``: each a map with the request id, its
    time, outcome, reason, candidates with their estimates, and the explanation text)."""

    wire_name: ClassVar[str] = "cluster_status"
    instances: list[InstanceStatus] = field(default_factory=list)
    conductor: dict[str, Any] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Arrival(Record):
    """One request the Conductor was asked to place (a :class:`WorkloadWindow` row):
    ``age_s`` seconds before the window's end, its prompt length, the output length it
    asked for (``max_tokens``) and its prompt's block hashes (packed as in ``schedule``);
    ``prefill_only``: an embedding (answered by its prefill instance)."""

    age_s: float
    input_length: int
    output_length: int
    hashes: bytes = b""
    prefill_only: bool = False

    @property
    def block_hashes(self) -> list[int]:
        """The 128-bit hashes ``hashes`` packs."""
        return hashes_from_wire(self.hashes)


@dataclass(frozen=True, kw_only=True)
class WorkloadQuery(Message):
    """Gateway (its re-planner) -> Conductor: the requests of the last ``window_s`` seconds
    and what a simulation of this cluster needs (``workload_window``)."""

    wire_name: ClassVar[str] = "workload_query"
    window_s: float = 60.0


@dataclass(frozen=True, kw_only=True)
class WorkloadWindow(Message):
    """Conductor -> gateway: the recent arrivals, oldest first; the placeable prefill and
    decode instances and the draining ones; a registered worker's measured cost profile
    (``CostProfile.to_dict()``, None before one registers) with its KV bytes per token;
    the smallest decode KV pool (tokens); the Conductor's config (``ConductorConfig`` JSON)."""

    wire_name: ClassVar[str] = "workload_window"
    window_s: float
    arrivals: list[Arrival] = field(default_factory=list)
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    profile: dict[str, Any] | None = None
    kv_bytes_per_token: int = 0
    hidden_bytes_per_token: int = 0
    decode_kv_capacity_tokens: int = 0
    conductor: str = ""


@dataclass(frozen=True, kw_only=True)
class MetricsQuery(Message):
    """Gateway -> Conductor or worker: your Prometheus metrics (``metrics_text``)."""

    wire_name: ClassVar[str] = "metrics_query"


@dataclass(frozen=True, kw_only=True)
class MetricsText(Message):
    """Conductor or worker -> gateway: its metrics in Prometheus' text exposition format,
    without ``role`` / ``worker`` labels (the gateway adds them when it merges every
    process's metrics into its one ``/metrics``)."""

    wire_name: ClassVar[str] = "metrics_text"
    instance_id: str
    role: str
    text: str


@dataclass(frozen=True, kw_only=True)
class AdapterUpdate(Message):
    """Gateway -> Conductor (keep the cluster's list of adapters loaded while serving,
    ``adapters_ok``) or worker (load into its engine, or unload: ``adapters_ok`` once
    done, or ``error``): vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
    ``op`` is ``load`` or ``unload``; an unload names the adapter only (path and tag
    empty)."""

    wire_name: ClassVar[str] = "adapter_update"
    op: str
    adapter: AdapterRecord

    def __post_init__(self) -> None:
        if self.op not in ("load", "unload"):
            raise ValueError(f"adapter_update op must be load or unload, not {self.op!r}")


@dataclass(frozen=True, kw_only=True)
class AdaptersOk(Message):
    """Conductor or worker -> gateway: the ``adapter_update`` is done; ``adapters``: the
    Conductor's list of adapters loaded while serving, as it now stands."""

    wire_name: ClassVar[str] = "adapters_ok"
    adapters: list[AdapterRecord] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class UpdateWeights(Message):
    """Gateway -> worker, a weight update in two steps: ``stage`` reads the checkpoint at
    ``weights.path`` beside the served weights (nothing served changes), ``commit``
    installs the staged weights (the same path) and forgets the KV of the old ones (the
    engine's cached prefixes, the block store's blocks), ``drop`` forgets staged weights;
    answered ``weights_ok``, or ``error`` naming why not. Gateway -> Conductor: ``record``
    keeps ``weights`` as the cluster's (a registering worker is given them), ``query``
    asks for them; answered ``weights_ok``."""

    wire_name: ClassVar[str] = "update_weights"
    op: str
    weights: WeightsRecord | None = None

    def __post_init__(self) -> None:
        if self.op not in ("stage", "commit", "drop", "record", "query"):
            raise ValueError(f"update_weights op must be stage, commit, drop, record or "
                             f"query, not {self.op!r}")  # fmt: skip
        if self.weights is None and self.op in ("stage", "commit", "record"):
            raise ValueError(f"update_weights {self.op} names no weights")


@dataclass(frozen=True, kw_only=True)
class WeightsOk(Message):
    """Worker or Conductor -> gateway: the ``update_weights`` is done; ``weights``: the
    Conductor's record of the cluster's weights (None: those it started with)."""

    wire_name: ClassVar[str] = "weights_ok"
    weights: WeightsRecord | None = None


@dataclass(frozen=True, kw_only=True)
class Sleep(Message):
    """Gateway -> worker, vLLM's sleep mode (level 1): ``sleep`` forgets the engine's
    cached prefixes and releases its KV pool's memory (``error``, retryable, while
    requests are still ending there), ``wake`` allocates the pool again; answered
    ``sleep_state``."""

    wire_name: ClassVar[str] = "sleep"
    op: str

    def __post_init__(self) -> None:
        if self.op not in ("sleep", "wake"):
            raise ValueError(f"sleep op must be sleep or wake, not {self.op!r}")


@dataclass(frozen=True, kw_only=True)
class SleepState(Message):
    """Worker -> gateway: whether its engine sleeps now, and the bytes the ``sleep`` it
    answers released."""

    wire_name: ClassVar[str] = "sleep_state"
    sleeping: bool
    released_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Profile(Message):
    """Gateway -> worker, vLLM's ``/start_profile`` and ``/stop_profile``: ``start``
    records the engine's coming steps with torch's profiler (``config``: the
    :class:`~halfmoon.core.profiling.ProfilerConfig` as JSON; the session's file-name
    ``prefix`` and iteration bounds, -1 for the config's); ``stop`` ends it and writes
    the trace. Answered ``profile_state``, or ``error`` (``unsupported`` where the engine
    has no profiler)."""

    wire_name: ClassVar[str] = "profile"
    op: str
    config: str = ""
    prefix: str = ""
    delay_iterations: int = -1
    max_iterations: int = -1

    def __post_init__(self) -> None:
        if self.op not in ("start", "stop"):
            raise ValueError(f"profile op must be start or stop, not {self.op!r}")


@dataclass(frozen=True, kw_only=True)
class ProfileState(Message):
    """Worker -> gateway: whether a profiling session is on there now, and the traces
    the ``stop`` it answers wrote (paths on the worker's host)."""

    wire_name: ClassVar[str] = "profile_state"
    active: bool
    traces: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class ResetPrefixCache(Message):
    """Gateway -> worker: forget the engine's cached prefixes (vLLM's
    ``/reset_prefix_cache``), with ``external`` its block store's too (DRAM and SSD);
    answered ``cache_reset``, or ``error`` when its engine cannot."""

    wire_name: ClassVar[str] = "reset_prefix_cache"
    external: bool = False


@dataclass(frozen=True, kw_only=True)
class CacheReset(Message):
    """Worker -> gateway: the ``reset_prefix_cache`` is done (``success``) or could not
    be now (``reason``: e.g. running requests hold blocks; nothing of that cache is
    forgotten then)."""

    wire_name: ClassVar[str] = "cache_reset"
    success: bool
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Error(Message):
    """Any process -> the sender of a command it could not carry out. ``retryable``: the
    gateway may place the request again; ``suspect``: the worker to blame;
    ``unsupported``: the worker's engine cannot do what the request asks (the client's
    request is at fault, not the cluster: a 400)."""

    wire_name: ClassVar[str] = "error"
    error: str
    request_id: str | None = None
    retryable: bool = False
    suspect: str = ""
    unsupported: bool = False


# -- workers <-> Conductor -------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Register(Message):
    """Worker -> Conductor: join the cluster (``registered`` or ``refused``), with its
    measured cost profile and what the cluster must agree on; ``blocks``: what it holds
    when it registers again; ``draining``: keep it out of placement; ``adapters``: the
    LoRA adapters it loaded while serving (registering again: a restarted Conductor
    learns the cluster's list back from them)."""

    wire_name: ClassVar[str] = "register"
    instance_id: str
    role: str
    command_endpoint: str
    transfer_endpoint: str
    kv_capacity_tokens: int = 0
    kv_bytes_per_token: int = 0
    hidden_bytes_per_token: int = 0
    profile: dict[str, Any] | None = None  # CostProfile.to_dict()
    incarnation: str = ""
    block_size: int | None = None
    model: str | None = None
    dtype: str | None = None
    kv_compression: str | None = None
    draining: bool = False
    blocks: list[HeldBlocks] = field(default_factory=list)
    adapters: list[AdapterRecord] = field(default_factory=list)
    #: Weights it installed while serving (registering again: a restarted Conductor
    #: learns the cluster's back from them).
    weights: WeightsRecord | None = None


@dataclass(frozen=True, kw_only=True)
class Registered(Message):
    """Conductor -> worker: registration accepted. ``tbt_slo_s``: the cluster's TBT SLO,
    which a decode worker's ``--decode-guard`` holds its steps to (0: not said);
    ``adapters``: the LoRA adapters loaded while serving, for it to load too."""

    wire_name: ClassVar[str] = "registered"
    instance_id: str
    tbt_slo_s: float = 0.0
    #: LoRA adapters loaded while the cluster serves: the worker loads them before it
    #: takes requests.
    adapters: list[AdapterRecord] = field(default_factory=list)
    #: Weights installed while the cluster serves (None: those it started with): the
    #: worker installs them before it takes requests.
    weights: WeightsRecord | None = None


@dataclass(frozen=True, kw_only=True)
class Refused(Message):
    """Conductor -> worker: registration refused; ``error`` names the disagreement."""

    wire_name: ClassVar[str] = "refused"
    instance_id: str
    error: str


@dataclass(frozen=True, kw_only=True)
class RegisterAgain(Message):
    """Conductor -> worker, answering a heartbeat: I do not know you (I restarted)."""

    wire_name: ClassVar[str] = "register_again"


@dataclass(frozen=True, kw_only=True)
class Events(Message):
    """Worker -> Conductor: a batch of block, lifecycle and load events (no answer)."""

    wire_name: ClassVar[str] = "events"
    instance_id: str
    events: list[Event]


@dataclass(frozen=True, kw_only=True)
class Heartbeat(Message):
    """Worker -> Conductor, 4 times a second (answered only by ``register_again`` or
    ``drain``)."""

    wire_name: ClassVar[str] = "heartbeat"
    instance_id: str


@dataclass(frozen=True, kw_only=True)
class Drain(Message):
    """Deploy controller -> Conductor: stop placing on this instance (``draining``);
    Conductor -> that worker, answering its heartbeat: exit once idle."""

    wire_name: ClassVar[str] = "drain"
    instance_id: str


@dataclass(frozen=True, kw_only=True)
class Draining(Message):
    """Conductor -> deploy controller: the instance left placement."""

    wire_name: ClassVar[str] = "draining"
    instance_id: str


# -- gateway -> workers ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Generate(Message):
    """Gateway -> coupled worker: run the whole request, stream ``tokens`` back."""

    wire_name: ClassVar[str] = "generate"
    request_id: str
    token_ids: list[int]
    params: WireParams
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)


@dataclass(frozen=True, kw_only=True)
class Expect(Message):
    """Gateway -> decode worker: a request's KV will come (``num_stages`` streams), then
    its ``handoff``; stream its tokens back."""

    wire_name: ClassVar[str] = "expect"
    request_id: str
    params: WireParams
    num_prompt_tokens: int
    num_stages: int = 1
    est_ttft_s: float = 0.0
    prefill_instance: str = ""
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)


@dataclass(frozen=True, kw_only=True)
class Prefill(Message):
    """Gateway -> prefill worker: prefill the prompt (its prefix from ``cache_source``),
    stream the KV to ``decode``, send the first token back (an embedding, ``params.embed``:
    no ``decode``; its vector goes back instead)."""

    wire_name: ClassVar[str] = "prefill"
    request_id: str
    token_ids: list[int]
    params: WireParams
    decode: Endpoints | None = None
    cache_source: Endpoints | None = None
    cached_tokens: int = 0
    replications: list[Replication] = field(default_factory=list)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)
        if self.decode is None and not self.params.embed:
            raise ValueError("a prefill names the decode worker its KV streams to")


@dataclass(frozen=True, kw_only=True)
class CppPrefill(Message):
    """Gateway -> each stage of a CPP group: run stage ``stage`` of ``num_stages`` of the
    prompt, chunk by chunk (halfmoon.serve.worker.pipeline)."""

    wire_name: ClassVar[str] = "cpp_prefill"
    request_id: str
    token_ids: list[int]
    params: WireParams
    stage: int
    num_stages: int
    chunk_tokens: int
    next_transfer: str = ""  # the next stage's transfer endpoint ("" for the last)
    group: list[str]  # the stages' instance ids, in pipeline order
    commands: list[str]  # the stages' command endpoints, in pipeline order
    decode: Endpoints
    cached_tokens: int = 0
    cache_source: Endpoints | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        check_cache_salt(self.cache_salt)


@dataclass(frozen=True, kw_only=True)
class Replicate(Message):
    """Gateway -> prefill worker: copy these blocks from the store at ``source`` (a
    transfer endpoint) into yours."""

    wire_name: ClassVar[str] = "replicate"
    hashes: bytes
    source: str

    @property
    def block_hashes(self) -> list[int]:
        """The 128-bit hashes ``hashes`` packs."""
        return hashes_from_wire(self.hashes)


@dataclass(frozen=True, kw_only=True)
class Abort(Message):
    """Gateway -> worker: drop the request."""

    wire_name: ClassVar[str] = "abort"
    request_id: str


@dataclass(frozen=True, kw_only=True)
class Lost(Message):
    """Gateway's instance watcher -> a request's queue (in process, never sent): a worker
    the request runs on is gone."""

    wire_name: ClassVar[str] = "lost"
    instance_id: str


# -- workers -> workers ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Handoff(Message):
    """Prefill worker (or a CPP group's last stage) -> decode worker: the KV streams are
    done; import them and decode from these tokens with this seed."""

    wire_name: ClassVar[str] = "handoff"
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    seed: int


@dataclass(frozen=True, kw_only=True)
class PrefillDone(Message):
    """vLLM prefill worker -> vLLM decode worker (#19): the prompt's KV went by the servers'
    KV connectors as ``session`` (``streamed``: all ``num_tokens`` of it); decode the whole
    request (the decode server samples the first token again). ``cached_tokens``,
    ``kv_bytes`` and the prompt's log-probabilities (when asked for: the prefill server
    computed them) are the prefill's, for the first tokens message."""

    wire_name: ClassVar[str] = "prefill_done"
    request_id: str
    token_ids: list[int]
    session: str
    num_tokens: int
    streamed: bool
    cached_tokens: int = 0
    kv_bytes: int = 0
    prompt_logprobs: WireLogprobs | None = None

    @property
    def prompt_token_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The prompt's log-probability records (None when none were asked for)."""
        return None if self.prompt_logprobs is None else logprobs_from_wire(self.prompt_logprobs)


@dataclass(frozen=True, kw_only=True)
class CppOffer(Message):
    """CPP stage s > 0 -> stage 0: I can start after ``blocks`` prefix blocks."""

    wire_name: ClassVar[str] = "cpp_offer"
    request_id: str
    stage: int
    blocks: int


@dataclass(frozen=True, kw_only=True)
class CppStart(Message):
    """CPP stage 0 -> the other stages: start after ``start_blocks`` prefix blocks."""

    wire_name: ClassVar[str] = "cpp_start"
    request_id: str
    start_blocks: int


# -- workers -> gateway ----------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Tokens(Message):
    """Worker -> gateway: a request's new tokens from output position ``index`` (the
    first token's message also says how many prompt tokens were cached and how many KV
    bytes moved, and carries the prompt's log-probabilities when they were asked for:
    one per prompt token after the first)."""

    wire_name: ClassVar[str] = "tokens"
    request_id: str
    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: WireLogprobs | None = None
    cached_tokens: int | None = None
    kv_bytes: int = 0
    prompt_logprobs: WireLogprobs | None = None
    #: An embedding request's answer (no tokens, finished ``stop``): its vector as
    #: little-endian float32 bytes.
    embedding: bytes | None = None

    @property
    def token_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The log-probability records (empty when none were asked for)."""
        return logprobs_from_wire(self.logprobs or ())

    @property
    def embedding_values(self) -> tuple[float, ...] | None:
        """The embedding as floats (None: not an embedding answer)."""
        if self.embedding is None:
            return None
        return struct.unpack(f"<{len(self.embedding) // 4}f", self.embedding)

    @property
    def prompt_token_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The prompt's log-probability records (None when none were asked for)."""
        return None if self.prompt_logprobs is None else logprobs_from_wire(self.prompt_logprobs)


@dataclass(frozen=True, kw_only=True)
class Batch(Message):
    """Worker -> gateway: one decode step's ``tokens`` messages for that gateway."""

    wire_name: ClassVar[str] = "batch"
    messages: list[Tokens]


@dataclass(frozen=True, kw_only=True)
class WorkerPong(Message):
    """Worker -> whoever pinged: its engine's load and integrity; ``stats``: its role's
    counters."""

    wire_name: ClassVar[str] = "worker_pong"
    instance_id: str
    role: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_steps: int
    integrity: str
    stats: dict[str, int | float] = field(default_factory=dict)


# -- helpers -------------------------------------------------------------------------------------
def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """Sampling parameters as the map a :class:`WireParams` travels as."""
    return record_to_wire(WireParams.of(params))


def params_from_wire(data: Any) -> SamplingParams:
    """The engine's sampling parameters from :func:`params_to_wire`'s map."""
    return record_from_wire(WireParams, data).to_params()


def check_cache_salt(salt: str | None) -> None:
    """A command's ``cache_salt`` is None or a non-empty string (the gateway sends only
    those); anything else makes the command malformed."""
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r:.40}")


def logprobs_to_wire(entries: tuple[TokenLogprob, ...]) -> WireLogprobs:
    """Token log-probabilities in their wire form."""
    return [
        (e.logprob, [(t, lp) for t, lp in e.top])
        if e.rank is None
        else (e.logprob, [(t, lp) for t, lp in e.top], e.rank)
        for e in entries
    ]


def logprobs_from_wire(data: Any) -> tuple[TokenLogprob, ...]:
    """The records of :func:`logprobs_to_wire`'s lists."""
    return tuple(
        TokenLogprob(
            float(item[0]),
            tuple((int(t), float(v)) for t, v in item[1]),
            None if len(item) < 3 else int(item[2]),
        )
        for item in data
    )


__all__ = [
    "LIFECYCLE_KINDS", "MESSAGE_TYPES", "NO_ENDPOINTS", "Abort", "Arrival", "Batch", "BlockEvent",
    "ClusterIdentity", "ClusterStatus", "ConductorPong", "CppOffer", "CppPrefill", "CppStart", "Drain",
    "Draining", "Endpoints", "Error", "Event", "Events", "Expect", "FirstTokenSeen", "Generate", "Handoff",
    "Heartbeat", "HeldBlocks", "InstanceFailed", "InstanceStatus", "LifecycleEvent", "LoadEvent", "Lost",
    "MalformedMessage", "Member", "Message", "MetricsQuery", "MetricsText", "Ping", "PlacementDecision", "Prefill",
    "PrefillDone", "Record", "Refused", "Register", "RegisterAgain", "Registered", "Release", "Replicate",
    "Replication", "Schedule", "StatusQuery", "Tokens", "WireLogprobs", "WireParams", "WorkerPong",
    "WorkloadQuery", "WorkloadWindow",
    "check_cache_salt", "decode_message", "encode_message", "event_entry", "from_wire",
    "logprobs_from_wire", "logprobs_to_wire", "params_from_wire", "params_to_wire",
    "record_from_wire", "record_to_wire", "to_wire",
]  # fmt: skip
