"""How fast can loopback TCP carry a batch of cold blocks on this host, without our code?
The ceiling under our tcp transport and our store's put+get over tcp.

Run from the repository root::

    .venv/bin/python -m benchmarks.dataplane.loopback_ceiling [--seconds 4] [--rounds 3] [--json F]

Like our tcp transport on a 2-core host, two connections run in parallel, each a bare
sender process (``sendall`` of 1 MiB slices) and a bare receiver process (``recv_into``
a preallocated buffer), without and with an xxh3 checksum of every MiB on both sides
(our protocol checksums every payload). Each pair cycles through 32 MiB of source and
destination, so the two together touch 64 MiB as a 64 MiB batch of distinct blocks does:
streaming one hot 1 MiB buffer (what iperf3 does) measures caches, not the transfer.

A put then a get moves each byte once each way, so the best put+get GiB/s over tcp is
half the one-way figure (``1 / (1/x + 1/x)``); the script prints that bound. Medians over
``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import sys
import time

import xxhash

MIB, GIB = 1 << 20, 1 << 30
#: Bytes each pair cycles through (two pairs: a 64 MiB batch).
SPAN_BYTES = 32 << 20


def _sender(port: int, checksum: bool) -> None:
    """Stream 1 MiB slices of a cold span until the receiver hangs up (in a child)."""
    sock = socket.create_connection(("127.0.0.1", port))
    span = memoryview(bytearray(os.urandom(SPAN_BYTES)))
    try:
        while True:
            for start in range(0, SPAN_BYTES, MIB):
                piece = span[start : start + MIB]
                if checksum:
                    xxhash.xxh3_64_intdigest(piece)
                sock.sendall(piece)
    except OSError:
        pass  # the receiver closed: done


def _receiver(listener: socket.socket, seconds: float, checksum: bool, out: int) -> None:
    """Receive into a cold span for ``seconds``; write bytes and elapsed time to ``out``."""
    listener.settimeout(30.0)  # a sender that never connects fails the run, no hang
    sock, _ = listener.accept()
    sock.settimeout(None)  # blocking; a kernel timeout (Python's own polls every call)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 30, 0))
    span = memoryview(bytearray(SPAN_BYTES))
    received = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for start in range(0, SPAN_BYTES, MIB):
            got = start
            while got < start + MIB:
                n = sock.recv_into(span[got : start + MIB])
                if not n:
                    raise RuntimeError("a sender stopped early")
                got += n
            if checksum:
                xxhash.xxh3_64_intdigest(span[start : start + MIB])
            received += MIB
    elapsed = time.perf_counter() - started
    sock.close()
    os.write(out, f"{received} {elapsed}\n".encode())


def _fork(job) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            job()
        except BaseException:
            code = 1
        os._exit(code)
    return pid


def pairs_gib_s(seconds: float, checksum: bool, num_pairs: int = 2) -> float:
    """Aggregate one-way GiB/s of ``num_pairs`` bare sender/receiver process pairs."""
    read_end, write_end = os.pipe()
    pids = []
    for _ in range(num_pairs):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        pids.append(_fork(lambda lst=listener: _receiver(lst, seconds, checksum, write_end)))
        pids.append(_fork(lambda port=port: _sender(port, checksum)))
        listener.close()
    os.close(write_end)
    with os.fdopen(read_end) as results:
        lines = results.read().split("\n")
    failed = [pid for pid in pids if os.waitpid(pid, 0)[1] != 0]
    reports = [line.split() for line in lines if line]
    if failed or len(reports) != num_pairs:
        raise RuntimeError(f"{len(failed)} of the ceiling's processes failed")
    return sum(int(n) / float(s) for n, s in reports) / GIB


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the rounds and medians here")
    args = parser.parse_args()
    if args.seconds <= 0 or args.rounds < 1:
        parser.error("--seconds must be positive and --rounds at least 1")
    runs: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for checksum in (False, True):
            name = f"2 pairs, {'xxh3 both sides' if checksum else 'no checksum'}"
            runs.setdefault(name, []).append(pairs_gib_s(args.seconds, checksum))
    medians = {name: statistics.median(values) for name, values in runs.items()}
    print(f"{'bare senders/receivers':<28} {'one-way GiB/s':>13} {'put+get bound':>14}  rounds")
    for name, value in medians.items():
        listed = ", ".join(f"{v:.2f}" for v in runs[name])
        print(f"{name:<28} {value:>13.2f} {value / 2:>14.2f}  {listed}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"rounds": runs, "median_gib_s": medians}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
