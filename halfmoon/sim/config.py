"""What a simulated cluster looks like: the cluster spec string and the simulator's knobs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from halfmoon.conductor.config import PREFIX_FETCH_MODES
from halfmoon.core.config import SLOConfig
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.eviction import POLICY_NAMES
from halfmoon.core.request import SCHEDULING_POLICIES
from halfmoon.costmodel.base import CostModel
from halfmoon.costmodel.decode_guard import DECODE_GUARDS
from halfmoon.costmodel.serving import ServingTerms
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates

#: ``8P8D`` (8 prefill + 8 decode instances) or ``16M`` (16 coupled, vLLM-like instances).
_CLUSTER_RE = re.compile(r"^\s*(?:(\d+)\s*P\s*(\d+)\s*D|(\d+)\s*M)\s*$", re.IGNORECASE)

#: When a disaggregated request's first token counts as delivered (``first_token_at``).
FIRST_TOKEN_AT = ("join", "kv")
# DECODE_GUARDS (what a decode instance does with a request whose admission would break
# the TBT SLO) lives in halfmoon.costmodel.decode_guard: the live decode worker shares it.


@dataclass(frozen=True)
class ClusterSpec:
    """Instance counts: disaggregated (``num_prefill`` P + ``num_decode`` D) or coupled."""

    num_prefill: int = 0
    num_decode: int = 0
    num_coupled: int = 0

    def __post_init__(self) -> None:
        counts = (self.num_prefill, self.num_decode, self.num_coupled)
        if min(counts) < 0:
            raise HalfmoonError(f"instance counts must be >= 0, got {counts}")
        if self.num_coupled and (self.num_prefill or self.num_decode):
            raise HalfmoonError("a cluster is either disaggregated (xPyD) or coupled (xM)")
        if not self.num_coupled and (self.num_prefill < 1 or self.num_decode < 1):
            raise HalfmoonError(
                f"cluster {self} needs at least one prefill and one decode instance"
            )

    @classmethod
    def parse(cls, text: str) -> ClusterSpec:
        """Parse ``8P8D``, ``3P1D``, ``16M``...; anything else raises HalfmoonError."""
        match = _CLUSTER_RE.match(text or "")
        if match is None:
            raise HalfmoonError(
                f"bad cluster spec {text!r}: expected xPyD (e.g. 8P8D) or xM (e.g. 16M)"
            )
        prefill, decode, coupled = match.groups()
        if coupled is not None:
            if int(coupled) < 1:
                raise HalfmoonError(f"bad cluster spec {text!r}: needs at least one instance")
            return cls(num_coupled=int(coupled))
        return cls(num_prefill=int(prefill), num_decode=int(decode))

    @property
    def coupled(self) -> bool:
        """Whether the instances do both prefill and decode."""
        return self.num_coupled > 0

    @property
    def num_instances(self) -> int:
        """Instances in the cluster."""
        return self.num_prefill + self.num_decode + self.num_coupled

    def __str__(self) -> str:
        if self.num_coupled:
            return f"{self.num_coupled}M"
        return f"{self.num_prefill}P{self.num_decode}D"


@dataclass(frozen=True)
class SimConfig:
    """Knobs of the simulated instances (the Conductor has its own ``ConductorConfig``).

    Prefill instances:
    - ``prefill_chunk_tokens``: compute a prompt in chunks of this many tokens (each chunk
      attends to everything before it); None computes it in one pass, which is what the
      Conductor's estimate assumes.
    - ``cache_capacity_tokens`` / ``cache_policy``: the instance's local DRAM prefix cache
      (None: unbounded). The default, 3M tokens, is ~1 TB of LLaMA2-70B KV (320 KiB/token),
      the DRAM of one 8-GPU node.
    - ``num_layers``: the model's layers; KV streams to decode layer by layer.
    - ``instance_prefix_fetch``: when an instance pulls a remote prefix: ``queued`` (when the
      request's turn comes, the instance held), ``overlap`` (from the request's arrival,
      while the queue runs, as halfmoon's live workers do); None (the default): as the
      Conductor estimates (``ConductorConfig.prefix_fetch``). Setting it apart from the
      Conductor's simulates an estimate that does not match the instances.

    Decode instances:
    - ``kv_capacity_tokens``: KV memory per decode or coupled instance (None: the cost
      model's). A request reserves ``input + output`` tokens when it joins the batch.
    - ``decode_tbt_guard``: a request whose admission would make the estimated decode step
      exceed the TBT SLO is ``reject``-ed (the paper's "decoding instance rejects": its
      prefill is wasted), made to ``wait`` until it fits, or admitted anyway (``off``).
    - ``max_batch_size``: running sequences per batch (vLLM's ``max_num_seqs``).
    - ``speculation``: speculative decoding's rows checked and tokens gained per
      sequence and step (:class:`~halfmoon.costmodel.speculation.SpeculationRates`, e.g.
      a live worker's measured ones); the Conductor knows them, as it does from a live
      worker's load reports. Default: none. ``speculation_blind``: the Conductor and the
      decode guard estimate as if nothing speculated (a scheduler unaware of it) while
      the steps still speculate.

    Coupled (vLLM-like) instances:
    - ``coupled_prefix_caching``: local prefix cache in HBM, ``coupled_cache_capacity_tokens``
      (None: the instance's KV capacity; generous to the baseline: the cache does not
      compete with running requests).
    - ``coupled_chunked_prefill``: Sarathi-style mixed batches of at most
      ``coupled_token_budget`` tokens (decodes first); otherwise vLLM v0's default, a
      prefill step of waiting prompts (up to ``coupled_max_batched_tokens`` new tokens, at
      least one prompt) runs before any decode step while prompts fit.

    Serving path: ``serving`` holds the time a live deployment spends outside the
    engine's forward passes (:class:`~halfmoon.costmodel.serving.ServingTerms`: a delay
    per request before placement, hand-over time on the prefill instance, a per-sequence
    cost in every decode step, the KV import of a joining request); all zero by default,
    which is the engine-only model.

    ``host_cores``: the instances are single-threaded processes sharing this many CPUs
    with the serving path (``serving.background_cpu_s_per_token`` per emitted token); a
    busy instance slows down when demand exceeds the cores (:mod:`halfmoon.sim.host`).
    None (the default): every instance has its own hardware.

    ``first_token_at``: when a disaggregated request's first token (the one its prefill
    computed) counts as delivered: ``join`` (default), when the decode instance takes it
    into its batch at a step boundary; ``kv``, when its KV has arrived there, as a live
    prefill worker sends it once its KV stream is across (waiting for room and for the
    running step then shows as the gap to the second token, as a live client sees it).

    ``scheduling_policy``: how prefill and coupled instances order their waiting
    requests: ``fcfs`` (arrival order) or ``priority`` (vLLM's: by each request's
    ``priority``, lower first, then arrival; the ones in progress are not interrupted).

    Workload: ``time_scale`` divides arrival times (2 replays twice as fast);
    ``max_requests`` stops reading the workload after that many requests.
    """

    cluster: ClusterSpec
    slo: SLOConfig = field(default_factory=SLOConfig)
    num_layers: int = 80
    prefill_chunk_tokens: int | None = None
    cache_capacity_tokens: int | None = 3_000_000
    cache_policy: str = "lru"
    kv_capacity_tokens: int | None = None
    decode_tbt_guard: str = "reject"
    max_batch_size: int = 256
    coupled_prefix_caching: bool = True
    coupled_cache_capacity_tokens: int | None = None
    coupled_chunked_prefill: bool = False
    coupled_token_budget: int = 2048
    coupled_max_batched_tokens: int = 32768
    time_scale: float = 1.0
    max_requests: int | None = None
    serving: ServingTerms = field(default_factory=lambda: ServingTerms())
    host_cores: float | None = None
    first_token_at: str = "join"
    instance_prefix_fetch: str | None = None
    scheduling_policy: str = "fcfs"
    speculation: SpeculationRates = NO_SPECULATION
    speculation_blind: bool = False

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise HalfmoonError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        fetch = self.instance_prefix_fetch
        if fetch is not None and fetch not in PREFIX_FETCH_MODES:
            raise HalfmoonError(
                f"instance_prefix_fetch must be one of {', '.join(PREFIX_FETCH_MODES)}, "
                f"got {fetch!r}"
            )
        if self.first_token_at not in FIRST_TOKEN_AT:
            raise HalfmoonError(
                f"first_token_at must be one of {', '.join(FIRST_TOKEN_AT)}, "
                f"got {self.first_token_at!r}"
            )
        if self.num_layers < 1:
            raise HalfmoonError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 1:
            raise HalfmoonError(
                f"prefill chunk size must be >= 1 token, got {self.prefill_chunk_tokens}"
            )
        for name in (
            "cache_capacity_tokens",
            "kv_capacity_tokens",
            "coupled_cache_capacity_tokens",
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise HalfmoonError(f"{name} must be >= 0, got {value}")
        if self.cache_policy not in POLICY_NAMES:
            raise HalfmoonError(
                f"unknown cache policy {self.cache_policy!r}; choose from {', '.join(POLICY_NAMES)}"
            )
        if self.decode_tbt_guard not in DECODE_GUARDS:
            raise HalfmoonError(
                f"unknown decode TBT guard {self.decode_tbt_guard!r}; "
                f"choose from {', '.join(DECODE_GUARDS)}"
            )
        if self.max_batch_size < 1:
            raise HalfmoonError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.coupled_token_budget < 1 or self.coupled_max_batched_tokens < 1:
            raise HalfmoonError("coupled token budgets must be >= 1")
        if not self.time_scale > 0:
            raise HalfmoonError(f"time scale must be > 0, got {self.time_scale}")
        if self.host_cores is not None and not self.host_cores > 0:
            raise HalfmoonError(f"host_cores must be > 0, got {self.host_cores}")
        if self.max_requests is not None and self.max_requests < 1:
            raise HalfmoonError(f"max_requests must be >= 1, got {self.max_requests}")


@dataclass(frozen=True, kw_only=True)
class InstanceSpec:
    """The shape, cost and capacity of a simulated cluster's instances, shared by its
    prefill, decode and coupled instances (each kind reads the knobs it needs).

    - ``config``: the simulator's knobs (:class:`SimConfig`). A prefill instance reads
      ``num_layers``, ``prefill_chunk_tokens`` and ``serving.prefill_handoff_s_per_token``;
      a decode instance ``slo.tbt_s``, ``decode_tbt_guard``, ``max_batch_size``,
      ``serving`` and ``first_token_at``; a coupled instance ``max_batch_size``,
      ``coupled_chunked_prefill``, ``coupled_token_budget``,
      ``coupled_max_batched_tokens`` and ``serving``.
    - ``cost_model``: forward-pass and transfer times, KV bytes per token.
    - ``kv_capacity_tokens``: KV memory per decode or coupled instance, resolved
      (:meth:`for_config` takes ``config.kv_capacity_tokens``, else the cost model's);
      must be > 0.

    What wires an instance into a run (clock, Conductor callback, host, random stream,
    prefix cache) is passed to its constructor by keyword, not held here.
    """

    config: SimConfig
    cost_model: CostModel
    kv_capacity_tokens: int

    def __post_init__(self) -> None:
        if self.kv_capacity_tokens <= 0:
            raise HalfmoonError("no KV capacity: the model's weights fill the instance's memory")

    @classmethod
    def for_config(cls, config: SimConfig, cost_model: CostModel) -> InstanceSpec:
        """The spec of ``config``'s instances on ``cost_model``: the KV capacity is
        ``config.kv_capacity_tokens``, or the cost model's when that is None; raises
        HalfmoonError when it is not positive."""
        capacity = config.kv_capacity_tokens
        if capacity is None:
            capacity = cost_model.kv_capacity_tokens()
        return cls(config=config, cost_model=cost_model, kv_capacity_tokens=capacity)
