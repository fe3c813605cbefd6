"""The models a gateway serves: the base model, the LoRA adapters it started with and
those loaded and unloaded while it serves (vLLM's ``/v1/load_lora_adapter``), each
request's ``model`` checked against them. :class:`ServedModels` is a base of
:class:`~halfmoon.serve.gateway.gateway.Gateway`."""

from __future__ import annotations

import asyncio
from typing import Any

from halfmoon.core.adapters import RuntimeAdapter, check_adapter_dir
from halfmoon.core.errors import HalfmoonError
from halfmoon.serve.gateway.backend import Backend, BackendError
from halfmoon.serve.gateway.config import GatewayConfig
from halfmoon.serve.gateway.responses import HTTPError


class ServedModels:
    """The served models over ``backend`` (which knows the adapters loaded while serving)."""

    def __init__(self, backend: Backend, config: GatewayConfig) -> None:
        self.backend = backend
        self.config = config
        #: One load or unload of a LoRA adapter at a time (each checks, then updates).
        self._adapter_lock = asyncio.Lock()

    @property
    def runtime_adapters(self) -> dict[str, RuntimeAdapter]:
        """LoRA adapters loaded while serving (the backend's view of the cluster's list)."""
        return getattr(self.backend, "adapters", {})

    @property
    def model_names(self) -> tuple[str, ...]:
        """What a request's ``model`` may say: the base model, the adapters it started
        with, then those loaded while serving."""
        static = self.config.model_names
        return (*static, *(n for n in self.runtime_adapters if n not in static))

    def model_card(self, name: str | None = None) -> dict[str, Any]:
        """:meth:`GatewayConfig.model_card`, for an adapter loaded while serving too."""
        adapter = self.runtime_adapters.get(name) if name is not None else None
        if adapter is None or name in self.config.model_names:
            return self.config.model_card(name)
        return {**self.config.model_card(), "id": name, "root": adapter.path,
                "parent": self.config.model_name}  # fmt: skip

    def adapter_key(self, lora: str | None) -> str | None:
        """What marks the prefix-cache chain of a request of adapter ``lora``
        (:func:`~halfmoon.core.adapters.lora_key`): its name, or ``name#tag`` for an
        adapter loaded while serving."""
        if lora is None or lora in self.config.model_names:
            return lora
        adapter = self.runtime_adapters.get(lora)
        return lora if adapter is None else adapter.key

    async def load_adapter(self, name: str, path: str, load_inplace: bool = False) -> str:
        """vLLM's ``/v1/load_lora_adapter``: load the PEFT directory ``path`` as adapter
        ``name`` on every worker (all or none); its answer, or an HTTPError naming the
        problem (400: the request, 404: no adapter at ``path``)."""
        if not name or not path:
            raise HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                            "BadRequestError")  # fmt: skip
        if name in self.config.base_names:
            raise HTTPError(400, f"The lora adapter '{name}' conflicts with the base model "
                            "name.", "BadRequestError", param="lora_name")  # fmt: skip
        async with self._adapter_lock:
            if name in self.model_names:
                why = (
                    "reloading an adapter in place is not supported: unload it, then load it"
                    if load_inplace else f"The lora adapter '{name}' has already been loaded."
                )  # fmt: skip
                raise HTTPError(400, why, "BadRequestError", param="lora_name")
            try:
                adapter = RuntimeAdapter.new(name, path)
            except HalfmoonError as exc:
                raise HTTPError(400, str(exc), "BadRequestError", param="lora_name") from None
            try:
                check_adapter_dir(adapter.module)
            except HalfmoonError as exc:
                raise HTTPError(404, str(exc), "NotFoundError", param="lora_path") from None
            load = getattr(self.backend, "load_adapter", None)
            if load is None:
                raise HTTPError(400, "this server cannot load LoRA adapters while it serves",
                                "BadRequestError")  # fmt: skip
            try:
                await load(adapter)
            except BackendError as exc:
                raise HTTPError(400, f"LoRA adapter {name!r} not loaded: {exc}",
                                "BadRequestError", param="lora_path") from None  # fmt: skip
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_adapter(self, name: str) -> str:
        """vLLM's ``/v1/unload_lora_adapter``: no new request may name adapter ``name``;
        each worker drops it once the requests using it there have finished."""
        if not name:
            raise HTTPError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                            "BadRequestError")  # fmt: skip
        async with self._adapter_lock:
            if name in self.config.model_names:
                raise HTTPError(400, f"LoRA adapter '{name}' is served from the start "
                                "(--lora-modules) and stays", "BadRequestError",
                                param="lora_name")  # fmt: skip
            if name not in self.runtime_adapters:
                raise HTTPError(404, f"The lora adapter '{name}' cannot be found.",
                                "NotFoundError", param="lora_name")  # fmt: skip
            try:
                await self.backend.unload_adapter(name)
            except BackendError as exc:
                raise HTTPError(503, f"LoRA adapter {name!r} not unloaded: {exc}",
                                "ServiceUnavailable") from None  # fmt: skip
        return f"Success: LoRA adapter '{name}' removed successfully."

    def check_model(self, model: str | None) -> None:
        """A 404 unless ``model`` is None, the model this server serves or one of its LoRA
        adapters."""
        if model is not None and model not in self.model_names:
            served = ", ".join(repr(n) for n in self.model_names)
            raise HTTPError(
                404,
                f"model {model!r} does not exist; this server serves {served}",
                "NotFoundError",
                param="model",
            )

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` selects (None: the base model, by any of
        its names)."""
        return model if model is not None and model not in self.config.base_names else None
