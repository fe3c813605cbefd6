"""A prefill worker's SSD tier, live: a corrupt block on the read path is recomputed,
never served, and counted on ``/metrics`` (issue #17: a prompt's blocks spill from the
prefill worker's DRAM tier to its SSD tier, one of them is damaged on disk, and the same
prompt comes back); blocks on disk outlive a restart of the cluster, and are served only
to the same weights."""

from __future__ import annotations

import re
import struct
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from halfmoon.core.hashing import hash_blocks
from halfmoon.store.journal import OP_PUT, read_journal
from halfmoon.store.ssd import DATA_FILE, JOURNAL_FILE

BLOCK = 16  # tokens per KV block (the default --block-size)
CORRUPT = 2  # which of the prompt's full blocks is damaged
PROMPT = [(i * 37) % 3000 + 10 for i in range(4 * BLOCK + 6)]  # 4 full blocks
# Two prompts of 44 engine blocks each: together they evict PROMPT from the prefill
# engine's 80-block pool (5 MiB), and their blocks push PROMPT's out of the 2-block
# DRAM tier onto the 128-block SSD tier (which keeps them all).
OTHERS = [[(i * k) % 3000 + 20 for i in range(700)] for k in (53, 71)]


def _spilling_args(ssd: Path, *extra: str, ssd_mb: int = 8) -> tuple[str, ...]:
    return (
        "--prefill", "1", "--decode", "1", "--kv-cache-mb", "5", "--store-dram-mb", "0.125",
        "--store-ssd-dir", str(ssd), "--store-ssd-mb", str(ssd_mb), *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def spilling(cluster_factory, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("ssd")
    return cluster_factory(*_spilling_args(ssd)), ssd / "prefill-0"


def _complete(cluster, prompt):
    client = openai.OpenAI(base_url=cluster.base_url + "/v1", api_key="none", max_retries=0)
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def _ssd_slots(directory: Path) -> tuple[dict[int, int], int]:
    """Block hash -> slot of every block on the SSD tier (replaying its journal), and the
    block size in bytes."""
    journal = directory / JOURNAL_FILE
    _, block_bytes, num_slots, namespace = struct.unpack_from("<8sQQ16s", journal.read_bytes())
    slots: dict[int, int] = {}
    for r in read_journal(str(journal), block_bytes, num_slots, namespace).records:
        if r.op == OP_PUT:
            slots[r.block_hash] = r.slot
        else:
            slots.pop(r.block_hash, None)
    return slots, block_bytes


def _corrupt_count(cluster) -> float:
    with urllib.request.urlopen(cluster.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(
        r'^halfmoon:kv_store_corrupt_blocks_total\{[^}]*worker="prefill-0"[^}]*\} ([0-9.e+]+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


def test_corrupt_ssd_block_is_recomputed_with_identical_output(spilling):
    cluster, ssd = spilling
    first, cached = _complete(cluster, PROMPT)
    assert cached == 0
    for other in OTHERS:
        _complete(cluster, other)
    slots, block_bytes = _ssd_slots(ssd)
    hashes = hash_blocks(PROMPT, BLOCK).full
    assert len(hashes) == 4 and all(h in slots for h in hashes)  # spilled to SSD
    with open(ssd / DATA_FILE, "r+b") as f:  # flip 64 bytes inside the block's payload
        offset = slots[hashes[CORRUPT]] * block_bytes + 100
        f.seek(offset)
        flipped = bytes(b ^ 0xFF for b in f.read(64))
        f.seek(offset)
        f.write(flipped)

    again, cached = _complete(cluster, PROMPT)
    assert again == first  # recomputed, not garbage
    assert cached == CORRUPT * BLOCK  # the blocks before the damaged one, nothing from it on
    deadline = time.monotonic() + 15  # load reports and the gateway's view: ~1 s behind
    while _corrupt_count(cluster) < 1 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _corrupt_count(cluster) == 1
    assert "failed its checksum" in cluster.log_path.read_text()
    pongs = cluster.ping_workers()
    assert all(p.integrity == "ok" for p in pongs)
    assert [p.stats["store_corrupt_blocks"] for p in pongs if p.role == "prefill"] == [1]


def test_blocks_on_disk_outlive_a_restart_for_the_same_weights_only(cluster_factory, tmp_path):
    """PROMPT spills to the SSD tier, the cluster stops; a cluster of the same weights
    started on the directory serves PROMPT's blocks from disk, one of other weights (the
    tiny preset of another seed: the same token hashes) recomputes them all. (512 blocks
    of SSD: the new weights' first start measures its cost profile, whose prompts go to
    the store too, and must not be what pushes PROMPT out.)"""
    first = cluster_factory(*_spilling_args(tmp_path, ssd_mb=32))
    text, _ = _complete(first, PROMPT)
    for other in OTHERS:
        _complete(first, other)
    slots, _ = _ssd_slots(tmp_path / "prefill-0")
    assert all(h in slots for h in hash_blocks(PROMPT, BLOCK).full)
    first.stop()

    same = cluster_factory(*_spilling_args(tmp_path, ssd_mb=32))
    assert _complete(same, PROMPT) == (text, 4 * BLOCK)  # from disk, the same answer
    same.stop()

    other_weights = cluster_factory(*_spilling_args(tmp_path, "--seed", "1", ssd_mb=32))
    _, cached = _complete(other_weights, PROMPT)
    assert cached == 0
    assert "KV blocks of other weights" in other_weights.log_path.read_text()
    _, cached = _complete(other_weights, PROMPT)
    assert cached > 0  # its own blocks are cached as usual
