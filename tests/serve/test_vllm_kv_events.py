"""vLLM's KV events (halfmoon/serve/vllm/): real vLLM batches decoded, vLLM hashes
translated to halfmoon's chained hashes, and the subscriber over a local PUB/SUB pair.

The golden batches (tests/data/vllm_kv_events/, README there) were recorded once from
vLLM's own block pool and publisher; vLLM is not needed here.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from halfmoon.core.events import TIER_DRAM, BlockEvicted, BlockStored
from halfmoon.core.hashing import chain_root, hash_blocks
from halfmoon.serve.runtime import free_port
from halfmoon.serve.vllm.kv_events import (
    END_SEQ,
    SKIP_BLOCK_SIZE,
    SKIP_CONFLICT,
    SKIP_EXTRA_KEYS,
    SKIP_LORA,
    SKIP_MEDIUM,
    SKIP_OTHER_GROUP,
    SKIP_REMOTE,
    SKIP_TOKEN_COUNT,
    SKIP_UNKNOWN_EVENT,
    SKIP_UNKNOWN_PARENT,
    SKIP_UNKNOWN_REMOVAL,
    HashTranslator,
    KVEventError,
    PublisherRestarted,
    VllmAllBlocksCleared,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventBatch,
    VllmUnknownEvent,
    decode_frames,
    decode_payload,
)
from halfmoon.serve.vllm.subscriber import KVEventSubscriber

DATA = Path(__file__).parents[1] / "data" / "vllm_kv_events"
B = 16
#: The token ids make_fixture.py gave vLLM: prompt A, A's 8 decoded tokens, prompt C.
PROMPT_A = list(range(1000, 1040))
OUTPUT_A = list(range(2000, 2008))
PROMPT_C = list(range(3000, 3032))


def _golden(name: str) -> dict:
    return msgpack.unpackb((DATA / f"{name}.msgpack").read_bytes(), raw=False)


def _fields(record: VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared) -> dict:
    """A record as vLLM's field names (those make_fixture.py stored)."""
    out = {"type": type(record).__name__.removeprefix("Vllm")}
    out.update(vars(record))
    return out


def _as_recorded(event: dict) -> dict:
    """vLLM's recorded event, with arrays as the decoder's tuples."""
    out = {k: tuple(v) if isinstance(v, list) else v for k, v in event.items()}
    if out.get("extra_keys") is not None:
        out["extra_keys"] = tuple(None if k is None else tuple(k) for k in out["extra_keys"])
    return out


# -- golden: real vLLM bytes -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["int_hashes", "bytes_hashes"])
def test_golden_batches_decode_to_what_vllm_held(name: str) -> None:
    doc = _golden(name)
    assert len(doc["live"]) == len(doc["expected"]) == 5
    for frames, want in zip(doc["live"], doc["expected"], strict=True):
        batch = decode_frames(frames)
        assert (batch.seq, batch.ts, batch.topic) == (want["seq"], want["ts"], doc["topic"])
        assert batch.data_parallel_rank == want["data_parallel_rank"] == 0
        assert len(batch.events) == len(want["events"])
        for record, event in zip(batch.events, want["events"], strict=True):
            recorded = _as_recorded(event)
            got = _fields(record)
            assert {k: got[k] for k in got.keys() & recorded.keys()} == {
                k: recorded[k] for k in got.keys() & recorded.keys()
            }
            assert got.keys() <= recorded.keys()
    hash_type = int if name == "int_hashes" else bytes
    first = decode_frames(doc["live"][0]).events[0]
    assert isinstance(first, VllmBlockStored) and first.parent_block_hash is None
    assert all(isinstance(h, hash_type) for h in first.block_hashes)


def test_golden_replay_answers_from_the_asked_seq_then_ends() -> None:
    doc = _golden("int_hashes")
    *batches, end = doc["replay_from_3"]
    assert [decode_frames(frames[1:]).seq for frames in batches] == [3, 4]
    assert all(frames[0] == b"" for frames in doc["replay_from_3"])
    assert end == [b"", b"", END_SEQ, b""]
    assert decode_frames(batches[0][1:]) == decode_frames(doc["live"][3])


@pytest.mark.parametrize("name", ["int_hashes", "bytes_hashes"])
def test_golden_batches_translate_to_halfmoon_hashes(name: str) -> None:
    doc = _golden(name)
    a = hash_blocks(PROMPT_A + OUTPUT_A, B).full
    salted = hash_blocks(PROMPT_A[:B], B, chain_root("tenant-a")).full
    c = hash_blocks(PROMPT_C, B).full
    translator = HashTranslator(B)
    got = [translator.translate("vllm-0", decode_frames(frames)) for frames in doc["live"]]
    stored = [[BlockStored(h, TIER_DRAM, "vllm-0") for h in hs] for hs in (a[:2], a[2:], salted)]
    assert got[:3] == stored
    # step 3 evicts A's blocks tail first, then B's; step 4 stores C and clears everything
    assert got[3] == [BlockEvicted(h, TIER_DRAM, "vllm-0") for h in (a[2], a[1], a[0], salted[0])]
    assert got[4] == [BlockStored(h, TIER_DRAM, "vllm-0") for h in c] + [
        BlockEvicted(h, TIER_DRAM, "vllm-0") for h in c
    ]
    assert translator.num_held("vllm-0") == 0
    assert not translator.skipped
    translator.check_integrity()


# -- translation -------------------------------------------------------------------------------
def _stored(tokens, vhashes, parent=None, block_size=B, **kw) -> VllmBlockStored:
    return VllmBlockStored(tuple(vhashes), parent, tuple(tokens), block_size, medium="GPU", **kw)


def _batch(*events, seq: int = 0) -> VllmEventBatch:
    return VllmEventBatch(seq, 0.0, events)


def _hashes(events) -> list[int]:
    return [e.block_hash for e in events]


def test_chained_stores_map_to_the_hash_chain_of_the_concatenated_tokens() -> None:
    tokens = list(range(7, 7 + 5 * B))
    translator = HashTranslator(B)
    out = translator.translate("i", _batch(_stored(tokens[: 2 * B], [101, 102])))
    out += translator.translate("i", _batch(_stored(tokens[2 * B : 3 * B], [103], parent=102)))
    out += translator.translate("i", _batch(_stored(tokens[3 * B :], [104, 105], parent=103)))
    assert _hashes(out) == list(hash_blocks(tokens, B).full)
    assert all(isinstance(e, BlockStored) and e.instance_id == "i" for e in out)
    translator.check_integrity()


def test_a_vllm_block_of_k_halfmoon_blocks_maps_to_k_hashes() -> None:
    tokens = list(range(3 * 2 * B))
    translator = HashTranslator(B)
    out = translator.translate("i", _batch(_stored(tokens[: 4 * B], [1, 2], block_size=2 * B)))
    out += translator.translate("i", _batch(_stored(tokens[4 * B :], [3], 2, block_size=2 * B)))
    assert _hashes(out) == list(hash_blocks(tokens, B).full)
    evicted = translator.translate("i", _batch(VllmBlockRemoved((2,), "GPU")))
    assert _hashes(evicted) == list(hash_blocks(tokens, B).full[2:4])
    translator.check_integrity()


def test_a_removal_maps_back_to_the_stored_hashes() -> None:
    tokens = list(range(3 * B))
    translator = HashTranslator(B)
    stored = translator.translate("i", _batch(_stored(tokens, [11, 12, 13])))
    removed = translator.translate("i", _batch(VllmBlockRemoved((13, 11), "GPU")))
    assert removed == [
        BlockEvicted(h, TIER_DRAM, "i") for h in (stored[2].block_hash, stored[0].block_hash)
    ]
    assert translator.num_held("i") == 1
    assert translator.translate("i", _batch(VllmBlockRemoved((13, 99), "GPU"))) == []
    assert translator.skipped == {SKIP_UNKNOWN_REMOVAL: 2}
    translator.check_integrity()


def test_an_unknown_parent_is_skipped_and_counted_not_guessed() -> None:
    tokens = list(range(2 * B))
    translator = HashTranslator(B)
    assert translator.translate("i", _batch(_stored(tokens[B:], [2], parent=1))) == []
    # its child cannot be translated either, and a removal of it is unknown
    assert translator.translate("i", _batch(_stored(tokens[:B], [3], parent=2))) == []
    assert translator.translate("i", _batch(VllmBlockRemoved((2,), "GPU"))) == []
    assert translator.skipped == {SKIP_UNKNOWN_PARENT: 2, SKIP_UNKNOWN_REMOVAL: 1}
    assert translator.num_held("i") == 0
    # the parent of another instance does not count
    translator.translate("j", _batch(_stored(tokens[:B], [1])))
    assert translator.translate("i", _batch(_stored(tokens[B:], [2], parent=1))) == []


def test_all_blocks_cleared_evicts_everything_the_instance_held() -> None:
    tokens = list(range(3 * B))
    translator = HashTranslator(B)
    held = translator.translate("i", _batch(_stored(tokens, [1, 2, 3])))
    other = translator.translate("j", _batch(_stored(tokens[:B], [1])))
    out = translator.translate("i", _batch(VllmAllBlocksCleared(), _stored(tokens[:B], [7])))
    assert out[:3] == [BlockEvicted(e.block_hash, TIER_DRAM, "i") for e in held]
    assert out[3:] == [BlockStored(held[0].block_hash, TIER_DRAM, "i")]  # stored after the reset
    assert translator.num_held("i") == 1 and translator.num_held("j") == 1
    assert translator.translate("j", PublisherRestarted(last_seq=9, seq=0)) == [
        BlockEvicted(other[0].block_hash, TIER_DRAM, "j")
    ]
    translator.check_integrity()


def test_a_block_held_twice_is_stored_once_and_evicted_when_the_last_holding_goes() -> None:
    tokens = list(range(B))
    translator = HashTranslator(B)
    first = translator.translate("i", _batch(_stored(tokens, [5])))
    assert translator.translate("i", _batch(_stored(tokens, [5]))) == []  # announced again
    cpu = VllmBlockStored((5,), None, tuple(tokens), B, medium="CPU")
    assert translator.translate("i", _batch(cpu)) == []  # GPU and CPU are both dram
    assert translator.translate("i", _batch(VllmBlockRemoved((5,), "GPU"))) == []
    assert translator.translate("i", _batch(VllmBlockRemoved((5,), "CPU"))) == [
        BlockEvicted(first[0].block_hash, TIER_DRAM, "i")
    ]
    translator.check_integrity()


def test_the_cache_salt_roots_the_chain_like_halfmoon_salts() -> None:
    tokens = list(range(2 * B))
    translator = HashTranslator(B)
    out = translator.translate("i", _batch(_stored(tokens, [1, 2], extra_keys=(("t",), None))))
    assert _hashes(out) == list(hash_blocks(tokens, B, chain_root("t")).full)


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (_stored(range(B), [1], lora_name="adapter", lora_id=1), SKIP_LORA),
        (_stored(range(B), [1], group_idx=1), SKIP_OTHER_GROUP),
        (_stored(range(B), [1], extra_keys=((("mm-0", 0),),)), SKIP_EXTRA_KEYS),
        (
            _stored(range(B), [1], 9, extra_keys=(("salt",),)),
            SKIP_EXTRA_KEYS,
        ),  # salt not on block 0
        (_stored(range(8), [1], block_size=8), SKIP_BLOCK_SIZE),
        (_stored(range(B), [1], locality="REMOTE"), SKIP_REMOTE),
        (_stored(range(2 * B), [1]), SKIP_TOKEN_COUNT),  # a masked block: tokens, no hash
        (VllmBlockStored((1,), None, tuple(range(B)), B, medium="NVME"), SKIP_MEDIUM),
        (VllmUnknownEvent("BlockUpdated"), SKIP_UNKNOWN_EVENT),
    ],
)
def test_what_cannot_be_translated_is_skipped_with_its_reason(event, reason: str) -> None:
    translator = HashTranslator(B)
    assert translator.translate("i", _batch(event)) == []
    assert translator.skipped == {reason: 1}


def test_one_vllm_hash_with_two_token_chains_is_a_conflict() -> None:
    translator = HashTranslator(B)
    translator.translate("i", _batch(_stored(range(B), [1])))
    assert translator.translate("i", _batch(_stored(range(1, B + 1), [1]))) == []
    assert translator.skipped == {SKIP_CONFLICT: 1}
    translator.check_integrity()


# -- decoding refuses what is not a batch ------------------------------------------------------
def _payload(events: list, *rest) -> bytes:
    return msgpack.packb([1.5, events, *rest], use_bin_type=True)


STORED = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
          "token_ids": list(range(B)), "block_size": B, "lora_id": None, "medium": "GPU",
          "lora_name": None}  # fmt: skip


@pytest.mark.parametrize(
    ("frames", "match"),
    [
        ([b"", b"\0" * 8], "3 frames"),
        ([b"", b"\0" * 4, _payload([])], "8 bytes"),
        ([b"\xff", b"\0" * 8, _payload([])], "UTF-8"),
        ([b"", b"\0" * 8, b"\xc1"], "not msgpack"),
        ([b"", b"\0" * 8, msgpack.packb({"ts": 1.0, "events": []})], "expected an array"),
        ([b"", b"\0" * 8, msgpack.packb(["now", []])], "ts must be a number"),
        ([b"", b"\0" * 8, _payload([[1, 2]])], "an event is a map"),
        ([b"", b"\0" * 8, _payload([{"block_hashes": [1]}])], "string 'type'"),
        ([b"", b"\0" * 8, _payload([{**STORED, "token_ids": [-1]}])], "token_ids"),
        ([b"", b"\0" * 8, _payload([{**STORED, "block_hashes": [True]}])], "block hash"),
        ([b"", b"\0" * 8, _payload([{**STORED, "block_size": 0}])], "block_size"),
        ([b"", b"\0" * 8, _payload([{"type": "BlockStored", "block_hashes": [1]}])], "missing"),
        ([b"", b"\0" * 8, _payload([{"type": "BlockRemoved", "medium": 3}])], "missing"),
        ([b"", b"\0" * 8, _payload([], "rank")], "data_parallel_rank"),
    ],
)
def test_a_malformed_message_is_refused_naming_the_part(frames: list, match: str) -> None:
    with pytest.raises(KVEventError, match=match):
        decode_frames(frames)


def test_unknown_event_types_and_keys_are_kept_out_of_the_way() -> None:
    batch = decode_payload(_payload([{"type": "BlockUpdated"}, {**STORED, "new_field": [1]}]), 7)
    assert batch.seq == 7 and batch.data_parallel_rank is None
    assert batch.events[0] == VllmUnknownEvent("BlockUpdated")
    assert batch.events[1] == VllmBlockStored((1,), None, tuple(range(B)), B, medium="GPU")


# -- the subscriber over a real local PUB/SUB pair ---------------------------------------------
TOPIC = "kv@vllm-0"


def _frames(seq: int, tokens: list[int] | None = None, topic: str = TOPIC) -> list[bytes]:
    """One batch as vLLM publishes it (a store of one block hashed ``seq + 1``)."""
    events = [] if tokens is None else [{**STORED, "block_hashes": [seq + 1], "token_ids": tokens}]
    return [topic.encode(), seq.to_bytes(8, "big"), _payload(events, 0)]


@pytest.fixture
def pub() -> Iterator[tuple[zmq.Socket, str]]:
    sock = zmq.Context.instance().socket(zmq.PUB)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(linger=0)


def _join(pub: zmq.Socket, sub: KVEventSubscriber) -> None:
    """Publish on a longer topic (the SUB's prefix filter lets it in, its exact check
    drops it) until the subscription has reached the PUB."""
    deadline = time.monotonic() + 5
    while sub.stats.num_other_topic == 0:
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        pub.send_multipart(_frames(0, topic=TOPIC + "-warmup"))
        assert sub.poll(0.05) == []


def _collect(sub: KVEventSubscriber, num_items: int) -> list:
    items: list = []
    deadline = time.monotonic() + 5
    while len(items) < num_items and time.monotonic() < deadline:
        items += sub.poll(0.05)
    return items


def test_the_subscriber_receives_in_order_and_counts_a_gap_and_a_restart(pub) -> None:
    sock, endpoint = pub
    with KVEventSubscriber(endpoint, topic=TOPIC) as sub:
        _join(sock, sub)
        for seq in (0, 1, 4):
            sock.send_multipart(_frames(seq, list(range(B))))
        items = _collect(sub, 3)
        assert [b.seq for b in items] == [0, 1, 4]
        assert (sub.stats.num_gaps, sub.stats.num_missed_batches) == (1, 2)
        sock.send_multipart(_frames(0))  # a new publisher process
        items = _collect(sub, 2)
        assert items[0] == PublisherRestarted(last_seq=4, seq=0)
        assert isinstance(items[1], VllmEventBatch) and items[1].seq == 0
        assert sub.stats.num_restarts == 1 and sub.stats.num_batches == 4


def test_a_bound_subscriber_takes_a_connecting_publisher() -> None:
    """vLLM's PUB connects when its endpoint is not a wildcard. A bound SUB subscribes a
    connecting peer only while it is polled (what ``_join`` does): batches published
    before that are dropped by the PUB, which is what the sequence gap is for."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with KVEventSubscriber(endpoint, topic=TOPIC, bind=True) as sub:
        sock = zmq.Context.instance().socket(zmq.PUB)
        try:
            sock.connect(endpoint)
            _join(sock, sub)
            sock.send_multipart(_frames(0, list(range(B))))
            assert [b.seq for b in _collect(sub, 1)] == [0]
        finally:
            sock.close(linger=0)


def test_a_replay_that_does_not_answer_counts_the_gap_and_moves_on(pub) -> None:
    sock, endpoint = pub
    silent = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    with KVEventSubscriber(
        endpoint, topic=TOPIC, replay_endpoint=silent, replay_timeout_s=0.1
    ) as sub:
        _join(sock, sub)
        sock.send_multipart(_frames(2))
        assert [b.seq for b in _collect(sub, 1)] == [2]
        assert (sub.stats.num_replay_timeouts, sub.stats.num_missed_batches) == (1, 2)


class FakeReplay:
    """vLLM's replay ROUTER (``ZmqEventPublisher._service_replay``) over ``batches``, on
    its own thread; the socket is closed when the thread stops."""

    def __init__(self, batches: dict[int, list[bytes]]) -> None:
        self.batches = batches
        self.asked: list[int] = []
        self._stop = threading.Event()
        self._port: queue.Queue[int] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        self.endpoint = f"tcp://127.0.0.1:{self._port.get(timeout=5)}"

    def _serve(self) -> None:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        try:
            self._port.put(sock.bind_to_random_port("tcp://127.0.0.1"))
            while not self._stop.is_set():
                if not sock.poll(20):
                    continue
                client, _, start = sock.recv_multipart()
                self.asked.append(int.from_bytes(start, "big"))
                for seq in sorted(s for s in self.batches if s >= self.asked[-1]):
                    sock.send_multipart([client, b"", *self.batches[seq]])
                sock.send_multipart([client, b"", b"", END_SEQ, b""])
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture
def replay() -> Iterator[FakeReplay]:
    # the buffer lost seq 0; seq 1..2 are there (and 3, which arrives live too)
    fake = FakeReplay({seq: _frames(seq, list(range(seq, seq + B))) for seq in (1, 2, 3)})
    try:
        yield fake
    finally:
        fake.close()


def test_a_gap_is_filled_from_the_replay_socket_in_order(pub, replay: FakeReplay) -> None:
    sock, endpoint = pub
    with KVEventSubscriber(endpoint, topic=TOPIC, replay_endpoint=replay.endpoint) as sub:
        _join(sock, sub)
        sock.send_multipart(_frames(3, list(range(3, 3 + B))))
        items = _collect(sub, 3)
    assert replay.asked == [0]
    assert [b.seq for b in items] == [1, 2, 3]
    assert (sub.stats.num_replayed_batches, sub.stats.num_missed_batches) == (2, 1)
    assert sub.stats.num_replay_timeouts == 0
    # replayed batches translate like live ones (each stores a one-block prompt here)
    translator = HashTranslator(B)
    out = [e for b in items for e in translator.translate("vllm-0", b)]
    assert _hashes(out) == [hash_blocks(range(s, s + B), B).full[0] for s in (1, 2, 3)]
