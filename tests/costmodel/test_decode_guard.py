"""The decode TBT guard's rule, shared by the simulator and the live decode worker."""

import pytest

from halfmoon.costmodel.decode_guard import (
    ADMIT,
    DECODE_GUARDS,
    REJECT,
    WAIT,
    decode_guard_verdict,
    decode_step_estimate_s,
    guard_refusal,
)
from halfmoon.costmodel.serving import ServingTerms


@pytest.mark.parametrize(
    "guard,busy,step_s,verdict",
    [
        ("reject", True, 0.2, REJECT),
        ("wait", True, 0.2, WAIT),
        ("off", True, 0.2, ADMIT),
        ("reject", False, 0.2, ADMIT),  # a lone request is never refused for its own step
        ("wait", False, 0.2, ADMIT),
        ("reject", True, 0.1, ADMIT),  # at the SLO: within it
        ("wait", True, 0.05, ADMIT),
    ],
)
def test_the_verdict_compares_the_joined_step_with_the_slo(guard, busy, step_s, verdict):
    assert decode_guard_verdict(guard, busy=busy, step_s=step_s, tbt_slo_s=0.1) == verdict


def test_no_known_slo_admits_and_an_unknown_guard_is_named():
    assert decode_guard_verdict("reject", busy=True, step_s=9.0, tbt_slo_s=0.0) == ADMIT
    with pytest.raises(ValueError, match="unknown decode guard 'maybe'"):
        decode_guard_verdict("maybe", busy=True, step_s=0.0, tbt_slo_s=0.1)
    assert DECODE_GUARDS == ("reject", "wait", "off")


def test_the_step_estimate_adds_the_serving_terms():
    def engine(batch: int, context: int) -> float:
        return 0.01 + 0.001 * batch + 1e-6 * context

    serving = ServingTerms(decode_step_overhead_s=0.002, decode_per_seq_overhead_s=0.0005,
                           kv_import_s_per_token=1e-7)  # fmt: skip
    assert decode_step_estimate_s(engine, serving, 0, 500) == 0.0
    got = decode_step_estimate_s(engine, serving, 4, 1000, imported_tokens=200)
    assert got == pytest.approx(0.01 + 0.004 + 0.001 + 0.002 + 4 * 0.0005 + 200 * 1e-7)


def test_the_refusal_names_the_guard_the_step_and_the_slo():
    reason = guard_refusal("decode-0", 0.2345, 0.1)
    assert "decode-0" in reason and "~234.5ms" in reason and "100ms TBT SLO" in reason
    assert "decode guard 'reject'" in reason


def test_simulator_and_worker_share_the_choices():
    from halfmoon.serve.worker.main import DECODE_GUARDS as worker_choices
    from halfmoon.sim import DECODE_GUARDS as sim_choices

    assert sim_choices is DECODE_GUARDS and worker_choices is DECODE_GUARDS
