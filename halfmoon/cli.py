"""The ``halfmoon`` command line.

Each subsystem contributes its subcommands through a ``register(subparsers)`` function in
its own ``cli`` module (kept free of heavy imports such as torch until a command runs).
A subcommand sets ``func`` on its parser; it returns an exit code (0 when it returns None).
User errors (:class:`HalfmoonError`, ``ValueError`` raised while validating input) are
printed as one line, ``halfmoon: error: ...``, with exit code 2 — never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from halfmoon import __version__
from halfmoon.core.errors import HalfmoonError
from halfmoon.engine import hugepages

#: Modules that add subcommands, in the order they appear in ``--help``.
COMMAND_MODULES = (
    "halfmoon.workload.cli",
    "halfmoon.sim.cli",
    "halfmoon.sim.plan",
    "halfmoon.bench.cli",
    "halfmoon.engine.cli",
    "halfmoon.demo",
    "halfmoon.serve.launch.launcher",
    "halfmoon.serve.worker.main",
    "halfmoon.serve.control.conductor_main",
    "halfmoon.transfer.cli",
    "halfmoon.deploy.cli",  # after serve.launcher: it adds --ray to `halfmoon serve`
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="halfmoon",
        description="KV-cache-centric, disaggregated LLM serving (after Mooncake).",
    )
    parser.add_argument("--version", action="version", version=f"halfmoon {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script."""
    # Before anything allocates: torch reads it once (halfmoon.engine.hugepages).
    hugepages.enable_by_default()
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        code = func(args)
    except (HalfmoonError, ValueError) as exc:
        print(f"halfmoon: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("halfmoon: interrupted", file=sys.stderr)
        return 130
    return 0 if code is None else int(code)


if __name__ == "__main__":
    sys.exit(main())
