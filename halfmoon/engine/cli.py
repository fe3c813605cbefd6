"""``halfmoon model create | import | list`` and ``halfmoon generate``.

Registering the commands imports nothing heavy; torch and the engine load inside the
handlers, so other subcommands stay fast and torch-free.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from halfmoon.engine.catalog import NAMED_MODELS, PRESETS


def _progress(message: str) -> None:
    print(f"halfmoon: {message}", file=sys.stderr, flush=True)


def _cmd_model_import(args: argparse.Namespace) -> int:
    from halfmoon.engine.catalog import named_model_file, unknown_model_error
    from halfmoon.engine.gguf_import import import_gguf

    source = Path(args.source).expanduser()
    if args.source in NAMED_MODELS and not source.exists():
        source = named_model_file(args.source)
    elif not source.is_file():
        raise unknown_model_error(args.source)
    out = import_gguf(source, Path(args.out), dtype=args.dtype, progress=_progress)
    print(f"wrote {out}")
    return 0


def _cmd_model_list(args: argparse.Namespace) -> int:
    from halfmoon.engine.catalog import cache_dir, list_models

    rows = list_models()
    if args.json:
        print(json.dumps([vars(r) for r in rows], indent=2))
        return 0
    width = max(len(r.name) for r in rows)
    for r in rows:
        print(f"{r.name:<{width}}  {r.kind:<6}  {r.status:<15}  {r.summary}")
    print(f"cache: {cache_dir()}")
    return 0


def _cmd_model_create(args: argparse.Namespace) -> int:
    from halfmoon.engine.loader import create_preset_dir

    out = create_preset_dir(args.preset, Path(args.out), seed=args.seed)
    print(f"wrote preset {args.preset!r} (seed {args.seed}) to {out}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from halfmoon.core.speculative import parse_speculative_config
    from halfmoon.engine.catalog import resolve_model
    from halfmoon.engine.config import EngineConfig, resolve_dtype
    from halfmoon.engine.engine import LLMEngine
    from halfmoon.engine.sampling import EngineSamplingParams

    dtype = args.dtype
    if dtype == "auto":
        dtype = resolve_dtype(dtype, resolve_model(args.model, progress=_progress))
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=dtype,
        kv_cache_mb=args.kv_cache_mb,
        lora_modules=(("lora", args.lora),) if args.lora else (),
        speculative=parse_speculative_config(args.speculative_config),
    )
    params = EngineSamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=tuple(args.stop or ()),
        ignore_eos=args.ignore_eos,
        lora="lora" if args.lora else None,
    )
    if args.model not in PRESETS:
        from halfmoon.engine.catalog import resolve_model

        config = replace(config, model=str(resolve_model(args.model, progress=_progress)))
    engine = LLMEngine(config)
    prompt: str | list[int] = args.prompt
    if args.chat:
        if engine.tokenizer is None:
            raise ValueError("--chat needs a model directory with a tokenizer")
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    (out,) = engine.generate([prompt], params)
    engine.check_integrity()
    if args.json:
        payload = {
            "text": out.text,
            "token_ids": list(out.token_ids),
            "finish_reason": out.finish_reason,
        }
        spec = engine.stats().spec_decode
        if spec is not None:
            payload["spec_decode"] = {
                "draft_tokens": spec.num_draft_tokens,
                "accepted_tokens": spec.num_accepted_tokens,
            }
        print(json.dumps(payload))
    else:
        print(out.text)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``model create | import | list`` and ``generate``."""
    model = subparsers.add_parser("model", help="import, create and list models")
    model_sub = model.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    create = model_sub.add_parser(
        "create", help="write a preset with random weights as a complete HF directory"
    )
    create.add_argument("--preset", required=True, choices=PRESETS, help="model size")
    create.add_argument("--out", required=True, help="output directory")
    create.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    create.set_defaults(func=_cmd_model_create)

    imp = model_sub.add_parser(
        "import",
        help="write a GGUF file (or a named model's) as an HF directory",
        description="Dequantize a GGUF file (architectures llama, qwen2, mistral; tensors "
        "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and K-quants) into config.json, "
        "safetensors, tokenizer.json, tokenizer_config.json and generation_config.json.",
    )
    imp.add_argument("source", help=f"a .gguf file or a named model ({', '.join(NAMED_MODELS)})")
    imp.add_argument("--out", required=True, help="output directory (must not exist)")
    imp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                     help="dtype of the written weights (default float32)")  # fmt: skip
    imp.set_defaults(func=_cmd_model_import)

    listing = model_sub.add_parser(
        "list", help="named models, presets and what the model cache holds"
    )
    listing.add_argument("--json", action="store_true", help="print JSON rows")
    listing.set_defaults(func=_cmd_model_list)

    gen = subparsers.add_parser("generate", help="generate text with the halfmoon engine")
    gen.add_argument(
        "--model", required=True,
        help="an HF directory, a .gguf file, a named model or a preset (`halfmoon model list`)",
    )  # fmt: skip
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="top-k sampling (0 = off)")
    gen.add_argument(
        "--min-p", type=float, default=0.0,
        help="draw only tokens at least this fraction as likely as the likeliest (0 = off)",
    )  # fmt: skip
    gen.add_argument(
        "--seed",
        type=int,
        default=None,
        help="sampling seed (presets always use weight seed 0, as `model create`)",
    )
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    gen.add_argument("--lora", metavar="DIR", help="run with this LoRA adapter (a PEFT directory)")
    gen.add_argument(
        "--speculative-config", metavar="JSON",
        help='prompt-lookup speculative decoding, e.g. \'{"num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (vLLM\'s flag)',
    )  # fmt: skip
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--json", action="store_true", help="print text, token_ids, finish_reason")
    gen.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    gen.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16", "auto"),
                     help="auto: the model's config dtype, float32 models in bfloat16 (as vLLM)")  # fmt: skip
    gen.add_argument("--kv-cache-mb", type=float, default=256.0, help="KV pool size in MiB")
    gen.set_defaults(func=_cmd_generate)
