"""``halfmoon serve`` refuses contradictory options before it starts any process."""

import pytest

from halfmoon.cli import main


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

    from halfmoon.serve.worker_main import add_engine_options, engine_config

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    args = parser.parse_args([])
    assert engine_config(argparse.Namespace(**vars(args), role="prefill")).max_num_seqs == 1
    assert engine_config(argparse.Namespace(**vars(args), role="decode")).max_num_seqs == 64
    args = parser.parse_args(["--prefill-max-num-seqs", "4"])
    assert engine_config(argparse.Namespace(**vars(args), role="prefill")).max_num_seqs == 4


def test_settle_gc_takes_start_up_objects_out_of_the_collector():
    import gc

    from halfmoon.serve.runtime import settle_gc

    survivor = [[i] for i in range(1000)]  # tracked containers made "at start-up"
    try:
        settle_gc()
        assert gc.get_freeze_count() >= len(survivor)
    finally:
        gc.unfreeze()


def test_every_conductor_option_of_serve_reaches_the_conductor():
    """The Conductor process gets each Conductor option ``serve`` takes (the CPP hidden-state
    size once was accepted and dropped)."""
    from halfmoon.cli import build_parser
    from halfmoon.serve.launcher import conductor_argv

    args = build_parser().parse_args(["serve", "--cpp-hidden-bytes-per-token", "0"])
    argv = conductor_argv(args)
    assert argv[argv.index("--cpp-hidden-bytes-per-token") + 1] == "0"
    conductor = build_parser().parse_args(["conductor", "--port", "1", *argv])
    assert conductor.cpp_hidden_bytes_per_token == 0
    default = conductor_argv(build_parser().parse_args(["serve"]))
    assert "--cpp-hidden-bytes-per-token" not in default
