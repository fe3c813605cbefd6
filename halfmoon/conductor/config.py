"""The Conductor's configuration (frozen; every knob documented)."""

from __future__ import annotations

from dataclasses import dataclass, field

from halfmoon.conductor.calibration import MAX_STDDEVS
from halfmoon.core.config import SLOConfig
from halfmoon.core.jsonconfig import config_fields, config_to_json

EARLY_REJECT_MODES = ("none", "snapshot", "predict")
BALANCING_MODES = ("fixed", "adaptive")
PREFIX_FETCH_MODES = ("queued", "overlap")
DECODE_KV_BOOKINGS = ("output", "prompt")


@dataclass(frozen=True)
class ConductorConfig:
    """How the Conductor places and rejects requests.

    - ``policy``: prefill placement policy (see ``halfmoon.conductor.policies.POLICIES``).
    - ``block_size_tokens``: tokens per hashed block of the requests it sees: the
      simulator's block size, and the live cluster's (the Conductor service refuses a
      worker registering, or a placement asked, with another one).
    - ``early_reject``: ``none`` (admit everything), ``snapshot`` (reject when the estimated
      TTFT or the decode TBT *now* breaks the SLO), ``predict`` (TBT at the moment the
      request's prefill would finish, from the paper's load prediction).
    - ``kvcache_balancing_threshold``: the kvcache-centric policy fetches a remote prefix
      only when it is longer than the local one by more than this fraction of the prompt.
    - ``balancing``: ``fixed`` uses that threshold; ``adaptive`` learns it online from
      the measured outcomes of its placements, starting from (and, without enough
      outcomes, falling back to) the configured value (:mod:`halfmoon.conductor.balancing`).
    - ``link_backlog``: book every transfer the Conductor plans (prefix fetches, KV
      hand-offs to decode, hot-spot copies) on the instances' links
      (:mod:`halfmoon.conductor.links`), price a fetch by its wait for both links, and
      count it in the fetching instance's queue. Off, a fetch is priced as if the network
      were idle (the paper's estimate). ``balancing="adaptive"`` turns it on.
    - ``prefix_fetch``: when a prefill instance pulls a remote prefix. ``queued`` (the
      paper's estimate): when the request's turn comes, the instance held meanwhile, so
      TTFT = T_queue + T_transfer + T_prefill (and with link books the fetch holds the
      instance and starts when its queue is through). ``overlap``: when the request
      arrives, while the requests before it run (halfmoon's live prefill workers pull on
      a thread of their own), so TTFT = max(T_queue, T_transfer) + T_prefill, the fetch
      is not counted in the instance's queue and is booked on the links from now. CPP
      groups' fetches stay ``queued``. The simulator's instances do as the Conductor
      estimates unless ``SimConfig.instance_prefix_fetch`` says otherwise. Both presets
      keep ``queued``: with instances that overlap, ``overlap`` estimated no better
      (docs/simulation.md, section 7).
    - ``prefill_calibration``: learn, per prefill instance, how far its measured prefills
      are from the cost model's estimates, and scale its estimates by that; and learn how
      late first tokens reach clients against the TTFT estimates, and add that to the TTFT
      held against the SLO (:mod:`halfmoon.conductor.calibration`). Off, every estimate is
      the cost model's (the paper's, and the simulator's own world, where the two agree
      unless a host is shared). ``lateness_stddevs``: with calibration on, the lateness
      held is its mean plus this many standard deviations (0: the mean).
    - ``decode_time_estimate_s``: the uniform decode duration t_d the prediction assumes;
      None predicts from the distribution of recently observed decode durations
      (:class:`~halfmoon.conductor.admission.DecodeTimes`; t_d is their moving average).
    - ``replicate_remote_prefixes``: plan a copy of remotely fetched blocks to the chosen
      instance (they arrive there anyway; the plan makes the copy a cached one).
    - Hot-spot replication: a prefix (identified by its last cached block) used by at least
      ``hot_min_requests`` requests within ``hot_window_s`` seconds is copied to more
      instances, up to ``hot_max_replicas`` holders; 0 disables it.
    - ``coupled_router``: how coupled (prefill+decode) instances are chosen.
    - Chunked pipeline parallelism (CPP): with ``cpp_stages`` K > 1, the registered prefill
      instances form disjoint groups of K consecutive ones (P1..PK, PK+1..P2K, ...; a
      remainder forms no group). A prompt of at least ``cpp_min_tokens`` tokens also gets
      one candidate per group: its new tokens cut into chunks of ``cpp_chunk_tokens``
      flow through the K stages (``halfmoon.costmodel.pipeline``). The group is chosen
      only when its TTFT is lower than that of the policy's single-instance choice.
      ``cpp_hidden_bytes_per_token``: bytes handed between stages per token (None: the
      cost model's hidden size x dtype bytes).
    - ``decode_time_by_prefix``: predict each request's decode duration from those of
      the earlier requests that share its prompt's first block (their median), and let
      the prediction (``early_reject="predict"``) count a request with one as leaving
      at its own t_d (:mod:`halfmoon.conductor.lengths`); off, every request by the
      durations of all.
    - ``decode_kv_booking``: what a request holds of its decode instance's KV pool when
      the Conductor checks for room (``early_reject``'s KV check, and the choice of a
      decode instance with room). ``output``: its prompt plus ``output_length``, all of
      its KV from the start, as the simulator's decode instances reserve it (a trace
      gives each request's output length). ``prompt``: its prompt and first token only,
      as the live engines admit it (vLLM's and halfmoon's grow a request's KV as it
      decodes and preempt one when the pool is full): live, ``output_length`` is the
      client's ``max_tokens``, a bound (the whole context when a chat request leaves it
      out), and holding it against the pool refused concurrent requests on an idle
      cluster.
    - ``priority_estimates``: estimate a request's T_queue from the bookings its engine
      serves before it under vLLM's ``priority`` policy (those of a lower or equal
      priority value, and the one in service: :class:`~halfmoon.conductor.state.PrefillState`);
      off, from every booking, as under ``fcfs`` (for comparison: under ``fcfs`` every
      request has priority 0, and the two agree).

    The defaults are the ``paper`` preset (:mod:`halfmoon.conductor.options`).
    """

    policy: str = "kvcache-centric"
    block_size_tokens: int = 512
    slo: SLOConfig = field(default_factory=SLOConfig)
    early_reject: str = "none"
    kvcache_balancing_threshold: float = 0.1
    balancing: str = "fixed"
    link_backlog: bool = False
    prefix_fetch: str = "queued"
    prefill_calibration: bool = False
    lateness_stddevs: float = 0.0
    decode_time_estimate_s: float | None = None
    replicate_remote_prefixes: bool = True
    hot_min_requests: int = 8
    hot_window_s: float = 60.0
    hot_max_replicas: int = 2
    coupled_router: str = "cache-aware"
    cpp_stages: int = 1
    cpp_chunk_tokens: int = 1024
    cpp_min_tokens: int = 2048
    cpp_hidden_bytes_per_token: int | None = None
    priority_estimates: bool = True
    decode_time_by_prefix: bool = False
    decode_kv_booking: str = "output"

    def __post_init__(self) -> None:
        if self.decode_kv_booking not in DECODE_KV_BOOKINGS:
            raise ValueError(
                f"unknown decode KV booking {self.decode_kv_booking!r}; "
                f"choose from {', '.join(DECODE_KV_BOOKINGS)}"
            )
        if self.early_reject not in EARLY_REJECT_MODES:
            raise ValueError(
                f"unknown early-reject mode {self.early_reject!r}; "
                f"choose from {', '.join(EARLY_REJECT_MODES)}"
            )
        if self.block_size_tokens < 1:
            raise ValueError(f"block_size_tokens must be >= 1, got {self.block_size_tokens}")
        if not 0 <= self.kvcache_balancing_threshold <= 1:
            raise ValueError("kvcache_balancing_threshold must be in [0, 1]")
        if self.balancing not in BALANCING_MODES:
            raise ValueError(
                f"unknown balancing mode {self.balancing!r}; choose from {', '.join(BALANCING_MODES)}"
            )
        if self.prefix_fetch not in PREFIX_FETCH_MODES:
            raise ValueError(
                f"unknown prefix-fetch mode {self.prefix_fetch!r}; "
                f"choose from {', '.join(PREFIX_FETCH_MODES)}"
            )
        if not 0 <= self.lateness_stddevs <= MAX_STDDEVS:
            raise ValueError(
                f"lateness_stddevs must be in [0, {MAX_STDDEVS}], got {self.lateness_stddevs}"
            )
        if self.hot_min_requests < 0 or self.hot_window_s <= 0 or self.hot_max_replicas < 0:
            raise ValueError("hot-spot parameters must be non-negative (window positive)")
        if self.cpp_stages < 1:
            raise ValueError(f"cpp_stages must be >= 1, got {self.cpp_stages}")
        if self.cpp_chunk_tokens < 1:
            raise ValueError(f"cpp_chunk_tokens must be >= 1, got {self.cpp_chunk_tokens}")
        if self.cpp_min_tokens < 0:
            raise ValueError(f"cpp_min_tokens must be >= 0, got {self.cpp_min_tokens}")
        if self.cpp_hidden_bytes_per_token is not None and self.cpp_hidden_bytes_per_token < 0:
            raise ValueError("cpp_hidden_bytes_per_token must be >= 0")

    @property
    def prices_links(self) -> bool:
        """Whether placements price fetches by the links' backlog (``link_backlog``, or
        the adaptive balancing that relies on it)."""
        return self.link_backlog or self.balancing == "adaptive"

    @property
    def overlaps_fetches(self) -> bool:
        """Whether a single instance's prefix fetch runs while its queue does."""
        return self.prefix_fetch == "overlap"

    def to_json(self) -> str:
        """The config as one JSON document (what a launcher hands a Conductor process)."""
        return config_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> ConductorConfig:
        """The config :meth:`to_json` wrote; unknown keys are an error (no silent drift)."""
        data = config_fields(cls, text, "ConductorConfig keys")
        if "slo" in data:
            data["slo"] = SLOConfig(**data["slo"])
        return cls(**data)
