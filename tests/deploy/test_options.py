"""``--ray`` options, ``halfmoon cluster`` arguments, and Ray staying optional."""

import subprocess
import sys

import pytest

from halfmoon.cli import build_parser, main
from halfmoon.core.errors import HalfmoonError
from halfmoon.deploy.cli import scale_targets
from halfmoon.deploy.options import deploy_config, deploy_spec, parse_resource


def _serve(*argv: str):
    return build_parser().parse_args(["serve", *argv])


@pytest.mark.slow  # a subprocess
def test_without_ray_nothing_ray_is_imported():
    code = (
        "import sys, halfmoon.serve.launch.launcher, halfmoon.cli, halfmoon.deploy.cli; "
        "halfmoon.cli.build_parser().parse_args(['serve', '--ray']); "
        "assert 'ray' not in sys.modules, 'ray was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_ray_address_flag():
    assert _serve().ray is None
    assert _serve("--ray").ray == "auto"
    assert _serve("--ray", "10.0.0.1:6379").ray == "10.0.0.1:6379"
    assert _serve().host is None  # 127.0.0.1 locally, the gateway's node with --ray


def test_resources_and_placement():
    args = _serve("--ray", "--prefill-resource", "prefill", "--decode-resource", "decode:0.5",
                  "--cpus-per-worker", "2", "--gpus-per-worker", "1", "--max-worker-restarts",
                  "5", "--placement-strategy", "SPREAD", "--control-resource", "head")  # fmt: skip
    cfg = deploy_config(args)
    assert cfg.max_worker_restarts == 5 and cfg.placement_strategy == "SPREAD"
    assert cfg.worker_request("prefill").as_options() == {
        "num_cpus": 2.0, "num_gpus": 1.0, "resources": {"prefill": 1.0}}  # fmt: skip
    assert cfg.worker_request("decode").as_bundle() == {"CPU": 2.0, "GPU": 1.0, "decode": 0.5}
    assert cfg.control_request().as_options() == {
        "num_cpus": 0.0, "num_gpus": 0.0, "resources": {"head": 1.0}}  # fmt: skip
    assert cfg.actor_name("decode-1") == "halfmoon:decode-1"


def test_spec_sizes_follow_the_mode():
    spec = deploy_spec(_serve("--ray", "--prefill", "2", "--decode", "3"), "{}", "{}")
    assert spec.sizes == (("prefill", 2), ("decode", 3)) and spec.num_workers == 5
    coupled = deploy_spec(_serve("--ray", "--mode", "coupled", "--instances", "4"), "{}", "{}")
    assert coupled.sizes == (("coupled", 4),)
    with pytest.raises(HalfmoonError, match="at least 1"):
        deploy_spec(_serve("--ray", "--decode", "0"), "{}", "{}")


def test_the_gateway_spec_carries_the_sampling_defaults_options():
    spec = deploy_spec(_serve("--ray"), "{}", "{}").gateway
    assert (spec.generation_config, spec.override_generation_config) == ("auto", ())
    args = _serve("--ray", "--generation-config", "vllm",
                  "--override-generation-config", '{"temperature": 0.3}')  # fmt: skip
    spec = deploy_spec(args, "{}", "{}").gateway
    assert (spec.generation_config, spec.override_generation_config) == (
        "vllm", (("temperature", 0.3),))  # fmt: skip
    with pytest.raises(HalfmoonError, match="unknown fields"):
        deploy_spec(_serve("--ray", "--override-generation-config", '{"t": 1}'), "{}", "{}")


@pytest.mark.parametrize("text", ["", ":2", "CPU", "x:0", "x:-1", "x:lots"])
def test_bad_resources_are_clear_errors(text):
    with pytest.raises(HalfmoonError):
        parse_resource(text)


def test_bad_options_are_one_line_errors(capsys):
    assert main(["serve", "--ray", "--max-worker-restarts", "-2"]) == 2
    assert "max-worker-restarts" in capsys.readouterr().err
    assert main(["serve", "--ray", "--prefill-resource", "p:0"]) == 2
    assert "amount must be > 0" in capsys.readouterr().err


def test_cluster_scale_arguments():
    args = build_parser().parse_args(
        ["cluster", "scale", "--prefill", "2", "--decode", "1", "--address", "h:1", "--wait", "9"]
    )
    assert scale_targets(args) == {"prefill": 2, "decode": 1}
    assert (args.address, args.name, args.wait) == ("h:1", "halfmoon", 9.0)
    with pytest.raises(HalfmoonError, match="at least one pool"):
        scale_targets(build_parser().parse_args(["cluster", "scale"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cluster"])  # an action is required


def test_the_gateway_spec_carries_the_request_id_headers_option():
    assert deploy_spec(_serve("--ray"), "{}", "{}").gateway.request_id_headers is False
    spec = deploy_spec(_serve("--ray", "--enable-request-id-headers"), "{}", "{}")
    assert spec.gateway.request_id_headers is True


def test_the_gateway_spec_carries_the_parsers(capsys):
    plain = dict(deploy_spec(_serve("--ray"), "{}", "{}").gateway.api_options)
    assert plain["reasoning_parser"] is None and plain["docs"]
    argv = ("--ray", "--reasoning-parser", "qwen3", "--tool-call-parser", "hermes",
            "--disable-fastapi-docs", "--default-chat-template-kwargs", '{"t": 1}',
            "--root-path", "/llm")  # fmt: skip
    spec = deploy_spec(_serve(*argv), "{}", "{}").gateway
    options = dict(spec.api_options)
    assert (options["reasoning_parser"], options["tool_call_parser"]) == ("qwen3", "hermes")
    assert not options["docs"] and options["default_template_kwargs"] == {"t": 1}
    assert dict(spec.http_options) == {"log_level": "warning", "root_path": "/llm"}
    from halfmoon.serve.gateway.config import GatewayConfig

    assert GatewayConfig("m", 256, **options).reasoning_parser == "qwen3"  # (the actor's)
    with pytest.raises(SystemExit):
        _serve("--reasoning-parser", "nope")
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_the_gateway_spec_carries_cors_and_tls(tmp_path):
    import shutil
    import subprocess

    from halfmoon.serve.gateway.exposure import CorsPolicy

    spec = deploy_spec(_serve("--ray", "--allowed-origins", "https://a.example"), "{}", "{}")
    assert spec.gateway.cors == CorsPolicy(("https://a.example",)) and spec.gateway.tls is None
    if shutil.which("openssl") is None:
        return
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)  # fmt: skip
    argv = ("--ray", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    tls = deploy_spec(_serve(*argv), "{}", "{}").gateway.tls
    assert tls is not None and (tls.keyfile, tls.certfile) == (str(key), str(cert))


def test_the_gateway_spec_carries_runtime_lora_updating(monkeypatch):
    from halfmoon.core.adapters import RUNTIME_LORA_ENV

    monkeypatch.delenv(RUNTIME_LORA_ENV, raising=False)
    assert deploy_spec(_serve("--ray"), "{}", "{}").gateway.allow_runtime_lora is False
    spec = deploy_spec(_serve("--ray", "--allow-runtime-lora-updating"), "{}", "{}")
    assert spec.gateway.allow_runtime_lora is True
    monkeypatch.setenv(RUNTIME_LORA_ENV, "True")  # vLLM's switch, where the deployment is made
    assert deploy_spec(_serve("--ray"), "{}", "{}").gateway.allow_runtime_lora is True


def test_the_gateway_spec_carries_the_profiler_config(tmp_path, monkeypatch):
    """``serve --ray --profiler-config``: the gateway actor serves the profiler's routes
    with it (its directory made absolute where the command runs)."""
    from halfmoon.core.profiling import parse_profiler_config

    assert deploy_spec(_serve("--ray"), "{}", "{}").gateway.profiler_config is None
    monkeypatch.chdir(tmp_path)
    argv = ("--ray", "--profiler-config", '{"profiler": "torch", "torch_profiler_dir": "t"}')
    config = parse_profiler_config(deploy_spec(_serve(*argv), "{}", "{}").gateway.profiler_config)
    assert config is not None and config.torch_profiler_dir == str(tmp_path / "t")
