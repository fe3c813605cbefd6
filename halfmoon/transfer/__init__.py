"""Transfer engine: moves KV block payloads between processes and machines.

Transports ``tcp`` (zero-copy ``sendmsg`` / ``recv_into``, parallel connections), ``shm``
(direct copies through shared memory between processes on one host) and ``inproc`` (for
tests) behind one interface. Peers are ``host:port`` endpoints, bind 127.0.0.1 by
default and authenticate with a shared secret (HMAC challenge-response). Frames carry
lengths, xxh3 checksums and msgpack headers; no pickle.

Usage::

    receiver = TransferEngine(secret); receiver.start()
    receiver.register_region("kv", size_bytes)
    sender = TransferEngine(secret); sender.start()
    sender.connect(receiver.endpoint).push("kv", [(offset, block), ...])
"""

from halfmoon.transfer.client import PeerClient
from halfmoon.transfer.engine import TransferEngine
from halfmoon.transfer.errors import (
    AuthenticationError,
    ChecksumError,
    PeerClosedError,
    ProtocolError,
    RemoteError,
    TransferCancelled,
    TransferError,
    TransferTimeout,
)
from halfmoon.transfer.handles import TransferHandle, TransferResult
from halfmoon.transfer.hub import InProcessHub
from halfmoon.transfer.messages import PutBlock, TransferCompleted
from halfmoon.transfer.pool import TRANSPORTS
from halfmoon.transfer.regions import MemoryRegion
from halfmoon.transfer.sender import StreamSender
from halfmoon.transfer.streams import StreamLayout, StreamReceiver

__all__ = [
    "TRANSPORTS",
    "AuthenticationError",
    "ChecksumError",
    "InProcessHub",
    "MemoryRegion",
    "PeerClient",
    "PeerClosedError",
    "ProtocolError",
    "PutBlock",
    "RemoteError",
    "StreamLayout",
    "StreamReceiver",
    "StreamSender",
    "TransferCancelled",
    "TransferCompleted",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "TransferResult",
    "TransferTimeout",
]
