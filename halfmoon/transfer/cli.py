"""``halfmoon microbench transfer | store``: quick measurements of the data plane.

A short run of ``benchmarks/dataplane/transfer.py`` / ``benchmarks/dataplane/store.py`` without the
Mooncake peer (well under a minute): block sizes 64 KiB, 1 MiB and 16 MiB (plus 4 KiB for
the store), 32 MiB batches, medians of 3 repetitions, everything on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

KIB, MIB = 1 << 10, 1 << 20
_BATCH_BYTES = 32 * MIB
_REPS = 3
_DESCRIPTION = (
    "Quick measurements of the data plane without the Mooncake peer (well under a minute): "
    "block sizes 64 KiB, 1 MiB and 16 MiB (plus 4 KiB for the store), 32 MiB batches, "
    "medians of 3 repetitions, everything on 127.0.0.1. The full comparison with Mooncake is "
    "benchmarks/dataplane/transfer.py and benchmarks/dataplane/store.py."
)


def _cmd_microbench(args: argparse.Namespace) -> int:
    # Imported here: the CLI must start fast and this pulls in numpy and the engine.
    from halfmoon.transfer import microbench as mb

    if args.target == "transfer":
        sizes = [64 * KIB, MIB, 16 * MIB]
        results = mb.bench_transfer(sizes, _BATCH_BYTES, _REPS)
    else:
        sizes = [4 * KIB, 64 * KIB, MIB, 16 * MIB]
        results = mb.bench_store_local(sizes, _BATCH_BYTES, _REPS)
        results += mb.bench_store_remote(sizes, _BATCH_BYTES, _REPS)
    if args.json:
        payload: dict[str, Any] = {"target": args.target, "results": [r.to_dict() for r in results]}
        print(json.dumps(payload, indent=2))
    else:
        print(mb.format_table(results))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``microbench`` to the top-level CLI."""
    parser = subparsers.add_parser(
        "microbench",
        help="quick data-plane benchmarks (transfer engine, block store)",
        description=_DESCRIPTION,
    )
    parser.add_argument(
        "target",
        choices=("transfer", "store"),
        help="transfer: tcp/shm push into a peer process vs memcpy; store: local and remote put/get",
    )
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.set_defaults(func=_cmd_microbench)
