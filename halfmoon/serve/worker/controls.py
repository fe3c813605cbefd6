"""A worker's side of the gateway's operations on the whole cluster
(halfmoon.serve.gateway.cluster_ops) that change its engine while it serves: LoRA adapters
loaded and unloaded, the prefix cache reset, new weights staged and installed, sleep mode,
the profiler. Each command is answered with its result, or an ``error`` saying why not
(retryable while requests are still ending here; ``unsupported`` where the engine cannot).
:class:`ClusterControls` is a base of :class:`~halfmoon.serve.worker.process.Worker`,
which holds the state it changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from halfmoon.core.adapters import RuntimeAdapter
from halfmoon.core.errors import HalfmoonError, Unsupported
from halfmoon.core.profiling import ProfileSession, parse_profiler_config
from halfmoon.serve.control.messages import (
    AdaptersOk,
    AdapterUpdate,
    CacheReset,
    Error,
    Message,
    Profile,
    ProfileState,
    ResetPrefixCache,
    Sleep,
    SleepState,
    UpdateWeights,
    WeightsOk,
    WeightsRecord,
)

if TYPE_CHECKING:
    from halfmoon.engine.connector import EngineConnector
    from halfmoon.serve.worker.conductor_link import WorkerIdentity
    from halfmoon.serve.worker.process import Role
    from halfmoon.store import TieredStore
    from halfmoon.transfer.store_service import EncodedBlocks

log = logging.getLogger(__name__)


class RequestsRunning(HalfmoonError):
    """New weights cannot be installed yet, or the engine cannot sleep: requests are still
    running on this worker."""


class ClusterControls:
    """The cluster-wide controls of one worker (see the module docstring)."""

    # What the worker holds (halfmoon.serve.worker.process.Worker sets them).
    engine: EngineConnector
    me: WorkerIdentity
    role: Role | None
    store: TieredStore | None
    encoded_blocks: EncodedBlocks | None
    runtime_adapters: dict[str, RuntimeAdapter]
    weights: WeightsRecord | None
    _staged_weights: tuple[str, object] | None
    ssd_namespace_of: Callable[[str], bytes] | None
    #: The worker's: one signed message to a peer of its command socket.
    send: Callable[[bytes, Message], None]

    def control_handlers(self) -> dict[type[Message], Callable[[bytes, Any], None]]:
        """The commands these controls answer, by message type."""
        return {
            AdapterUpdate: self._on_adapter_update, ResetPrefixCache: self._on_reset_prefix_cache,
            UpdateWeights: self._on_update_weights, Sleep: self._on_sleep,
            Profile: self._on_profile,
        }  # fmt: skip

    def load_adapters(self, adapters: list[RuntimeAdapter]) -> None:
        """Load the cluster's adapters loaded while it serves, those not loaded here yet
        (at registration, before any request can name them); one that fails is logged
        (requests naming it fail here, with its reason)."""
        for adapter in adapters:
            if self.runtime_adapters.get(adapter.name) == adapter:
                continue  # registering again: loaded already
            try:
                self.engine.load_lora(adapter)
            except HalfmoonError as exc:
                log.warning("LoRA adapter %r not loaded: %s", adapter.name, exc)
                continue
            self.runtime_adapters[adapter.name] = adapter

    def _on_adapter_update(self, identity: bytes, msg: AdapterUpdate) -> None:
        """Load or unload a LoRA adapter in the engine (the gateway's
        ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``); ``error`` says why not."""
        try:
            if msg.op == "load":
                adapter = msg.adapter.adapter()
                self.engine.load_lora(adapter)
                self.runtime_adapters[adapter.name] = adapter
            else:
                self.engine.unload_lora(msg.adapter.name)
                self.runtime_adapters.pop(msg.adapter.name, None)
        except Exception as exc:  # noqa: BLE001 - any failure is the answer, not a crash
            if not isinstance(exc, HalfmoonError):
                log.exception("LoRA adapter %s of %r failed", msg.op, msg.adapter.name)
            self.send(identity, Error(error=f"{self.me.instance_id}: {exc}", msg_id=msg.msg_id))
            return
        self.send(identity, AdaptersOk(msg_id=msg.msg_id))

    def _on_reset_prefix_cache(self, identity: bytes, msg: ResetPrefixCache) -> None:
        """Forget the engine's cached prefixes and, with ``external``, the block store's
        (vLLM's ``/reset_prefix_cache``); ``cache_reset`` says whether all of it went.
        The evictions reach the Conductor as cache events."""
        reasons = []
        try:
            if not self.engine.reset_prefix_cache():
                reasons.append("running requests hold KV blocks of its pool")
            if msg.external and not self._clear_store():
                reasons.append("blocks of its store are being read")
        except Exception as exc:  # noqa: BLE001 - any failure is the answer, not a crash
            if not isinstance(exc, HalfmoonError):
                log.exception("resetting the prefix cache failed")
            self.send(identity, Error(error=f"{self.me.instance_id}: {exc}", msg_id=msg.msg_id))
            return
        log.info("prefix cache reset%s%s", " (with the store)" if msg.external else "",
                 f": not all of it, {'; '.join(reasons)}" if reasons else "")  # fmt: skip
        self.send(identity, CacheReset(success=not reasons, reason="; ".join(reasons),
                                       msg_id=msg.msg_id))  # fmt: skip

    def _clear_store(self) -> bool:
        """Forget the block store's blocks and the encoded copies kept for pulls; False
        when some are being read (they stay)."""
        if self.encoded_blocks is not None:
            self.encoded_blocks.clear()
        return self.store is None or self.store.clear()

    def _on_update_weights(self, identity: bytes, msg: UpdateWeights) -> None:
        """One step of a weight update (SGLang's ``/update_weights_from_disk``):
        :meth:`update_weights`; ``error`` says why not."""
        try:
            self.update_weights(msg.op, msg.weights)
        except Exception as exc:  # noqa: BLE001 - any failure is the answer, not a crash
            # (retryable: requests still ending here, e.g. aborted ones whose KV streams
            # finish: the same commit succeeds once they have)
            self._answer_failure(identity, msg, exc, f"weight update {msg.op}")
            return
        self.send(identity, WeightsOk(weights=self.weights, msg_id=msg.msg_id))

    def _on_sleep(self, identity: bytes, msg: Sleep) -> None:
        """vLLM's sleep mode, level 1 (:meth:`LLMEngine.sleep`): ``sleep`` once no request
        is here (else a retryable ``error``: those ending, say an aborted one finishing its
        KV stream, soon will be), ``wake``; answered ``sleep_state``. The forgotten
        prefixes reach the Conductor as cache events; the block store keeps its blocks."""
        released = 0
        try:
            if msg.op == "wake":
                self.engine.wake_up()
            else:
                assert self.role is not None
                if self.engine.has_unfinished_requests() or self.role.num_pending():
                    raise RequestsRunning("requests are running here: the engine sleeps once "
                                          "none is (pause generation first)")  # fmt: skip
                released = self.engine.sleep()
        except Exception as exc:  # noqa: BLE001 - any failure is the answer, not a crash
            self._answer_failure(identity, msg, exc, f"sleep mode {msg.op}")
            return
        self.send(identity, SleepState(sleeping=self.engine.sleeping, released_bytes=released,
                                       msg_id=msg.msg_id))  # fmt: skip

    def _on_profile(self, identity: bytes, msg: Profile) -> None:
        """vLLM's ``/start_profile`` and ``/stop_profile`` on this worker's engine
        (:meth:`EngineConnector.start_profile`); answered ``profile_state`` with the
        traces a ``stop`` wrote."""
        traces: list[str] = []
        try:
            if msg.op == "start":
                config = parse_profiler_config(msg.config)
                if config is None:
                    raise HalfmoonError("a profile start names no profiler config")
                session = ProfileSession(
                    profile_prefix=msg.prefix or None,
                    delay_iterations=None if msg.delay_iterations < 0 else msg.delay_iterations,
                    max_iterations=None if msg.max_iterations < 0 else msg.max_iterations,
                )  # fmt: skip
                self.engine.start_profile(config, session, self.me.instance_id)
            else:
                traces = self.engine.stop_profile()
        except Exception as exc:  # noqa: BLE001 - any failure is the answer, not a crash
            self._answer_failure(identity, msg, exc, f"profile {msg.op}")
            return
        self.send(identity, ProfileState(active=msg.op == "start", traces=traces,
                                         msg_id=msg.msg_id))  # fmt: skip

    def _answer_failure(self, identity: bytes, msg: Message, exc: Exception, what: str) -> None:
        """Answer ``msg`` with an ``error`` naming ``exc`` (retryable while requests are
        still ending here, ``unsupported`` where the engine cannot); one that is not a
        HalfmoonError is logged with its traceback."""
        if not isinstance(exc, HalfmoonError):
            log.exception("%s failed", what)
        self.send(identity, Error(error=f"{self.me.instance_id}: {exc}", msg_id=msg.msg_id,
                                  retryable=isinstance(exc, RequestsRunning),
                                  unsupported=isinstance(exc, Unsupported)))  # fmt: skip

    def update_weights(self, op: str, weights: WeightsRecord | None) -> None:
        """``stage``: read the checkpoint at ``weights.path`` beside the served weights;
        ``commit``: install those staged (HalfmoonError while this worker has requests:
        their KV is of the old weights) and forget every block of KV computed with the old
        ones, the engine's cached prefixes and the block store's; ``drop``: forget staged
        weights."""
        if op == "drop":
            self._staged_weights = None
            return
        if weights is None or op not in ("stage", "commit"):
            raise HalfmoonError(f"a worker does not take update_weights {op!r}")
        if op == "stage":
            self._staged_weights = None  # (the memory of an earlier one freed first)
            self._staged_weights = (weights.path, self.engine.stage_weights(weights.path))
            log.info("weights of %s read (version %s), waiting to be installed",
                     weights.path, weights.version)  # fmt: skip
            return
        if self._staged_weights is None or self._staged_weights[0] != weights.path:
            raise HalfmoonError(f"no weights of {weights.path} are staged here")
        assert self.role is not None
        if self.engine.has_unfinished_requests() or self.role.num_pending():
            raise RequestsRunning("requests are running here: new weights are installed once "
                                  "none is (pause generation first)")  # fmt: skip
        # The store first (nothing installed when it cannot be), then the engine, whose
        # reset demotes nothing; the store again for a block stored meanwhile.
        namespace = None if self.ssd_namespace_of is None else self.ssd_namespace_of(weights.path)
        if not self._clear_store():
            raise HalfmoonError("blocks of its store are being read: try again")
        self.engine.commit_weights(self._staged_weights[1])
        self._staged_weights = None
        self.weights = weights
        if not self._clear_store():
            log.warning("blocks of the store stored while the weights were installed are "
                        "being read: they stay until evicted")  # fmt: skip
        elif self.store is not None and namespace is not None:
            # (blocks on SSD from now on are of these weights: a restart on the old ones
            # does not serve them)
            self.store.set_ssd_namespace(namespace)
        log.info("weights of %s installed (version %s): cached KV forgotten", weights.path,
                 weights.version)  # fmt: skip

    def install_cluster_weights(self, weights: WeightsRecord | None) -> None:
        """Install the weights the cluster serves since an update (given as the Conductor
        accepts this worker), unless installed already; HalfmoonError when they cannot
        be (this worker must not serve other weights than the cluster's)."""
        if weights is None or weights == self.weights:
            return
        if not weights.path:  # a version label given to the weights it started with
            self.weights = weights
            return
        log.info("the cluster serves the weights of %s (version %s): installing them",
                 weights.path, weights.version)  # fmt: skip
        self.update_weights("stage", weights)
        self.update_weights("commit", weights)
