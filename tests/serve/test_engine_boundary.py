"""The serving side handles bytes, never tensors: the engine's device (CPU or GPU) stays a
detail of the engine, which hands out and takes host memory (docs/engine.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import halfmoon.serve

#: Attribute calls that only make sense on a tensor's memory (``.numpy()`` of a GPU
#: tensor fails; ``frombuffer`` makes a CPU tensor a GPU model cannot take).
TENSOR_CALLS = {"numpy", "frombuffer", "cpu", "cuda", "pin_memory"}


def _offenders(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
        else:
            modules = []
        if any(m == "torch" or m.startswith("torch.") for m in modules):
            found.append(f"{path.name}:{node.lineno}: imports torch")
        if isinstance(node, ast.Attribute) and node.attr in TENSOR_CALLS:
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    return found


def test_serve_never_touches_tensors() -> None:
    root = Path(halfmoon.serve.__file__).parent
    offenders = [o for path in sorted(root.rglob("*.py")) for o in _offenders(path)]
    assert not offenders, "move host/device handling into halfmoon/engine: " + ", ".join(offenders)


#: The engine modules serve may import: the connector (the whole runtime boundary), and
#: what the gateway and the launcher need before any engine runs (tokenizer, model
#: catalog, the engine's config, the check of a structured output's spec).
ENGINE_MODULES = {"connector", "tokenizer", "catalog", "config", "structured"}
#: Engine internals a serving role must reach only through the connector.
INTERNALS = {"block_manager", "kv_cache", "runner", "kv_layout", "model_config", "scheduler"}


def test_serve_reaches_the_engine_only_through_its_connector() -> None:
    root = Path(halfmoon.serve.__file__).parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "halfmoon.engine."
            ):
                module = node.module.split(".")[2]
                if module not in ENGINE_MODULES:
                    found.append(f"{path.name}:{node.lineno}: imports halfmoon.engine.{module}")
            if isinstance(node, ast.Attribute) and node.attr in INTERNALS:
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not found, "go through halfmoon.engine.connector: " + ", ".join(found)
