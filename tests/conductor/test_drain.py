"""Draining an instance: the Conductor stops placing on it and says when it is idle."""

from __future__ import annotations

import pytest

from halfmoon.core.request import Request


def test_a_drained_instance_gets_no_new_work_and_is_busy_until_its_requests_end(
    make_conductor,
) -> None:
    conductor = make_conductor(num_prefill=2, num_decode=2)
    first = Request("a", 0.0, 1600, 8, tuple(range(100)), 16)
    decision = conductor.schedule(first)
    prefill_id, decode_id = decision.prefill.instance_id, decision.decode.instance_id
    conductor.drain(prefill_id)
    conductor.drain(decode_id)
    assert conductor.busy(prefill_id) and conductor.busy(decode_id)
    assert prefill_id not in conductor.prefill_instances
    again = conductor.schedule(Request("b", 0.0, 1600, 8, tuple(range(100)), 16))
    assert again.prefill.instance_id != prefill_id and again.decode.instance_id != decode_id
    assert again.prefill.cache_source != prefill_id  # nor a source of prefixes
    conductor.release("a")
    assert not conductor.busy(prefill_id) and not conductor.busy(decode_id)
    conductor.remove_instance(prefill_id)
    assert prefill_id not in conductor.draining
    with pytest.raises(KeyError):
        conductor.drain("P9")
