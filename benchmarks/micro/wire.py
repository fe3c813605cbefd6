"""A NIC-like wire on one host: a network namespace behind a veth pair, both directions
held to a rate by a token bucket (``tc tbf``). Benchmarks run a peer process inside the
namespace (``ip netns exec``) at :data:`NS_IP` and talk to it from the host at
:data:`HOST_IP`, so their bytes cross a shaped link instead of this host's loopback.
Root and iproute2 (``ip``, ``tc``) needed."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

NETNS, VETH_HOST, VETH_NS = "hmkv", "hmkv0", "hmkv1"
HOST_IP, NS_IP = "10.231.0.1", "10.231.0.2"


@contextlib.contextmanager
def shaped_wire(gbit: float) -> Iterator[str]:
    """A network namespace behind a veth pair whose both directions a token bucket holds
    to ``gbit`` Gbit/s; yields the namespace's name (removed on exit)."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        raise SystemExit("--wire-gbit needs root and iproute2 (ip, tc)")

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    with contextlib.suppress(subprocess.CalledProcessError):
        sh("ip", "netns", "del", NETNS)
    sh("ip", "netns", "add", NETNS)
    try:
        sh("ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS)
        sh("ip", "link", "set", VETH_NS, "netns", NETNS)
        sh("ip", "addr", "add", f"{HOST_IP}/30", "dev", VETH_HOST)
        sh("ip", "link", "set", VETH_HOST, "up")
        sh("ip", "netns", "exec", NETNS, "ip", "addr", "add", f"{NS_IP}/30", "dev", VETH_NS)
        sh("ip", "netns", "exec", NETNS, "ip", "link", "set", VETH_NS, "up")
        sh("ip", "netns", "exec", NETNS, "ip", "link", "set", "lo", "up")
        rate = f"{gbit}gbit"
        for prefix in ((), ("ip", "netns", "exec", NETNS)):
            dev = VETH_HOST if not prefix else VETH_NS
            sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
               "burst", "1mb", "latency", "50ms")  # fmt: skip
        yield NETNS
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            sh("ip", "link", "del", VETH_HOST)
        with contextlib.suppress(subprocess.CalledProcessError):
            sh("ip", "netns", "del", NETNS)
