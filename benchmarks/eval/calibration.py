"""The serving path's terms (:class:`halfmoon.costmodel.profile.ServingTerms`), measured
through the live clusters before the evaluation runs, for ``halfmoon simulate``.

Two calibration runs per cluster, neither of them one of the evaluated points:

- **isolated**: 16 docqa requests one at a time (``--max-concurrency 1``). TTFT minus the
  profile's prefill of the same new and cached tokens is the path's per-request time.
  The part of it that occupies the 1P1D prefill worker is its CPU time per request
  beyond the profile's prefill (block store load and save, the layer-streaming thread,
  hand-over), per prompt token: ``prefill_handoff_s_per_token``. The rest only delays
  the request (HTTP, tokenizing,
  hashing, the Conductor round trip, the ``expect`` message, waiting for the last layers
  on the wire): ``request_overhead_s``, per cluster.
- **burst**: 16 short prompts sent at once with 256, 244, ... 76 output tokens, so the
  batch drains from 16 to 1; once all of them decode, gap - the profile's step at each
  batch size is fitted as ``decode_step_overhead_s + batch * decode_per_seq_overhead_s``
  (a per-sequence term alone, measured at batch 16, left small batches' steps too
  short), and the spread of gap / modelled step (p90 over p50) gives
  ``step_jitter_sigma`` (2M: both
  instances decode, each shares the cores with the other; 1P1D: from a **loaded burst**,
  the same burst while 1,024-token prompts with 32 output tokens keep the prefill worker
  busy and join the decoding batch, as in serving: with the prefill worker idle the
  decode steps were far more regular than under load, sigma 0.05 against 0.2-0.5 in the
  live runs); the CPU time
  of the gateway, the Conductor and the benchmark client during the burst, per output
  token, gives ``background_cpu_s_per_token`` (the simulations then run on a host of
  ``os.cpu_count()`` cores shared by the instances: ``--host-cores``).

``kv_import_s_per_token`` comes from the worker profiler (the engine's import of a
handed-off request, timed at start-up); the evaluation does not re-measure it.

``benchmarks.eval.serving`` runs the calibration; ``benchmarks.eval.recalibrate`` runs it
again for results already recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from halfmoon.core.request import Request
from halfmoon.costmodel.profile import CostProfile
from halfmoon.costmodel.serving import ServingTerms
from halfmoon.workload.trace import write_trace

BURST_REQUESTS = 16
BURST_PROMPT_TOKENS = 256
BURST_OUTPUT_TOKENS = 256
#: Output lengths step down by this from request to request (256, 244, ... 76): the
#: batch drains from 16 to 1, so the excess is measured at every batch size.
BURST_OUTPUT_STEP = 12
#: The loaded burst's load: 1,024-token prompts from when the burst's prompts are through
#: until after its decodes end, a little more than one prefill worker computes.
LOAD_PROMPT_TOKENS = 1024
LOAD_START_S = 0.8
LOAD_INTERVAL_S = 0.1
LOAD_REQUESTS = 40
#: They decode too: each joins the burst's batch (KV import, hand-over messages) and
#: leaves it 32 tokens later, as requests do while serving.
LOAD_OUTPUT_TOKENS = 32


def write_burst_trace(path: Path, loaded: bool = False) -> Path:
    """16 unshared 256-token prompts, all at t=0, 256, 244, ... 76 output tokens;
    ``loaded`` adds the load (unshared 1,024-token prompts, 32 output tokens each)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    requests = [
        Request(f"burst-{i}", 0.0, BURST_PROMPT_TOKENS,
                BURST_OUTPUT_TOKENS - BURST_OUTPUT_STEP * i, (i,), 512)
        for i in range(BURST_REQUESTS)
    ]  # fmt: skip
    if loaded:
        blocks = LOAD_PROMPT_TOKENS // 512
        requests += [
            Request(f"load-{k}", LOAD_START_S + k * LOAD_INTERVAL_S, LOAD_PROMPT_TOKENS,
                    LOAD_OUTPUT_TOKENS,
                    tuple(range(1000 + blocks * k, 1000 + blocks * (k + 1))), 512)
            for k in range(LOAD_REQUESTS)
        ]  # fmt: skip
    write_trace(requests, path)
    return path


#: Each calibration run is done this many times and its figures' medians kept: one
#: isolated run's hand-over term moved between 4.7 and 13 us per token from one
#: calibration to the next, enough to move TTFT errors near saturation by tens of points.
CALIBRATION_ROUNDS = 3


def median_entries(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Key by key, the median of the numbers of ``entries`` (other values: the first's);
    ``rounds`` says how many entries there were."""
    import statistics

    out: dict[str, Any] = {"rounds": len(entries)}
    for key, value in entries[0].items():
        values = [e.get(key) for e in entries]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out[key] = statistics.median(numbers) if len(numbers) == len(values) else value
    return out


def serving_terms(
    profile: CostProfile, isolated: dict[str, dict[str, Any]], bursts: dict[str, dict[str, Any]]
) -> dict[str, ServingTerms]:
    """Each cluster's terms from its isolated and burst measurements (see the module
    docstring); negative medians (the path faster than the profile) count as zero."""
    request_s = max(0.0, isolated["2M"]["ttft_extra_p50_s"] or 0.0)
    disagg_s = max(0.0, isolated["1P1D"]["ttft_extra_p50_s"] or 0.0)
    handoff_s = min(disagg_s, max(0.0, isolated["1P1D"].get("prefill_cpu_extra_s") or 0.0))
    prompt_tokens = isolated["1P1D"].get("input_tokens_mean") or 1.0

    def burst(shape: str, key: str) -> float:
        return max(0.0, bursts[shape].get(key) or 0.0)

    loaded = "1P1D-loaded" if "1P1D-loaded" in bursts else "1P1D"  # older results: none

    engine = profile.serving
    return {
        "2M": ServingTerms(
            request_overhead_s=request_s,
            decode_per_seq_overhead_s=burst("2M", "per_seq_excess_p50_s"),
            decode_step_overhead_s=burst("2M", "per_step_excess_s"),
            step_jitter_sigma=burst("2M", "split_jitter_sigma"),
            step_wait_mean_s=burst("2M", "wait_mean_s"),
            background_cpu_s_per_token=burst("2M", "path_cpu_s_per_token"),
        ),
        "1P1D": ServingTerms(
            request_overhead_s=disagg_s - handoff_s,
            prefill_handoff_s_per_token=handoff_s / prompt_tokens,
            decode_per_seq_overhead_s=burst(loaded, "per_seq_excess_p50_s"),
            decode_step_overhead_s=burst(loaded, "per_step_excess_s"),
            kv_import_s_per_token=engine.kv_import_s_per_token,
            step_jitter_sigma=burst(loaded, "split_jitter_sigma"),
            step_wait_mean_s=burst(loaded, "wait_mean_s"),
            background_cpu_s_per_token=burst("1P1D", "path_cpu_s_per_token"),
        ),
    }
