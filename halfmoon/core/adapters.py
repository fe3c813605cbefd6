"""LoRA adapters as the serving side names them (no torch): vLLM's ``--lora-modules``.

A request selects an adapter by its name in the ``model`` field; the engines load the
adapter's PEFT directory (:mod:`halfmoon.engine.lora`). Parsing and the cheap checks
(the name, the directory's two files) happen here, where the CLI and the gateway can
run them before any engine starts.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from halfmoon.core.errors import HalfmoonError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: An adapter's name: what a request's ``model`` field says to use it.
_NAME = re.compile(r"^[A-Za-z0-9][\w.:/@+-]{0,127}$")


@dataclass(frozen=True)
class LoraModule:
    """One adapter to serve: ``name`` (a request's ``model``) and its PEFT directory."""

    name: str
    path: str


def check_lora_name(name: str) -> str:
    """``name`` when it can name an adapter (letters, digits and ``_.:/@+-``, at most
    128 characters, starting with a letter or digit), else HalfmoonError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise HalfmoonError(
            f"LoRA adapter name {name!r}: use letters, digits and _.:/@+- (at most 128 "
            "characters, starting with a letter or digit)"
        )
    return name


def parse_lora_modules(
    values: Iterable[str | Sequence[str]], base_model: str | None = None
) -> tuple[LoraModule, ...]:
    """vLLM's ``--lora-modules`` values: ``name=path`` or a JSON object with ``name`` and
    ``path`` (or ``(name, path)`` pairs, as a config document holds them). HalfmoonError
    naming the bad value (a malformed one, a name used twice or the base model's own
    name)."""
    modules: list[LoraModule] = []
    for value in values:
        name, path = _name_and_path(value)
        if not isinstance(path, str) or not path:
            raise HalfmoonError(f"--lora-modules {value!r}: the path must be a string")
        check_lora_name(name)
        if name == base_model or any(m.name == name for m in modules):
            raise HalfmoonError(f"--lora-modules: the name {name!r} is already taken")
        modules.append(LoraModule(name, str(Path(path).expanduser().resolve())))
    return tuple(modules)


def _name_and_path(value: str | Sequence[str]) -> tuple[object, object]:
    """One ``--lora-modules`` value taken apart (its parts are checked by the caller)."""
    if not isinstance(value, str):
        if len(value) != 2:
            raise HalfmoonError(f"--lora-modules {value!r}: expected (name, path)")
        return value[0], value[1]
    text = value.strip()
    if text.startswith("{"):
        try:
            doc = json.loads(text)
            return doc["name"], doc["path"]
        except (ValueError, KeyError, TypeError):
            raise HalfmoonError(
                f'--lora-modules {value!r}: a JSON value needs "name" and "path"'
            ) from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise HalfmoonError(f"--lora-modules {value!r}: expected NAME=PATH")
    return name, path


def check_adapter_dir(module: LoraModule) -> None:
    """HalfmoonError unless ``module.path`` is a directory with PEFT's two files (what
    the CLI checks before starting engines; they read and check the contents)."""
    path = Path(module.path)
    if not path.is_dir():
        raise HalfmoonError(f"LoRA adapter {module.name!r}: {path} is not a directory")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            hint = ""
            if name == WEIGHTS_FILE and (path / "adapter_model.bin").is_file():
                hint = " (adapter_model.bin is not read: save it as safetensors)"
            raise HalfmoonError(f"LoRA adapter {module.name!r}: no {name} in {path}{hint}")


def lora_pairs(modules: Iterable[LoraModule]) -> tuple[tuple[str, str], ...]:
    """``(name, path)`` pairs: how configs (``EngineConfig.lora_modules``) hold them."""
    return tuple((m.name, m.path) for m in modules)


# -- adapters loaded while serving (vLLM's /v1/load_lora_adapter) --------------------------
#: vLLM's switch for its runtime LoRA endpoints, honoured as it is there.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_allowed(flag: bool, env: Mapping[str, str]) -> bool:
    """Whether ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` are served: the
    ``--allow-runtime-lora-updating`` flag, or vLLM's environment switch set to a true
    value (``1``, ``true``; as vLLM reads it)."""
    return flag or env.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class RuntimeAdapter:
    """An adapter loaded into a running cluster: ``name``, its PEFT directory and the
    ``tag`` that load drew (a fresh one each time), so that an adapter unloaded and loaded
    again under the same name, with other weights, never meets the KV cached for the
    old ones: its prefix-cache chain is marked by ``name#tag`` (:func:`lora_key`)."""

    name: str
    path: str
    tag: str

    @classmethod
    def new(cls, name: str, path: str) -> RuntimeAdapter:
        """A load of ``path`` as ``name``: the name checked, the path resolved, a new tag."""
        check_lora_name(name)
        resolved = str(Path(path).expanduser().resolve())
        return cls(name, resolved, secrets.token_hex(6))

    @property
    def module(self) -> LoraModule:
        """The ``(name, path)`` pair to load."""
        return LoraModule(self.name, self.path)

    @property
    def key(self) -> str:
        """What marks its prefix-cache chain."""
        return lora_key(self.name, self.tag)


def lora_key(name: str, tag: str = "") -> str:
    """The adapter identity a request's prefix-cache chain is marked with
    (:func:`~halfmoon.core.hashing.adapter_salt`): the name of an adapter the server
    started with (no tag), ``name#tag`` for one loaded while it ran (``#`` is in no
    adapter's name)."""
    return f"{name}#{tag}" if tag else name
