"""LoRA adapters: logits against PEFT's own model, many adapters in one batch, separate
prefix caches, and the adapters the loader refuses."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import peft
import pytest
import torch
from engine_testlib import Reference, assert_logits_close, engine_config, prefill
from safetensors.torch import load_file, save_file

from halfmoon.core.adapters import LoraModule, parse_lora_modules
from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.engine.config import ModelConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.lora import MODULES, LoraAdapter, write_random_adapter
from halfmoon.engine.runner import LOGITS_ALL, ChunkInput

# (PEFT's save_pretrained asks transformers a deprecated question)
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_adapter(ref: Reference, out: Path, seed: int, **lora: object) -> torch.nn.Module:
    """A random adapter made and saved by PEFT itself on (a copy of) ``ref``'s model;
    returns PEFT's model with it (the reference)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **lora)  # random A and B
    model = peft.get_peft_model(copy.deepcopy(ref.hf_model), config)
    with torch.no_grad():  # PEFT's random B is small: make the adapter matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(20.0)
    model.eval()
    model.save_pretrained(out)
    return model


def peft_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


@pytest.fixture(scope="module")
def adapters(reference: Reference, tmp_path_factory: pytest.TempPathFactory):
    """Two PEFT adapters of ``reference``: all seven linears at rank 8, and q/v at rank 4
    with rsLoRA and one module of another rank (``rank_pattern``)."""
    root = tmp_path_factory.mktemp(f"lora-{reference.name}")
    a = peft_adapter(reference, root / "a", 1, r=8, lora_alpha=16, target_modules=ALL)
    b = peft_adapter(reference, root / "b", 2, r=4, lora_alpha=8, use_rslora=True,
                     target_modules=["q_proj", "v_proj", "down_proj"],
                     rank_pattern={"down_proj": 2})  # fmt: skip
    return {"a": (root / "a", a), "b": (root / "b", b)}


def lora_engine(ref: Reference, adapters, **overrides) -> LLMEngine:
    modules = tuple((name, str(path)) for name, (path, _) in adapters.items())
    return LLMEngine(engine_config(ref.path, lora_modules=modules, **overrides))


def test_logits_match_peft(reference: Reference, adapters, prompts) -> None:
    engine = lora_engine(reference, adapters)
    (tokens,) = prompts(11, [45], reference.vocab_size)
    base = peft_logits(reference.hf_model, tokens)
    for name, (_, model) in adapters.items():
        theirs = peft_logits(model, tokens)
        assert (theirs - base).abs().max() > 0.1 * base.abs().max()  # the adapter matters
        bm = engine.block_manager
        assert bm.admit(name, tokens, 45) == 0
        outs, start = [], 0
        for size in (16, 5, 24):  # chunk edges off the block grid
            chunk = ChunkInput(name, tokens[start : start + size], start, bm.block_table(name),
                               LOGITS_ALL, lora=name)  # fmt: skip
            outs.append(engine.runner.execute([chunk])[0])
            start += size
        assert_logits_close(torch.cat(outs), theirs)
        bm.free(name)
    # and the base model's rows are untouched by the adapters being loaded
    assert_logits_close(prefill(engine, "base", tokens, [45]), base)
    engine.block_manager.free("base")
    engine.check_integrity()


def test_greedy_decode_matches_peft(reference: Reference, adapters, prompts) -> None:
    """The decode path too (batched decode rows, the compiled attention where it builds):
    greedy tokens of both adapters and the base model, decoded together, are PEFT's."""
    engine = lora_engine(reference, adapters)
    (tokens,) = prompts(15, [21], reference.vocab_size)
    names = [None, *adapters]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, lora=n) for n in names]
    ours = [list(out.token_ids) for out in engine.generate([tokens] * len(names), params)]
    for i, name in enumerate(names):
        model = reference.hf_model if name is None else adapters[name][1]
        with torch.no_grad():
            theirs = model.generate(torch.tensor([tokens]), max_new_tokens=8, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(tokens):]  # fmt: skip
        assert ours[i] == theirs.tolist(), name
    assert len({tuple(t) for t in ours}) == len(names)
    engine.check_integrity()


def test_one_step_of_mixed_adapters(llama_ref: Reference, tmp_path: Path, prompts) -> None:
    """Prompt chunks and decode rows of adapters a, b and none in the same steps give
    each request the tokens it gets alone."""
    config = ModelConfig.from_hf(json.loads((llama_ref.path / "config.json").read_text()))
    mods = {n: write_random_adapter(config, tmp_path / n, seed=s, std=0.3)
            for n, s in (("a", 1), ("b", 2))}  # fmt: skip
    adapters = {n: (p, None) for n, p in mods.items()}
    seqs = prompts(12, [20, 33, 9, 40, 17, 25], llama_ref.vocab_size)
    names = ["a", "b", None, "a", None, "b"]
    alone = []
    for tokens, name in zip(seqs, names, strict=True):
        engine = lora_engine(llama_ref, adapters)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora=name)
        (out,) = engine.generate([tokens], params)
        alone.append(out.token_ids)
    engine = lora_engine(llama_ref, adapters, max_num_batched_tokens=64)  # mixed steps
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora=n) for n in names]
    assert [out.token_ids for out in engine.generate(seqs, params)] == alone
    assert len({tuple(t) for t in alone[:3]}) == 3  # a, b and none differ
    engine.check_integrity()


def test_prefix_cache_per_adapter(llama_ref: Reference, tmp_path: Path, prompts) -> None:
    config = ModelConfig.from_hf(json.loads((llama_ref.path / "config.json").read_text()))
    adapters = {"a": (write_random_adapter(config, tmp_path / "a"), None)}
    engine = lora_engine(llama_ref, adapters)
    (tokens,) = prompts(13, [64], llama_ref.vocab_size)

    def cached(name: str | None, rid: str, salt: str | None = None) -> int:
        params = SamplingParams(max_tokens=2, temperature=0.0, lora=name)
        engine.add_request(rid, tokens, params, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    return out.num_cached_tokens
        raise AssertionError("no output")

    assert cached(None, "base") == 0
    assert cached("a", "a1") == 0  # not the base model's blocks
    assert cached("a", "a2") == 48  # its own
    assert cached("a", "a3", salt="t") == 0  # and a tenant's salt keeps apart as before
    assert cached(None, "base2") == 48
    with pytest.raises(HalfmoonError, match="U\\+001F"):  # no salt borrows an adapter's chain
        engine.add_request("x", tokens, SamplingParams(), cache_salt="\x1flora:a\x1f")
    engine.check_integrity()


def test_unknown_adapter_is_refused(llama_ref: Reference) -> None:
    engine = LLMEngine(engine_config(llama_ref.path))
    with pytest.raises(HalfmoonError, match="unknown LoRA adapter 'nope'"):
        engine.add_request("r", [5, 6, 7], SamplingParams(lora="nope"))
    assert not engine.has_unfinished_requests()


def test_parse_lora_modules() -> None:
    mods = parse_lora_modules(["sql=/a/b", '{"name": "org/chat", "path": "/c"}'], "base")
    assert mods == (LoraModule("sql", "/a/b"), LoraModule("org/chat", "/c"))
    for bad, why in [("sql", "NAME=PATH"), ("=x", "NAME=PATH"), ("{}", "name"),
                     ("base=/x", "already taken"), ("a b=/x", "letters")]:  # fmt: skip
        with pytest.raises(HalfmoonError, match=why):
            parse_lora_modules([bad], "base")
    with pytest.raises(HalfmoonError, match="already taken"):
        parse_lora_modules(["x=/a", "x=/b"])


def test_refused_adapters(llama_ref: Reference, tmp_path: Path) -> None:
    config = ModelConfig.from_hf(json.loads((llama_ref.path / "config.json").read_text()))
    good = write_random_adapter(config, tmp_path / "good", modules=("q_proj", "down_proj"))
    adapter = LoraAdapter.load(LoraModule("g", str(good)), config, torch.float32)
    assert adapter.modules == ("q_proj", "down_proj") and adapter.rank == 8
    assert set(adapter.layers[0]) == {"qkv_proj", "down_proj"}

    def variant(name: str, config_edit=None, tensor_edit=None) -> Path:
        out = tmp_path / name
        out.mkdir()
        peft_config = json.loads((good / "adapter_config.json").read_text())
        tensors = load_file(str(good / "adapter_model.safetensors"))
        if config_edit:
            config_edit(peft_config)
        if tensor_edit:
            tensor_edit(tensors)
        (out / "adapter_config.json").write_text(json.dumps(peft_config))
        save_file(tensors, str(out / "adapter_model.safetensors"))
        return out

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    cases = {
        "dora": (variant("dora", lambda c: c.update(use_dora=True)), "use_dora"),
        "bias": (variant("bias", lambda c: c.update(bias="all")), "bias"),
        "save": (variant("save", lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
        "alpha": (variant("alpha", lambda c: c.update(lora_alpha=0)), "lora_alpha"),
        "shape": (variant("shape", tensor_edit=lambda t: t.update({key + "A.weight": torch.zeros(8, 7)})),
                  "another model"),
        "half": (variant("half", tensor_edit=lambda t: t.pop(key + "B.weight")), "lora_A only"),
        "embed": (variant("embed", tensor_edit=lambda t: t.update(
            {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 4)})),
                  "embeddings"),
        "layer": (variant("layer", tensor_edit=lambda t: t.update(
            {k.replace("layers.0.", "layers.9."): v.clone() for k, v in list(t.items())})), "layer 9"),
    }  # fmt: skip
    for name, (path, why) in cases.items():
        with pytest.raises(HalfmoonError, match=why):
            LoraAdapter.load(LoraModule(name, str(path)), config, torch.float32)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "adapter_config.json").write_text(json.dumps({"lora_alpha": 8}))
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(HalfmoonError, match="save it as safetensors"):
        LoraAdapter.load(LoraModule("bin", str(tmp_path / "bin")), config, torch.float32)
    with pytest.raises(HalfmoonError, match="not a directory"):
        LoraAdapter.load(LoraModule("none", str(tmp_path / "missing")), config, torch.float32)
    with pytest.raises(HalfmoonError, match="no adapter_config.json"):
        LoraAdapter.load(LoraModule("cfg", str(tmp_path)), config, torch.float32)
    assert set(MODULES) == set(ALL)


def test_pipeline_stages_apply_the_adapter(llama_ref: Reference, tmp_path: Path, prompts) -> None:
    """A CPP group's stages (the connector's) run a request's adapter on their own
    layers: the first token is the one the whole engine gives it."""
    from halfmoon.engine.connector import LocalConnector

    config = ModelConfig.from_hf(json.loads((llama_ref.path / "config.json").read_text()))
    adapters = {"a": (write_random_adapter(config, tmp_path / "a", std=0.3), None)}
    engine = lora_engine(llama_ref, adapters)
    connector = LocalConnector(engine)
    (prompt,) = prompts(14, [40], llama_ref.vocab_size)
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    firsts = {}
    for name in ("a", None):
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, lora=name))
        stages = [connector.pipeline_stage(2, s) for s in range(2)]
        rid = f"cpp-{name}"
        for stage in stages:
            assert stage.start(rid, prompt, 0, lora=name) == 0
        for lo in range(0, len(prompt), 16):
            hidden = None
            for stage in stages:
                hidden = stage.run_chunk(rid, prompt, lo, min(lo + 16, len(prompt)), hidden, 16)
        token, *_ = stages[-1].sample_first(rid, prompt, greedy)
        assert token == out.token_ids[0]
        firsts[name] = token
        for stage in stages:
            stage.release(rid)
    assert firsts["a"] != firsts[None]  # (so the stages did apply it)
    with pytest.raises(HalfmoonError, match="unknown LoRA adapter"):
        connector.pipeline_stage(2, 0).start("x", prompt, 0, lora="nope")


def test_adapters_loaded_and_unloaded_while_serving(
    llama_ref: Reference, tmp_path: Path, prompts
) -> None:
    """An engine started without adapters loads one (vLLM's /v1/load_lora_adapter) and
    answers with it as an engine started with it does; its prefix-cache chain is its
    load's (a reload of the name under another tag, with other weights, never hits the
    old blocks); unloading refuses new requests at once and drops the adapter when the
    last running request with it has finished."""
    from halfmoon.core.adapters import RuntimeAdapter

    config = ModelConfig.from_hf(json.loads((llama_ref.path / "config.json").read_text()))
    one = write_random_adapter(config, tmp_path / "one", seed=1, std=0.3)
    two = write_random_adapter(config, tmp_path / "two", seed=2, std=0.3)
    (tokens,) = prompts(14, [64], llama_ref.vocab_size)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora="x")
    started = lora_engine(llama_ref, {"x": (one, None)})
    (expected,) = started.generate([tokens], params)

    engine = LLMEngine(engine_config(llama_ref.path))
    assert not engine.loras
    first = RuntimeAdapter.new("x", str(one))
    engine.load_lora(first)
    engine.load_lora(first)  # the same load twice (registration and broadcast): once
    with pytest.raises(HalfmoonError, match="'x' is already loaded"):
        engine.load_lora(RuntimeAdapter.new("x", str(two)))
    with pytest.raises(HalfmoonError, match="no adapter_config.json"):
        engine.load_lora(RuntimeAdapter.new("y", str(tmp_path)))
    (got,) = engine.generate([tokens], params)
    assert got.token_ids == expected.token_ids
    (again,) = engine.generate([tokens], params)
    assert again.num_cached_tokens == 48  # its own chain

    # unloading while a request runs with it: that one finishes, new ones are refused
    engine.add_request("running", tokens, params)
    engine.step()
    engine.unload_lora("x")
    with pytest.raises(HalfmoonError, match="'x' is being unloaded"):
        engine.add_request("late", tokens, params)
    with pytest.raises(HalfmoonError, match="still being unloaded \\(1 requests use it\\)"):
        engine.load_lora(RuntimeAdapter.new("x", str(two)))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.token_ids for o in outs] == [expected.token_ids]
    engine.step()
    assert "x" not in engine.loras
    with pytest.raises(HalfmoonError, match="unknown LoRA adapter 'x'"):
        engine.unload_lora("x")

    # the name again, other weights: nothing cached under the first load is reused
    engine.load_lora(RuntimeAdapter.new("x", str(two)))
    (other,) = engine.generate([tokens], params)
    assert other.num_cached_tokens == 0 and other.token_ids != expected.token_ids
    (fresh,) = lora_engine(llama_ref, {"x": (two, None)}).generate([tokens], params)
    assert other.token_ids == fresh.token_ids
    engine.check_integrity()
