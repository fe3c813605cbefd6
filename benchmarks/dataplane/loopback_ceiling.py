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

:class:`BarePairs` keeps such pairs alive to move one batch at a time, so the transfer
benchmark can time bare loopback and our tcp in turns, batch by batch.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
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


class BarePairs:
    """Bare sender/receiver process pairs kept alive for one batch after another, so
    bare loopback can take turns with our tcp transport in the same run, batch by batch
    (``benchmarks.dataplane.transfer --ceiling``).

    ``batch()`` has each of ``num_pairs`` senders stream ``batch_bytes / num_pairs`` from
    its cold span (1 MiB writes, xxh3 of every MiB on both sides with ``checksum``) and
    returns when every receiver has its share. The processes are spawned, not forked (the
    caller may run threads), and wait on a pipe between batches, using no CPU.
    """

    def __init__(self, batch_bytes: int, checksum: bool, num_pairs: int = 2) -> None:
        if batch_bytes <= 0 or batch_bytes % num_pairs:
            raise ValueError(f"batch_bytes must be a positive multiple of {num_pairs}")
        self.batch_bytes = batch_bytes
        ctx = multiprocessing.get_context("spawn")
        share = batch_bytes // num_pairs
        self._senders: list = []
        self._receivers: list = []
        self._procs: list = []
        try:
            for _ in range(num_pairs):
                rx_parent, rx_child = ctx.Pipe()
                self._start(ctx, _pair_receiver, rx_child, share, checksum)
                port = rx_parent.recv()  # listening
                tx_parent, tx_child = ctx.Pipe()
                self._start(ctx, _pair_sender, tx_child, port, share, checksum)
                self._receivers.append(rx_parent)
                self._senders.append(tx_parent)
            for receiver in self._receivers:
                if receiver.recv() != "connected":
                    raise RuntimeError("a bare receiver did not connect")
        except BaseException:
            self.close()
            raise

    def _start(self, ctx, target, *args) -> None:
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self._procs.append(proc)

    def batch(self) -> None:
        """Move one batch; raises if a pair failed."""
        for sender in self._senders:
            sender.send("go")
        for receiver in self._receivers:
            if not receiver.poll(60.0) or receiver.recv() != "done":
                raise RuntimeError("a bare pair failed to move its share")

    def close(self) -> None:
        """Stop every process."""
        for conn in self._senders + self._receivers:
            conn.close()
        for proc in self._procs:
            proc.join(timeout=5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def __enter__(self) -> BarePairs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _pair_receiver(conn, share: int, checksum: bool) -> None:
    """Listen, tell the port, accept; then receive ``share`` bytes per batch into a cold
    span and say "done", until the parent hangs up (in a spawned child)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(30.0)
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    sock.settimeout(None)
    conn.send("connected")
    span = memoryview(bytearray(min(share, SPAN_BYTES)))
    position = 0
    while True:
        received = 0
        while received < share:
            start = position % span.nbytes
            end = min(start + MIB, span.nbytes, start + share - received)
            got = start
            while got < end:
                n = sock.recv_into(span[got:end])
                if not n:
                    return  # the sender is gone: the parent is closing
                got += n
            if checksum:
                xxhash.xxh3_64_intdigest(span[start:end])
            received += end - start
            position += end - start
        try:
            conn.send("done")
        except OSError:
            return


def _pair_sender(conn, port: int, share: int, checksum: bool) -> None:
    """Connect; on every "go" stream ``share`` bytes of a cold span in 1 MiB writes
    (in a spawned child)."""
    sock = socket.create_connection(("127.0.0.1", port))
    span = memoryview(bytearray(os.urandom(min(share, SPAN_BYTES))))
    position = 0
    while True:
        try:
            conn.recv()
        except EOFError:
            sock.close()
            return
        sent = 0
        while sent < share:
            start = position % span.nbytes
            piece = span[start : min(start + MIB, span.nbytes, start + share - sent)]
            if checksum:
                xxhash.xxh3_64_intdigest(piece)
            sock.sendall(piece)
            sent += piece.nbytes
            position += piece.nbytes


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
