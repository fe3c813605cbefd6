"""A halfmoon worker's vLLM engine: start the worker's own vLLM server (or attach to a
running one), check it, and wrap it in :class:`~halfmoon.serve.vllm.connector.VllmServerConnector`."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from halfmoon.core.profiling import parse_profiler_config
from halfmoon.serve.vllm.connector import VllmServerConnector
from halfmoon.serve.vllm.pd import ConnectorSettings, kv_transfer_config
from halfmoon.serve.vllm.server import (
    NO_PREFIX_CACHING,
    VllmEndpoints,
    VllmLaunch,
    VllmProcess,
    VllmServerError,
    find_vllm_python,
    fitting_max_model_len,
    vllm_block_size,
    wait_healthy,
)

#: How long a worker waits for its vLLM server (a CPU start compiles for 30-50 s, and
#: several servers starting together share the cores).
START_TIMEOUT_S = 600.0


def vllm_engine(
    options: Any, instance_id: str, attach: str | None, stop: Callable[[], bool],
    kv_connector: ConnectorSettings | None = None,
) -> VllmServerConnector:  # fmt: skip
    """The engine of a ``--engine vllm`` worker; ``options`` are its
    :class:`~halfmoon.serve.worker.main.EngineOptions`, ``attach`` a ``--vllm-url``,
    ``kv_connector`` the settings of halfmoon's KV connector inside the server (a
    disaggregated prefill or decode worker)."""
    from halfmoon.engine.catalog import resolve_model

    if not options.prefix_caching:
        raise VllmServerError(NO_PREFIX_CACHING)
    if attach is not None and kv_connector is not None:
        raise VllmServerError(
            "--vllm-url attaches coupled workers only: a disaggregated worker starts its own "
            "vLLM, with halfmoon's KV connector configured"
        )
    vllm_block_size(options.block_size, options.vllm_args)  # refuses a bad one before starting
    model_dir = resolve_model(options.model, options.seed)
    common = {"model_dir": str(model_dir), "instance_id": instance_id,
              "block_size": options.block_size, "dtype": options.dtype}  # fmt: skip
    if attach is not None:
        endpoints = VllmEndpoints.parse(attach)
        wait_healthy(endpoints.url, START_TIMEOUT_S, stop=stop)
        return _serving_adapters(VllmServerConnector(endpoints, **common), options)
    launch = VllmLaunch(
        python=find_vllm_python(options.vllm_python), model_dir=str(model_dir),
        served_model_name=model_dir.name, block_size=options.block_size, dtype=options.dtype,
        kv_cache_mb=options.kv_cache_mb,
        max_model_len=options.max_model_len or fitting_max_model_len(
            model_dir, options.kv_cache_mb, options.block_size, options.dtype, options.vllm_args
        ),
        max_num_seqs=options.max_num_seqs, num_threads=options.num_threads,
        max_num_batched_tokens=options.max_num_batched_tokens,
        scheduling_policy=options.scheduling_policy, lora_modules=options.lora_modules,
        runtime_lora=options.runtime_lora, speculative_config=options.speculative_config,
        profiler_config=server_profiler_config(options.profiler_config, instance_id),
        extra_args=tuple(shlex.split(options.vllm_args)) + (
            ("--kv-transfer-config", kv_transfer_config(kv_connector)) if kv_connector else ()
        ),
    )  # fmt: skip
    process = VllmProcess(launch, topic=f"kv@{instance_id}")
    try:
        process.wait_ready(START_TIMEOUT_S, stop)
        connector = VllmServerConnector(process.endpoints, process=process, **common)
        return _serving_adapters(connector, options)
    except BaseException:
        process.stop()
        raise


def server_profiler_config(config: str | None, instance_id: str) -> str | None:
    """The ``--profiler-config`` of a worker's own vLLM server: the cluster's, writing into
    a directory of the worker's own under it (so each trace is known to be its server's)."""
    parsed = parse_profiler_config(config)
    if parsed is None:
        return None
    return parsed.for_directory(str(Path(parsed.torch_profiler_dir) / instance_id)).to_json()


def _serving_adapters(connector: VllmServerConnector, options: Any) -> VllmServerConnector:
    """``connector`` when its server serves every adapter of ``--lora-modules`` (an
    attached server must have been started with them), else VllmServerError."""
    missing = [name for name, _ in options.lora_modules if name not in connector.facts.adapters]
    if missing:
        connector.close()
        raise VllmServerError(
            f"the vLLM server serves no LoRA adapter {', '.join(map(repr, missing))} "
            "(start it with --enable-lora --lora-modules NAME=PATH for each)"
        )
    return connector
