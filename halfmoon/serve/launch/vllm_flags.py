"""``vllm serve``'s flags on ``halfmoon serve``: a vLLM command line starts halfmoon
unchanged, or is refused before anything starts with a message naming halfmoon's way.

Each flag is one of:

- *done here* (wired where halfmoon does the same thing): ``MODEL`` as the first
  argument (``vllm serve MODEL``), ``--max-num-batched-tokens`` (the engine's tokens per
  step, the prefill chunk; passed to vLLM servers with ``--engine vllm``),
  ``--enable-auto-tool-choice`` (refused without ``--tool-call-parser``, as on vLLM),
  ``--uvicorn-log-level``, ``--disable-uvicorn-access-log`` (halfmoon's
  ``--disable-access-log``), ``--root-path``, ``--disable-fastapi-docs``,
  ``--default-chat-template-kwargs``,
  ``--return-tokens-as-token-ids`` and ``--enable-force-include-usage`` (server-wide
  defaults of the request options);
- *accepted, changing nothing* because halfmoon already behaves as the flag asks
  (:data:`ACCEPTED`, each with the reason its help states);
- *refused* where halfmoon cannot do what it asks (:data:`REFUSED`; or a value other
  than the one halfmoon serves: ``--tensor-parallel-size``/``--pipeline-parallel-size``
  other than 1, ``--kv-cache-dtype`` other than ``auto``, ``--load-format`` other than
  ``auto``/``safetensors``).
"""

from __future__ import annotations

import argparse
from typing import Any

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.jsonconfig import json_object_option
from halfmoon.engine.tokenizer import RESERVED_TEMPLATE_NAMES
from halfmoon.serve.worker.main import DEFAULT_MODEL

#: Switches that ask for what halfmoon does anyway: why each changes nothing.
ACCEPTED = {
    "--trust-remote-code": "no code from the checkpoint runs: the architectures halfmoon "
    "serves are its own",
    "--enforce-eager": "CUDA graphs are off unless --cuda-graphs",
    "--enable-chunked-prefill": "prompts are always prefilled in chunks of at most "
    "--max-num-batched-tokens",
    "--disable-log-requests": "halfmoon logs no request contents (its access log has a "
    "line per request: --disable-access-log)",
    "--disable-log-stats": "halfmoon logs no periodic stats line (its figures: /metrics)",
    "--enable-prompt-tokens-details": "usage carries prompt_tokens_details.cached_tokens "
    "whenever the cluster reports it",
    "--enable-server-load-tracking": "GET /load (requests in flight) is always served",
}
#: Flags with a value that ask for what halfmoon does anyway: why each changes nothing.
ACCEPTED_VALUES = {
    "--max-log-len": "halfmoon logs no request contents",
    "--swap-space": "a preempted sequence is recomputed, not swapped out to host memory",
    "--max-loras": "halfmoon's engine reserves no adapter slots: any number of LoRA adapters "
    "share a step (with --engine vllm its servers are sized for the adapters given)",
    "--max-lora-rank": "halfmoon's engine takes adapters of any rank (with --engine vllm its "
    "servers are sized for the largest given)",
    "--max-cpu-loras": "adapters stay loaded in every worker's memory",
}
#: Flags that ask for what halfmoon does not do: what to use instead.
REFUSED = {
    "--gpu-memory-utilization": "each worker's KV pool is sized in MiB by --kv-cache-mb, not "
    "as a fraction of the device's memory",
    "--quantization": "quantized checkpoints are not served: the weights run in --dtype "
    "(float32, bfloat16, float16)",
    "--tokenizer": "the model directory's own tokenizer is used (a chat template of another: "
    "--chat-template)",
    "--revision": "no model hub is read: --model names a local directory or a GGUF file",
    "--hf-overrides": "the model's config.json is read as it is",
    "--enable-log-requests": "halfmoon logs no request contents; its access log (on by "
    "default) has a line per request",
    "--middleware": "no middleware is loaded from the command line",
    "--kv-transfer-config": "halfmoon moves KV between its own workers (--mode "
    "disaggregated; with --engine vllm, its servers get halfmoon's connector)",
    "--limit-mm-per-prompt": "multimodal inputs are not served",
}
#: Flags whose value must be the one halfmoon serves: those values.
ONLY = {
    "--tensor-parallel-size": ("1",),
    "--pipeline-parallel-size": ("1",),
    "--kv-cache-dtype": ("auto",),
    "--load-format": ("auto", "safetensors"),
    "--data-parallel-size": ("1",),
    "--api-server-count": ("1",),
    "--tokenizer-mode": ("auto", "hf"),
    "--chat-template-content-format": ("auto", "string"),
}
#: Why a value other than :data:`ONLY`'s is refused.
_ONLY_WHY = {
    "--tensor-parallel-size": "each worker runs the whole model: scale out with "
    "--prefill/--decode (or --instances), and split long prompts across prefill workers "
    "with --cpp-stages",
    "--pipeline-parallel-size": "each worker runs the whole model; --cpp-stages pipelines "
    "long prompts across prefill workers",
    "--kv-cache-dtype": "the KV pool holds the model's --dtype (--kv-compression int8 or fp8 "
    "compresses KV on the wire)",
    "--load-format": "safetensors checkpoints (and GGUF files) are read",
    "--data-parallel-size": "each worker runs the whole model: more copies are more "
    "workers (--prefill/--decode, --instances)",
    "--api-server-count": "one gateway serves the API (its Conductor places the requests)",
    "--tokenizer-mode": "the model directory's Hugging Face tokenizer is read",
    "--chat-template-content-format": "a message's text parts reach the template as one string",
}
_SHORT = {"--tensor-parallel-size": "-tp", "--pipeline-parallel-size": "-pp",
          "--quantization": "-q", "--data-parallel-size": "-dp"}  # fmt: skip


def _names(flag: str) -> list[str]:
    """A flag's names: vLLM's short one too, where it has one."""
    return [flag, _SHORT[flag]] if flag in _SHORT else [flag]


def _dest(flag: str) -> str:
    return "vllm_" + flag.lstrip("-").replace("-", "_")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """``vllm serve``'s flags (see the module docstring) on ``halfmoon serve``'s parser."""
    p.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="the model, as vllm serve takes it (the same as --model)",
    )  # fmt: skip
    p.add_argument(
        "--uvicorn-log-level", default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="the HTTP server's own log level (vLLM's flag)",
    )  # fmt: skip
    p.add_argument(
        "--disable-uvicorn-access-log", dest="disable_access_log", action="store_true",
        help="vLLM's name of --disable-access-log",
    )  # fmt: skip
    p.add_argument(
        "--root-path", default=None,
        help="the path prefix a proxy serves the API under (vLLM's flag; the OpenAPI "
        "schema names it)",
    )  # fmt: skip
    p.add_argument(
        "--return-tokens-as-token-ids", action="store_true",
        help="log-probability tokens as 'token_id:<id>' by default (vLLM's flag; a request's "
        "return_tokens_as_token_ids too)",
    )  # fmt: skip
    p.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help="accepted for vLLM's command lines: --tool-call-parser alone lets tool_choice "
        "be 'auto' (this flag without it is refused, as on vLLM)",
    )  # fmt: skip
    p.add_argument(
        "--default-chat-template-kwargs", default=None, metavar="JSON",
        help="chat template variables every chat request gets unless its own "
        "chat_template_kwargs set them (vLLM's flag), e.g. '{\"enable_thinking\": false}'",
    )  # fmt: skip
    p.add_argument(
        "--disable-fastapi-docs", action="store_true",
        help="no /openapi.json, /docs or /redoc (vLLM's flag)",
    )  # fmt: skip
    p.add_argument(
        "--enable-force-include-usage", action="store_true",
        help="streamed answers end with their usage even when stream_options does not ask "
        "(vLLM's flag)",
    )  # fmt: skip
    for flag, why in ACCEPTED.items():
        p.add_argument(flag, dest=_dest(flag), action="store_true",
                       help=f"accepted for vLLM's command lines, changing nothing: {why}")  # fmt: skip
    for flag, why in ACCEPTED_VALUES.items():
        p.add_argument(flag, dest=_dest(flag), default=None, metavar="VALUE",
                       help=f"accepted for vLLM's command lines, changing nothing: {why}")  # fmt: skip
    for flag, why in REFUSED.items():
        p.add_argument(*_names(flag), dest=_dest(flag), default=None, nargs="?", const="",
                       metavar="VALUE", help=f"refused (vLLM's flag): {why}")  # fmt: skip
    for flag, values in ONLY.items():
        p.add_argument(*_names(flag), dest=_dest(flag), default=None, metavar="VALUE",
                       help=f"vLLM's flag: only {' or '.join(values)} ({_ONLY_WHY[flag]})")  # fmt: skip


def default_template_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``--default-chat-template-kwargs`` as a dict (empty when not given); HalfmoonError
    for anything but a JSON object, or one that sets a variable the template's caller
    sets itself."""
    given = json_object_option(getattr(args, "default_chat_template_kwargs", None),
                               "--default-chat-template-kwargs", '{"enable_thinking": false}')  # fmt: skip
    kwargs = dict(given or {})
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise HalfmoonError(f"--default-chat-template-kwargs cannot set {', '.join(reserved)}")
    return kwargs


def check_vllm_flags(args: argparse.Namespace) -> None:
    """Refuse what halfmoon cannot do (HalfmoonError naming the flag and halfmoon's way),
    and take the positional ``MODEL`` as ``--model``."""
    for flag, why in REFUSED.items():
        if getattr(args, _dest(flag), None) is not None:
            raise HalfmoonError(f"{flag} is not supported: {why}")
    for flag, values in ONLY.items():
        given = getattr(args, _dest(flag), None)
        if given is not None and given not in values:
            raise HalfmoonError(f"{flag} {given}: only {' or '.join(values)} is served "
                                f"({_ONLY_WHY[flag]})")  # fmt: skip
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(
        args, "tool_call_parser", None
    ):
        raise HalfmoonError("--enable-auto-tool-choice needs --tool-call-parser (the format "
                            "of the model's tool calls)")  # fmt: skip
    default_template_kwargs(args)  # (checked here, before anything starts)
    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model not in (tag, DEFAULT_MODEL):
            raise HalfmoonError(f"two models given: {tag!r} and --model {args.model!r}")
        args.model = tag
