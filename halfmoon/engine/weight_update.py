"""New weights for a serving engine, without a restart (an RL trainer's next checkpoint).

SGLang's ``/update_weights_from_disk`` and vLLM's weight-update routes replace a served
model's weights in place. Here that happens in two steps, so that a cluster can do it all
or none:

1. :func:`stage_weights` reads the new checkpoint into a plain model beside the served
   one (same architecture, else a HalfmoonError naming the difference; a missing or
   misshapen tensor is refused as at start). Nothing served changes yet; the staged copy
   costs the model's size in memory until it is installed or dropped.
2. :func:`install_weights` copies it into the served model's own tensors (so whatever
   holds their memory, a CUDA graph or a compiled kernel, sees the new values) and packs
   again what was packed for the CPU (:mod:`halfmoon.engine.prepack`).

KV computed with the old weights is wrong for the new ones: the engine forgets its cached
prefixes as it installs them (:meth:`halfmoon.engine.engine.LLMEngine.commit_weights`),
and a serving worker clears its block store too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from halfmoon.core.errors import HalfmoonError
from halfmoon.engine.config import ModelConfig, checkpoint_of
from halfmoon.engine.model import LlamaForCausalLM
from halfmoon.engine.prepack import PackedLinear
from halfmoon.engine.weights import empty_model, load_weights


@dataclass
class StagedWeights:
    """A checkpoint read and checked, waiting to be installed (:func:`install_weights`)."""

    #: The checkpoint's directory.
    path: Path
    #: Its weights in a plain model of the served model's dtype and device.
    model: LlamaForCausalLM


def stage_weights(
    served: ModelConfig, model_path: str, dtype: torch.dtype, device: torch.device | str
) -> StagedWeights:
    """Read the checkpoint ``model_path`` names for a model served as ``served``
    (:func:`checkpoint_of`); HalfmoonError when it is not the same architecture or its
    weights do not load."""
    path, config = checkpoint_of(served, model_path)
    model = empty_model(config, dtype, device)
    load_weights(model, path)
    return StagedWeights(path, model.eval())


def install_weights(served: LlamaForCausalLM, staged: StagedWeights) -> int:
    """Copy ``staged``'s weights into ``served``'s tensors in place, packed linears
    packed again; returns the number of tensors replaced. Every tensor is matched first:
    one without a counterpart is a HalfmoonError before anything changes."""
    new_modules = dict(staged.model.named_modules())
    repacks: list[tuple[PackedLinear, torch.Tensor, torch.Tensor | None]] = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, module in served.named_modules():
        if name == "packed_lm_head":
            assert isinstance(module, PackedLinear)
            head = staged.model.lm_head
            repacks.append((module, (staged.model.embed_tokens if head is None else head).weight,
                            None))  # fmt: skip
            continue
        new = new_modules.get(name)
        if isinstance(module, PackedLinear):
            if not isinstance(new, torch.nn.Linear):
                raise HalfmoonError(f"the staged weights have no linear {name}")
            repacks.append((module, new.weight, new.bias))
            continue
        for param_name, param in module.named_parameters(recurse=False):
            source = None if new is None else getattr(new, param_name, None)
            if not isinstance(source, torch.Tensor) or source.shape != param.shape:
                raise HalfmoonError(f"the staged weights have no {name}.{param_name} of "
                                    f"shape {tuple(param.shape)}")  # fmt: skip
            copies.append((param, source))
    with torch.no_grad():
        for dest, source in copies:
            dest.copy_(source)
        for module, weight, bias in repacks:
            module.repack(weight, bias)
    return len(copies) + sum(1 + (bias is not None) for _, _, bias in repacks)
