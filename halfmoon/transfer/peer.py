"""A standalone transfer peer process (tests and benchmarks start it on 127.0.0.1).

``python -m halfmoon.transfer.peer serve [...]`` runs an engine with optional regions, a
block store and an announced stream, prints one JSON line ``{"endpoint": ..., "pid": ...}``
and then one line per stream event; it exits when stdin closes or on SIGTERM.
``python -m halfmoon.transfer.peer stream-send --to HOST:PORT [...]`` sends a synthetic
layer-wise stream, printing ``{"sent": layer}`` after each layer.

The shared secret comes from the environment (``HALFMOON_TRANSFER_SECRET``, hex), never
from the command line, where other users could read it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import xxhash

from halfmoon.core.heap import settle_gc
from halfmoon.store import StoreConfig, TieredStore
from halfmoon.transfer.engine import TransferEngine
from halfmoon.transfer.errors import TransferError
from halfmoon.transfer.messages import TransferCompleted
from halfmoon.transfer.pool import TRANSPORTS
from halfmoon.transfer.regions import MemoryRegion
from halfmoon.transfer.streams import StreamLayout, StreamReceiver

SECRET_ENV = "HALFMOON_TRANSFER_SECRET"


def layer_block_bytes(layer: int, block: int, block_bytes: int) -> bytes:
    """The synthetic payload of (layer, block): one repeated byte, so corruption shows."""
    return bytes([(layer * 7 + block) % 251]) * block_bytes


def _emit(record: dict[str, object]) -> None:
    # One write per line: records from different threads must not interleave.
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _secret() -> bytes:
    raw = os.environ.get(SECRET_ENV)
    if not raw:
        raise SystemExit(f"set {SECRET_ENV} to the shared secret in hex")
    return bytes.fromhex(raw)


def _serve(args: argparse.Namespace) -> int:
    store = None
    if args.store_block_bytes:
        store = TieredStore(
            StoreConfig(
                block_bytes=args.store_block_bytes,
                dram_capacity_bytes=args.store_dram_bytes,
                ssd_dir=args.store_ssd_dir,
                ssd_capacity_bytes=args.store_ssd_bytes,
                shared_dram=args.shared_dram,
            )
        )
    regions: dict[str, MemoryRegion] = {}

    def on_complete(event: TransferCompleted) -> None:
        # Checksums of every region let a test verify the bytes without reading them back
        # (off by default: hashing whole regions would distort benchmarks).
        digests = (
            {n: xxhash.xxh3_64_hexdigest(r.view) for n, r in regions.items()}
            if args.digests
            else {}
        )
        _emit(
            {
                "completed": event.kind,
                "id": event.transfer_id,
                "num_bytes": event.num_bytes,
                "regions": digests,
            }
        )

    engine = TransferEngine(
        _secret(),
        port=args.port,
        transport=args.transport,
        store=store,
        on_complete=None if args.quiet else on_complete,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        engine.start()
        for spec in args.region:
            name, size, *flags = spec.split(":")
            regions[name] = engine.register_region(name, int(size), shared="shared" in flags)
        if args.expect_stream:
            session, layers, blocks, size, region = args.expect_stream.split(":")
            layout = StreamLayout.contiguous(int(layers), int(blocks), int(size))
            receiver = engine.expect_stream(session, region, layout, on_layer=_emit_layer)
            threading.Thread(target=_watch_stream, args=(receiver,), daemon=True).start()
        settle_gc()  # full collections would stall the requests (see settle_gc)
        _emit({"endpoint": engine.endpoint, "pid": os.getpid()})
        threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
        stop.wait()
    finally:
        engine.close()
        if store is not None:
            store.close()
    return 0


def _emit_layer(receiver: StreamReceiver, layer: int) -> None:
    hasher = xxhash.xxh3_64()
    for view in receiver.dests(layer):
        hasher.update(view)
    _emit({"layer": layer, "xxh3": hasher.hexdigest()})


def _watch_stream(receiver: StreamReceiver) -> None:
    try:
        receiver.wait(timeout_s=3600)
        _emit({"stream": "done"})
    except TransferError as exc:
        _emit({"stream": "error", "error": type(exc).__name__, "message": str(exc)})


def _stream_send(args: argparse.Namespace) -> int:
    engine = TransferEngine(_secret(), transport=args.transport)
    try:
        client = engine.connect(args.to)
        sender = client.open_stream(args.session, args.layers, args.blocks, args.block_bytes)
        for layer in range(args.layers):
            blocks = [layer_block_bytes(layer, b, args.block_bytes) for b in range(args.blocks)]
            sender.send_layer(layer, blocks)
            _emit({"sent": layer})
            time.sleep(args.delay_s)
        sender.finish()
        _emit({"finished": True})
    except TransferError as exc:
        _emit({"error": type(exc).__name__, "message": str(exc)})
        return 1
    finally:
        engine.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the peer process."""
    parser = argparse.ArgumentParser(prog="python -m halfmoon.transfer.peer", description=__doc__)
    sub = parser.add_subparsers(dest="role", required=True)
    serve = sub.add_parser("serve", help="run an engine until stdin closes")
    serve.add_argument("--port", type=int, default=0)
    serve.add_argument("--transport", choices=TRANSPORTS[:3], default="auto")
    serve.add_argument("--region", action="append", default=[], help="NAME:BYTES[:shared]")
    serve.add_argument("--store-block-bytes", type=int, default=0)
    serve.add_argument("--store-dram-bytes", type=int, default=0)
    serve.add_argument("--store-ssd-dir", default=None)
    serve.add_argument("--store-ssd-bytes", type=int, default=0)
    serve.add_argument("--shared-dram", action="store_true")
    serve.add_argument("--expect-stream", default="", help="SESSION:LAYERS:BLOCKS:BYTES:REGION")
    serve.add_argument(
        "--digests", action="store_true", help="print region xxh3 digests on completion"
    )
    serve.add_argument(
        "--quiet",
        action="store_true",
        help="print no line per completed transfer (benchmarks: the printing and its reader "
        "would be timed with every operation)",
    )
    serve.set_defaults(func=_serve)
    send = sub.add_parser("stream-send", help="send a synthetic layer-wise stream")
    send.add_argument("--to", required=True)
    send.add_argument("--transport", choices=TRANSPORTS[:3], default="auto")
    send.add_argument("--session", required=True)
    send.add_argument("--layers", type=int, required=True)
    send.add_argument("--blocks", type=int, required=True)
    send.add_argument("--block-bytes", type=int, required=True)
    send.add_argument("--delay-s", type=float, default=0.0)
    send.set_defaults(func=_stream_send)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m halfmoon.transfer.peer``."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
