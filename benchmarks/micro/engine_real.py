"""halfmoon's engine vs vLLM's CPU build vs transformers on a real model, same weights,
same threads: decode step time at batch 1, 8, 32 x context 512, 2048, and prefill
tokens/s for one 2048-token prompt.

halfmoon's ``LLMEngine`` and transformers (``generate``, SDPA, ``use_cache``) run in this
process; vLLM's offline ``LLM`` runs in ``.venv-vllm`` (``make vllm`` / ``vllm_env.sh`` makes
it) as a subprocess, ``benchmarks/micro/vllm_peer.py``, driven line by line so that the three
take turns. Every engine gets float32 (``--dtype bfloat16``: bfloat16), ``--threads`` threads (vLLM: ``OMP_NUM_THREADS``
and its thread binding), prefix caching off, the same ``max_model_len``, greedy
sampling, ``ignore_eos`` and the same random token-id prompts (distinct per sequence).

One method for all three:

- decode step (ms) = (T(max_tokens=1+k) - T(max_tokens=1)) / k over a batch of B
  prompts of C tokens whose KV (all but the last prompt token) is already in the cache:
  halfmoon imports it (``import_request``, random N(0, 1) KV; the import is not timed),
  vLLM marks the requests for its own ``DecodeBenchConnector`` (KV filled once at
  startup with N(0, 1) values), transformers gets a ``DynamicCache`` of random N(0, 1)
  KV and ``generate`` continues from it. T covers submit -> every sequence done (first
  token computed from the last prompt token, then max_tokens - 1 decode steps); the
  difference leaves k decode steps at batch B, context C+1 .. C+k. Step time does not
  depend on the KV values; a real prefill of 32 x 2048 tokens would take ~10 minutes
  per engine on 2 cores.
- prefill tokens/s = 2048 / T(max_tokens=1) for a fresh 2048-token prompt (real prefill,
  one chunk).

Rounds alternate the engines (the order rotates each round) so background load hits all
alike; each round's ratio is kept. Ratios are ``other / halfmoon`` for times (decode:
``vllm_ms / halfmoon_ms``) and ``halfmoon / other`` for tokens/s: > 1 means halfmoon is
faster. Tables show medians (the ratio column: the median of the per-round ratios).

Tokens are checked on a real (prefilled) path: greedy outputs of two short text prompts
(8 tokens) and the first token of every 2048-token prefill prompt must agree across the
engines; disagreements are printed and kept in the JSON, never hidden.

Allocator: vLLM runs with tcmalloc preloaded (its CPU guide). This process (halfmoon and
transformers) keeps glibc's malloc unless ``--malloc glibc-tuned`` (freed blocks up to
32 MiB stay in the heap instead of going back to the kernel) or ``--malloc tcmalloc``;
back to back on this machine either was ~10-15% faster than the default at batch 8 x
context 512. Other load on the cores moves every number far more than that (the
engines' per-round times swing up to 10x): hence the rotating rounds and per-round ratios.

Usage::

    benchmarks/micro/vllm_env.sh          # once: .venv-vllm (make vllm)
    .venv/bin/python -m benchmarks.micro.engine_real --model DIR_OR_NAME [--threads 2]
        [--device cpu|cuda] [--rounds 5] [--k 12] [--k-large 8] [--malloc default|glibc-tuned|tcmalloc]
        [--json benchmarks/results/engine_real.json] [--quick]

``--quick``: context 512, batch 1 and 8, k 4, one round, a 512-token prefill (~3 min,
most of it vLLM's start). A full run takes ~15 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from halfmoon.core.request import SamplingParams
from halfmoon.engine import hugepages
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import KVHandoff, LLMEngine
from halfmoon.engine.kv_cache import torch_dtype

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
#: vLLM's venv (``make vllm`` makes it), shared with ``--engine vllm``.
VLLM_VENV = ROOT / ".venv-vllm"
ENGINES = ("halfmoon", "vllm", "transformers")
SHORT = {"halfmoon": "hm", "halfmoon-eager": "hm-eager", "halfmoon-reference": "hm-ref",
         "vllm": "vllm", "transformers": "hf"}  # fmt: skip
#: Run only when named in --engines, beside "halfmoon" (side by side in one run):
#: halfmoon without CUDA graphs (a --cuda-graphs run's own speed-up), and halfmoon with
#: the reference attention (gather + SDPA: what the compiled kernel and glue give).
OPTIONAL_ENGINES = {
    "halfmoon-eager": {"cuda_graphs": False},
    "halfmoon-reference": {"attention": "reference"},
}
TEXT_PROMPTS = ("The capital of France is", "def fibonacci(n):\n    ")
CHECK_TOKENS = 8
MALLOC_MARK = "HALFMOON_ENGINE_REAL_MALLOC"
TCMALLOC = "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
#: ``--malloc`` modes for this process (halfmoon and transformers). glibc hands blocks of
#: 128 KiB+ back to the kernel at every free, so a step's fresh activations page-fault in
#: again; ``glibc-tuned`` keeps blocks up to 32 MiB (glibc's ceiling) in the heap.
MALLOC_ENV = {
    "default": {},
    "glibc-tuned": {
        "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
        "MALLOC_TRIM_THRESHOLD_": str(4 << 30),
        "MALLOC_TOP_PAD_": str(256 << 20),
    },
    "tcmalloc": {"LD_PRELOAD": TCMALLOC},
}


def resolve_model_dir(value: str) -> str:
    """An HF directory as given, else whatever halfmoon's model catalog makes of it."""
    if os.path.isdir(value):
        return os.path.abspath(value)
    try:
        from halfmoon.engine.catalog import resolve_model
    except ImportError as exc:
        raise SystemExit(
            f"--model {value!r} is not a directory, and halfmoon.engine.catalog (which "
            f"resolves model names) cannot be imported: {exc}"
        ) from exc
    return str(resolve_model(value))


# -- the three engines ---------------------------------------------------------------------


class VllmPeer:
    """benchmarks/micro/vllm_peer.py --serve in the vLLM venv, one JSON line each way."""

    def __init__(self, python: str, model: str, args: argparse.Namespace, log_path: str):
        if not os.access(python, os.X_OK):
            raise SystemExit(f"no vLLM venv at {python}: run benchmarks/micro/vllm_env.sh first")
        self.log = open(log_path, "w")  # noqa: SIM115 - lives as long as the peer
        cmd = [
            python, str(HERE / "vllm_peer.py"), "--serve", "--model", model,
            "--threads", str(args.threads), "--max-model-len", str(args.max_model_len),
            "--max-num-seqs", str(max(args.batches)), "--max-num-batched-tokens",
            str(args.max_num_batched_tokens), "--kv-space-gb", str(args.vllm_kv_gb),
            "--dtype", getattr(args, "dtype", "float32"),
        ]  # fmt: skip
        lora_modules = getattr(args, "lora_modules", ())
        if lora_modules:
            cmd += ["--max-lora-rank", str(args.max_lora_rank), "--lora-modules", *lora_modules]
        if getattr(args, "speculative_config", None):
            cmd += ["--speculative-config", args.speculative_config]
        if getattr(args, "log_stats", False):
            cmd += ["--log-stats"]
        # The peer sets its own allocator (tcmalloc, vLLM's CPU guide) and paths.
        drop = ("VIRTUAL_ENV", "PYTHON", "MALLOC_", "LD_PRELOAD", MALLOC_MARK)
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
            env=env, cwd=str(ROOT),
        )  # fmt: skip
        self.info: dict[str, Any] | None = None

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"vLLM peer exited (rc {self.proc.wait()}); see {self.log.name}")
        msg = json.loads(line)
        if "error" in msg:
            raise SystemExit(f"vLLM peer: {msg['error']} (log: {self.log.name})")
        return msg

    def wait_ready(self) -> dict[str, Any]:
        if self.info is None:
            self.info = self._read()
        return self.info

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def generate(
        self, prompts: list[list[int]], max_tokens: int, fill: bool, regex: str | None = None,
        loras: list[str | None] | None = None, ignore_eos: bool = True, all_ids: bool = False,
    ):  # fmt: skip
        msg = self._ask({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                         "fill": fill, "regex": regex, "loras": loras, "ignore_eos": ignore_eos,
                         "all_ids": all_ids})  # fmt: skip
        return msg["elapsed_s"], msg["token_ids"]

    def counters(self) -> dict[str, float]:
        """vLLM's counters so far (see vllm_peer.py's ``counters`` op)."""
        return self._ask({"op": "counters"})["counters"]

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


class Halfmoon:
    def __init__(
        self,
        model: str,
        args: argparse.Namespace,
        cuda_graphs: bool | None = None,
        attention: str | None = None,
    ):
        self.engine = LLMEngine(
            EngineConfig(
                model=model, dtype=getattr(args, "dtype", "float32"), kv_cache_mb=args.halfmoon_kv_mb,
                max_num_seqs=max(args.batches), max_num_batched_tokens=args.max_num_batched_tokens,
                max_model_len=args.max_model_len, enable_prefix_caching=False,
                num_threads=args.threads, attention=attention or args.attention, device=args.device,
                cuda_graphs=args.cuda_graphs if cuda_graphs is None else cuda_graphs,
            )
        )  # fmt: skip
        self.counter = 0

    def generate(self, prompts: list[list[int]], max_tokens: int):
        start = time.perf_counter()
        outs = self.engine.generate(prompts, greedy(max_tokens))
        return time.perf_counter() - start, [list(o.token_ids) for o in outs]

    def handoffs(self, prompts: list[list[int]], seed: int) -> list[KVHandoff]:
        """Each prompt with random KV for all but its last token."""
        layout = self.engine.kv_layout
        computed = len(prompts[0]) - 1
        generator = torch.Generator().manual_seed(seed)
        data = torch.randn(layout.buffer_shape(-(-computed // layout.block_size)),
                           generator=generator).to(torch_dtype(layout.dtype))  # fmt: skip
        return [
            KVHandoff(request_id=f"d{i}", token_ids=tuple(p), num_prompt_tokens=len(p),
                      num_computed_tokens=computed, seed=0, layout=layout, data=data)
            for i, p in enumerate(prompts)
        ]  # fmt: skip

    def decode(self, handoffs: list[KVHandoff], max_tokens: int):
        self.counter += 1
        for h in handoffs:  # the import copies the KV in; not timed
            self.engine.import_request(h, greedy(max_tokens), f"{h.request_id}-{self.counter}")
        sync(self.engine.config.device)  # a GPU's copies of the import end before the clock
        final = {}
        start = time.perf_counter()
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        elapsed = time.perf_counter() - start
        tokens = [list(final[f"{h.request_id}-{self.counter}"].token_ids) for h in handoffs]
        assert all(len(t) == max_tokens for t in tokens), [len(t) for t in tokens]
        return elapsed, tokens


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class Transformers:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32"):
        import transformers

        transformers.logging.set_verbosity_error()
        self.device = device
        self.model = (
            transformers.AutoModelForCausalLM.from_pretrained(
                model, dtype=getattr(torch, dtype), attn_implementation="sdpa"
            )
            .eval()
            .to(device)
        )
        self.config = self.model.config
        self.version = transformers.__version__

    def _generate(self, ids: torch.Tensor, max_tokens: int, cache=None) -> torch.Tensor:
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False, use_cache=True,
            eos_token_id=None, pad_token_id=self.config.pad_token_id or 0,
        )  # fmt: skip
        mask = torch.ones_like(ids)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache,
                                      generation_config=config)  # fmt: skip
        sync(self.device)
        assert out.shape[1] == ids.shape[1] + max_tokens, (out.shape, ids.shape, max_tokens)
        return out[:, ids.shape[1] :]

    def generate(self, prompts: list[list[int]], max_tokens: int):
        """One prompt at a time (same lengths would need no padding; these differ)."""
        elapsed, tokens = 0.0, []
        for p in prompts:
            start = time.perf_counter()
            out = self._generate(torch.tensor([p], device=self.device), max_tokens)
            elapsed += time.perf_counter() - start
            tokens.append(out[0].tolist())
        return elapsed, tokens

    def random_cache(self, batch: int, computed: int, seed: int):
        from transformers import DynamicCache

        generator = torch.Generator().manual_seed(seed)
        shape = (batch, self.config.num_key_value_heads, computed, self.config.head_dim)
        key, value = (
            torch.randn(shape, generator=generator).to(self.device),
            torch.randn(shape, generator=generator).to(self.device),
        )
        cache = DynamicCache(config=self.config)
        for layer in range(self.config.num_hidden_layers):
            cache.update(key.clone(), value.clone(), layer)
        return cache

    def decode(self, ids: torch.Tensor, cache, max_tokens: int):
        # Back to the prompt's KV less its last token (crop takes the count to remove).
        extra = cache.get_seq_length() - (ids.shape[1] - 1)
        if extra > 0:
            cache.crop(-extra)
        start = time.perf_counter()
        out = self._generate(ids, max_tokens, cache)
        return time.perf_counter() - start, out.tolist()


# -- measurement ---------------------------------------------------------------------------


def rotated(engines: list[str], round_index: int) -> list[str]:
    shift = round_index % len(engines)
    return engines[shift:] + engines[:shift]


def random_prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (batch, length), generator=generator).tolist()


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def ratio_rows(per_round: dict[str, list[float]], invert: bool) -> dict[str, list[float]]:
    """Per-round ratios against halfmoon, > 1 = halfmoon faster."""
    out = {}
    hm = per_round.get("halfmoon")
    for name, values in per_round.items():
        if name == "halfmoon" or hm is None:
            continue
        out[f"{SHORT[name]}/hm" if not invert else f"hm/{SHORT[name]}"] = [
            (o / h if not invert else h / o) for o, h in zip(values, hm, strict=True)
        ]
    return out


def check_tokens(runners: dict[str, Callable], tokenizer, log: Callable[[str], None]):
    """Greedy tokens of short real prompts (real prefill) must agree across engines."""
    results = []
    for text in TEXT_PROMPTS:
        ids = tokenizer(text)["input_ids"]
        got = {name: run([ids], CHECK_TOKENS)[1][0] for name, run in runners.items()}
        ref = got.get("halfmoon") or next(iter(got.values()))
        agree = {name: _common_prefix(ref, toks) for name, toks in got.items()}
        results.append({"prompt": text, "prompt_ids": ids, "tokens": got,
                        "agree_prefix": agree, "all_agree": all(t == ref for t in got.values())})  # fmt: skip
        status = "agree" if results[-1]["all_agree"] else "DISAGREE"
        log(f"  tokens {text!r}: {status} " + ", ".join(f"{n}={t}" for n, t in got.items()))
    return results


def _mem_available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF directory or a model name")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="weights and KV of every engine (vLLM's CPU default: bfloat16)",
    )
    parser.add_argument("--device", default="cpu",
                        help="halfmoon's and transformers' device (cpu, cuda); vLLM's CPU "
                        "build stays on the CPU: leave it out (--engines) on a GPU")  # fmt: skip
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="comma-separated, of " + ", ".join(ENGINES) + "; and "
                        "halfmoon-eager (halfmoon without graphs, with --cuda-graphs), "
                        "halfmoon-reference (halfmoon with --attention reference)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5, help="decode rounds per case")
    parser.add_argument("--prefill-rounds", type=int, default=3, help="0 skips the prefill cases")
    parser.add_argument("--k", type=int, default=12, help="decode steps timed per run")
    parser.add_argument("--k-large", type=int, default=8,
                        help="k for batch 32 x context 2048 (transformers' steps are slow)")  # fmt: skip
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--prefill-tokens", default="2048,8191",
                        help="prompt lengths of the prefill cases (comma-separated)")  # fmt: skip
    parser.add_argument("--hf-prefill-max", type=int, default=2048,
                        help="transformers runs the prefill cases up to this length")  # fmt: skip
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="default: 2304, or the longest prefill + 1")  # fmt: skip
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="default: 2048, or the longest prefill (one chunk)")  # fmt: skip
    parser.add_argument("--attention", default="auto",
                        help="halfmoon's decode attention: auto, compiled or reference")  # fmt: skip
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="halfmoon replays decode steps from CUDA graphs (--device cuda)")  # fmt: skip
    parser.add_argument("--halfmoon-kv-mb", type=float, default=3300.0)
    parser.add_argument("--vllm-kv-gb", type=int, default=4)
    parser.add_argument("--vllm-python", default=str(VLLM_VENV / "bin" / "python"))
    parser.add_argument("--vllm-log", default="/tmp/engine_real_vllm.log")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: context 512, batch 1 and 8, k 4, 1 round, 512-token prefill")  # fmt: skip
    parser.add_argument("--malloc", choices=sorted(MALLOC_ENV), default="default",
                        help="allocator of this process (halfmoon, transformers); vLLM always "
                        "gets tcmalloc, as its CPU guide says")  # fmt: skip
    parser.add_argument("--huge-pages", choices=("on", "off"), default="on",
                        help="torch's huge pages (THP_MEM_ALLOC_ENABLE) for every engine, "
                        "the vLLM peer included; on is what halfmoon's CLI sets")  # fmt: skip
    parser.add_argument("--json", help="write every row (per-round values included) here")
    args = parser.parse_args()
    # Before anything allocates (torch reads it once); the vLLM peer inherits it.
    os.environ[hugepages.ENV] = "1" if args.huge_pages == "on" else "0"
    if os.environ.get(MALLOC_MARK, "default") != args.malloc:
        env = {**os.environ, **MALLOC_ENV[args.malloc], MALLOC_MARK: args.malloc}
        argv = [sys.executable, "-m", "benchmarks.micro.engine_real", *sys.argv[1:]]
        os.execve(sys.executable, argv, env)
    if args.quick:
        args.batches, args.contexts, args.k, args.k_large = "1,8", "512", 4, 4
        args.rounds, args.prefill_rounds, args.prefill_tokens = 1, 1, "512"
    if args.rounds < 1 or args.prefill_rounds < 0:
        parser.error("--rounds must be >= 1 and --prefill-rounds >= 0")
    args.batches = [int(x) for x in args.batches.split(",")]
    args.prefill_tokens = [int(x) for x in args.prefill_tokens.split(",")]
    longest = max(args.prefill_tokens)
    args.max_model_len = args.max_model_len or max(2304, longest + 1)
    args.max_num_batched_tokens = args.max_num_batched_tokens or max(2048, longest)
    args.contexts = [int(x) for x in args.contexts.split(",")]
    named = args.engines.split(",")
    unknown = sorted(set(named) - set(ENGINES) - set(OPTIONAL_ENGINES))
    if unknown:
        parser.error(f"unknown --engines {', '.join(unknown)}; known: "
                     f"{', '.join((*ENGINES, *OPTIONAL_ENGINES))}")  # fmt: skip
    if "halfmoon-eager" in named and not args.cuda_graphs:
        parser.error("--engines halfmoon-eager compares against --cuda-graphs; add it")
    engines = [e for e in (*ENGINES[:1], *OPTIONAL_ENGINES, *ENGINES[1:]) if e in named]
    if "halfmoon-reference" in named and args.attention == "reference":
        parser.error("--engines halfmoon-reference compares against another --attention")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    wall_start = time.perf_counter()
    load_start = os.getloadavg()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - wall_start:6.0f}s] {msg}", file=sys.stderr, flush=True)

    model_dir = resolve_model_dir(args.model)
    torch.set_num_threads(args.threads)
    # Start vLLM first: it compiles (30-50 s, longer on a first start) while we load.
    peer = None
    if "vllm" in engines:
        peer = VllmPeer(args.vllm_python, model_dir, args, args.vllm_log)
    try:
        rows, meta = run(args, engines, model_dir, peer, log)
    finally:
        if peer is not None:
            peer.close()
    meta.update(
        wall_s=time.perf_counter() - wall_start, loadavg_start=load_start,
        loadavg_end=os.getloadavg(),
    )  # fmt: skip
    log(f"wall {meta['wall_s']:.0f} s, load average {load_start} -> {meta['loadavg_end']}")
    if args.json:  # first: a printing problem must not lose the run
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
            fh.write("\n")
    print_tables(rows, engines, meta)


def run(args, engines, model_dir, peer, log):
    from transformers import AutoTokenizer

    log(f"model {model_dir}; engines {engines}; {args.threads} threads")
    hm = Halfmoon(model_dir, args) if "halfmoon" in engines else None
    variants = {name: Halfmoon(model_dir, args, **OPTIONAL_ENGINES[name])
                for name in OPTIONAL_ENGINES if name in engines}  # fmt: skip
    hf = Transformers(model_dir, args.device, args.dtype) if "transformers" in engines else None
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = hm.engine.model_config.vocab_size if hm else hf.config.vocab_size  # type: ignore[union-attr]
    meta: dict[str, Any] = {
        "model": model_dir, "threads": args.threads, "torch": torch.__version__,
        "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
        "nproc": os.cpu_count(), "engines": engines, "device": args.device,
        "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None, "k": args.k, "k_large": args.k_large,
        "rounds": args.rounds, "prefill_rounds": args.prefill_rounds,
        "max_model_len": args.max_model_len, "max_num_batched_tokens": args.max_num_batched_tokens,
        "malloc": args.malloc, "malloc_env": MALLOC_ENV[args.malloc],
        "halfmoon_attention": hm.engine.attention_backend if hm else None,
        "huge_pages": args.huge_pages, "huge_pages_mib_this_process": hugepages.resident_mib(),
        "mem_available_gib_start": _mem_available_gib(),
    }  # fmt: skip
    if hf is not None:
        meta["transformers"] = hf.version
    if peer is not None:
        log("waiting for the vLLM peer (compiling) ...")
        info = peer.wait_ready()
        meta["vllm"] = info
        meta["huge_pages_mib_vllm"] = hugepages.resident_mib(peer.proc.pid)
        log(f"vLLM {info['vllm']} ready after {info['startup_s']:.0f} s; "
            f"torch threads {info['torch_threads']}, env {info['env']}")  # fmt: skip

    runners: dict[str, Callable] = {}
    if hm is not None:
        runners["halfmoon"] = hm.generate
    for name, variant in variants.items():
        runners[name] = variant.generate
    if peer is not None:
        runners["vllm"] = lambda prompts, n: peer.generate(prompts, n, False)
    if hf is not None:
        runners["transformers"] = hf.generate

    log("token check (real prefill, greedy)")
    meta["token_check"] = check_tokens(runners, tokenizer, log)
    rows: list[dict[str, Any]] = []

    # Prefill: tokens/s of one fresh prompt per round, same prompt for every engine.
    if args.prefill_rounds > 0:
        log("prefill: warm-up")
        warm = random_prompts(vocab, 1, 256, seed=1)
        for run_fn in runners.values():
            run_fn(warm, 1)
        for length in args.prefill_tokens:
            rows.append(prefill_case(args, runners, vocab, length, log))

    # Decode: B prompts with their KV in place; (T(1+k) - T(1)) / k.
    for context in args.contexts:
        for batch in args.batches:
            k = args.k_large if batch >= 32 and context >= 2048 else args.k
            rows.append(
                decode_case(args, hm, hf, peer, engines, vocab, batch, context, k, log, variants)
            )
    graphs = hm.engine.runner.decode_graphs if hm else None
    if graphs is not None:  # whether the decode steps above replayed graphs, or why not
        meta["cuda_graphs"] = {
            "captured": graphs.num_captured, "replays": graphs.num_replays,
            "disabled": graphs.disabled_reason,
        }  # fmt: skip
        log(f"CUDA graphs: {meta['cuda_graphs']}")
    return rows, meta


def prefill_case(args, runners, vocab, length, log) -> dict[str, Any]:
    """Tokens/s of one fresh ``length``-token prompt per round (transformers only up to
    ``--hf-prefill-max``: its long prefills add minutes and no target is set against it)."""
    names = [n for n in runners if n != "transformers" or length <= args.hf_prefill_max]
    times: dict[str, list[float]] = {name: [] for name in names}
    first: list[dict[str, int]] = []
    for r in range(args.prefill_rounds):
        prompt = random_prompts(vocab, 1, length, seed=100 + r + length)
        firsts = {}
        for name in rotated(names, r):
            elapsed, tokens = runners[name](prompt, 1)
            times[name].append(elapsed)
            firsts[name] = tokens[0][0]
        first.append(firsts)
        log(f"  prefill {length} round {r}: "
            + ", ".join(f"{n} {length / t[-1]:.0f} tok/s" for n, t in times.items()))  # fmt: skip
    tps = {name: [length / t for t in ts] for name, ts in times.items()}
    agree = all(len(set(f.values())) == 1 for f in first)
    if not agree:
        log(f"  FIRST TOKENS DISAGREE on a {length}-token prompt: {first}")
    row = {
        "case": f"prefill {length}", "kind": "prefill", "tokens": length,
        "time_s": times, "tokens_per_s": tps, "median_tokens_per_s": {n: median(v) for n, v in tps.items()},
        "ratios": ratio_rows(tps, invert=True), "first_tokens": first, "first_tokens_agree": agree,
    }  # fmt: skip
    _finish_ratios(row)
    return row


def decode_case(
    args, hm, hf, peer, engines, vocab, batch, context, k, log, variants=None
) -> dict[str, Any]:
    prompts = random_prompts(vocab, batch, context, seed=1000 * batch + context)
    seed = batch * 7919 + context
    runs: dict[str, Callable[[int], tuple[float, list]]] = {}
    if hm is not None:
        handoffs = hm.handoffs(prompts, seed)
        runs["halfmoon"] = lambda n: hm.decode(handoffs, n)
    for name, variant in (variants or {}).items():
        variant_handoffs = variant.handoffs(prompts, seed)
        runs[name] = lambda n, v=variant, h=variant_handoffs: v.decode(h, n)
    if peer is not None:
        runs["vllm"] = lambda n: peer.generate(prompts, n, True)
    if hf is not None:
        ids = torch.tensor(prompts, device=args.device)
        cache = hf.random_cache(batch, context - 1, seed)
        runs["transformers"] = lambda n: hf.decode(ids, cache, n)
    order = [e for e in engines if e in runs]
    for name in order:  # warm-up: shapes, workspaces, allocator
        runs[name](3)
    t1: dict[str, list[float]] = {n: [] for n in order}
    tk: dict[str, list[float]] = {n: [] for n in order}
    step: dict[str, list[float]] = {n: [] for n in order}
    for r in range(args.rounds):
        for name in rotated(order, r):
            a = runs[name](1)[0]
            b = runs[name](1 + k)[0]
            t1[name].append(a)
            tk[name].append(b)
            step[name].append((b - a) / k * 1e3)
        log(f"  decode b={batch} ctx={context} k={k} round {r}: "
            + ", ".join(f"{n} {v[-1]:.1f} ms" for n, v in step.items()))  # fmt: skip
    row = {
        "case": f"decode b={batch} ctx={context}", "kind": "decode", "batch": batch,
        "context": context, "k": k, "t1_s": t1, "t1k_s": tk, "step_ms": step,
        "median_step_ms": {n: median(v) for n, v in step.items()},
        "ratios": ratio_rows(step, invert=False),
    }  # fmt: skip
    _finish_ratios(row)
    return row


def _finish_ratios(row: dict[str, Any]) -> None:
    row["median_ratios"] = {name: median(v) for name, v in row["ratios"].items()}
    row["ratio_range"] = {name: [min(v), max(v)] for name, v in row["ratios"].items()}


def print_tables(rows: list[dict[str, Any]], engines: list[str], meta: dict[str, Any]) -> None:
    others = [e for e in engines if e != "halfmoon"]
    where = meta.get("gpu") or f"{meta['threads']} threads"
    print(f"\nmodel {meta['model']}, {where}, torch {meta['torch']}"
          + (f", vLLM {meta['vllm']['vllm']}" if "vllm" in meta else "")
          + (f", transformers {meta['transformers']}" if "transformers" in meta else "")
        + f", malloc {meta['malloc']} (this process), huge pages {meta['huge_pages']} "
        f"({meta['huge_pages_mib_this_process'] or 0:.0f} MiB here"
        + (f", {meta.get('huge_pages_mib_vllm') or 0:.0f} MiB in vLLM's process"
           if "vllm" in meta else "") + ")")  # fmt: skip
    print(
        "decode step (ms, median of rounds); ratio = other_ms / halfmoon_ms, > 1 = halfmoon "
        "faster (median of per-round ratios, [min, max])"
    )
    head = f"{'case':22} {'k':>3}" + "".join(f" {SHORT[e] + ' ms':>9}" for e in engines)
    head += "".join(f" {SHORT[o] + '/hm':>22}" for o in others if "halfmoon" in engines)
    print(head)
    for row in rows:
        if row["kind"] != "decode":
            continue
        line = f"{row['case']:22} {row['k']:3d}"
        line += "".join(f" {row['median_step_ms'][e]:9.1f}" for e in engines)
        for o in others:
            key = f"{SHORT[o]}/hm"
            if key in row["median_ratios"]:
                lo, hi = row["ratio_range"][key]
                line += f" {row['median_ratios'][key]:6.2f} [{lo:5.2f},{hi:5.2f}]"
        print(line)
    for row in rows:
        if row["kind"] != "prefill":
            continue
        print(
            f"\nprefill {row['tokens']} tokens (tokens/s, median of rounds); ratio = "
            "halfmoon_tok_s / other_tok_s, > 1 = halfmoon faster"
        )
        present = [e for e in engines if e in row["median_tokens_per_s"]]
        line = "".join(f" {SHORT[e]} {row['median_tokens_per_s'][e]:.0f}" for e in present)
        for o in others:
            key = f"hm/{SHORT[o]}"
            if key in row["median_ratios"]:
                lo, hi = row["ratio_range"][key]
                line += f"   {key} {row['median_ratios'][key]:.2f} [{lo:.2f},{hi:.2f}]"
        print(line.strip())
        print(f"first generated token agrees across engines: {row['first_tokens_agree']}")
    checks = meta.get("token_check", [])
    if checks:
        print("greedy token check (short prompts, real prefill): "
              + ("all agree" if all(c["all_agree"] for c in checks) else "DISAGREEMENT, see JSON"))  # fmt: skip


if __name__ == "__main__":
    main()
