"""vLLM's CPU build as the peer of ``benchmarks.micro.engine_real``.

Runs INSIDE ``.venv-vllm`` (``make vllm`` or ``benchmarks/micro/vllm_env.sh`` makes it), started
by path (vLLM imports this file as the module ``vllm_peer``), and never imports halfmoon.
It holds one offline ``vllm.LLM`` over an HF directory in float32 (``--dtype``; the first start
compiles the model, 30-50 s, so one process measures every case):

- ``--serve``: reads JSON commands from stdin, one a line, and answers each with one
  JSON line on stdout (engine_real.py drives it this way, interleaving the engines);
- otherwise: runs the decode/prefill grid by itself and prints one JSON row per point.

Commands (``--serve``): ``{"op": "generate", "prompts": [[ids...], ...], "max_tokens": n,
"fill": bool, "regex": optional, "loras": optional, "ignore_eos": true, "all_ids": false}``
runs ``LLM.generate`` on the token-id prompts (greedy, ``ignore_eos`` unless false, no
detokenization; held to ``regex`` by vLLM's structured outputs if given; ``loras``: per
prompt the name of one of ``--lora-modules`` or null, run as vLLM's ``LoRARequest``) and
answers ``{"elapsed_s", "token_ids"}`` (the first 16 generated ids of each prompt, or all
with ``all_ids``); ``{"op": "counters"}`` answers vLLM's counters so far (``LLM.get_metrics``:
its speculative decoding's among them, with ``--speculative-config``); ``{"op": "quit"}`` ends. ``fill`` marks the requests for vLLM's
own ``DecodeBenchConnector`` (below): their KV, all but the last prompt token, counts as
already computed (filled once at startup with N(0, 1) values), so a decode step at a
long context is measured without paying the prefill. Unmarked requests prefill for real.

CPU tuning as vLLM's CPU guide gives it: tcmalloc and torch's libgomp in ``LD_PRELOAD``,
``OMP_NUM_THREADS`` = ``VLLM_CPU_OMP_THREADS_BIND`` cores (threads pinned via
``GOMP_CPU_AFFINITY``), ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV cache. The process re-executes
itself once with that environment (the preload must be there at start). The engine core
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, uniprocess executor): a
step is timed like halfmoon's ``LLMEngine.step``, with no second process competing for
the cores. Left to its defaults on a 2-core machine, vLLM's automatic binding reserves one
core for its scheduler process and runs the model on the other (one thread).

Usage::

    .venv-vllm/bin/python benchmarks/micro/vllm_peer.py --model DIR [--threads 2]
        [--max-model-len 2304] [--max-num-seqs 32] [--kv-space-gb 4] [--serve]
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import random
import sys
import time
from typing import Any

ENV_MARK = "HALFMOON_VLLM_PEER_ENV"
#: SamplingParams.extra_args key that marks a request for the dummy KV fill.
FILL_FLAG = "halfmoon_decode_bench_fill"
CONNECTOR = "FlaggedDecodeBenchConnector"
TCMALLOC = "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)  # locates without importing
    if spec is None or spec.origin is None:
        raise SystemExit(f"vllm_peer: package {name!r} not installed in {sys.prefix}")
    return os.path.dirname(spec.origin)


def runtime_env(threads: int, kv_space_gb: int) -> dict[str, str]:
    """The environment vLLM's CPU guide asks for, for ``threads`` cores 0..threads-1."""
    env = dict(os.environ)
    preload = [p for p in env.get("LD_PRELOAD", "").split(":") if p]
    if os.path.exists(TCMALLOC) and not any("tcmalloc" in p for p in preload):
        preload.insert(0, TCMALLOC)
    torch_dir = _package_dir("torch")
    gomp = sorted(
        glob.glob(os.path.join(torch_dir, "lib", "libgomp*.so*"))
        + glob.glob(os.path.join(os.path.dirname(torch_dir), "torch.libs", "libgomp*.so*"))
    )
    if gomp and not any("gomp" in p for p in preload):
        preload.append(gomp[0])
    cores = list(range(threads))
    env.update(
        {
            ENV_MARK: "1",
            "LD_PRELOAD": ":".join(preload),
            "OMP_NUM_THREADS": str(threads),
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
            "GOMP_CPU_AFFINITY": " ".join(map(str, cores)),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gb),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    # Let the connector module (this file) be imported by name.
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def __getattr__(name: str) -> Any:
    """Build the connector class on first access (vLLM imports it by module path), so
    importing this module for the re-exec does not pull vLLM in."""
    if name != CONNECTOR:
        raise AttributeError(name)
    from vllm.distributed.kv_transfer.kv_connector.v1.decode_bench_connector import (
        DecodeBenchConnector,
    )

    class FlaggedDecodeBenchConnector(DecodeBenchConnector):
        """vLLM's DecodeBenchConnector, for marked requests only (others prefill)."""

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int):
            params = getattr(request, "sampling_params", None)
            extra = getattr(params, "extra_args", None) or {}
            if not extra.get(FILL_FLAG):
                return 0, False
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    globals()[CONNECTOR] = FlaggedDecodeBenchConnector
    return FlaggedDecodeBenchConnector


class Peer:
    """One ``vllm.LLM`` and the two things engine_real.py asks of it."""

    def __init__(self, args: argparse.Namespace):
        start = time.perf_counter()
        import torch
        import vllm
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.torch = torch
        kv_transfer = KVTransferConfig(
            kv_connector=CONNECTOR,
            kv_connector_module_path="vllm_peer",
            kv_role="kv_both",
            kv_connector_extra_config={"fill_mean": 0.0, "fill_std": 1.0, "startup_fill": True},
        )
        #: ``--lora-modules`` NAME=PATH -> (vLLM's int id, path).
        self.loras = {
            name: (i + 1, path)
            for i, (name, path) in enumerate(m.split("=", 1) for m in args.lora_modules)
        }
        lora = {}
        if self.loras:
            lora = {"enable_lora": True, "max_loras": len(self.loras),
                    "max_lora_rank": args.max_lora_rank}  # fmt: skip
        spec = {}
        if args.speculative_config:
            # (no dummy-KV connector beside speculative decoding: those requests prefill)
            spec = {"speculative_config": json.loads(args.speculative_config)}
            kv_transfer = None
        if args.log_stats:  # (LLM.get_metrics reads them)
            spec["disable_log_stats"] = False
        self.llm = LLM(
            **lora,
            **spec,
            model=args.model,
            tokenizer=args.model,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=False,
            seed=0,
            kv_transfer_config=kv_transfer,
        )
        self.info = {
            "event": "ready",
            "vllm": vllm.__version__,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "startup_s": time.perf_counter() - start,
            "env": {
                k: os.environ.get(k, "")
                for k in (
                    "OMP_NUM_THREADS",
                    "VLLM_CPU_OMP_THREADS_BIND",
                    "GOMP_CPU_AFFINITY",
                    "VLLM_CPU_KVCACHE_SPACE",
                    "VLLM_ENABLE_V1_MULTIPROCESSING",
                    "LD_PRELOAD",
                )
            },  # fmt: skip
            "affinity": sorted(os.sched_getaffinity(0)),
        }

    def generate(
        self, prompts: list[list[int]], max_tokens: int, fill: bool, regex: str | None = None,
        loras: list[str | None] | None = None, ignore_eos: bool = True, all_ids: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import StructuredOutputsParams

        params = SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, detokenize=False,
            extra_args={FILL_FLAG: True} if fill else None,
            structured_outputs=StructuredOutputsParams(regex=regex) if regex else None,
        )  # fmt: skip
        inputs = [{"prompt_token_ids": list(p)} for p in prompts]
        start = time.perf_counter()
        requests = None
        if loras is not None:
            requests = [None if n is None else LoRARequest(n, *self.loras[n]) for n in loras]
        outs = self.llm.generate(inputs, params, use_tqdm=False, lora_request=requests)
        elapsed = time.perf_counter() - start
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        if any(len(t) != max_tokens if ignore_eos else len(t) > max_tokens for t in token_ids):
            raise RuntimeError(f"vLLM returned {[len(t) for t in token_ids]} tokens, "
                               f"asked for {max_tokens}")  # fmt: skip
        return {
            "elapsed_s": elapsed,
            "token_ids": token_ids if all_ids else [t[:16] for t in token_ids],
        }

    def counters(self) -> dict[str, float]:
        """vLLM's own counters so far (``LLM.get_metrics``): name -> value, for the
        counters only (speculative decoding's among them)."""
        from vllm.v1.metrics.reader import Counter, Vector

        values: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            if isinstance(metric, Counter):
                values[metric.name] = values.get(metric.name, 0) + metric.value
            elif isinstance(metric, Vector):
                for i, v in enumerate(metric.values):
                    values[f"{metric.name}[{i}]"] = values.get(f"{metric.name}[{i}]", 0) + v
        return values


def serve(peer: Peer, out: Any) -> None:
    def send(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    send(peer.info)
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            if cmd["op"] == "quit":
                break
            if cmd["op"] == "counters":
                send({"counters": peer.counters()})
                continue
            if cmd["op"] != "generate":
                raise ValueError(f"unknown op {cmd['op']!r}")
            send(peer.generate(cmd["prompts"], int(cmd["max_tokens"]), bool(cmd.get("fill")),
                               cmd.get("regex"), cmd.get("loras"), cmd.get("ignore_eos", True),
                               bool(cmd.get("all_ids"))))  # fmt: skip
        except Exception as exc:  # answer, so the driver does not hang
            send({"error": f"{type(exc).__name__}: {exc}"})


def standalone(peer: Peer, args: argparse.Namespace, out: Any) -> None:
    """The grid on its own: decode step (ms) by differencing, prefill tokens/s."""

    def emit(row: dict[str, Any]) -> None:
        out.write(json.dumps(row) + "\n")
        out.flush()

    emit(peer.info)
    rng = random.Random(0)
    vocab = peer.llm.llm_engine.model_config.get_vocab_size()

    def prompts(batch: int, length: int) -> list[list[int]]:
        return [[rng.randrange(5, vocab) for _ in range(length)] for _ in range(batch)]

    prompt = prompts(1, args.prefill_tokens)
    peer.generate(prompts(1, 256), 1, False)  # warm-up
    times = [peer.generate(prompt, 1, False)["elapsed_s"] for _ in range(args.rounds)]
    emit({"case": f"prefill {args.prefill_tokens}", "times_s": times,
          "tokens_per_s": args.prefill_tokens / min(times)})  # fmt: skip
    for context in args.contexts:
        for batch in args.batches:
            batch_prompts = prompts(batch, context)
            peer.generate(batch_prompts, 3, True)  # warm-up
            steps = []
            for _ in range(args.rounds):
                t1 = peer.generate(batch_prompts, 1, True)["elapsed_s"]
                tk = peer.generate(batch_prompts, 1 + args.k, True)["elapsed_s"]
                steps.append((tk - t1) / args.k * 1e3)
            emit({"case": f"decode b={batch} ctx={context}", "step_ms": steps})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="HF directory")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--max-model-len", type=int, default=2304)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--kv-space-gb", type=int, default=4)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--serve", action="store_true", help="JSON commands on stdin")
    parser.add_argument(
        "--lora-modules",
        nargs="*",
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (vLLM's enable_lora, max_loras = their number)",
    )
    parser.add_argument("--max-lora-rank", type=int, default=16)
    parser.add_argument("--speculative-config", default=None,
                        help="vLLM's speculative_config as JSON (e.g. ngram)")  # fmt: skip
    parser.add_argument("--log-stats", action="store_true",
                        help="keep vLLM's stats (the counters op reads them)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="standalone only")
    parser.add_argument("--k", type=int, default=8, help="standalone: decode steps timed")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                        default=[512, 2048])  # fmt: skip
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, 8, 32])  # fmt: skip
    args = parser.parse_args()
    if os.environ.get(ENV_MARK) != "1":
        env = runtime_env(args.threads, args.kv_space_gb)
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
    # Answers go to the original stdout; anything else printed (vLLM's logs) to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    peer = Peer(args)
    if args.serve:
        serve(peer, out)
    else:
        standalone(peer, args, out)


if __name__ == "__main__":
    main()
