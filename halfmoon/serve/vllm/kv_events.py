"""vLLM's KV-cache events: the wire format decoded, and vLLM's block hashes translated.

A vLLM server with ``--kv-events-config '{"enable_kv_cache_events": true}'`` publishes
one *batch* per scheduler step that changed its prefix cache, as three ZeroMQ frames
(docs/vllm.md, "KV events", has the source lines)::

    [ topic (utf-8, "" by default) | seq (8 bytes big-endian, 0, 1, ... per process) | payload ]

    payload = msgpack array [ts, [event, ...], data_parallel_rank]   (rank may be absent)
    event   = msgpack map {"type": "BlockStored", "block_hashes": [...], "parent_block_hash":
              ..., "token_ids": [...], "block_size": 16, "medium": "GPU", ...}
            | {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU", ...}
            | {"type": "AllBlocksCleared"}

:func:`decode_frames` (or :func:`decode_payload`) turns those bytes into frozen records
and refuses anything else with :class:`KVEventError`; an event ``type`` this decoder does
not know becomes :class:`VllmUnknownEvent` (newer vLLMs add types; a batch is not lost for
it). Map keys it does not know are ignored for the same reason.

:class:`HashTranslator` turns records into halfmoon's :class:`~halfmoon.core.events.BlockStored`
/ :class:`~halfmoon.core.events.BlockEvicted`. vLLM's hash (SHA-256 of a pickled tuple,
cut to 64 bits, or raw bytes) means nothing to halfmoon's index, which keys blocks by
:func:`~halfmoon.core.hashing.hash_blocks` of the token ids; a ``BlockStored`` carries
its blocks' token ids and its parent's vLLM hash, so each block's halfmoon hash is
``hash_blocks(token_ids, B, parent's halfmoon hash)``, the parent's translation being
known from an earlier event of the same instance. Nothing is guessed: an event whose
parent was never seen is skipped and counted (:attr:`HashTranslator.skipped`), and so is
one this translation cannot reproduce (LoRA, multimodal or prompt-embedding keys, another
KV-cache group, a block size that is not a multiple of ``B``).

Threads: decoding is a pure function; each vLLM instance's subscriber thread calls it
(:mod:`halfmoon.serve.vllm.subscriber`) and puts ``(instance_id, item)`` on one queue. One
:class:`HashTranslator` serves every instance and is *not* thread-safe: a single thread
(the Conductor's loop) drains that queue and calls :meth:`HashTranslator.translate` in
arrival order, which keeps each instance's events in its sequence order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import msgpack

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.events import TIER_DRAM, TIER_SSD, TIERS, BlockEvicted, BlockStored, CacheEvent
from halfmoon.core.hashing import chain_root, hash_blocks

#: vLLM's ``ExternalBlockHash``: a 64-bit int by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``),
#: else the raw digest bytes.
VllmHash = int | bytes
SEQ_BYTES = 8
#: The sequence frame of the replay socket's end-of-replay marker (vLLM's ``END_SEQ``).
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
#: Payloads larger than this are refused before unpacking (a 128k-token prefill's batch,
#: its token ids included, is under 1 MiB).
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
_TOKEN_LIMIT = 1 << 32
_HASH_LIMIT = 1 << 64


class KVEventError(HalfmoonError):
    """Bytes that are not a vLLM KV-event batch; the message names the part that is wrong."""


@dataclass(frozen=True)
class VllmBlockStored:
    """Full blocks became cached: ``block_hashes[i]`` covers ``token_ids[i*block_size:
    (i+1)*block_size]`` and chains on ``block_hashes[i-1]`` (the first on
    ``parent_block_hash``; None: the prompt's first block). ``extra_keys[i]``: block i's
    untagged extra hash keys (a LoRA name, ``(mm_identifier, offset)`` pairs, the cache
    salt on block 0, prompt-embedding digests) or None."""

    block_hashes: tuple[VllmHash, ...]
    parent_block_hash: VllmHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    locality: str | None = None


@dataclass(frozen=True)
class VllmBlockRemoved:
    """Blocks left the prefix cache of ``medium`` (evicted, or their block reused)."""

    block_hashes: tuple[VllmHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


@dataclass(frozen=True)
class VllmAllBlocksCleared:
    """The prefix cache was reset (``/reset_prefix_cache``, weights updated)."""


@dataclass(frozen=True)
class VllmUnknownEvent:
    """An event of a type this decoder does not know (kept so it can be counted)."""

    type: str


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared | VllmUnknownEvent


@dataclass(frozen=True)
class VllmEventBatch:
    """One published batch: the events of one scheduler step, in order."""

    seq: int
    ts: float
    events: tuple[VllmEvent, ...]
    data_parallel_rank: int | None = None
    topic: str = ""


@dataclass(frozen=True)
class PublisherRestarted:
    """The subscriber saw the sequence go back (``seq`` < the next one expected): a new
    publisher process, whose prefix cache starts empty."""

    last_seq: int
    seq: int


# -- decoding ----------------------------------------------------------------------------------
def decode_frames(frames: Sequence[bytes | memoryview]) -> VllmEventBatch:
    """One PUB message ``[topic, seq, payload]`` as a batch."""
    if len(frames) != 3:
        raise KVEventError(
            f"a KV-event message has 3 frames (topic, seq, payload), got {len(frames)}"
        )
    topic, seq, payload = (bytes(frame) for frame in frames)
    try:
        topic_text = topic.decode("utf-8")
    except UnicodeDecodeError:
        raise KVEventError(f"the topic frame is not UTF-8: {topic[:40]!r}") from None
    return decode_payload(payload, decode_seq(seq), topic_text)


def decode_seq(frame: bytes | memoryview) -> int:
    """The sequence frame: 8 bytes, big-endian, unsigned."""
    if len(frame) != SEQ_BYTES:
        raise KVEventError(f"a sequence frame has {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def decode_payload(payload: bytes, seq: int = 0, topic: str = "") -> VllmEventBatch:
    """A batch's msgpack payload (``msgspec`` array-like ``KVEventBatch``) as records."""
    where = f"batch {seq}"
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise KVEventError(f"{where}: payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        body = msgpack.unpackb(payload, raw=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise KVEventError(f"{where}: not msgpack: {exc}") from None
    if not isinstance(body, list) or len(body) not in (2, 3):
        raise KVEventError(f"{where}: expected an array [ts, events, data_parallel_rank]")
    ts, events = body[0], body[1]
    if isinstance(ts, bool) or not isinstance(ts, int | float):
        raise KVEventError(f"{where}: ts must be a number, got {type(ts).__name__}")
    if not isinstance(events, list):
        raise KVEventError(f"{where}: events must be an array, got {type(events).__name__}")
    rank = _opt_int(body[2] if len(body) == 3 else None, "data_parallel_rank", where)
    decoded = tuple(_event(raw, f"{where} event {i}") for i, raw in enumerate(events))
    return VllmEventBatch(seq, float(ts), decoded, rank, topic)


def _event(raw: object, where: str) -> VllmEvent:
    if not isinstance(raw, dict):
        raise KVEventError(f"{where}: an event is a map, got {type(raw).__name__}")
    tag = raw.get("type")
    if not isinstance(tag, str):
        raise KVEventError(f"{where}: an event needs a string 'type'")
    where = f"{where} ({tag})"
    if tag == "BlockStored":
        return _stored(raw, where)
    if tag == "BlockRemoved":
        return VllmBlockRemoved(
            _hashes(_required(raw, "block_hashes", where), where),
            _opt_str(raw.get("medium"), "medium", where),
            _opt_int(raw.get("group_idx"), "group_idx", where),
            _opt_str(raw.get("locality"), "locality", where),
        )
    if tag == "AllBlocksCleared":
        return VllmAllBlocksCleared()
    return VllmUnknownEvent(tag)


def _stored(raw: dict, where: str) -> VllmBlockStored:
    parent = _required(raw, "parent_block_hash", where)
    block_size = _required(raw, "block_size", where)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise KVEventError(f"{where}: block_size must be a positive integer, got {block_size!r}")
    return VllmBlockStored(
        block_hashes=_hashes(_required(raw, "block_hashes", where), where),
        parent_block_hash=None if parent is None else _hash(parent, where),
        token_ids=_tokens(_required(raw, "token_ids", where), where),
        block_size=block_size,
        medium=_opt_str(raw.get("medium"), "medium", where),
        lora_id=_opt_int(raw.get("lora_id"), "lora_id", where),
        lora_name=_opt_str(raw.get("lora_name"), "lora_name", where),
        extra_keys=_extra_keys(raw.get("extra_keys"), where),
        group_idx=_opt_int(raw.get("group_idx"), "group_idx", where),
        kv_cache_spec_kind=_opt_str(raw.get("kv_cache_spec_kind"), "kv_cache_spec_kind", where),
        locality=_opt_str(raw.get("locality"), "locality", where),
    )


def _required(raw: dict, name: str, where: str) -> object:
    if name not in raw:
        raise KVEventError(f"{where}: missing field {name!r}")
    return raw[name]


def _hash(value: object, where: str) -> VllmHash:
    if isinstance(value, bytes) and value:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _HASH_LIMIT:
        return value
    raise KVEventError(
        f"{where}: a block hash is a 64-bit unsigned int or bytes, got {value!r:.60}"
    )


def _hashes(value: object, where: str) -> tuple[VllmHash, ...]:
    if not isinstance(value, list):
        raise KVEventError(f"{where}: block_hashes must be an array")
    return tuple(_hash(h, where) for h in value)


def _tokens(value: object, where: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise KVEventError(f"{where}: token_ids must be an array")
    if not all(type(t) is int and 0 <= t < _TOKEN_LIMIT for t in value):
        raise KVEventError(f"{where}: token_ids must be integers in [0, 2**32)")
    return tuple(value)


def _opt_str(value: object, name: str, where: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise KVEventError(f"{where}: {name} must be a string or nil, got {value!r:.60}")


def _opt_int(value: object, name: str, where: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise KVEventError(f"{where}: {name} must be an integer or nil, got {value!r:.60}")


def _frozen(value: object) -> object:
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


def _extra_keys(value: object, where: str) -> tuple[tuple | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(k is None or isinstance(k, list) for k in value):
        raise KVEventError(f"{where}: extra_keys must be an array of arrays or nils")
    return tuple(None if keys is None else _frozen(keys) for keys in value)


# -- translation -------------------------------------------------------------------------------
#: Why an event (or, for the two per-block reasons, a block) was not translated.
SKIP_UNKNOWN_PARENT = "unknown_parent"  # its parent's BlockStored was never seen (or is gone)
SKIP_OTHER_GROUP = "other_group"  # another KV-cache group (hybrid models)
SKIP_REMOTE = "remote"  # locality REMOTE: not in this instance's memory
SKIP_MEDIUM = "unknown_medium"  # a medium with no halfmoon tier
SKIP_LORA = "lora"  # an adapter's blocks: halfmoon hashes have no adapter key
SKIP_EXTRA_KEYS = "extra_keys"  # multimodal / prompt-embedding keys (the salt is translated)
SKIP_BLOCK_SIZE = "block_size"  # not a multiple of the translator's block size
SKIP_TOKEN_COUNT = "token_count"  # token ids do not cover the hashes (sparse groups)
SKIP_UNKNOWN_EVENT = "unknown_event"
SKIP_UNKNOWN_REMOVAL = "unknown_removal"  # per block: removed but not held
SKIP_CONFLICT = "conflict"  # per block: one vLLM hash, two different token chains

#: vLLM medium -> halfmoon tier (``None``: an event without a medium, the engine's pool).
DEFAULT_TIERS: Mapping[str | None, str] = {
    None: TIER_DRAM, "GPU": TIER_DRAM, "CPU": TIER_DRAM, "STORAGE": TIER_SSD,
}  # fmt: skip


@dataclass
class _Holdings:
    """One instance's cached blocks. ``chains[v]``: the halfmoon hashes of vLLM block
    ``v``, kept while any medium holds it; ``refs[(tier, h)]``: how many (block, medium)
    holdings produce halfmoon hash ``h`` in ``tier`` (an event goes out on 0 <-> 1)."""

    chains: dict[VllmHash, tuple[int, ...]]
    media: dict[VllmHash, set[str | None]]
    refs: Counter[tuple[str, int]]


class HashTranslator:
    """vLLM block hashes -> halfmoon's chained hashes, per vLLM instance.

    A vLLM block of ``S = k * block_size`` tokens becomes ``k`` halfmoon blocks::

        vLLM block v_i:  | B | B | ... | B |   chains[v_i] = (h_ik, ..., h_ik+k-1)
                                         ^ chain tip: what v_(i+1)'s first block chains on

    Stores of a block already held in that medium are ignored (vLLM's ``full`` report
    mode re-announces prefix hits); a removal of a block not held is counted. Every
    record is stamped with the instance id. Single-threaded (module docstring).
    """

    def __init__(
        self, block_size: int, *, group_idx: int = 0,
        tiers: Mapping[str | None, str] = DEFAULT_TIERS,
    ) -> None:  # fmt: skip
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if bad := {t for t in tiers.values() if t not in TIERS}:
            raise ValueError(f"unknown tiers {sorted(bad)}; expected {', '.join(TIERS)}")
        self.block_size = block_size
        self.group_idx = group_idx
        self.tiers = dict(tiers)
        #: Events (blocks, for SKIP_UNKNOWN_REMOVAL and SKIP_CONFLICT) not translated, by reason.
        self.skipped: Counter[str] = Counter()
        self._held: dict[str, _Holdings] = {}

    def translate(
        self, instance_id: str, item: VllmEventBatch | PublisherRestarted
    ) -> list[CacheEvent]:
        """halfmoon's events for one batch of ``instance_id`` (a restart clears it)."""
        if isinstance(item, PublisherRestarted):
            return list(self.clear(instance_id))
        held = self._held.setdefault(instance_id, _Holdings({}, {}, Counter()))
        out: list[CacheEvent] = []
        for event in item.events:
            if isinstance(event, VllmBlockStored):
                self._stored(instance_id, held, event, out)
            elif isinstance(event, VllmBlockRemoved):
                self._removed(instance_id, held, event, out)
            elif isinstance(event, VllmAllBlocksCleared):
                out.extend(self.clear(instance_id))
                held = self._held.setdefault(instance_id, _Holdings({}, {}, Counter()))
            else:
                self.skipped[SKIP_UNKNOWN_EVENT] += 1
        return out

    def clear(self, instance_id: str) -> list[BlockEvicted]:
        """Forget everything ``instance_id`` held; one eviction per (tier, hash) it held."""
        held = self._held.pop(instance_id, None)
        if held is None:
            return []
        return [BlockEvicted(h, tier, instance_id) for tier, h in held.refs]

    def num_held(self, instance_id: str) -> int:
        """Distinct (tier, halfmoon hash) pairs ``instance_id`` holds."""
        held = self._held.get(instance_id)
        return 0 if held is None else len(held.refs)

    def check_integrity(self) -> None:
        """Assert that every instance's reference counts match its holdings."""
        for instance_id, held in self._held.items():
            assert held.chains.keys() == held.media.keys(), instance_id
            expected: Counter[tuple[str, int]] = Counter()
            for vhash, media in held.media.items():
                assert media, (instance_id, vhash)
                for medium in media:
                    expected.update((self.tiers[medium], h) for h in held.chains[vhash])
            assert expected == held.refs, instance_id

    # -- one event ---------------------------------------------------------------------------
    def _refusal(self, event: VllmBlockStored | VllmBlockRemoved) -> str | None:
        if event.group_idx not in (None, self.group_idx):
            return SKIP_OTHER_GROUP
        if event.locality == "REMOTE":
            return SKIP_REMOTE
        if event.medium not in self.tiers:
            return SKIP_MEDIUM
        if isinstance(event, VllmBlockRemoved):
            return None
        if event.lora_name is not None or event.lora_id is not None:
            return SKIP_LORA
        if event.block_size % self.block_size:
            return SKIP_BLOCK_SIZE
        if len(event.token_ids) != len(event.block_hashes) * event.block_size:
            return SKIP_TOKEN_COUNT
        keys = event.extra_keys or ()
        if any(k is not None for k in keys[1:]) or (keys and not _is_root_salt(event, keys[0])):
            return SKIP_EXTRA_KEYS
        return None

    def _stored(
        self, instance_id: str, held: _Holdings, event: VllmBlockStored, out: list[CacheEvent]
    ) -> None:
        if reason := self._refusal(event):
            self.skipped[reason] += 1
            return
        if event.parent_block_hash is None:
            salt = event.extra_keys[0][0] if event.extra_keys and event.extra_keys[0] else None
            root = chain_root(salt)
        elif (parent := held.chains.get(event.parent_block_hash)) is not None:
            root = parent[-1]
        else:
            self.skipped[SKIP_UNKNOWN_PARENT] += 1
            return
        hashes = hash_blocks(event.token_ids, self.block_size, root).full
        per_block = event.block_size // self.block_size
        tier = self.tiers[event.medium]
        for i, vhash in enumerate(event.block_hashes):
            chain = hashes[i * per_block : (i + 1) * per_block]
            known = held.chains.get(vhash)
            if known is not None and known != chain:
                self.skipped[SKIP_CONFLICT] += 1
                continue
            media = held.media.setdefault(vhash, set())
            if event.medium in media:
                continue  # announced again: already held there
            held.chains[vhash] = chain
            media.add(event.medium)
            for h in chain:
                held.refs[(tier, h)] += 1
                if held.refs[(tier, h)] == 1:
                    out.append(BlockStored(h, tier, instance_id))

    def _removed(
        self, instance_id: str, held: _Holdings, event: VllmBlockRemoved, out: list[CacheEvent]
    ) -> None:
        if reason := self._refusal(event):
            self.skipped[reason] += 1
            return
        tier = self.tiers[event.medium]
        for vhash in event.block_hashes:
            media = held.media.get(vhash)
            if media is None or event.medium not in media:
                self.skipped[SKIP_UNKNOWN_REMOVAL] += 1
                continue
            media.remove(event.medium)
            for h in held.chains[vhash]:
                held.refs[(tier, h)] -= 1
                if held.refs[(tier, h)] == 0:
                    del held.refs[(tier, h)]
                    out.append(BlockEvicted(h, tier, instance_id))
            if not media:
                del held.media[vhash], held.chains[vhash]


def _is_root_salt(event: VllmBlockStored, keys: tuple | None) -> bool:
    """Block 0's keys are nothing, or only the cache salt (which vLLM puts on block 0)."""
    if keys is None:
        return True
    return (
        event.parent_block_hash is None
        and len(keys) == 1
        and isinstance(keys[0], str)
        and bool(keys[0])
    )
