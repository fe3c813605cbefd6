"""vLLM's sleep mode, level 1, in the engine (``LLMEngine.sleep`` / ``wake_up``): the KV
pool's memory is given back (a fresh process's resident memory drops by it) and every cached
prefix forgotten; asleep, the engine takes no request and no block is read or written;
awake, it computes what it computed before."""

from __future__ import annotations

import subprocess
import sys

import pytest
from engine_testlib import engine_config

from halfmoon.core.errors import HalfmoonError
from halfmoon.core.request import SamplingParams
from halfmoon.engine.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


#: Run in a fresh process (as a worker is): this test process's heap, after hours of
#: other tests, may serve the pool from memory it already holds, which then stays its.
RESIDENT = """
import sys
from halfmoon.engine.engine import LLMEngine
from halfmoon.engine.config import EngineConfig

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096

engine = LLMEngine(EngineConfig(model=sys.argv[1], kv_cache_mb=64.0, num_threads=1))
engine.generate([[5, 6, 7] * 20])
before = resident()
freed = engine.sleep()
asleep = resident()
engine.wake_up()
print(freed, before - asleep, resident() - asleep)
"""


@pytest.mark.slow  # a subprocess
def test_the_released_pool_goes_back_to_the_system(tiny_dir):
    out = subprocess.run([sys.executable, "-c", RESIDENT, str(tiny_dir)], capture_output=True,
                         text=True, timeout=300, check=True)  # fmt: skip
    freed, dropped, regained = (int(v) for v in out.stdout.split()[-3:])
    assert freed == 64 * 2**20
    assert dropped > 0.9 * freed and regained > 0.9 * freed, out.stdout


def test_sleep_gives_the_pool_back_and_waking_serves_as_before(tiny_dir, prompts):
    engine = LLMEngine(engine_config(tiny_dir, kv_cache_mb=64.0))
    batch = prompts(3, [40, 70], engine.model_config.vocab_size)
    before = [list(o.token_ids) for o in engine.generate(batch, GREEDY)]
    assert engine.stats().num_cached_blocks > 0
    freed = engine.sleep()
    assert freed == 64 * 2**20 and engine.kv_cache.pool.nbytes == 0
    assert all(t.untyped_storage().nbytes() == 0 for t in engine.kv_cache._tensors())
    assert engine.sleeping and engine.sleep() == 0  # (asleep already)
    assert engine.stats().num_cached_blocks == 0
    with pytest.raises(HalfmoonError, match="sleeps"):
        engine.add_request("r", batch[0], GREEDY)
    with pytest.raises(HalfmoonError, match="released"):
        engine.kv_cache.export_blocks([0])
    with pytest.raises(HalfmoonError, match="released"):
        engine.kv_cache.layer(0)
    engine.wake_up()
    pool = engine.kv_cache.pool
    assert not engine.sleeping and pool.nbytes == freed and float(pool.abs().sum()) == 0.0
    assert engine.kv_cache.layer(1)[0].data_ptr() > pool.data_ptr()  # (views re-pointed)
    again = [list(o.token_ids) for o in engine.generate(batch, GREEDY)]
    assert again == before
    engine.check_integrity()


def test_a_pool_lent_as_numpy_bytes_is_released_too(tiny_dir):
    """The prefill worker streams KV as numpy-backed views of the pool, which makes its
    storage unresizable: the release re-points the pool's tensors instead."""
    engine = LLMEngine(engine_config(tiny_dir))
    keys, _ = engine.kv_cache.layer_bytes(0, [0, 1])
    del keys
    assert not engine.kv_cache.pool.untyped_storage().resizable()
    assert engine.sleep() > 0
    engine.wake_up()
    assert engine.kv_cache.export_blocks([0]).abs().sum() == 0


def test_an_engine_with_requests_does_not_sleep(tiny_dir, prompts):
    engine = LLMEngine(engine_config(tiny_dir))
    (prompt,) = prompts(4, [20], engine.model_config.vocab_size)
    engine.add_request("running", prompt, GREEDY)
    engine.step()
    with pytest.raises(HalfmoonError, match="1 requests are in the engine"):
        engine.sleep()
    assert not engine.sleeping
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.sleep() > 0
    engine.wake_up()
    engine.wake_up()  # (awake already: nothing happens)
    assert not engine.sleeping
