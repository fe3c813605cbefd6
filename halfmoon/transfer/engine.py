"""The transfer engine facade: one per worker process, serving and requesting.

Receiving side: ``register_region`` (preallocated buffers peers push into),
``expect_stream`` (a layer-wise session; ``accept_streams`` places unannounced ones on
demand), an optional block store that peers pull from
and put into, and ``on_complete`` notifications. Requesting side: ``connect(endpoint)``
returns a :class:`PeerClient` with push / put / pull / open_stream.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from halfmoon.store import TieredStore
from halfmoon.transfer.auth import check_secret
from halfmoon.transfer.busypoll import DEFAULT_BUSY_POLL_S
from halfmoon.transfer.client import PeerClient
from halfmoon.transfer.endpoint import DEFAULT_HOST
from halfmoon.transfer.errors import TransferError
from halfmoon.transfer.hub import InProcessHub
from halfmoon.transfer.messages import CompletionListener
from halfmoon.transfer.pool import TRANSPORTS
from halfmoon.transfer.regions import MemoryRegion, RegionTable, SegmentCache
from halfmoon.transfer.server import TransferServer
from halfmoon.transfer.store_service import EncodedBlocks, PullEncoder, StoreFallback
from halfmoon.transfer.streams import LayerCallback, StreamLayout, StreamReceiver, StreamTable

#: Where an unannounced stream lands: ``(session_id, num_layers, num_blocks, block_bytes)
#: -> (region name, layout)``.
StreamPlacer = Callable[[str, int, int, int], tuple[str, StreamLayout]]


class TransferEngine:
    """Serves this process's regions, streams and store; connects to peers.

    ``transport`` is the default for ``connect``: ``auto`` (shared memory with a peer on
    this host's /dev/shm, else tcp), ``tcp``, ``shm`` or ``inproc`` (needs ``hub``). Peers must share ``secret`` (>= 16 bytes). ``timeout_s`` bounds each
    operation; ``num_connections`` is how many parallel connections a batch may use
    (default: 4, or the number of cores if fewer). ``busy_poll_s`` is how long a
    connection polls for an awaited frame before sleeping (0 turns polling off; it backs
    off by itself when polling finds nothing, see :class:`~halfmoon.transfer.link.Link`).
    ``checksum`` (default on): hash every payload this engine sends with xxh3, checked by
    the receiver; off, payloads rely on TCP's own checksums and cost ~10% less CPU a
    batch on a small host (see :mod:`halfmoon.transfer.protocol`). Payloads are verified
    whenever their sender hashed them, whatever this setting.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        host: str = DEFAULT_HOST,
        port: int = 0,
        transport: str = "auto",
        store: TieredStore | None = None,
        hub: InProcessHub | None = None,
        num_connections: int | None = None,
        timeout_s: float = 30.0,
        on_complete: CompletionListener | None = None,
        busy_poll_s: float = DEFAULT_BUSY_POLL_S,
        checksum: bool = True,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(
                f"unknown transport {transport!r}; choose from {', '.join(TRANSPORTS)}"
            )
        if transport == "inproc" and hub is None:
            raise ValueError("the inproc transport needs an InProcessHub shared by the engines")
        self._secret = check_secret(secret)
        self.transport = transport
        self.num_connections = num_connections
        self.timeout_s = timeout_s
        self._hub = hub
        self.regions = RegionTable()
        self._streams = StreamTable()
        self._segments = SegmentCache()
        self._server = TransferServer(
            secret,
            self.regions,
            self._streams,
            store=store,
            host=host,
            port=port,
            on_complete=on_complete,
            io_timeout_s=timeout_s,
            busy_poll_s=busy_poll_s,
            checksum=checksum,
        )
        self.busy_poll_s = busy_poll_s
        self.checksum = checksum
        self._clients: dict[tuple[str, str], PeerClient] = {}
        self._lock = threading.Lock()
        self.endpoint = ""

    def set_store_fallback(self, reader: StoreFallback | None) -> None:
        """Serve peers' pulls of blocks the attached store lacks with ``reader`` (None:
        such blocks are misses)."""
        self._server.store_fallback = reader

    def set_pull_encoder(self, encode: PullEncoder | None, keep_bytes: int = 0) -> None:
        """Send the store's blocks encoded by ``encode`` (compressed KV) to tcp peers whose
        ``pull`` can decode them (None: raw), keeping up to ``keep_bytes`` of encoded
        blocks for later pulls of the same blocks (0: every pull encodes)."""
        self._server.pull_encoder = encode
        self._server.encoded_blocks = (
            EncodedBlocks(keep_bytes) if encode is not None and keep_bytes > 0 else None
        )

    @property
    def encoded_blocks(self) -> EncodedBlocks | None:
        """The encoded blocks kept for later pulls (None: none are)."""
        return self._server.encoded_blocks

    def start(self) -> str:
        """Start listening; returns this engine's ``host:port``."""
        self.endpoint = str(self._server.start())
        if self._hub is not None:
            self._hub.add(self.endpoint, self._server)
        return self.endpoint

    def __enter__(self) -> TransferEngine:
        if not self.endpoint:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ receiving side
    def register_region(self, name: str, size_bytes: int, shared: bool = False) -> MemoryRegion:
        """Preallocate ``size_bytes`` that peers may push into (shared: for the shm transport)."""
        return self.regions.add(MemoryRegion.allocate(name, size_bytes, shared))

    def register_buffer(self, name: str, buffer: object) -> MemoryRegion:
        """Expose an existing writable buffer as a region (tcp / in-process writes)."""
        return self.regions.add(MemoryRegion.wrap(name, buffer))

    def unregister_region(self, name: str) -> None:
        """Remove a region; later pushes into it fail at the sender."""
        self.regions.remove(name)

    def expect_stream(
        self,
        session_id: str,
        region: str,
        layout: StreamLayout,
        on_layer: LayerCallback | None = None,
    ) -> StreamReceiver:
        """Announce a layer-wise session whose blocks land in ``region`` per ``layout``.

        ``on_layer(receiver, layer)`` runs on the connection thread as each layer lands.
        """
        receiver = StreamReceiver(session_id, self.regions.get(region), layout, on_layer)
        self._streams.add(receiver)
        return receiver

    def accept_streams(
        self,
        place: StreamPlacer | None,
        accepted: Callable[[StreamReceiver], None] | None = None,
    ) -> None:
        """Accept sessions nobody announced: ``place(session_id, num_layers, num_blocks,
        block_bytes) -> (region, layout)`` chooses where one lands when its sender opens
        it (raise :class:`RemoteError` to refuse), and ``accepted(receiver)`` learns of
        its receiver; None turns this off again."""
        if place is None:
            self._streams.acceptor = None
            return

        def accept(
            session_id: str, num_layers: int, num_blocks: int, block_bytes: int
        ) -> StreamReceiver:
            region, layout = place(session_id, num_layers, num_blocks, block_bytes)
            receiver = self.expect_stream(session_id, region, layout)
            if accepted is not None:
                accepted(receiver)
            return receiver

        self._streams.acceptor = accept

    # ------------------------------------------------------------ requesting side
    def connect(self, endpoint: str, transport: str | None = None) -> PeerClient:
        """The (cached) client for ``endpoint`` over ``transport`` (default: the engine's)."""
        transport = transport or self.transport
        key = (endpoint, transport)
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = PeerClient(
                    endpoint,
                    self._secret,
                    transport=transport,
                    num_connections=self.num_connections,
                    timeout_s=self.timeout_s,
                    hub=self._hub,
                    segments=self._segments,
                    busy_poll_s=self.busy_poll_s,
                    checksum=self.checksum,
                )
                self._clients[key] = client
        return client

    def close(self) -> None:
        """Close clients, stop serving (open streams fail), free regions."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
        if self._hub is not None and self.endpoint:
            self._hub.remove(self.endpoint)
        self._server.close()
        self._streams.fail_all(TransferError("the transfer engine closed"))
        self.regions.close()
        self._segments.close()
