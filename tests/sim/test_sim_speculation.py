"""The simulator's decode instances speculating (``SimConfig.speculation``): steps cost
the rows the drafts add, each gives ``tokens_per_step`` tokens a request on average
(arriving together: one TBT gap a step), and the Conductor estimates with the same
rates."""

import pytest

from halfmoon.core.config import SLOConfig
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates


def test_a_speculating_request_by_hand(run_sim, make_request) -> None:
    """Three rows a sequence, two tokens a step: after its first token (the prefill's, at
    join), 9 tokens come in steps of 2, 2, 2, 2, 1; each step is the model's over three
    times the context (the throughput model's step depends on the context alone)."""
    rates = SpeculationRates(3.0, 2.0)
    result, sim = run_sim("1P1D", [make_request("r", 0.0, 4000, 10)], speculation=rates)
    (record,) = result.records
    assert len(record.token_times_s) == 10
    arrivals = sorted(set(record.token_times_s))
    assert [record.token_times_s.count(t) for t in arrivals] == [1, 2, 2, 2, 2, 1]
    steps = [0.0125 + 2.7e-8 * round(3.0 * (4000 + k)) for k in (1, 3, 5, 7, 9)]
    assert record.tbt_gaps_s == pytest.approx(steps, abs=1e-12)
    assert [s.speculation for s in sim.conductor._decode.values()] == [rates]  # noqa: SLF001
    plain, sim = run_sim("1P1D", [make_request("r", 0.0, 4000, 10)])
    assert len(plain.records[0].tbt_gaps_s) == 9
    assert [s.speculation for s in sim.conductor._decode.values()] == [NO_SPECULATION]  # noqa: SLF001
    assert record.finish_s < plain.records[0].finish_s


@pytest.mark.parametrize("rates", [SpeculationRates(2.6, 1.5), SpeculationRates(4.0, 3.7)])
def test_fractions_of_a_token_carry_over_and_no_request_overshoots(run_sim, make_request, rates):
    requests = [make_request(f"r{i}", 0.01 * i, 600 + 100 * i, 7 + 13 * i) for i in range(6)]
    result, _ = run_sim("1P2D", requests, speculation=rates)
    assert result.report["num_completed"] == 6
    for record, request in zip(
        sorted(result.records, key=lambda r: r.request_id), requests, strict=True
    ):
        assert len(record.token_times_s) == request.output_length
        steps = len(set(record.token_times_s)) - 1  # after the first token
        # ceil((n - 1) / tokens) steps, give or take the carried fraction
        expected = (request.output_length - 1) / rates.tokens_per_step
        assert expected - 1 <= steps <= expected + 1


def test_a_guard_blind_to_speculation_lets_steps_break_the_slo(run_sim, make_request) -> None:
    """Long requests on one decode instance whose steps read three times their context
    (three rows a sequence): the guard that knows it refuses what would break the 18 ms
    TBT SLO, and its steps stay within it (up to the context its batch grows by after
    the last admission); one blind to it (the estimates of a speculation-unaware
    scheduler) refuses far fewer and its steps overrun by half."""
    slo = SLOConfig(ttft_s=60.0, tbt_s=0.018, tbt_metric="top10mean")
    requests = [make_request(f"r{i}", 0.25 * i, 4000, 1000) for i in range(60)]
    rates = SpeculationRates(3.0, 2.0)
    aware, _ = run_sim("8P1D", requests, slo=slo, speculation=rates)
    blind, _ = run_sim("8P1D", requests, slo=slo, speculation=rates, speculation_blind=True)
    worst = {name: max(max(r.tbt_gaps_s, default=0.0) for r in result.records)
             for name, result in (("aware", aware), ("blind", blind))}  # fmt: skip
    refused = {name: result.report["num_refused_after_prefill"]
               for name, result in (("aware", aware), ("blind", blind))}  # fmt: skip
    assert refused["aware"] > 3 * refused["blind"]
    assert worst["aware"] <= 0.019 < 0.025 < worst["blind"]
