"""Engine vs transformers on the same weights: prefill tokens/s and decode step time.

For each preset and dtype, in one process, interleaving the contenders so background
load hits both alike:

- prefill of one 512- and one 2048-token prompt: ``LLMEngine.generate(max_tokens=1)``
  (prefix caching off, one chunk) vs transformers' forward (``use_cache=True``,
  ``logits_to_keep=1``: what its ``generate`` runs for a prompt);
- one decode step at batch 1, 8, 32 over mixed context lengths: ``LLMEngine.step()``
  (KV imported through the handoff path, so no prefill is paid) vs transformers looping
  its forward over the sequences one by one (each with its own ``DynamicCache``) and vs
  one forward over the left-padded batch. Caches are filled with random K/V: step time
  does not depend on the values.

Usage::

    .venv/bin/python -m benchmarks.micro.engine [--presets tiny,small] [--dtypes float32,bfloat16]
        [--device cpu|cuda] [--repeats 3] [--threads 2] [--json out.json]

Prints one table of medians; ratios > 1 mean the engine is faster (prefill: transformers
time / engine time; decode: baseline step time / engine step time). ``best hf/eng`` is
the same ratio over the fastest run of each, a check against bursts of background load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from halfmoon.core.request import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.engine import KVHandoff, LLMEngine
from halfmoon.engine.kv_cache import torch_dtype
from halfmoon.engine.loader import LoadedModel, build_preset
from halfmoon.engine.weights import hf_state_dict

PREFILL_TOKENS = (512, 2048)
DECODE_BATCHES = (1, 8, 32)


@dataclass(frozen=True)
class Row:
    """One measurement line of the table."""

    preset: str
    dtype: str
    case: str
    engine_ms: float
    hf_ms: float
    hf_padded_ms: float | None
    tokens_per_s: float | None
    best_ratio: float


def context_lengths(batch: int) -> list[int]:
    """Mixed contexts: 512 alone, else evenly spread over 128..1024."""
    if batch == 1:
        return [512]
    return [128 + (i * 896) // (batch - 1) for i in range(batch)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_model(loaded: LoadedModel, dtype: str, device: str) -> torch.nn.Module:
    """transformers' LlamaForCausalLM holding exactly the engine's weights."""
    import transformers

    config = transformers.LlamaConfig(**loaded.config.to_hf())
    model = transformers.LlamaForCausalLM(config)
    state = hf_state_dict(loaded.model)
    if loaded.config.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.to(device=device, dtype=torch_dtype(dtype)).eval()


def check_same_model(engine: LLMEngine, hf: torch.nn.Module, device: str) -> None:
    """Both score one prompt alike (else the comparison would be meaningless)."""
    prompt = list(range(10, 60))
    (ours,) = engine.generate(
        [prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    )
    with torch.no_grad():
        theirs = hf.generate(
            torch.tensor([prompt], device=device), max_new_tokens=4, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
    if list(ours.token_ids) != theirs:
        print(f"  note: greedy tokens differ ({list(ours.token_ids)} vs {theirs}); low precision?")


def bench_prefill(
    engine: LLMEngine, hf: torch.nn.Module, num_tokens: int, repeats: int, device: str
) -> list[list[float]]:
    generator = torch.Generator().manual_seed(num_tokens)
    prompt = torch.randint(5, engine.model_config.vocab_size, (num_tokens,), generator=generator)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    ids = prompt.view(1, -1).to(device)

    def ours() -> None:
        engine.generate([prompt.tolist()], params)

    def theirs() -> None:
        with torch.no_grad():
            hf(ids, use_cache=True, logits_to_keep=1)

    return interleaved([ours, theirs], repeats, device)


def interleaved(fns: list[Callable[[], object]], repeats: int, device: str) -> list[list[float]]:
    """Run times (ms) of each of ``fns``, timed in rounds (one run of each per round, after
    a warm-up each) so bursts of background load hit all contenders alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, times, strict=True):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            out.append((time.perf_counter() - start) * 1e3)
    return times


def random_handoff(engine: LLMEngine, request_id: str, context: int, seed: int) -> KVHandoff:
    """A handoff carrying ``context`` tokens of random KV and one token still to decode."""
    layout = engine.kv_layout
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(5, engine.model_config.vocab_size, (context + 1,), generator=generator)
    num_blocks = -(-context // layout.block_size)
    data = torch.randn(layout.buffer_shape(num_blocks), generator=generator).to(
        torch_dtype(layout.dtype)
    )
    return KVHandoff(request_id, tuple(tokens.tolist()), context, context, seed, layout, data)


def hf_caches(hf: torch.nn.Module, lengths: list[int], dtype: str, device: str):
    """Per-sequence caches and one left-padded batch cache, with random K/V."""
    from transformers import DynamicCache

    config = hf.config
    shape_kv = (config.num_key_value_heads, config.head_dim)
    dt = torch_dtype(dtype)
    singles = []
    for length in lengths:
        cache = DynamicCache(config=config)
        for layer in range(config.num_hidden_layers):
            k = torch.randn(1, shape_kv[0], length, shape_kv[1], dtype=dt, device=device)
            cache.update(k, torch.randn_like(k), layer)
        singles.append(cache)
    longest = max(lengths)
    padded = DynamicCache(config=config)
    for layer in range(config.num_hidden_layers):
        k = torch.randn(len(lengths), shape_kv[0], longest, shape_kv[1], dtype=dt, device=device)
        padded.update(k, torch.randn_like(k), layer)
    mask = torch.zeros(len(lengths), longest + 1, dtype=torch.long, device=device)
    for i, length in enumerate(lengths):
        mask[i, longest - length :] = 1
    return singles, padded, mask


def bench_decode(
    engine: LLMEngine, hf: torch.nn.Module, batch: int, repeats: int, dtype: str, device: str
) -> list[list[float]]:
    """Step times (ms) of the engine, transformers' per-sequence loop and its padded batch."""
    lengths = context_lengths(batch)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i, length in enumerate(lengths):
        engine.import_request(random_handoff(engine, f"d{batch}-{i}", length, i), params)
    singles, padded, mask = hf_caches(hf, lengths, dtype, device)
    token = torch.tensor([[7]], device=device)

    def loop() -> None:
        with torch.no_grad():
            for cache, length in zip(singles, lengths, strict=True):
                pos = torch.tensor([[length]], device=device)
                hf(token, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
                cache.crop(-1)  # drop the token just added

    tokens = token.expand(batch, 1).contiguous()
    positions = torch.tensor([[n] for n in lengths], device=device)

    def padded_step() -> None:
        with torch.no_grad():
            hf(tokens, attention_mask=mask, position_ids=positions, past_key_values=padded,
               use_cache=True, logits_to_keep=1)  # fmt: skip
            padded.crop(-1)

    # Decode steps are cheap: three times the prefill repeats.
    times = interleaved([engine.step, loop, padded_step], 3 * repeats, device)
    for i in range(batch):
        engine.abort_request(f"d{batch}-{i}")
    engine.check_integrity()
    return times


def run_preset(preset: str, dtype: str, args: argparse.Namespace) -> list[Row]:
    loaded = build_preset(preset, seed=0, dtype=dtype, device=args.device)
    hf = hf_model(loaded, dtype, args.device)
    config = EngineConfig(model=preset, device=args.device, dtype=dtype, kv_cache_mb=args.kv_cache_mb,
                          enable_prefix_caching=False, max_num_batched_tokens=2048)  # fmt: skip
    engine = LLMEngine(config, loaded=loaded)
    check_same_model(engine, hf, args.device)
    rows = []
    for num_tokens in PREFILL_TOKENS:
        ours, theirs = bench_prefill(engine, hf, num_tokens, args.repeats, args.device)
        med = statistics.median(ours)
        rows.append(Row(preset, dtype, f"prefill {num_tokens}", med, statistics.median(theirs),
                        None, num_tokens / (med / 1e3), min(theirs) / min(ours)))  # fmt: skip
        print_row(rows[-1])
    for batch in DECODE_BATCHES:
        ours, loop, padded = bench_decode(engine, hf, batch, args.repeats, dtype, args.device)
        medians = [statistics.median(t) for t in (ours, loop, padded)]
        rows.append(Row(preset, dtype, f"decode b={batch}", *medians, None, min(loop) / min(ours)))
        print_row(rows[-1])
    return rows


HEADER = (
    f"{'preset':6} {'dtype':8} {'case':14} {'engine ms':>10} {'hf ms':>10} {'hf pad ms':>10} "
    f"{'hf/eng':>7} {'pad/eng':>7} {'eng tok/s':>10} {'best hf/eng':>11}"
)


def print_row(row: Row) -> None:
    padded = f"{row.hf_padded_ms:10.2f}" if row.hf_padded_ms is not None else f"{'-':>10}"
    pad_ratio = f"{row.hf_padded_ms / row.engine_ms:7.2f}" if row.hf_padded_ms else f"{'-':>7}"
    rate = f"{row.tokens_per_s:10.0f}" if row.tokens_per_s else f"{'-':>10}"
    print(
        f"{row.preset:6} {row.dtype:8} {row.case:14} {row.engine_ms:10.2f} {row.hf_ms:10.2f} "
        f"{padded} {row.hf_ms / row.engine_ms:7.2f} {pad_ratio} {rate} {row.best_ratio:11.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default="tiny,small")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--kv-cache-mb", type=float, default=1024.0)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    # transformers 5.2x renames `past_key_values`; the old name still works everywhere.
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads, device {args.device}")
    print(HEADER, flush=True)
    rows: list[Row] = []
    for preset in args.presets.split(","):
        for dtype in args.dtypes.split(","):
            rows += run_preset(preset, dtype, args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([asdict(r) for r in rows], fh, indent=2)


if __name__ == "__main__":
    main()
