"""``halfmoon serve`` refuses contradictory options before it starts any process."""

from dataclasses import replace

import pytest

from halfmoon.cli import main
from halfmoon.core.errors import HalfmoonError


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cpp-stages", "2"], "at least 2 prefill workers"),
        (["--cpp-stages", "2", "--prefill", "2", "--mode", "coupled"], "--mode disaggregated"),
        (["--cpp-stages", "0"], "--cpp-stages and --cpp-chunk-tokens must be >= 1"),
        (["--cpp-chunk-tokens", "0"], "--cpp-stages and --cpp-chunk-tokens must be >= 1"),
        (["--cpp-min-tokens", "-1"], "--cpp-min-tokens >= 0"),
        (["--prefill-max-num-seqs", "0"], "prefill workers: max_num_seqs must be >= 1"),
        (["--mode", "coupled", "--max-num-seqs", "0"], "coupled workers: max_num_seqs"),
        (["--dtype", "float8"], "unknown dtype 'float8'"),
        (["--kv-cache-mb", "0"], "kv_cache_mb must be positive"),
        (["--cuda-graphs"], "--cuda-graphs) needs a cuda device (--device cuda), not 'cpu'"),
        (["--responses-store-mb", "-1"], "--responses-store-mb must be >= 0"),
        (["--kv-compression-keep-mb", "-1"], "--kv-compression-keep-mb must be >= 0"),
        (["--lora-modules", "sql=/nonexistent/adapter"], "is not a directory"),
        (["--lora-modules", "sql"], "expected NAME=PATH"),
        (["--lora-modules", "a b=/x"], "use letters, digits"),
        (["--enable-lora"], "name the adapters with --lora-modules"),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
        (["--speculative-config", "ngram"], "--speculative-config must be a JSON object"),
        (
            ["--speculative-config", '{"method": "eagle3", "num_speculative_tokens": 2}'],
            "'eagle3' is not served",
        ),
        (
            ["--speculative-config", '{"prompt_lookup_max": 3}'],
            "num_speculative_tokens is required",
        ),
        (["--profiler-config", "torch"], "--profiler-config must be a JSON object"),
        (["--profiler-config", '{"profiler": "torch"}'], '"torch_profiler_dir" names'),
        (
            ["--profiler-config", '{"profiler": "cuda", "torch_profiler_dir": "/tmp/t"}'],
            "profiler 'cuda' is not served",
        ),
        (
            [
                "--profiler-config",
                '{"profiler": "torch", "torch_profiler_dir": "/tmp/t", '
                '"proton_profiler_dir": "/tmp/p"}',
            ],
            "proton_profiler_dir not served by halfmoon",
        ),  # fmt: skip
    ],
)
def test_bad_cpp_options_are_named(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path))
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("halfmoon: error:") and message in err
    assert not any(tmp_path.iterdir())  # nothing was prepared or started


def test_prefill_workers_take_one_prompt_per_step_by_default():
    """A prefill worker computes prompts one at a time, in arrival order (the queue the
    Conductor's TTFT estimate and the simulator assume); decode workers batch."""
    import argparse

    from halfmoon.serve.worker.main import add_engine_options, engine_config

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args([])
    assert engine_config(argparse.Namespace(**vars(args), role="prefill")).max_num_seqs == 1
    assert engine_config(argparse.Namespace(**vars(args), role="decode")).max_num_seqs == 64
    args = parser.parse_args(["--prefill-max-num-seqs", "4"])
    assert engine_config(argparse.Namespace(**vars(args), role="prefill")).max_num_seqs == 4


def test_settle_gc_takes_start_up_objects_out_of_the_collector():
    import gc

    from halfmoon.core.heap import settle_gc

    survivor = [[i] for i in range(1000)]  # tracked containers made "at start-up"
    try:
        settle_gc()
        assert gc.get_freeze_count() >= len(survivor)
    finally:
        gc.unfreeze()


def test_every_conductor_option_of_serve_reaches_the_conductor():
    """parser -> ConductorConfig -> JSON document -> the Conductor process's config: every
    option ``serve`` takes arrives unchanged (the CPP hidden-state size once was dropped)."""
    from halfmoon.cli import build_parser
    from halfmoon.serve.control.conductor_main import conductor_config
    from halfmoon.serve.launch.launcher import conductor_json

    flags = ["--policy", "cache-aware", "--coupled-router", "least-load", "--ttft-slo", "7",
             "--tbt-slo", "0.5", "--tbt-metric", "p90", "--early-reject", "predict",
             "--block-size", "32", "--cpp-stages", "2",
             "--cpp-chunk-tokens", "256", "--cpp-min-tokens", "64",
             "--cpp-hidden-bytes-per-token", "0", "--prefix-fetch", "overlap",
             "--decode-kv-booking", "output"]  # fmt: skip
    doc = conductor_json(build_parser().parse_args(["serve", "--prefill", "2", *flags]))
    child = conductor_config(build_parser().parse_args(["conductor", "--port", "1",
                                                        "--config-json", doc]))  # fmt: skip
    assert child.to_json() == doc
    # The same flags given to `halfmoon conductor` directly describe the same config.
    direct = build_parser().parse_args(["conductor", "--port", "1", *flags])
    assert conductor_config(direct) == child
    assert (child.policy, child.block_size_tokens, child.slo.tbt_s, child.early_reject) == (
        "cache-aware", 32, 0.5, "predict")  # fmt: skip
    assert child.cpp_hidden_bytes_per_token == 0
    assert child.prefix_fetch == "overlap"  # the preset's is queued
    assert child.decode_kv_booking == "output"  # the live preset's is prompt


def test_every_engine_option_of_serve_reaches_the_workers(tmp_path):
    """parser -> EngineOptions -> JSON document -> the worker's options, for every engine
    flag (a flag added without its field fails here, not in a live cluster)."""
    import argparse

    from halfmoon.cli import build_parser
    from halfmoon.serve.launch.launcher import engine_json
    from halfmoon.serve.worker.main import EngineOptions, add_engine_options, worker_options

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (adapter / name).write_text("{}")  # (what serve checks; the engines read them)
    probe = argparse.ArgumentParser()
    add_engine_options(probe)
    dests = {a.dest for a in probe._actions if a.dest != "help"}  # noqa: SLF001
    # (runtime_lora is serve's --allow-runtime-lora-updating or vLLM's switch: below)
    assert dests == set(EngineOptions.__dataclass_fields__) - {"runtime_lora"}
    flags = ["--device", "cpu", "--dtype", "bfloat16", "--kv-cache-mb", "64", "--max-num-seqs",
             "8", "--decode-guard", "wait", "--prefill-max-num-seqs", "2", "--max-model-len", "512",
             "--prefill-chunk-tokens", "128", "--num-threads", "2", "--block-size", "32",
             "--seed", "3", "--no-prefix-caching", "--store-dram-mb", "16", "--prefix-store", "demote",
             "--store-ssd-dir", str(tmp_path), "--store-ssd-mb", "8", "--cuda-graphs",
             "--kv-compression-keep-mb", "12", "--scheduling-policy", "priority",
             "--enable-lora", "--lora-modules", f"sql={adapter}", "org/b=" + str(adapter),
             "--speculative-config", '{"num_speculative_tokens": 3, "prompt_lookup_max": 4}',
             "--allow-runtime-lora-updating", "--max-num-batched-tokens", "256"]  # fmt: skip
    args = build_parser().parse_args(["serve", *flags])
    doc = engine_json(args, "/models/x")
    worker = build_parser().parse_args(["worker", "--role", "prefill", "--port", "1",
                                        "--conductor", "tcp://h:1", "--config-json", doc])  # fmt: skip
    options = worker_options(worker)
    assert options == EngineOptions.from_args(
        argparse.Namespace(**{**vars(args), "model": "/models/x"})
    )
    assert options.to_json() == doc and not options.prefix_caching and options.block_size == 32
    assert options.prefix_store == "demote" and options.decode_guard == "wait"
    assert options.cuda_graphs and options.kv_compression_keep_mb == 12
    assert options.scheduling_policy == "priority" and options.runtime_lora
    assert replace(options, cuda_graphs=False).engine_config("decode").max_num_batched_tokens == 256
    assert EngineOptions().engine_config("decode").max_num_batched_tokens == 2048  # (the default)
    spec = replace(options, cuda_graphs=False).engine_config("decode").speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == (
        3,
        4,
        4,
    )
    assert EngineOptions().engine_config("decode").speculative is None
    pairs = (("sql", str(adapter)), ("org/b", str(adapter)))
    assert options.lora_modules == pairs
    assert EngineOptions(lora_modules=pairs).engine_config("decode").lora_modules == pairs
    assert EngineOptions(engine="vllm", lora_modules=pairs).lora_modules == pairs
    with pytest.raises(HalfmoonError, match="no adapter_config.json"):
        EngineOptions(lora_modules=(("x", str(tmp_path)),))
    by_priority = EngineOptions(scheduling_policy="priority")
    assert by_priority.engine_config("prefill").scheduling_policy == "priority"
    with pytest.raises(HalfmoonError, match="--scheduling-policy"):
        EngineOptions(scheduling_policy="lifo")
    with pytest.raises(HalfmoonError, match="--prefix-store demote needs halfmoon's engine"):
        EngineOptions(prefix_store="demote", engine="vllm")
    # Without the flag: demote with halfmoon's engine, copy with vLLM's.
    assert EngineOptions().prefix_store == "demote"
    assert EngineOptions(engine="vllm").prefix_store == "copy"
    assert EngineOptions.from_json(EngineOptions().to_json()).prefix_store == "demote"
    path = tmp_path / "engine.json"
    path.write_text(doc)
    worker.config_json = str(path)
    assert worker_options(worker) == options
    worker.config_json = '{"block_size": 16, "colour": "red"}'
    with pytest.raises(HalfmoonError, match="unknown engine options: colour"):
        worker_options(worker)


def test_the_transfer_options_of_serve_reach_the_workers():
    """``--transport`` and ``--wire-checksum`` travel on each worker's command line, and
    the vLLM connector's settings carry the checksum choice through vLLM's extra config."""

    from halfmoon.cli import build_parser
    from halfmoon.serve.launch.launcher import worker_argv
    from halfmoon.serve.vllm.pd import ConnectorSettings
    from halfmoon.serve.worker.main import EngineOptions, vllm_connector_settings

    for flags, transport, checksum in (([], "auto", "xxh3"),
                                       (["--transport", "tcp", "--wire-checksum", "none"],
                                        "tcp", "none")):  # fmt: skip
        args = build_parser().parse_args(["serve", *flags])
        argv = worker_argv(args, "prefill", 0, "tcp://127.0.0.1:1", "{}")
        worker = build_parser().parse_args(list(argv))
        assert (worker.transport, worker.wire_checksum) == (transport, checksum)
        settings = vllm_connector_settings(worker, EngineOptions(), "prefill-0")
        assert settings.checksum is (checksum == "xxh3")
        assert ConnectorSettings.from_extra(settings.to_extra()) == settings
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--wire-checksum", "crc32"])


def test_presets_keep_each_commands_defaults():
    """The simulator replays the paper's settings; the live commands use the CPU preset."""
    from halfmoon.cli import build_parser
    from halfmoon.conductor.options import PRESETS
    from halfmoon.serve.launch.launcher import check_shape

    sim = build_parser().parse_args(["simulate", "--dataset", "leval"])
    serve = build_parser().parse_args(["serve"])
    assert serve.coupled_router is None  # resolved by --engine:
    check_shape(serve)
    vllm = build_parser().parse_args(["serve", "--engine", "vllm", "--mode", "coupled"])
    check_shape(vllm)
    assert (serve.coupled_router, vllm.coupled_router) == ("cache-aware", "kvcache-centric")
    conductor = build_parser().parse_args(["conductor", "--port", "1"])
    for args, preset in ((sim, "paper"), (serve, "live"), (conductor, "live")):
        assert {k: getattr(args, k) for k in PRESETS[preset]} == PRESETS[preset]
    assert (sim.early_reject, sim.tbt_slo, sim.cpp_min_tokens) == ("none", 0.1, 2048)
    assert (serve.early_reject, serve.tbt_slo, serve.cpp_min_tokens) == ("snapshot", 1.0, 512)
    assert (sim.prefix_fetch, serve.prefix_fetch) == ("queued", "queued")
    assert (sim.decode_kv_booking, serve.decode_kv_booking) == ("output", "prompt")
