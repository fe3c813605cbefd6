"""``vllm serve``'s flags on ``halfmoon serve`` (halfmoon/serve/launch/vllm_flags.py): a
vLLM command line parses, the flags halfmoon does the same for take effect, and those it
cannot do are refused before anything starts, naming halfmoon's way."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from halfmoon.cli import build_parser, main
from halfmoon.serve.gateway.http_limits import ConnectionLimits, server_config
from halfmoon.serve.launch.launcher import check_shape
from halfmoon.serve.vllm.server import VllmLaunch

from .test_gateway_tools import MESSAGES, AnswerBackend

VLLM_LINE = (
    "smollm2-135m-instruct --host 127.0.0.1 --port 8000 --dtype float32 --max-model-len 1024 "
    "--max-num-seqs 8 --max-num-batched-tokens 512 --trust-remote-code --seed 0 "
    "--uvicorn-log-level info --disable-log-requests --disable-log-stats --kv-cache-dtype auto "
    "--enforce-eager --block-size 16 --enable-chunked-prefill --swap-space 4 "
    "--enable-prompt-tokens-details --max-log-len 100 --tensor-parallel-size 1 "
    "--load-format safetensors --disable-uvicorn-access-log --root-path /llm "
    "--return-tokens-as-token-ids --enable-force-include-usage --enable-prefix-caching "
    "--enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser deepseek_r1 "
    "--served-model-name smol chat --data-parallel-size 1 --enable-server-load-tracking "
    "--max-loras 4 --max-lora-rank 64 --max-cpu-loras 8 --tokenizer-mode auto "
    "--chat-template-content-format string"
)


def test_a_vllm_command_line_parses_and_passes_the_checks():
    args = build_parser().parse_args(["serve", *VLLM_LINE.split()])
    check_shape(args)  # (nothing refused)
    assert args.model == "smollm2-135m-instruct" and args.max_num_batched_tokens == 512
    assert args.disable_access_log and args.uvicorn_log_level == "info"
    assert args.root_path == "/llm" and args.return_tokens_as_token_ids
    config = server_config(object(), "127.0.0.1", 1, ConnectionLimits(), log_level="info",
                           root_path="/llm")  # fmt: skip
    assert (config.log_level, config.root_path) == ("info", "/llm")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu-memory-utilization", "0.9"],
         "--gpu-memory-utilization is not supported: each worker's KV pool is sized in MiB by "
         "--kv-cache-mb"),
        (["-tp", "2"], "--tensor-parallel-size 2: only 1 is served (each worker runs the whole"),
        (["--pipeline-parallel-size", "2"], "--cpp-stages pipelines long prompts"),
        (["--kv-cache-dtype", "fp8"], "--kv-compression int8 or fp8"),
        (["-q", "awq"], "--quantization is not supported: quantized checkpoints"),
        (["--load-format", "pt"], "--load-format pt: only auto or safetensors"),
        (["--tokenizer", "other"], "--tokenizer is not supported"),
        (["--enable-log-requests"], "--enable-log-requests is not supported"),
        (["tiny", "--model", "small"], "two models given: 'tiny' and --model 'small'"),
        (["-dp", "2"], "--data-parallel-size 2: only 1 is served"),
        (["--kv-transfer-config", "{}"], "halfmoon moves KV between its own workers"),
    ],
)  # fmt: skip
def test_what_halfmoon_cannot_do_is_refused_naming_its_way(argv, message, capsys, tmp_path,
                                                          monkeypatch):  # fmt: skip
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path))
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("halfmoon: error:") and message in err, err
    assert not any(tmp_path.iterdir())  # nothing was prepared or started


def test_the_docs_can_be_turned_off(gateways):
    with TestClient(gateways.app(AnswerBackend(gateways.tokenizer), "m", docs=False)) as client:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert client.get(path).status_code == 404, path
        assert client.get("/v1/models").status_code == 200
    args = build_parser().parse_args(["serve", "--disable-fastapi-docs"])
    assert args.disable_fastapi_docs


def test_the_request_defaults_they_set_take_effect(gateways):
    backend = AnswerBackend(gateways.tokenizer)
    backend.answer = "hello"
    app = gateways.app(backend, "m", tokens_as_ids=True, force_include_usage=True)
    with TestClient(app) as client:
        body = {"model": "m", "messages": MESSAGES, "max_tokens": 8, "logprobs": True,
                "stream": True}  # fmt: skip
        text = client.post("/v1/chat/completions", json=body).text
    events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    tokens = [t["token"] for e in events if e["choices"] and e["choices"][0]["logprobs"]
              for t in e["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert tokens and all(t.startswith("token_id:") for t in tokens)


def test_a_vllm_server_gets_the_batched_tokens_limit():
    launch = VllmLaunch(python="python", model_dir="/m", served_model_name="m",
                        max_num_batched_tokens=512)  # fmt: skip
    argv = launch.argv(1, 2, 3, "t")
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "512"
    assert "--max-num-batched-tokens" not in VllmLaunch("python", "/m", "m").argv(1, 2, 3, "t")


def test_behind_a_root_path_the_api_key_still_guards_the_api(gateways):
    """``--root-path``: the server puts the proxy's prefix before every path; what needs
    a key is judged by the path within the app, so the prefix opens nothing."""
    backend = AnswerBackend(gateways.tokenizer)
    app = gateways.app(backend, "m", api_keys=("sekret",))
    with TestClient(app, root_path="/llm") as client:
        for path in ("/llm/v1/models", "/v1/models", "/llm/tokenize"):
            said = client.request("GET" if "models" in path else "POST", path)
            assert said.status_code == 401, (path, said.status_code)
        keyed = client.get("/llm/v1/models", headers={"Authorization": "Bearer sekret"})
        assert keyed.status_code == 200 and keyed.json()["data"][0]["id"] == "m"
        assert client.get("/llm/health").status_code == 200  # (open, as without a prefix)


class _Recording:
    """A tokenizer whose chat template records the variables it is given."""

    def __init__(self) -> None:
        self.kwargs: list[dict] = []

    def apply_chat_template(self, messages, **options):
        self.kwargs.append(options.get("template_kwargs") or {})
        return [1, 2]


def test_default_template_variables_yield_to_the_requests():
    from halfmoon.serve.gateway.config import GatewayConfig
    from halfmoon.serve.gateway.openai_api import ChatCompletionRequest
    from halfmoon.serve.gateway.preparation import RequestPreparation
    from halfmoon.serve.launch.vllm_flags import default_template_kwargs

    tok = _Recording()
    config = GatewayConfig("m", 256, default_template_kwargs={"enable_thinking": False, "x": 1})
    prep = RequestPreparation(AnswerBackend(None), tok, config)

    def rendered(**body) -> dict:
        request = ChatCompletionRequest(model="m", messages=MESSAGES, **body)
        prep.chat_prompt([m.for_template() for m in request.messages], request.template_options())
        return tok.kwargs[-1]

    assert rendered() == {"enable_thinking": False, "x": 1}
    assert rendered(chat_template_kwargs={"enable_thinking": True}) == {
        "enable_thinking": True, "x": 1}  # fmt: skip
    assert rendered(reasoning_effort="low")["enable_thinking"] is True  # (asked for)
    given = build_parser().parse_args(
        ["serve", "--default-chat-template-kwargs", '{"enable_thinking": false}'])  # fmt: skip
    assert default_template_kwargs(given) == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("value", "words"),
    [("[1]", "must be a JSON object"), ('{"messages": []}', "cannot set messages"),
     ("{bad", "must be a JSON object such as")],
)  # fmt: skip
def test_bad_default_template_variables_are_refused(value, words, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HALFMOON_CACHE", str(tmp_path))
    assert main(["serve", "--default-chat-template-kwargs", value]) == 2
    assert words in capsys.readouterr().err
