"""``--served-model-name`` with several names (vLLM's): the first is the model's name,
the others aliases a request's ``model`` may give; every name selects the base model
(no adapter, one prefix cache), ``/v1/models`` lists each, and no adapter may take one.

In-process (ASGI) over the tools tests' backend; the flag's parsing is checked through
``halfmoon serve``'s parser and the ``--ray`` spec."""

from __future__ import annotations

import pytest

from halfmoon.cli import build_parser
from halfmoon.deploy.options import deploy_spec
from halfmoon.serve.gateway.config import GatewayConfig, served_names

from .test_gateway_tools import MESSAGES, answering


def test_every_name_serves_the_base_model(gateways, tmp_path):
    adapter = tmp_path / "sql"
    with answering(gateways, model_aliases=("alias", "other"),
                   lora_modules=(("sql", str(adapter)),)) as (client, backend):  # fmt: skip
        backend.answer = "hi"
        for name in ("m", "alias", "other"):
            body = {"model": name, "messages": MESSAGES, "max_tokens": 4}
            said = client.post("/v1/chat/completions", json=body)
            assert said.status_code == 200, said.text
            assert said.json()["model"] == name and backend.params[-1].lora is None
            assert backend.salts[-1] is None  # (one prefix cache for every name)
        said = client.post("/v1/chat/completions", json={**body, "model": "sql"})
        assert said.status_code == 200 and backend.params[-1].lora == "sql"
        unknown = client.post("/v1/chat/completions", json={**body, "model": "nope"})
        assert unknown.status_code == 404 and "'alias'" in unknown.text
        cards = client.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["m", "alias", "other", "sql"]
        assert [c["root"] for c in cards[:3]] == ["m", "m", "m"]
        assert client.get("/v1/models/alias").json()["id"] == "alias"


def test_names_must_be_unique_and_apart_from_the_adapters():
    with pytest.raises(ValueError, match="unique"):
        GatewayConfig("m", 256, model_aliases=("m",))
    with pytest.raises(ValueError, match="LoRA adapter names"):
        GatewayConfig("m", 256, model_aliases=("a",), lora_modules=(("a", "/x"),))
    assert GatewayConfig("m", 256, model_aliases=("a",)).model_names == ("m", "a")


def test_the_flag_takes_several_names():
    args = build_parser().parse_args(["serve", "--served-model-name", "m", "alias"])
    assert served_names(args.served_model_name) == ("m", "alias")
    assert served_names(None) == () and served_names("x") == ("x",)
    spec = deploy_spec(build_parser().parse_args(
        ["serve", "--ray", "--served-model-name", "m", "a", "b"]), "{}", "{}").gateway  # fmt: skip
    assert (spec.served_model_name, dict(spec.api_options)["model_aliases"]) == ("m", ("a", "b"))
    plain = deploy_spec(build_parser().parse_args(["serve", "--ray"]), "{}", "{}").gateway
    assert (plain.served_model_name, dict(plain.api_options)["model_aliases"]) == (None, ())
