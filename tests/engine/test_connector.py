"""The engine connector (``halfmoon/engine/connector.py``): what serving does with an
engine, in host bytes, gives exactly what the engine's own paths give."""

from __future__ import annotations

import pytest

from halfmoon.core.events import BlockEvicted, BlockStored
from halfmoon.core.request import SamplingParams
from halfmoon.engine.config import EngineConfig
from halfmoon.engine.connector import HandoffState, LocalConnector

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(i * 37) % 4000 + 10 for i in range(70)]  # 4 full 16-token blocks and a tail


@pytest.fixture(scope="module")
def pair() -> tuple[LocalConnector, LocalConnector]:
    # Small chunks: the prompt takes several steps, the hook must wait for the last one.
    config = EngineConfig(model="tiny", kv_cache_mb=16, num_threads=1, prefill_chunk_tokens=32)
    return LocalConnector.create(config), LocalConnector.create(config)


def _finish(connector: LocalConnector, rid: str):
    last = None
    while connector.has_unfinished_requests():
        for out in connector.step():
            if out.request_id == rid:
                last = out
    return last


def _reference(connector: LocalConnector, rid: str, prompt=PROMPT, params=GREEDY):
    connector.add_request(rid, prompt, params)
    return _finish(connector, rid)


def test_prompt_kv_hook_sees_the_whole_prompt_once_per_layer(pair) -> None:
    a, b = pair
    seen: dict[int, tuple[bytes, bytes]] = {}

    def hook(rid: str, layer: int, keys: list[memoryview], values: list[memoryview]) -> None:
        assert rid == "p1" and layer not in seen
        seen[layer] = (b"".join(bytes(k) for k in keys), b"".join(bytes(v) for v in values))

    a.set_prompt_kv_hook(hook)
    try:
        first_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        a.add_request("p1", PROMPT, first_only, keep_kv=True)
        first = _finish(a, "p1")
    finally:
        a.set_prompt_kv_hook(None)
    layout = a.layout
    assert sorted(seen) == list(range(layout.num_layers))
    # The hook's bytes are the export layout [L, 2, n, B, H, D], layer by layer, K then V.
    n = -(-len(PROMPT) // layout.block_size)
    exported = b"".join(bytes(a.block_bytes("p1", i)) for i in range(n))
    per_block_layer = layout.bytes_per_block // (2 * layout.num_layers)
    for layer, (keys, values) in seen.items():
        assert len(keys) == len(values) == n * per_block_layer
        for i in range(n):
            block = exported[i * layout.bytes_per_block : (i + 1) * layout.bytes_per_block]
            k = block[2 * layer * per_block_layer : (2 * layer + 1) * per_block_layer]
            v = block[(2 * layer + 1) * per_block_layer : (2 * layer + 2) * per_block_layer]
            assert keys[i * per_block_layer : (i + 1) * per_block_layer] == k
            assert values[i * per_block_layer : (i + 1) * per_block_layer] == v

    # The handoff: state from A, the streamed bytes into B, the same tokens as one engine.
    state = a.take_handoff("p1")
    assert state == HandoffState("p1", (*PROMPT, first.new_token_ids[0]), len(PROMPT),
                                 len(PROMPT), state.seed, None)  # fmt: skip
    # What a decode worker's region holds once every layer streamed in: [L, 2, n, ...].
    kv = b"".join(keys + values for keys, values in (seen[i] for i in range(layout.num_layers)))
    b.import_request(state, GREEDY, memoryview(kv))
    continued = _finish(b, "p1")
    reference = _reference(a, "ref1")
    assert continued.token_ids == reference.token_ids
    a.check_integrity()
    b.check_integrity()


def test_seeded_prefix_is_reused_and_gives_the_same_tokens(pair) -> None:
    a, b = pair
    prompt = [(i * 53) % 4000 + 7 for i in range(70)]
    a.add_request("s1", prompt, GREEDY, keep_kv=True)
    reference = _finish(a, "s1")
    payloads = [a.block_bytes("s1", i) for i in range(4)]
    a.take_handoff("s1")
    assert b.cached_prefix_blocks(prompt, None) == 0
    assert b.seed_prefix(prompt, 1, payloads[1:], None) == 0  # B lacks block 0: no guess
    assert b.seed_prefix(prompt, 0, payloads[:2], None) == 2
    assert b.seed_prefix(prompt, 2, payloads[2:], None) == 2
    assert b.cached_prefix_blocks(prompt, None) == 4
    assert b.cached_prefix_blocks(prompt, "tenant") == 0  # another tenant's chain
    out = _reference(b, "s2", prompt)
    assert out.num_cached_tokens == 64 and out.token_ids == reference.token_ids
    b.check_integrity()


def test_cache_listener_hears_stored_blocks(pair) -> None:
    a, _ = pair
    events: list = []
    a.set_cache_listener(events.append)
    try:
        _reference(a, "c1", [(i * 11) % 4000 + 3 for i in range(40)])
    finally:
        a.set_cache_listener(None)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) >= 2 and all(e.tier == "dram" and e.instance_id == "" for e in stored)
    assert all(isinstance(e, BlockStored | BlockEvicted) for e in events)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_pipeline_stages_give_the_engines_first_token(pair, num_stages: int) -> None:
    a, _ = pair
    prompt = [(i * 29) % 4000 + 5 for i in range(50)]
    reference = _reference(a, f"r{num_stages}", prompt)
    stages = [a.pipeline_stage(num_stages, s) for s in range(num_stages)]
    assert a.pipeline_stage(num_stages, 0) is stages[0]  # cached per split
    rid = f"cpp{num_stages}"
    chunk = 16
    for stage in stages:
        assert stage.start(rid, prompt, 0) == 0
    for lo in range(0, len(prompt), chunk):
        hi = min(lo + chunk, len(prompt))
        hidden = None
        for stage in stages:
            hidden = stage.run_chunk(rid, prompt, lo, hi, hidden, chunk)
            if hidden is not None:
                assert len(hidden) == chunk * stage.row_bytes  # padded to a whole slot
        assert hidden is None  # the last stage keeps its rows
    token, logprob, _seed, finish = stages[-1].sample_first(rid, prompt, GREEDY)
    assert token == reference.token_ids[0] and logprob is None and finish is None
    for stage in stages:
        stage.release(rid)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    with pytest.raises(Exception, match="no final hidden state"):
        stages[-1].sample_first(rid, prompt, one)


def test_a_profiler_session_records_the_stages_chunks(pair, tmp_path) -> None:
    """A pipeline stage's chunks are steps of the worker's profiler trace, each a range
    naming its layers and tokens (``/start_profile`` on a CPP group's member)."""
    import gzip
    import json

    from halfmoon.core.profiling import ProfilerConfig, ProfileSession

    a, _ = pair
    prompt = [(i * 31) % 4000 + 5 for i in range(40)]
    first, last = a.pipeline_stage(2, 0), a.pipeline_stage(2, 1)
    config = ProfilerConfig(str(tmp_path), torch_profiler_with_stack=False)
    a.start_profile(config, ProfileSession(), "prefill-0")
    for stage in (first, last):
        stage.start("prof", prompt, 0)
    for lo in (0, 32):
        hidden = first.run_chunk("prof", prompt, lo, min(lo + 32, 40), None, 32)
        last.run_chunk("prof", prompt, lo, min(lo + 32, 40), hidden, 32)
    for stage in (first, last):
        stage.release("prof")
    trace, _ = a.stop_profile()
    with gzip.open(trace, "rt") as f:
        names = [e["name"] for e in json.load(f)["traceEvents"]
                 if e.get("name", "").startswith("stage[")]  # fmt: skip
    half = first.layers.last - 1
    assert sorted(names) == sorted(
        [
            f"stage[layers 0-{half}, prefill 32]",
            f"stage[layers {half + 1}-{last.layers.last - 1}, prefill 32]",
            f"stage[layers 0-{half}, prefill 8]",
            f"stage[layers {half + 1}-{last.layers.last - 1}, prefill 8]",
        ]
    )
