"""L1: hardware and model specs, and time estimates for prefill, decode steps and transfers.

Three interchangeable :class:`CostModel` implementations:

- :class:`RooflineCostModel` — first principles (FLOPs, bytes, efficiency factors);
  ``build_cost_model("llama2-70b", "a800")`` makes one from registry names;
- :class:`ThroughputCostModel` — the paper's worked example (fixed token rate);
- :class:`ProfileCostModel` — a polynomial fitted to the real engine's measurements.

:func:`cpp_prefill_estimate` schedules a prefill pipelined over K instances (CPP).

No torch here: the Conductor and the simulator import this anywhere.
"""

from halfmoon.costmodel.base import CostModel, causal_attention_pairs
from halfmoon.costmodel.hardware import GPUS, GPUSpec, get_gpu
from halfmoon.costmodel.models import MODEL_ALIASES, MODELS, ModelSpec, get_model
from halfmoon.costmodel.pipeline import (
    PipelineEstimate,
    cpp_prefill_estimate,
    cpp_prefill_time_s,
    hidden_bytes_per_token,
    pipeline_chunks,
)
from halfmoon.costmodel.profile import (
    CostProfile,
    DecodePoint,
    FitResult,
    PrefillPoint,
    ProfileCostModel,
    fit_profile,
)
from halfmoon.costmodel.roofline import (
    RooflineCostModel,
    break_even_bandwidth_bytes_per_s,
    build_cost_model,
    fast25_prefill_flops,
    fast25_prefill_time_s,
)
from halfmoon.costmodel.throughput import ThroughputCostModel

__all__ = [
    "GPUS",
    "MODELS",
    "MODEL_ALIASES",
    "CostModel",
    "CostProfile",
    "DecodePoint",
    "FitResult",
    "GPUSpec",
    "ModelSpec",
    "PipelineEstimate",
    "PrefillPoint",
    "ProfileCostModel",
    "RooflineCostModel",
    "ThroughputCostModel",
    "break_even_bandwidth_bytes_per_s",
    "build_cost_model",
    "causal_attention_pairs",
    "cpp_prefill_estimate",
    "cpp_prefill_time_s",
    "fast25_prefill_flops",
    "fast25_prefill_time_s",
    "fit_profile",
    "get_gpu",
    "get_model",
    "hidden_bytes_per_token",
    "pipeline_chunks",
]
