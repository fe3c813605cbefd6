"""Record real vLLM KV-event batches (README.md here says when and with which vLLM).

Run with the vLLM venv, never by the tests::

    .venv-vllm/bin/python tests/data/vllm_kv_events/make_fixture.py

vLLM's own block pool (``BlockPool``, 16-token blocks, SHA-256 block hashes with the
default seed) caches, evicts and resets blocks of real ``Request`` objects; its events go
through vLLM's own ``ZmqEventPublisher`` (PUB connecting to a SUB bound here, topic
``kv@vllm-0``, a replay ROUTER) and the frames received are written, with what vLLM's
event objects held (``expected``), to ``int_hashes.msgpack`` (the default 64-bit int
hashes) and ``bytes_hashes.msgpack`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).

The batches (one per scheduler step in vLLM; here one per step of this script):
  0. prompt A (40 tokens): its 2 full blocks stored, parent None
  1. A grows to 48 tokens (decode): block 2 stored, parent = block 1's hash
  2. prompt B (16 tokens, A's first 16) with cache_salt "tenant-a": 1 block stored
  3. A and B freed, 5 blocks taken: the 4 cached blocks evicted (4 BlockRemoved)
  4. prompt C (32 tokens) stored, then freed, then the prefix cache reset
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import msgspec
import zmq

HERE = Path(__file__).parent
TOPIC = "kv@vllm-0"
BLOCK = 16


def _fields(event) -> dict:
    out = {"type": type(event).__name__}
    out.update({name: getattr(event, name) for name in event.__struct_fields__})
    if out.get("extra_keys") is not None:
        out["extra_keys"] = [None if k is None else list(k) for k in out["extra_keys"]]
    return out


def _steps() -> list[list]:
    """The events of each step, from vLLM's block pool."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    pool = BlockPool(6, enable_caching=True, hash_block_size=BLOCK, enable_kv_cache_events=True)

    def request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
        return Request(rid, tokens, SamplingParams(max_tokens=8), None, cache_salt=salt,
                       block_hasher=hasher)  # fmt: skip

    def cache(req: Request, blocks: list, first: int, last: int) -> None:
        pool.cache_full_blocks(req, blocks, first, last, BLOCK, 0)

    def take() -> list:
        events = pool.take_events()
        for ev in events:  # what KVCacheManager.take_events adds for a full-attention group
            if type(ev).__name__ == "BlockStored":
                ev.kv_cache_spec_kind = "full_attention"
        return events

    prompt_a = list(range(1000, 1040))
    a = request("A", prompt_a)
    blocks_a = pool.get_new_blocks(3)
    cache(a, blocks_a, 0, 2)
    steps = [take()]
    a.append_output_token_ids(list(range(2000, 2008)))
    cache(a, blocks_a, 2, 3)
    steps.append(take())
    b = request("B", prompt_a[:BLOCK], salt="tenant-a")
    blocks_b = pool.get_new_blocks(1)
    cache(b, blocks_b, 0, 1)
    steps.append(take())
    pool.free_blocks(reversed(blocks_a))
    pool.free_blocks(blocks_b)
    taken = pool.get_new_blocks(5)
    steps.append(take())
    pool.free_blocks(taken)
    c = request("C", list(range(3000, 3032)))
    blocks_c = pool.get_new_blocks(2)
    cache(c, blocks_c, 0, 2)
    pool.free_blocks(blocks_c)
    assert pool.reset_prefix_cache()
    steps.append(take())
    return steps


def _record(name: str) -> None:
    import vllm
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    with socket.socket() as probe:  # a free port for vLLM's replay ROUTER to bind
        probe.bind(("127.0.0.1", 0))
        replay_port = probe.getsockname()[1]
    publisher = ZmqEventPublisher(
        data_parallel_rank=0, endpoint=f"tcp://127.0.0.1:{port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic=TOPIC,
    )  # fmt: skip
    # The PUB connects out to this bound SUB; the SUB sends its subscription only once it
    # has processed the new connection, i.e. while it is polled (a SUB left alone here
    # never subscribes and every batch is dropped by the PUB).
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        sub.poll(50)
    steps = _steps()
    batches = [KVEventBatch(ts=time.time(), events=events) for events in steps]
    for batch in batches:
        publisher.publish(batch)
    live = []
    while len(live) < len(batches) and sub.poll(5000):
        live.append(sub.recv_multipart())
    assert len(live) == len(batches), f"received {len(live)} of {len(batches)} batches"
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (3).to_bytes(8, "big")])
    replay = []
    while dealer.poll(5000):
        replay.append(dealer.recv_multipart())
        if replay[-1][2] == ZmqEventPublisher.END_SEQ:
            break
    publisher.shutdown()
    sub.close(linger=0)
    dealer.close(linger=0)
    expected = [
        {"seq": i, "ts": b.ts, "data_parallel_rank": b.data_parallel_rank,
         "events": [_fields(ev) for ev in b.events]}
        for i, b in enumerate(batches)
    ]  # fmt: skip
    doc = {
        "vllm_version": vllm.__version__,
        "hash_mode": name,
        "topic": TOPIC,
        "live": live,
        "replay_from_3": replay,
        "expected": expected,
    }
    path = HERE / f"{name}.msgpack"
    path.write_bytes(msgspec.msgpack.encode(doc))  # the vLLM venv has msgspec, not msgpack
    print(f"wrote {path} ({path.stat().st_size} bytes): {len(live)} batches, "
          f"{len(replay)} replay messages, vLLM {vllm.__version__}")  # fmt: skip


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else None
    if mode is None:  # one process per hash mode: vLLM reads the variable at import
        import subprocess

        for name, flag in (("int_hashes", "1"), ("bytes_hashes", "0")):
            env = {**os.environ, "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": flag}
            env.pop("PYTHONHASHSEED", None)
            subprocess.run([sys.executable, __file__, name], env=env, check=True)
    else:
        _record(mode)
