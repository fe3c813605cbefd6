"""New weights while serving, live: ``/update_weights_from_disk`` against a restart.

One ``halfmoon serve`` cluster (1 prefill + 1 decode worker, ``VLLM_SERVER_DEV_MODE=1``)
of a real model (SmolLM2 by default) is started, timed from launch to ``/health`` ok. A second checkpoint is written
beside the model (its weights moved by noise of ``--noise`` times each tensor's spread,
an RL step's worth of change), and each round switches the cluster between the two by
``/update_weights_from_disk`` and times it (the gateway's pause, staging on both workers
at once, installing, the cache flush), then a greedy request. Every answer is checked
against an engine started in this process on the checkpoint the cluster should serve
(the same tokens), and the prompt is the same each time, so an answer from KV cached
under the other weights would show. Last, what a trainer without weight updates pays per
checkpoint: a cluster started on the new checkpoint, timed to ``/health`` ok (a
directory it has not seen, so its cost profile is measured, as for every checkpoint).

Command (about 3 minutes on 2 cores): ``.venv/bin/python -m benchmarks.eval.weight_update_live
--rounds 4 --json benchmarks/results/weight_update_live.json``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from halfmoon.core.request import SamplingParams
from halfmoon.engine.catalog import cache_dir, resolve_model
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.serve.launch.local import LocalCluster

SECRET = "weight-update-benchmark-secret-0123"
PROMPT = "The three most useful things to pack for a week of hiking are"
MAX_TOKENS = 24


def moved_copy(src: Path, dst: Path, noise: float, seed: int = 0) -> Path:
    """``src``'s checkpoint with each tensor moved by ``noise`` times its spread."""
    shutil.copytree(src, dst)
    generator = torch.Generator().manual_seed(seed)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(str(file))
        moved = {}
        for name, t in tensors.items():
            step = noise * t.float().std() * torch.randn(t.shape, generator=generator)
            moved[name] = (t.float() + step).to(t.dtype).contiguous()
        save_file(moved, str(file))
    return dst


def post(url: str, body: dict, timeout_s: float = 600.0) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def greedy_tokens(url: str, model: str, prompt_ids: list[int]) -> tuple[list[int], float]:
    body = {"model": model, "prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    start = time.monotonic()
    status, out = post(url + "/v1/completions", body)
    assert status == 200, out
    return out["choices"][0]["token_ids"], time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--noise", type=float, default=0.02)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    original = resolve_model(args.model)
    with tempfile.TemporaryDirectory(prefix="hm-weights-") as tmp:
        moved = moved_copy(original, Path(tmp) / "step-1", args.noise)
        expected: dict[str, list[int]] = {}
        answers: dict[str, str] = {}
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        prompt_ids: list[int] = []
        for name, path in (("original", original), ("step-1", moved)):
            engine = LLMEngine(EngineConfig(model=str(path), kv_cache_mb=64))
            prompt_ids = engine.tokenizer.encode(PROMPT)  # (the same tokenizer for both)
            expected[name] = list(engine.generate([prompt_ids], params)[0].token_ids)
            answers[name] = engine.tokenizer.decode(expected[name])
            del engine
        os.environ["VLLM_SERVER_DEV_MODE"] = "1"
        serve_args = ["--model", args.model, "--prefill", "1", "--decode", "1"]
        log = Path(tmp) / "serve.log"
        cluster = LocalCluster(serve_args, cache_dir(), SECRET, log)
        start = time.monotonic()
        cluster.start()
        try:
            cluster.wait_ready(600)
            startup_s = time.monotonic() - start
            rounds = []
            first, _ = greedy_tokens(cluster.base_url, args.model, prompt_ids)
            assert first == expected["original"], (first, expected["original"])
            serving = "original"
            for r in range(args.rounds):
                target = "step-1" if serving == "original" else "original"
                path = moved if target == "step-1" else original
                begin = time.monotonic()
                status, out = post(cluster.base_url + "/update_weights_from_disk",
                                   {"model_path": str(path), "weight_version": f"r{r}"})  # fmt: skip
                update_s = time.monotonic() - begin
                assert status == 200 and out["success"], out
                tokens, request_s = greedy_tokens(cluster.base_url, args.model, prompt_ids)
                again, cached_s = greedy_tokens(cluster.base_url, args.model, prompt_ids)
                rounds.append({"to": target, "update_s": round(update_s, 3),
                               "first_request_s": round(request_s, 3),
                               "cached_request_s": round(cached_s, 3),
                               "tokens_as_expected": tokens == expected[target] == again})  # fmt: skip
                print(f"round {r}: -> {target}: update {update_s:.2f} s, next request "
                      f"{request_s:.2f} s (then {cached_s:.2f} s), tokens as expected: "
                      f"{rounds[-1]['tokens_as_expected']}")  # fmt: skip
                serving = target
        finally:
            cluster.stop()
        # The alternative: a restart on the new checkpoint (a directory it has not seen:
        # its cost profile is measured anew, as for every new checkpoint).
        fresh_args = ["--model", str(moved), *serve_args[2:]]
        fresh = LocalCluster(fresh_args, cache_dir(), SECRET, Path(tmp) / "fresh.log")
        start = time.monotonic()
        fresh.start()
        try:
            fresh.wait_ready(900)
            restart_new_s = time.monotonic() - start
            tokens, _ = greedy_tokens(fresh.base_url, moved.name, prompt_ids)
            assert tokens == expected["step-1"], (tokens, expected["step-1"])
        finally:
            fresh.stop()
        update = [r["update_s"] for r in rounds]
        doc = {
            "model": args.model, "noise": args.noise, "rounds": rounds,
            "startup_s": round(startup_s, 2), "median_update_s": statistics.median(update),
            "restart_new_checkpoint_s": round(restart_new_s, 2),
            "restart_over_update": round(restart_new_s / statistics.median(update), 1),
            "answers": answers,
            "answers_differ": expected["original"] != expected["step-1"],
        }  # fmt: skip
        print(f"cluster start {startup_s:.1f} s (on a new checkpoint {restart_new_s:.1f} s); "
              f"update median {statistics.median(update):.2f} s "
              f"[{min(update):.2f}, {max(update):.2f}]; the two checkpoints answer "
              f"{'differently' if doc['answers_differ'] else 'alike'}")  # fmt: skip
        if args.json:
            Path(args.json).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
