"""The gateway's side of LoRA adapters loaded while serving (vLLM's
``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``): the routes exist only when
allowed, requests are checked with vLLM's messages before the backend is asked, the
backend's list of adapters becomes what ``model`` may name, and each load's prefix-cache
chain is its own (``name#tag``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi.testclient import TestClient

from halfmoon.core.adapters import RuntimeAdapter, runtime_lora_allowed
from halfmoon.core.request import SamplingParams
from halfmoon.serve.gateway.backend import BackendError, GenerationChunk


class AdapterBackend:
    """Generates one token; keeps a cluster's list of adapters loaded while serving, and
    refuses to load an adapter whose name starts with ``bad``."""

    def __init__(self) -> None:
        self.adapters: dict[str, RuntimeAdapter] = {}
        self.salts: list[str | None] = []
        self.unloaded: list[str] = []

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:  # fmt: skip
        self.salts.append(cache_salt)
        yield GenerationChunk((65,), "length", 0)

    async def abort(self, request_id: str) -> None:
        return None

    async def health(self) -> dict[str, Any]:
        return {"mode": "adapters"}

    async def load_adapter(self, adapter: RuntimeAdapter) -> None:
        if adapter.name.startswith("bad"):
            raise BackendError("decode-0: LoRA adapter 'bad': an adapter of another model?")
        self.adapters[adapter.name] = adapter

    async def unload_adapter(self, name: str) -> None:
        self.unloaded.append(name)
        del self.adapters[name]


def _adapter_dir(tmp_path, name: str):
    path = tmp_path / name
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


def test_the_routes_exist_only_when_allowed(gateways, tmp_path) -> None:
    with TestClient(gateways.app(AdapterBackend(), "m")) as client:
        body = {"lora_name": "a", "lora_path": str(_adapter_dir(tmp_path, "a"))}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 404
        schema = client.get("/openapi.json").json()["components"]["schemas"]
        assert "'enum': ['m']" in str(schema["CompletionRequest"]["properties"]["model"])
    assert not runtime_lora_allowed(False, {})
    assert runtime_lora_allowed(True, {})
    assert runtime_lora_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not runtime_lora_allowed(False, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"})


def test_load_and_unload_through_the_backend(gateways, tmp_path) -> None:
    backend = AdapterBackend()
    static = _adapter_dir(tmp_path, "static")
    app = gateways.app(backend, "m", allow_runtime_lora=True,
                       lora_modules=(("fixed", str(static)),))  # fmt: skip
    with TestClient(app) as client:

        def load(name: str, path) -> Any:
            return client.post("/v1/load_lora_adapter",
                               json={"lora_name": name, "lora_path": str(path)})  # fmt: skip

        path = _adapter_dir(tmp_path, "a")
        answer = load("sql", path)
        assert answer.status_code == 200
        assert answer.text == "Success: LoRA adapter 'sql' added successfully."
        adapter = backend.adapters["sql"]
        assert adapter.path == str(path.resolve()) and len(adapter.tag) == 12
        ids = [c["id"] for c in client.get("/v1/models").json()["data"]]
        assert ids == ["m", "fixed", "sql"]
        card = client.get("/v1/models/sql").json()
        assert card["parent"] == "m" and card["root"] == str(path.resolve())
        # its requests' prefix-cache chain is this load's, a static adapter's its name's
        for model in ("sql", "fixed"):
            answer = client.post("/v1/completions",
                                 json={"model": model, "prompt": "hi", "max_tokens": 1})  # fmt: skip
            assert answer.status_code == 200, answer.text
        assert backend.salts == [f"\x1flora:sql#{adapter.tag}\x1f", "\x1flora:fixed\x1f"]
        schema = client.get("/openapi.json").json()["components"]["schemas"]
        assert "enum" not in str(schema["CompletionRequest"]["properties"]["model"])

        for name, where, code, error in (
            ("sql", path, 400, "The lora adapter 'sql' has already been loaded."),
            ("fixed", path, 400, "The lora adapter 'fixed' has already been loaded."),
            ("m", path, 400, "conflicts with the base model name"),
            ("", path, 400, "Both 'lora_name' and 'lora_path' must be provided."),
            ("x y", path, 400, "LoRA adapter name 'x y'"),
            ("new", tmp_path / "none", 404, "is not a directory"),
            ("bad", path, 400, "LoRA adapter 'bad' not loaded: decode-0"),
        ):
            answer = load(name, where)
            assert answer.status_code == code and error in answer.text, answer.text
        inplace = client.post("/v1/load_lora_adapter", json={
            "lora_name": "sql", "lora_path": str(path), "load_inplace": True})  # fmt: skip
        assert inplace.status_code == 400 and "unload it, then load it" in inplace.text
        assert sorted(backend.adapters) == ["sql"]

        for name, code, error in (
            ("fixed", 400, "served from the start (--lora-modules)"),
            ("nope", 404, "The lora adapter 'nope' cannot be found."),
            ("", 400, "'lora_name' needs to be provided"),
        ):
            answer = client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            assert answer.status_code == code and error in answer.text, answer.text
        answer = client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert answer.status_code == 200
        assert answer.text == "Success: LoRA adapter 'sql' removed successfully."
        assert backend.unloaded == ["sql"]
        gone = client.post("/v1/completions", json={"model": "sql", "prompt": "hi"})
        assert gone.status_code == 404
