"""CPU weight prepacking: same logits as the plain model, only large weights packed;
bfloat16 packed only where the CPU computes it natively."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from halfmoon.core.request import SamplingParams
from halfmoon.engine import prepack as prepack_module
from halfmoon.engine.config import EngineConfig, ModelConfig
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.loader import LoadedModel
from halfmoon.engine.prepack import PackedLinear, can_prepack, prepack_linears, prepack_lm_head
from halfmoon.engine.weights import empty_model, init_random_weights

pytestmark = pytest.mark.skipif(
    not can_prepack("cpu", torch.float32), reason="this torch build has no oneDNN linear"
)

# gate|up (3 MiB) and down (1.5 MiB) are packed; q|k|v (0.5 MiB) and o (0.25 MiB) stay
# plain while the decoder's linears add up to less than 32 MiB (2 layers: 10.5 MiB).
CONFIG = ModelConfig(
    model_type="llama", vocab_size=256, hidden_size=256, intermediate_size=1536, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=64, max_position=256,
)  # fmt: skip


def loaded_model(config: ModelConfig = CONFIG, dtype: torch.dtype = torch.float32) -> LoadedModel:
    model = empty_model(config, dtype, "cpu")
    init_random_weights(model, seed=3, std=0.05)
    return LoadedModel(config, model.eval(), None, ())


def test_only_large_weights_are_packed() -> None:
    loaded = loaded_model()
    assert prepack_linears(loaded.model) == 2 * 2  # gate|up and down of both layers
    layer = loaded.model.layers[0]
    assert isinstance(layer.gate_up_proj, PackedLinear)
    assert isinstance(layer.down_proj, PackedLinear)
    assert isinstance(layer.qkv_proj, torch.nn.Linear)
    assert prepack_linears(loaded.model) == 0  # idempotent


def test_every_weight_is_packed_when_the_model_streams_from_memory() -> None:
    loaded = loaded_model(dataclasses.replace(CONFIG, num_layers=7))  # 36.75 MiB of linears
    assert prepack_linears(loaded.model) == 7 * 4
    assert all(isinstance(layer.qkv_proj, PackedLinear) for layer in loaded.model.layers)
    assert prepack_linears(loaded.model) == 0


def test_packed_engine_generates_like_the_plain_one() -> None:
    prompts = [list(range(5, 40)), list(range(100, 117))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for prepack in (False, True):
        config = EngineConfig(  # the reference attention: no kernels built for this shape
            model="unused",
            kv_cache_mb=8,
            prepack_weights=prepack,
            prepack_lm_head=prepack,
            attention="reference",
        )
        engine = LLMEngine(config, loaded=loaded_model())
        outputs.append([o.token_ids for o in engine.generate(prompts, params)])
        engine.check_integrity()
    assert outputs[0] == outputs[1]
    x = torch.randn(8, 512)
    plain = torch.nn.Linear(512, 3072)
    torch.testing.assert_close(PackedLinear(plain)(x), plain(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_packed_lm_head_gives_the_plain_logits(tied: bool) -> None:
    config = ModelConfig(**{**CONFIG.__dict__, "tie_embeddings": tied})
    model = empty_model(config, torch.float32, "cpu")
    init_random_weights(model, seed=4, std=0.05)
    hidden = torch.randn(5, CONFIG.hidden_size)
    plain = model.compute_logits(hidden)
    assert prepack_lm_head(model) and model.lm_head is None
    assert not prepack_lm_head(model)  # idempotent
    torch.testing.assert_close(model.compute_logits(hidden), plain, rtol=1e-5, atol=1e-5)
    # The embedding (tied: the head's plain copy) still serves the lookup.
    assert model.embed_tokens.weight.shape == (256, CONFIG.hidden_size)


def test_bfloat16_is_packed_only_on_a_cpu_that_computes_it(monkeypatch) -> None:
    for native in (False, True):
        monkeypatch.setattr(prepack_module, "_NATIVE_BF16", native)
        assert can_prepack("cpu", torch.bfloat16) is native
        assert can_prepack("cpu", torch.float32)
        assert not can_prepack("cpu", torch.float16)
        # gate|up (1.5 MiB in bfloat16) of both layers; down (0.75 MiB) stays plain
        assert prepack_linears(loaded_model(dtype=torch.bfloat16).model) == 2 * native


@pytest.mark.skipif(not prepack_module.native_bf16(), reason="no native bfloat16 on this CPU")
def test_packed_bfloat16_engine_generates_like_the_plain_one() -> None:
    """On a CPU with native bfloat16: the packed model's greedy tokens and logits are the
    plain bfloat16 model's."""
    prompts = [list(range(5, 40)), list(range(100, 117))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = []
    for prepack in (False, True):
        config = EngineConfig(
            model="unused", dtype="bfloat16", kv_cache_mb=8, prepack_weights=prepack,
            prepack_lm_head=prepack, attention="reference",
        )  # fmt: skip
        loaded = loaded_model(dtype=torch.bfloat16)
        engine = LLMEngine(config, loaded=loaded)
        assert isinstance(loaded.model.layers[0].gate_up_proj, PackedLinear) is prepack
        outputs.append([o.token_ids for o in engine.generate(prompts, params)])
    assert outputs[0] == outputs[1]
    x = torch.randn(8, 512, dtype=torch.bfloat16)
    plain = torch.nn.Linear(512, 3072, bias=False).to(torch.bfloat16)
    torch.testing.assert_close(PackedLinear(plain)(x), plain(x))
