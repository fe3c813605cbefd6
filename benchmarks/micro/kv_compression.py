"""KV compression on the wire (``--kv-compression``, issue #21 goal 6), on a real model.

Three measurements, every codec of ``--modes`` side by side:

1. **Accuracy under teacher forcing.** Windows of real text (this repository's docs) are
   cut into a prefix and a continuation. transformers computes the prefix's KV cache;
   each codec encodes and decodes that cache (as a decode worker receives a prompt's KV),
   and the continuation is run over it, teacher-forced. Against the run over the exact
   cache: top-1 agreement per position and the largest logit error, over
   ``windows x continuation`` positions.
2. **Wire bytes and codec CPU.** On one real prompt's KV (``--prompt-tokens``): bytes on
   the wire per token, and encode / decode time per token on one thread.
3. **Effective KV throughput through a real stream.** A prompt's KV goes from this
   process to a receiver *process* over halfmoon's transfer engine (tcp), one stream
   layer at a time as a prefill worker sends it: encoded on the sending thread, decoded
   on the receiver's transfer thread as each layer lands. Logical (raw KV) bytes over the
   time from the first layer to the receiver's acknowledgement of the last. The
   receiver's decoded bytes are checked against the sender's own decode of the same
   payloads (a digest). The wire ceiling is ``none`` through the same path, measured in
   the same rounds (rounds rotate the modes). With ``--wire-gbit G`` (root, iproute2) the
   receiver runs in a network namespace behind a veth pair shaped to G Gbit/s by a token
   bucket: a NIC-like wire instead of this host's loopback.

Run from the repository root::

    .venv/bin/python -m benchmarks.micro.kv_compression --json benchmarks/results/kv_compression.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

from benchmarks.micro.wire import NS_IP, shaped_wire

ROOT = Path(__file__).resolve().parents[2]
SECRET_ENV = "HALFMOON_TRANSFER_SECRET"


# -- codecs ---------------------------------------------------------------------------------
_CODECS: dict[tuple[str, int], Any] = {}


def codec_for(mode: str, head_dim: int, directions=("encode", "decode")):
    """The float32 codec of ``mode`` as serving workers run it (compiled where it builds)."""
    from halfmoon.engine.kvcodec import compiled_or_eager, make_codec

    key = (mode, head_dim)
    if key not in _CODECS:
        _CODECS[key] = compiled_or_eager(make_codec(mode, torch.float32, head_dim), directions)
    return _CODECS[key]


# -- text and model --------------------------------------------------------------------------
def text_tokens(tokenizer: Any, needed: int) -> list[int]:
    """Token ids of this repository's markdown docs (real English, code and tables)."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    ids: list[int] = []
    for path in paths:
        ids += tokenizer.encode(path.read_text())
        if len(ids) >= needed:
            break
    if len(ids) < needed:
        raise SystemExit(f"the docs hold {len(ids)} tokens; {needed} are needed")
    return ids


def load_reference(model_dir: Path):
    """transformers' model and tokenizer for ``model_dir`` (float32, eval)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return model.eval(), tokenizer


# -- 1. accuracy -----------------------------------------------------------------------------
@torch.inference_mode()
def accuracy(model, ids: list[int], modes: list[str], args) -> dict[str, dict[str, float]]:
    """Top-1 agreement and logit errors of each codec, teacher-forced (see the docstring)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    codecs = {m: codec_for(m, head_dim) for m in modes}
    span = args.prefix + args.continuation
    stride = max(span, (len(ids) - span) // max(1, args.windows - 1))
    agree = {m: 0 for m in modes}
    max_err = dict.fromkeys(modes, 0.0)
    abs_err = dict.fromkeys(modes, 0.0)
    positions = 0
    for w in range(args.windows):
        window = torch.tensor([ids[w * stride : w * stride + span]])
        if window.shape[1] < span:
            break
        out = model(window[:, : args.prefix], use_cache=True)
        cont = window[:, args.prefix :]
        ref = model(cont, past_key_values=copy.deepcopy(out.past_key_values)).logits[0]
        positions += cont.shape[1]
        for mode, codec in codecs.items():
            cache = copy.deepcopy(out.past_key_values)
            for layer in cache.layers:  # [1, H_kv, T, D]: groups of D per (head, token)
                layer.keys = codec.encode_tensor(layer.keys)
                layer.values = codec.encode_tensor(layer.values)
            logits = model(cont, past_key_values=cache).logits[0]
            agree[mode] += int((logits.argmax(-1) == ref.argmax(-1)).sum())
            diff = (logits - ref).abs()
            max_err[mode] = max(max_err[mode], float(diff.max()))
            abs_err[mode] += float(diff.mean()) * cont.shape[1]
        print(f"  window {w + 1}/{args.windows}: " + ", ".join(
            f"{m} {agree[m] / positions:.4f}" for m in modes), flush=True)  # fmt: skip
    return {
        m: {"positions": positions, "top1_agreement": agree[m] / positions,
            "max_logit_error": max_err[m], "mean_logit_error": abs_err[m] / positions}
        for m in modes
    }  # fmt: skip


# -- 2. wire bytes and codec CPU --------------------------------------------------------------
def prompt_kv(model, ids: list[int], block_size: int) -> list[torch.Tensor]:
    """The prompt's KV as stream layers (K then V of each layer), each
    ``[n, block_size, H_kv, D]`` float32 like the engine's pool (padded to whole blocks)."""
    with torch.inference_mode():
        cache = model(torch.tensor([ids]), use_cache=True).past_key_values
    layers = []
    n = -(-len(ids) // block_size)
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            x = t[0].transpose(0, 1).contiguous()  # [T, H, D]
            padded = torch.zeros(n * block_size, *x.shape[1:])
            padded[: x.shape[0]] = x
            layers.append(padded.view(n, block_size, *x.shape[1:]))
    return layers


def block_views(x: torch.Tensor) -> list[memoryview]:
    """One byte view per block, as the engine's prompt-KV hook hands them out."""
    return [memoryview(b.view(torch.uint8).reshape(-1).numpy()) for b in x]


def codec_cost(layers: list[torch.Tensor], tokens: int, modes: list[str], rounds: int):
    """Wire bytes per token and one-thread encode / decode time of each codec."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a streamer thread's share; intra-op threads would oversubscribe
    head_dim = layers[0].shape[-1]
    raw = sum(x.numel() * 4 for x in layers)
    out: dict[str, dict[str, float]] = {}
    try:
        for mode in modes:
            codec = codec_for(mode, head_dim)
            views = [block_views(x) for x in layers]
            enc_s, dec_s, wire = [], [], 0
            for _ in range(rounds + 1):
                payloads, encode = [], 0.0
                for v in views:
                    t0 = time.perf_counter()
                    payload = codec.encode(v)
                    encode += time.perf_counter() - t0
                    payloads.append(bytes(payload))  # the wire's copy (untimed)
                dest = torch.empty(layers[0].numel())
                t1 = time.perf_counter()
                for p in payloads:
                    codec.decode(memoryview(p), memoryview(dest.view(torch.uint8).numpy()))
                dec_s.append(time.perf_counter() - t1)
                enc_s.append(encode)
                wire = sum(len(p) for p in payloads)
            enc, dec = statistics.median(enc_s[1:]), statistics.median(dec_s[1:])
            out[mode] = {
                "wire_bytes_per_token": wire / tokens, "raw_bytes_per_token": raw / tokens,
                "ratio": raw / wire, "encode_us_per_token": enc / tokens * 1e6,
                "decode_us_per_token": dec / tokens * 1e6, "encode_gib_s": raw / enc / 2**30,
                "decode_gib_s": raw / dec / 2**30,
            }  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return out


# -- 3. stream throughput ---------------------------------------------------------------------
def receiver_main(args) -> int:
    """The receiving process: announce sessions on request, decode layers as they land."""
    from halfmoon.transfer import StreamLayout, TransferEngine

    torch.set_num_threads(1)
    engine = TransferEngine(bytes.fromhex(os.environ[SECRET_ENV]), host=args.host,
                            transport="tcp")  # fmt: skip
    print(json.dumps({"endpoint": engine.start()}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        mode, layers, n, half = job["mode"], job["layers"], job["n"], job["half"]
        codec = codec_for(mode, job["head_dim"], ("decode",))
        raw = engine.register_region("raw", layers * n * half)
        decode_s = [0.0]
        if mode == "none":
            layout = StreamLayout.contiguous(layers, n, half)
            rx = engine.expect_stream(job["session"], "raw", layout)
        else:
            slot = codec.max_encoded_bytes(n * half)
            wire = engine.register_region("wire", layers * slot)

            def decode(receiver, layer, wire=wire, slot=slot, codec=codec, raw=raw,
                       size=n * half, decode_s=decode_s) -> None:  # fmt: skip
                t0 = time.perf_counter()
                payload = wire.view[layer * slot : layer * slot + receiver.lengths(layer)[0]]
                codec.decode(payload, raw.view[layer * size : (layer + 1) * size])
                decode_s[0] += time.perf_counter() - t0

            layout = StreamLayout.contiguous(layers, 1, slot)
            rx = engine.expect_stream(job["session"], "wire", layout, decode)
        print(json.dumps({"ready": job["session"]}), flush=True)
        rx.wait(120)
        digest = xxhash.xxh3_64_hexdigest(raw.view)
        engine.unregister_region("raw")
        if mode != "none":
            engine.unregister_region("wire")
        print(json.dumps({"done": job["session"], "digest": digest, "decode_s": decode_s[0]}),
              flush=True)  # fmt: skip
    engine.close()
    return 0


class Receiver:
    """The receiver process (in the shaped network namespace with ``--wire-gbit``)."""

    def __init__(self, secret: str, host: str, netns: str | None) -> None:
        argv = [sys.executable, "-m", "benchmarks.micro.kv_compression", "--role", "receiver",
                "--host", host]  # fmt: skip
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        env = {**os.environ, SECRET_ENV: secret, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=ROOT, env=env)  # fmt: skip
        self.endpoint = self.read()["endpoint"]

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the receiver exited ({self.proc.wait()})")
        return json.loads(line)

    def send(self, job: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stream_once(client, receiver: Receiver, layers: list[torch.Tensor], mode: str, session: str):
    """One prompt's KV through a stream; (seconds, encode seconds, receiver decode seconds)."""
    n = layers[0].shape[0]
    half = layers[0][0].numel() * 4
    codec = codec_for(mode, layers[0].shape[-1])
    receiver.send({"session": session, "mode": mode, "layers": len(layers), "n": n,
                   "half": half, "head_dim": layers[0].shape[-1]})  # fmt: skip
    assert receiver.read() == {"ready": session}
    shape = (len(layers), n, half) if mode == "none" else (
        len(layers), 1, codec.max_encoded_bytes(n * half))  # fmt: skip
    views = [block_views(x) for x in layers]
    expected = xxhash.xxh3_64()
    encode_s = 0.0
    start = time.perf_counter()
    sender = client.open_stream(session, *shape, timeout_s=60)
    for i, v in enumerate(views):
        if mode == "none":
            sender.send_layer(i, v)
            for b in v:
                expected.update(b)
        else:
            t0 = time.perf_counter()
            payload = codec.encode(v)
            encode_s += time.perf_counter() - t0
            sender.send_layer(i, [payload])
            # What the receiver must hold: the decode of exactly these bytes (untimed).
            t1 = time.perf_counter()
            mine = torch.empty(n * half // 4)
            codec.decode(payload, memoryview(mine.view(torch.uint8).numpy()))
            expected.update(memoryview(mine.view(torch.uint8).numpy()))
            start += time.perf_counter() - t1
    sender.finish()
    elapsed = time.perf_counter() - start
    done = receiver.read()
    if done.get("digest") != expected.hexdigest():
        raise RuntimeError(f"{mode}: the receiver decoded other bytes than were sent")
    return elapsed, encode_s, done["decode_s"]


def stream_rounds(layers, modes, rounds, netns: str | None, host: str):
    """Each round streams the prompt once per mode (the order rotating)."""
    from halfmoon.transfer import TransferEngine

    secret = secrets.token_hex(16)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the sending thread's share, as on a prefill worker
    receiver = Receiver(secret, host, netns)
    engine = TransferEngine(bytes.fromhex(secret), transport="tcp")
    raw = sum(x.numel() * 4 for x in layers)
    per_mode: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    try:
        client = engine.connect(receiver.endpoint)
        stream_once(client, receiver, layers, "none", "warm-up")
        for r in range(rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]
            for mode in order:
                s, enc, dec = stream_once(client, receiver, layers, mode, f"r{r}-{mode}")
                per_mode[mode].append({"seconds": s, "encode_s": enc, "decode_s": dec,
                                       "effective_gib_s": raw / s / 2**30})  # fmt: skip
    finally:
        engine.close()
        receiver.close()
        torch.set_num_threads(threads)
    out = {}
    for mode, runs in per_mode.items():
        ceiling = [c["effective_gib_s"] for c in per_mode.get("none", [])]
        eff = [c["effective_gib_s"] for c in runs]
        out[mode] = {
            "effective_gib_s": statistics.median(eff), "rounds_gib_s": eff,
            "rounds_vs_none": [e / c for e, c in zip(eff, ceiling, strict=False)] if ceiling else [],
            "encode_s": statistics.median(c["encode_s"] for c in runs),
            "decode_s": statistics.median(c["decode_s"] for c in runs),
        }  # fmt: skip
    return out


# -- main ----------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--role", default="bench", choices=("bench", "receiver"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--modes", default="none,int8,fp8,zstd")
    parser.add_argument("--windows", type=int, default=6, help="text windows for accuracy")
    parser.add_argument("--prefix", type=int, default=512, help="prefix tokens per window")
    parser.add_argument("--continuation", type=int, default=512,
                        help="teacher-forced positions per window")  # fmt: skip
    parser.add_argument("--prompt-tokens", type=int, default=2048,
                        help="the prompt whose KV is streamed")  # fmt: skip
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5, help="stream rounds per mode")
    parser.add_argument("--wire-gbit", type=float, default=0.0,
                        help="also stream over a veth pair shaped to this rate (root)")  # fmt: skip
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the model")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    if args.role == "receiver":
        return receiver_main(args)

    from halfmoon.engine.catalog import resolve_model
    from halfmoon.engine.kvcodec import MODES

    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        parser.error(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    if "none" not in modes:
        modes.insert(0, "none")  # the reference and the wire ceiling
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    model, tokenizer = load_reference(model_dir)
    span = args.prefix + args.continuation
    ids = text_tokens(tokenizer, max(args.prompt_tokens, span * args.windows))
    started = time.monotonic()
    result: dict[str, Any] = {"model": str(model_dir.name), "modes": modes, "args": vars(args)}
    if not args.skip_accuracy:
        print(f"accuracy: {args.windows} windows x {args.continuation} teacher-forced positions")
        result["accuracy"] = accuracy(model, ids, modes, args)
    layers = prompt_kv(model, ids[: args.prompt_tokens], args.block_size)
    result["codec"] = codec_cost(layers, args.prompt_tokens, modes, args.rounds)
    print("streams over loopback tcp ...", flush=True)
    result["stream_loopback"] = stream_rounds(layers, modes, args.rounds, None, "127.0.0.1")
    if args.wire_gbit:
        print(f"streams over a {args.wire_gbit:g} Gbit/s veth ...", flush=True)
        with shaped_wire(args.wire_gbit) as netns:
            result["stream_shaped"] = stream_rounds(layers, modes, args.rounds, netns, NS_IP)
    result["wall_s"] = round(time.monotonic() - started, 1)
    print_tables(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def print_tables(result: dict[str, Any]) -> None:
    """Markdown tables of the result."""
    modes = result["modes"]
    if "accuracy" in result:
        print("\n| mode | positions | top-1 agreement | max logit error | mean logit error |")
        print("|---|---:|---:|---:|---:|")
        for m in modes:
            a = result["accuracy"][m]
            print(f"| {m} | {a['positions']} | {a['top1_agreement'] * 100:.2f}% | "
                  f"{a['max_logit_error']:.4f} | {a['mean_logit_error']:.5f} |")  # fmt: skip
    print(
        "\n| mode | wire B/token | ratio | encode us/token | decode us/token | encode GiB/s | decode GiB/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for m in modes:
        c = result["codec"][m]
        print(f"| {m} | {c['wire_bytes_per_token']:.0f} | {c['ratio']:.2f}x | "
              f"{c['encode_us_per_token']:.2f} | {c['decode_us_per_token']:.2f} | "
              f"{c['encode_gib_s']:.2f} | {c['decode_gib_s']:.2f} |")  # fmt: skip
    for key, label in (("stream_loopback", "loopback tcp"), ("stream_shaped", "shaped veth")):
        if key not in result:
            continue
        print(f"\n{label}: | mode | effective GiB/s (median) | vs none, each round |")
        print("|---|---:|---|")
        for m in modes:
            s = result[key][m]
            rounds = ", ".join(f"{r:.2f}" for r in s["rounds_vs_none"])
            print(f"| {m} | {s['effective_gib_s']:.2f} | {rounds} |")


if __name__ == "__main__":
    sys.exit(main())
