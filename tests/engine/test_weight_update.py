"""New weights installed in a serving engine (halfmoon.engine.weight_update): the engine
then computes exactly what an engine started on them computes, forgets the prefixes it
cached with the old ones, and refuses checkpoints of another shape or while requests run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from engine_testlib import engine_config
from safetensors.torch import load_file, save_file

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.engine import prepack
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.loader import create_preset_dir
from halfmoon.engine.prepack import PackedLinear


def perturbed_copy(src: Path, dst: Path, seed: int) -> Path:
    """``src``'s checkpoint with every tensor moved by noise of its own scale."""
    shutil.copytree(src, dst)
    generator = torch.Generator().manual_seed(seed)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(str(file))
        moved = {
            name: t + 0.5 * t.float().std().clamp(min=0.05) * torch.randn(t.shape, generator=generator)
            for name, t in tensors.items()
        }  # fmt: skip
        save_file({k: v.to(tensors[k].dtype).contiguous() for k, v in moved.items()}, str(file))
    return dst


def greedy(engine: LLMEngine, prompts: list[list[int]], n: int = 12) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [list(o.token_ids) for o in engine.generate(prompts, params)]


@pytest.fixture
def pack_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pack every linear, however small (the test checkpoints are below the threshold)."""
    monkeypatch.setattr(prepack, "_MIN_PACKED_BYTES", 0)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "plain"])
def test_update_matches_an_engine_started_on_the_new_weights(
    request: pytest.FixtureRequest, reference_builder, prompts, tmp_path: Path, packed: bool
) -> None:
    if packed:
        request.getfixturevalue("pack_everything")
    old = reference_builder("qwen2")  # q/k/v biases: packed linears keep a bias
    new_dir = perturbed_copy(old.path, tmp_path / "new", seed=7)
    options = dict(prepack_weights=packed, prepack_lm_head=packed, enable_prefix_caching=True)
    engine = LLMEngine(engine_config(old.path, **options))
    assert packed == any(isinstance(m, PackedLinear) for m in engine.runner.model.modules())
    batch = prompts(3, [40, 23], old.vocab_size)
    before = greedy(engine, batch)
    assert engine.stats().num_cached_blocks > 0

    staged = engine.stage_weights(str(new_dir))
    assert greedy(engine, batch) == before  # staged only: nothing served changed
    engine.commit_weights(staged)
    assert engine.stats().num_cached_blocks == 0  # KV of the old weights forgotten

    fresh = LLMEngine(engine_config(new_dir, **options))
    expected = greedy(fresh, batch)
    assert expected != before  # (the new weights do change the answers)
    assert greedy(engine, batch) == expected
    # and again, now through the prefixes cached with the new weights
    assert greedy(engine, batch) == expected


def test_update_of_a_tied_head(pack_everything, tmp_path: Path, prompts) -> None:
    """The tiny preset ties its head to the embedding: both take the new values."""
    old = create_preset_dir("tiny", tmp_path / "a", seed=1)
    new = create_preset_dir("tiny", tmp_path / "b", seed=2)
    engine = LLMEngine(engine_config(old))
    assert engine.runner.model.packed_lm_head is not None
    batch = prompts(5, [20], engine.model_config.vocab_size)
    engine.commit_weights(engine.stage_weights(str(new)))
    assert greedy(engine, batch) == greedy(LLMEngine(engine_config(new)), batch)


def test_another_architecture_is_refused(reference_builder, tiny_dir: Path) -> None:
    engine = LLMEngine(engine_config(reference_builder("llama").path))
    with pytest.raises(HalfmoonError, match="not the served model's architecture.*hidden_size"):
        engine.stage_weights(str(tiny_dir))
    with pytest.raises(HalfmoonError):
        engine.stage_weights("/no/such/checkpoint")


def test_broken_weights_are_refused(reference_builder, tmp_path: Path) -> None:
    ref = reference_builder("llama")
    broken = shutil.copytree(ref.path, tmp_path / "broken")
    for file in broken.glob("*.safetensors"):
        tensors = load_file(str(file))
        tensors.pop(next(k for k in tensors if k.endswith("o_proj.weight")))
        save_file(tensors, str(file))
    engine = LLMEngine(engine_config(ref.path))
    with pytest.raises(HalfmoonError, match="missing"):
        engine.stage_weights(str(broken))


def test_commit_waits_for_running_requests(reference_builder, prompts, tmp_path: Path) -> None:
    ref = reference_builder("llama")
    engine = LLMEngine(engine_config(ref.path))
    staged = engine.stage_weights(str(perturbed_copy(ref.path, tmp_path / "new", seed=3)))
    engine.add_request("r", prompts(1, [10], ref.vocab_size)[0], SamplingParams(max_tokens=4))
    engine.step()
    with pytest.raises(HalfmoonError, match="1 requests are in the engine"):
        engine.commit_weights(staged)
    engine.abort_request("r")
    engine.commit_weights(staged)
