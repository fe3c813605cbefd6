"""``halfmoon worker``: one prefill, decode or coupled worker process.

Started by ``halfmoon serve``, or by hand to join a running cluster (its command line
names its role, so ``ps`` tells the workers apart)."""

from __future__ import annotations

import argparse
import hashlib
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from halfmoon.core.adapters import (
    check_adapter_dir,
    lora_pairs,
    parse_lora_modules,
    runtime_lora_allowed,
)
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.heap import settle_gc
from halfmoon.core.jsonconfig import config_fields, config_to_json
from halfmoon.core.profiling import parse_profiler_config
from halfmoon.core.request import SCHEDULING_POLICIES
from halfmoon.core.speculative import parse_speculative_config
from halfmoon.costmodel.decode_guard import DECODE_GUARDS
from halfmoon.engine.config import DTYPES, resolve_dtype
from halfmoon.serve.runtime import (
    load_secret,
    read_config_document,
    setup_logging,
    stop_event_on_signals,
    warn_if_public,
)

ROLES = ("prefill", "decode", "coupled")
#: Largest decode-worker KV inbox (shared memory, reserved at start), MiB.
INBOX_MAX_MB = 512
#: ``--kv-compression`` (halfmoon.engine.kvcodec.MODES; listed here to keep this torch-free).
KV_COMPRESSION_MODES = ("none", "int8", "fp8", "zstd")
#: ``--wire-checksum``: what guards KV payloads sent over tcp (see halfmoon.transfer.protocol).
WIRE_CHECKSUMS = ("xxh3", "none")
ENGINES = ("halfmoon", "vllm")
#: ``--prefix-store``: when a prefill worker's block store gets a prompt's blocks
#: (:mod:`halfmoon.serve.worker.prefix_cache`). Without the flag: ``demote`` with
#: halfmoon's engine (more hits from the same store, measured live in docs/benchmarks.md,
#: "Prefix store: copy or demote"), ``copy`` with vLLM's (which cannot demote).
PREFIX_STORE_POLICIES = ("copy", "demote")
#: ``--decode-guard`` without the flag. ``reject``, as the simulator's default and the
#: paper's decoding instance: a live and a simulated cluster given the same SLOs turn the
#: same requests away. With the live preset's 1 s TBT SLO it binds only when a CPU decode
#: step (~10-100 ms) is estimated ten times slower, a worker far past what it can serve.
DEFAULT_DECODE_GUARD = "reject"
#: What ``serve`` and ``worker`` run without ``--model``: a real, small instruct model.
DEFAULT_MODEL = "smollm2-135m-instruct"
#: Exit status of a worker the Conductor refused (it disagrees with the cluster).
REFUSED_EXIT_CODE = 3


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """Engine options shared by ``halfmoon worker`` and ``halfmoon serve``."""
    parser.add_argument(
        "--model", default=DEFAULT_MODEL,
        help=f"an HF model directory, a .gguf file, a named model or a preset "
        f"(`halfmoon model list`; default {DEFAULT_MODEL})",
    )  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype", default="float32",
        help="float32, bfloat16 or float16 (half, float), or auto: the model's config dtype, "
        "a float32 model in bfloat16 (as vLLM picks on a CPU)",
    )  # fmt: skip
    parser.add_argument("--kv-cache-mb", type=float, default=256.0, help="KV pool per worker, MiB")
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, help="sequences per step (decode, coupled)"
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, metavar="N",
        help="tokens one engine step computes at most, a prompt's chunk included (vLLM's "
        "flag; default 2048, a vLLM server's own default with --engine vllm)",
    )  # fmt: skip
    parser.add_argument(
        "--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
        help="LoRA adapters served beside the base model (vLLM's flag): NAME=PATH of a PEFT "
        "directory, or a JSON object with name and path; a request picks one by its "
        "'model' (each adapter's prefix cache is its own)",
    )  # fmt: skip
    parser.add_argument(
        "--enable-lora", action="store_true",
        help="accepted for vLLM's command lines: --lora-modules names the adapters (and "
        "alone enables LoRA); halfmoon serve --allow-runtime-lora-updating loads more "
        "while serving",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help="speculative decoding (vLLM's flag), prompt lookup: e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2}\'; each decode step also checks up to that many draft '
        "tokens copied from the request's own text, and keeps those the model agrees "
        "with (the same tokens as without it, fewer steps); docs/serving.md",
    )  # fmt: skip
    parser.add_argument(
        "--profiler-config", default=None, metavar="JSON",
        help="torch's profiler over the engine's steps (vLLM's flag): e.g. "
        '\'{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}\'; halfmoon serve then '
        "serves POST /start_profile and /stop_profile, between which each worker records "
        "one Chrome trace into the directory (with --engine vllm, each server into a "
        "directory of its own there); docs/serving.md, \"Profiling\"",
    )  # fmt: skip
    parser.add_argument(
        "--scheduling-policy", default="fcfs", choices=SCHEDULING_POLICIES,
        help="how each engine orders its queue (vLLM's flag): fcfs (default; a request's "
        "priority other than 0 is refused), or priority (lower 'priority' first, arrival "
        "among equals; the running request of the highest value is preempted for room)",
    )  # fmt: skip
    parser.add_argument(
        "--decode-guard", default=DEFAULT_DECODE_GUARD, choices=DECODE_GUARDS,
        help="what a decode worker does with a request whose joining would make its "
        "estimated step exceed the cluster's TBT SLO (--tbt-slo): reject it (default; its "
        "prefill is wasted, the client gets a 503 naming the guard), wait until the batch "
        "has room, or admit it anyway (off); as `halfmoon simulate --decode-guard`",
    )  # fmt: skip
    parser.add_argument(
        "--prefill-max-num-seqs", type=int, default=1,
        help="prompts a prefill worker computes per step; 1 (default): one at a time in "
        "arrival order, the queue the Conductor's TTFT estimate assumes",
    )  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--attention", default="auto", choices=("auto", "compiled", "reference"),
        help="decode attention: the compiled kernel reading the paged KV in place (built "
        "once per model shape into the cache), the reference gather + SDPA, or auto (the "
        "kernel when it can be built)",
    )  # fmt: skip
    parser.add_argument(
        "--cuda-graphs", action="store_true",
        help="with --device cuda: replay decode steps from captured CUDA graphs (one per "
        "batch and context bucket; not yet verified on a GPU, so off by default)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="weights seed of a preset")
    parser.add_argument(
        "--kv-compression", default="none", choices=KV_COMPRESSION_MODES,
        help="KV on the wire between prefill and decode workers: none (default), int8 or "
        "fp8 (a scale per token and head, ~3.8x fewer bytes than float32 KV), zstd "
        "(lossless, ~1.2x); every worker of a cluster must use the same (docs/serving.md)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-compression-keep-mb", type=float, default=64.0, metavar="MB",
        help="with --kv-compression: encoded blocks a prefill worker keeps for its peers' "
        "later pulls of the same prefix (a shared system prompt is encoded once, not once "
        "per pull; least recently used out first); 0 encodes every pull",
    )  # fmt: skip
    parser.add_argument(
        "--no-prefix-caching", dest="prefix_caching", action="store_false",
        help="turn off prefix reuse (engine pools and block stores) to measure its effect",
    )  # fmt: skip
    parser.add_argument(
        "--enable-prefix-caching", dest="prefix_caching", action="store_true",
        help="accepted for vLLM's command lines: prefix reuse is on unless --no-prefix-caching",
    )  # fmt: skip
    parser.add_argument(
        "--store-dram-mb", type=float, default=256.0, help="prefill workers' DRAM block store, MiB"
    )
    parser.add_argument(
        "--prefix-store", default=None, choices=PREFIX_STORE_POLICIES,
        help="when a prefill worker's block store gets a prompt's blocks: demote (the "
        "default with halfmoon's engine: only when the pool evicts them, no block held "
        "twice) or copy (after every prefill, so the store also holds what the pool "
        "holds; the default and only choice with --engine vllm); docs/serving.md",
    )  # fmt: skip
    parser.add_argument(
        "--store-ssd-dir",
        default=None,
        help="directory for the prefill workers' SSD tier (one subdirectory each)",
    )
    parser.add_argument("--store-ssd-mb", type=float, default=0.0, help="SSD tier size, MiB")
    parser.add_argument(
        "--engine", default="halfmoon", choices=ENGINES,
        help="halfmoon: this package's engine; vllm: a vLLM OpenAI server per worker, "
        "routed by its KV events, its KV moved by halfmoon's KV connector when "
        "disaggregated (docs/vllm.md)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-python", default=None,
        help="the Python of vLLM's environment (default: $HALFMOON_VLLM_PYTHON, or this "
        "Python if it has vLLM; `make vllm` makes .venv-vllm)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-args", default="",
        help="more arguments for the vLLM server, one string (e.g. \"--enforce-eager\")",
    )  # fmt: skip


def wire_bytes_per_block(raw_bytes: int, codec: Any) -> int:
    """Bytes a KV block of ``raw_bytes`` takes on the wire between workers, what the
    Conductor's transfer estimates use: with ``--kv-compression`` (``codec``) the codec's
    payload, at most the raw size; else the raw size."""
    if codec is None or codec.name == "none":
        return raw_bytes
    return min(raw_bytes, codec.max_encoded_bytes(raw_bytes))


@dataclass(frozen=True)
class EngineOptions:
    """What :func:`add_engine_options` describes, frozen: the document ``halfmoon serve``
    hands each worker (``--config-json``). One field per option, same name."""

    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_mb: float = 256.0
    max_num_seqs: int = 64
    #: ``--max-num-batched-tokens`` (None: the engine's default).
    max_num_batched_tokens: int | None = None
    decode_guard: str = DEFAULT_DECODE_GUARD
    prefill_max_num_seqs: int = 1
    max_model_len: int | None = None
    prefill_chunk_tokens: int | None = None
    num_threads: int = 1
    block_size: int = 16
    attention: str = "auto"
    cuda_graphs: bool = False
    seed: int = 0
    kv_compression: str = "none"
    kv_compression_keep_mb: float = 64.0
    prefix_caching: bool = True
    store_dram_mb: float = 256.0
    prefix_store: str | None = None  # None: demote with halfmoon's engine, else copy
    store_ssd_dir: str | None = None
    store_ssd_mb: float = 0.0
    engine: str = "halfmoon"
    vllm_python: str | None = None
    vllm_args: str = ""
    scheduling_policy: str = "fcfs"
    #: ``(name, PEFT directory)`` per adapter (``--lora-modules``, checked and resolved).
    lora_modules: tuple[tuple[str, str], ...] = ()
    enable_lora: bool = False
    #: ``--speculative-config`` as its canonical JSON (checked), or None.
    speculative_config: str | None = None
    #: ``--profiler-config`` as its canonical JSON (checked), or None: a vLLM-backed worker
    #: starts its server with it (halfmoon's engine gets it with each session's start).
    profiler_config: str | None = None
    #: Adapters may be loaded while serving (``halfmoon serve --allow-runtime-lora-updating``
    #: or vLLM's environment switch): a vLLM-backed worker starts its server ready for them.
    runtime_lora: bool = False

    def __post_init__(self) -> None:
        spec = parse_speculative_config(self.speculative_config)
        object.__setattr__(self, "speculative_config", None if spec is None else spec.to_json())
        profiler = parse_profiler_config(self.profiler_config)
        object.__setattr__(self, "profiler_config", profiler and profiler.to_json())
        if self.enable_lora and not self.lora_modules and not self.runtime_lora:
            raise HalfmoonError(
                "--enable-lora: name the adapters with --lora-modules NAME=PATH, or load them "
                "while serving (--allow-runtime-lora-updating)"
            )
        modules = parse_lora_modules(self.lora_modules)
        for module in modules:
            check_adapter_dir(module)
        object.__setattr__(self, "lora_modules", lora_pairs(modules))
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise HalfmoonError(
                f"unknown --scheduling-policy {self.scheduling_policy!r}; use one of "
                f"{', '.join(SCHEDULING_POLICIES)}"
            )
        if self.kv_compression not in KV_COMPRESSION_MODES:
            raise HalfmoonError(
                f"unknown --kv-compression {self.kv_compression!r}; use one of "
                f"{', '.join(KV_COMPRESSION_MODES)}"
            )
        if self.kv_compression_keep_mb < 0:
            raise HalfmoonError("--kv-compression-keep-mb must be >= 0")
        if self.decode_guard not in DECODE_GUARDS:
            raise HalfmoonError(
                f"unknown --decode-guard {self.decode_guard!r}; use one of "
                f"{', '.join(DECODE_GUARDS)}"
            )
        if self.prefix_store is None:
            default = "demote" if self.engine == "halfmoon" else "copy"
            object.__setattr__(self, "prefix_store", default)
        if self.prefix_store not in PREFIX_STORE_POLICIES:
            raise HalfmoonError(
                f"unknown --prefix-store {self.prefix_store!r}; use one of "
                f"{', '.join(PREFIX_STORE_POLICIES)}"
            )
        if self.prefix_store != "copy" and self.engine != "halfmoon":
            raise HalfmoonError(
                f"--prefix-store {self.prefix_store} needs halfmoon's engine (its pool "
                f"reports evictions); with --engine {self.engine} the engine keeps its own cache"
            )
        if self.kv_compression != "none" and self.engine != "halfmoon":
            raise HalfmoonError(
                "--kv-compression applies to halfmoon's own KV streams; with --engine "
                f"{self.engine} the KV moves through the engine's connector uncompressed"
            )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineOptions:
        """The options parsed by :func:`add_engine_options`."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if f.name != "runtime_lora"}
        allowed = runtime_lora_allowed(
            getattr(args, "allow_runtime_lora_updating", False), os.environ
        )
        return cls(**given, runtime_lora=allowed)

    def to_json(self) -> str:
        """One JSON document."""
        return config_to_json(self)

    @classmethod
    def from_json(cls, text: str) -> EngineOptions:
        """The options :meth:`to_json` wrote; unknown keys are an error (no silent drift)."""
        return cls(**config_fields(cls, text, "engine options"))

    def engine_config(self, role: str | None) -> Any:
        """The EngineConfig of a worker of ``role`` (a prefill worker batches
        ``prefill_max_num_seqs`` prompts)."""
        from halfmoon.engine.config import EngineConfig

        return EngineConfig(
            model=self.model, device=self.device, dtype=self.dtype, block_size=self.block_size,
            kv_cache_mb=self.kv_cache_mb,
            max_num_seqs=self.prefill_max_num_seqs if role == "prefill" else self.max_num_seqs,
            max_model_len=self.max_model_len, prefill_chunk_tokens=self.prefill_chunk_tokens,
            seed=self.seed, num_threads=self.num_threads,
            enable_prefix_caching=self.prefix_caching, attention=self.attention,
            cuda_graphs=self.cuda_graphs, scheduling_policy=self.scheduling_policy,
            lora_modules=self.lora_modules,
            speculative=parse_speculative_config(self.speculative_config),
            **({} if self.max_num_batched_tokens is None
               else {"max_num_batched_tokens": self.max_num_batched_tokens}),
        )  # fmt: skip


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig the options describe."""
    return EngineOptions.from_args(args).engine_config(getattr(args, "role", None))


def worker_options(args: argparse.Namespace) -> EngineOptions:
    """``--config-json`` (what ``halfmoon serve`` passes), else the engine flags."""
    if not args.config_json:
        return EngineOptions.from_args(args)
    try:
        return EngineOptions.from_json(read_config_document(args.config_json))
    except (ValueError, TypeError) as exc:
        raise HalfmoonError(f"--config-json: {exc}") from None


def with_model(engine_json: str, model_dir: Path) -> str:
    """The engine document ``engine_json`` serving the model prepared at ``model_dir``
    (``--dtype auto`` resolved for it)."""
    options = EngineOptions.from_json(engine_json)
    dtype = resolve_dtype(options.dtype, model_dir)
    return replace(options, model=str(model_dir), dtype=dtype).to_json()


def model_identity(model: str, seed: int) -> str:
    """What a registering worker says it serves: the model directory's name and a hash of
    its config.json (the same on every node that prepared the same model)."""
    from halfmoon.engine.catalog import resolve_model

    model_dir = resolve_model(model, seed)
    digest = hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:12]
    return f"{model_dir.name}#{digest}"


def kv_namespace(options: EngineOptions, model: str | None = None) -> bytes:
    """The fingerprint of the KV a worker of ``options`` computes (its model's weights and
    config, dtype, block size and ``--lora-modules``; ``model``: weights installed while
    serving instead of ``options.model``'s): what keys its SSD tier."""
    from halfmoon.engine.catalog import model_fingerprint, resolve_model

    model_dir = resolve_model(model or options.model, options.seed)
    return model_fingerprint(model_dir, options.dtype, options.block_size, options.lora_modules)


#: A directory for the vLLM KV connector's per-request transfer timings (JSON lines, one
#: file per worker; the benchmarks' transfer-vs-prefill figure reads them).
KV_STATS_DIR_ENV = "HALFMOON_KV_STATS_DIR"


def vllm_connector_settings(args: argparse.Namespace, options: EngineOptions, name: str) -> Any:
    """The KV connector settings of a disaggregated ``--engine vllm`` worker: its transfer
    endpoint on a free port of ``--host``, an inbox the size of the KV pool, a store of
    ``--store-dram-mb``."""
    import os

    from halfmoon.serve.runtime import free_port
    from halfmoon.serve.vllm.pd import ConnectorSettings

    stats_dir = os.environ.get(KV_STATS_DIR_ENV, "")
    return ConnectorSettings(
        host=args.host, port=free_port(args.host), transport=args.transport,
        checksum=getattr(args, "wire_checksum", "xxh3") != "none",
        inbox_mb=options.kv_cache_mb, store_mb=options.store_dram_mb,
        hash_block_size=options.block_size,
        stats_path=str(Path(stats_dir) / f"{name}.jsonl") if stats_dir else "",
    )  # fmt: skip


def run_worker(args: argparse.Namespace) -> int:
    """Load the engine, register with the Conductor, serve until SIGTERM."""
    from halfmoon.costmodel import CostProfile
    from halfmoon.engine.connector import LocalConnector
    from halfmoon.serve.worker.conductor_link import (
        ConductorLink,
        Heartbeat,
        RegistrationRefused,
        WorkerIdentity,
    )
    from halfmoon.serve.worker.coupled import CoupledRole
    from halfmoon.serve.worker.decode import DecodeRole
    from halfmoon.serve.worker.decode_guard import DecodeGuard
    from halfmoon.serve.worker.prefill import PrefillRole
    from halfmoon.serve.worker.prefix_cache import ClusterPrefixCache, Holdings
    from halfmoon.serve.worker.process import Worker
    from halfmoon.store.meta import NO_NAMESPACE
    from halfmoon.transfer import TransferEngine

    name = f"{args.role}-{args.index}"
    log = setup_logging(name, args.log_level)
    options = worker_options(args)
    if options.dtype not in DTYPES:  # auto (or an alias): as the model's config says
        from halfmoon.engine.catalog import resolve_model

        model_dir = resolve_model(options.model, options.seed)
        options = replace(options, dtype=resolve_dtype(options.dtype, model_dir))
    warn_if_public(args.host, log)
    secret = load_secret()
    stop = stop_event_on_signals()
    kv_connector = None
    if options.engine == "vllm":
        from halfmoon.serve.vllm.worker import vllm_engine

        if args.role != "coupled":
            kv_connector = vllm_connector_settings(args, options, name)
        engine = vllm_engine(options, name, args.vllm_url, stop.is_set, kv_connector)
    else:
        log.info("%s: loading the model (%s, %s) and building its kernels", name,
                 Path(options.model).name, options.dtype)  # fmt: skip
        engine = LocalConnector.create(options.engine_config(args.role))
    endpoint = f"tcp://{args.host}:{args.port}"
    me = WorkerIdentity(args.role, name, endpoint)
    link = ConductorLink(args.conductor, secret, me)
    store = None
    namespace = NO_NAMESPACE  # (what its SSD tier's blocks are of; a prefill worker's)
    holdings = Holdings(link)
    if kv_connector is not None:  # the KV moves inside vLLM, through halfmoon's connector
        me.transfer_endpoint = kv_connector.endpoint
    elif args.role == "prefill":
        ssd_dir = str(Path(options.store_ssd_dir) / name) if options.store_ssd_dir else None
        if ssd_dir:
            Path(ssd_dir).mkdir(parents=True, exist_ok=True)
            namespace = kv_namespace(options)
        store = ClusterPrefixCache.make_store(
            engine, options.store_dram_mb, ssd_dir, options.store_ssd_mb, holdings, namespace
        )
        foreign = store.stats().num_foreign_blocks
        if foreign:
            log.warning(
                "%s: %s held %d KV blocks of other weights (another model, dtype, block size "
                "or adapters); they are not served and their space is reused", name, ssd_dir,
                foreign,
            )  # fmt: skip
    transfer = None
    if args.role != "coupled" and kv_connector is None:
        transfer = TransferEngine(
            secret, host=args.host, transport=args.transport, store=store,
            checksum=args.wire_checksum != "none",
        )  # fmt: skip
        me.transfer_endpoint = transfer.start()
    worker = Worker(me, engine, secret, link, endpoint)
    link.on_adapters = worker.load_adapters  # the cluster's, given when it accepts us
    link.on_weights = worker.install_cluster_weights  # the same for weight updates
    if store is not None and namespace != NO_NAMESPACE:  # its SSD tier names new weights
        worker.ssd_namespace_of = lambda path: kv_namespace(options, path)
    if kv_connector is None and args.role != "coupled":
        from halfmoon.engine.connector import wire_codec

        # A decode worker only decodes; a prefill worker encodes its streams and the
        # blocks peers pull from its store, and decodes the blocks it pulls.
        directions = ["encode", "decode"] if args.role == "prefill" else ["decode"]
        worker.kv_codec = codec = wire_codec(options.kv_compression, engine.layout, directions)
        if codec.name != "none":
            log.info("KV compression on the wire: %s", codec.description)
    if kv_connector is not None:
        from halfmoon.serve.vllm.roles import VllmDecodeRole, VllmPrefillRole

        worker.set_role((VllmPrefillRole if args.role == "prefill" else VllmDecodeRole)(worker))
    elif args.role == "coupled":
        worker.set_role(CoupledRole(worker))
    elif args.role == "prefill":
        assert transfer is not None and store is not None
        cache = ClusterPrefixCache(engine, store, holdings, options.prefix_store)
        if options.prefix_store == "demote":  # blocks only in the pool are pulled from it
            transfer.set_store_fallback(cache.read_for_peer)
        if worker.kv_codec.name != "none":  # prefix pulls between workers go compressed
            keep = int(options.kv_compression_keep_mb * 2**20)
            transfer.set_pull_encoder(worker.kv_codec.encode, keep)
            worker.encoded_blocks = transfer.encoded_blocks
            cache.pull_codec = worker.kv_codec
        role = PrefillRole(worker, transfer, cache, holdings)
        worker.set_role(role)
    else:
        assert transfer is not None
        # The inbox holds the streams in flight (at most what the pool can take, and at
        # most INBOX_MAX_MB: it is reserved up front; requests beyond get regions of their
        # own).
        inbox_bytes = int(min(options.kv_cache_mb, INBOX_MAX_MB) * 2**20)
        worker.set_role(DecodeRole(worker, transfer, inbox_bytes=inbox_bytes))
    stats = engine.stats()
    if args.profile:
        profile = CostProfile.load(args.profile)
    else:
        from halfmoon.engine.catalog import cache_dir

        profile = engine.cost_profile(options.model, cache_dir() / "profiles")
    if isinstance(worker.role, DecodeRole):
        # Its steps estimated by the profile the Conductor gets (with the rows its recent
        # speculation checked); held to the TBT SLO the Conductor sends when it accepts
        # this worker.
        worker.role.guard = DecodeGuard(
            options.decode_guard, profile, lambda: link.tbt_slo_s,
            lambda: worker.speculation.rates,
        )  # fmt: skip
    try:
        link.register(
            kv_capacity_tokens=stats.num_blocks * options.block_size,
            kv_bytes_per_token=wire_bytes_per_block(engine.kv_bytes_per_block, worker.kv_codec)
            // options.block_size,
            profile=profile.to_dict(),
            hidden_bytes_per_token=engine.hidden_bytes_per_token,
            block_size=options.block_size,
            model=model_identity(options.model, options.seed),
            dtype=options.dtype,
            kv_compression=options.kv_compression,
        )
    except RegistrationRefused as exc:
        log.error("%s", exc)
        worker.close()
        return REFUSED_EXIT_CODE
    worker.heartbeat = Heartbeat(args.conductor, secret, name)
    log.info("%s ready on %s (%d KV blocks)", name, endpoint, stats.num_blocks)
    settle_gc()
    try:
        worker.run(stop.is_set)
        if worker.draining_since_s is not None and not stop.is_set():
            log.info("%s drained: exiting", name)
    finally:
        worker.close()
    return 0


def register(subparsers: Any) -> None:
    """Add ``halfmoon worker``."""
    p = subparsers.add_parser(
        "worker",
        help="run one prefill / decode / coupled worker process",
        description="Run one worker; it registers with the Conductor at --conductor. "
        "The shared secret comes from $HALFMOON_SECRET.",
    )
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--index", type=int, default=0, help="worker number within its role")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="command port")
    p.add_argument("--conductor", required=True, help="Conductor endpoint, tcp://HOST:PORT")
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--profile", default=None, help="cost profile JSON to report instead of measuring"
    )
    p.add_argument(
        "--transport",
        default="auto",
        choices=("auto", "tcp", "shm"),
        help="KV transfer transport to peers (auto: shared memory with co-located peers, else tcp)",
    )
    p.add_argument(
        "--wire-checksum",
        default="xxh3",
        choices=WIRE_CHECKSUMS,
        help="payloads this worker sends: xxh3-checksummed (default) or none",
    )
    p.add_argument(
        "--vllm-url", default=None, metavar="URL,EVENTS[,REPLAY[,TOPIC]]",
        help="with --engine vllm: serve through this running vLLM server (its HTTP URL, "
        "its KV-event PUB endpoint and optionally its replay endpoint) instead of starting one",
    )  # fmt: skip
    p.add_argument(
        "--config-json", default=None, metavar="JSON|PATH",
        help="the engine options as one JSON document (or a file holding it), as "
        "`halfmoon serve` passes them; replaces --model and the other engine options",
    )  # fmt: skip
    add_engine_options(p)
    p.set_defaults(func=run_worker)
