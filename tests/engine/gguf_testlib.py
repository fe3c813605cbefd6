"""Small GGUF files written with gguf-py, for the importer's tests.

:func:`write_gguf` writes a random-weight decoder of a given architecture as llama.cpp's
converter would (q/k rows permuted for llama and mistral, none for qwen2), each tensor in
a chosen GGML type, with a byte-level BPE tokenizer (the tiny preset's) or a scored
SentencePiece-style vocabulary. It returns the HF-named float32 weights it started from,
so a test can build the reference model from them directly.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from halfmoon.engine.tokenizer import build_preset_tokenizer

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS = 64, 4, 2, 16, 128, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
    "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two RoPE halves interleaved."""
    half = rows.shape[0] // num_heads // 2
    return rows.reshape(num_heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def byte_level_vocab(vocab_size: int = 1024) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the preset byte-level BPE; ids 0-4 are control."""
    tok = build_preset_tokenizer(vocab_size)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if i < 5 else 1 for i in range(len(tokens))]
    return tokens, types, merges


def sentencepiece_vocab(vocab_size: int = 600) -> tuple[list[str], list[int], list[float]]:
    """(tokens, types, scores): <unk>, <s>, </s>, 256 byte tokens, then ``▁``-spelled
    pieces learned by BPE on the preset corpus, scored by merge rank as SentencePiece does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from halfmoon.engine.tokenizer import _corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, min_frequency=2)
    tok.train_from_iterator(_corpus(3000), trainer=trainer)
    learned = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *([6] * 256)]
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(learned):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    return tokens, types, scores


def write_gguf(
    path: Path,
    arch: str = "llama",
    tensor_type: str = "F32",
    tokenizer: str = "gpt2",
    seed: int = 0,
    tied: bool = False,
    metadata: dict[str, float | int] | None = None,
) -> dict[str, np.ndarray]:
    """Write a 2-layer decoder of ``arch`` with its matrices as ``tensor_type`` (and
    ``metadata``: more keys, floats as float32, ints as int32); returns the HF-named
    float32 weights (before quantization)."""
    rng = np.random.default_rng(seed)
    if tokenizer == "gpt2":
        tokens, types, merges = byte_level_vocab()
        scores = None
    else:
        tokens, types, scores = sentencepiece_vocab()
        merges = None
    vocab = len(tokens)
    qkv_bias = arch == "qwen2"

    def normal(*shape: int, std: float = 0.2) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    hf: dict[str, np.ndarray] = {"model.embed_tokens.weight": normal(vocab, HIDDEN)}
    hf["model.norm.weight"] = 1 + normal(HIDDEN, std=0.1)
    if not tied:
        hf["lm_head.weight"] = normal(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = 1 + normal(HIDDEN, std=0.1)
        hf[p + "post_attention_layernorm.weight"] = 1 + normal(HIDDEN, std=0.1)
        hf[p + "self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        hf[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        hf[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        hf[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        hf[p + "mlp.gate_proj.weight"] = normal(INTER, HIDDEN)
        hf[p + "mlp.up_proj.weight"] = normal(INTER, HIDDEN)
        hf[p + "mlp.down_proj.weight"] = normal(HIDDEN, INTER)
        if qkv_bias:
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                hf[p + f"self_attn.{proj}_proj.bias"] = normal(rows * HEAD_DIM, std=0.1)

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model(tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    if merges is not None:
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(merges)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(4)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    else:
        writer.add_token_scores(scores)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    for key, value in (metadata or {}).items():
        if isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_int32(key, value)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for gguf_name, hf_name in _names(arch, tied):
        array = hf[hf_name]
        if arch != "qwen2" and ("attn_q." in gguf_name or "attn_k." in gguf_name):
            array = permute(array, HEADS if "attn_q." in gguf_name else KV_HEADS)
        if array.ndim == 1:  # norms and biases stay float32, as llama.cpp writes them
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def _names(arch: str, tied: bool) -> list[tuple[str, str]]:
    names = [("token_embd.weight", "model.embed_tokens.weight"),
             ("output_norm.weight", "model.norm.weight")]  # fmt: skip
    if not tied:
        names.append(("output.weight", "lm_head.weight"))
    layer = {
        "attn_norm.weight": "input_layernorm.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_k.weight": "self_attn.k_proj.weight",
        "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
    }
    if arch == "qwen2":
        layer.update({f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"})
    for i in range(LAYERS):
        names += [(f"blk.{i}.{g}", f"model.layers.{i}.{h}") for g, h in layer.items()]
    return names
