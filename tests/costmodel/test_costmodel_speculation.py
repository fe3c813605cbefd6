"""Speculative decoding in the decode-step estimates (``halfmoon.costmodel.speculation``):
the rates, the step of a speculating batch, and the rates of a worker's recent steps."""

import pytest

from halfmoon.costmodel.decode_guard import decode_step_estimate_s
from halfmoon.costmodel.serving import ServingTerms
from halfmoon.costmodel.speculation import NO_SPECULATION, RecentSpeculation, SpeculationRates


def engine(batch: int, context: int) -> float:
    """A one-token step: 10 ms, 2 ms a row, 1 us a context token."""
    return 0.01 + 0.002 * batch + 1e-6 * context


def test_rates_are_checked_and_parsed_with_errors_naming_the_problem():
    assert SpeculationRates.parse("2.5,1.8") == SpeculationRates(2.5, 1.8)
    assert not NO_SPECULATION.speculates and SpeculationRates(1.5, 1.0).speculates
    for text, error in (
        ("2.5", "expected ROWS,TOKENS"),
        ("a,b", "two numbers"),
        ("0.5,0.5", "rows_per_seq must be a finite number >= 1"),
        ("2,nan", "tokens_per_step must be a finite number >= 1"),
        ("2,3", r"tokens_per_step \(3\) cannot exceed rows_per_seq \(2\)"),
    ):
        with pytest.raises(ValueError, match=error):
            SpeculationRates.parse(text)


def test_rates_from_counts():
    # 100 sequence-steps checked 150 drafts and kept 80 of them
    assert SpeculationRates.from_counts(100, 150, 80) == SpeculationRates(2.5, 1.8)
    assert SpeculationRates.from_counts(0, 5, 5) is NO_SPECULATION
    assert SpeculationRates.from_counts(10, 0, 0) == NO_SPECULATION
    # more accepted than checked (counters read at different moments) is capped
    assert SpeculationRates.from_counts(10, 5, 9) == SpeculationRates(1.5, 1.5)


def test_a_speculating_step_is_the_step_of_its_rows():
    """b sequences checking r - 1 drafts each: the one-token step of b * r rows over r
    times the context, interpolated between whole row counts."""
    assert NO_SPECULATION.step_s(engine, 4, 1000) == engine(4, 1000)
    assert SpeculationRates(3.0, 2.0).step_s(engine, 4, 1000) == engine(12, 3000)
    half = SpeculationRates(2.5, 1.5).step_s(engine, 3, 1000)  # 7.5 rows
    assert half == pytest.approx((engine(7, 2500) + engine(8, 2500)) / 2, rel=1e-12)
    assert SpeculationRates(2.5, 1.5).step_s(engine, 0, 0) == engine(0, 0)
    # never below the plain step: more rows, more context
    for b in (1, 2, 7, 33):
        for rates in (SpeculationRates(1.1, 1.0), SpeculationRates(4.0, 3.0)):
            assert rates.step_s(engine, b, 500 * b) >= engine(b, 500 * b)
    assert SpeculationRates(2.5, 2.0).per_token_s(0.05) == 0.025


def test_the_step_estimate_counts_the_rows_and_the_serving_terms_per_sequence():
    serving = ServingTerms(decode_step_overhead_s=0.002, decode_per_seq_overhead_s=0.0005)
    rates = SpeculationRates(3.0, 2.0)
    got = decode_step_estimate_s(engine, serving, 4, 1000, speculation=rates)
    assert got == pytest.approx(engine(12, 3000) + 0.002 + 4 * 0.0005)
    assert decode_step_estimate_s(engine, serving, 0, 0, speculation=rates) == 0.0
    plain = decode_step_estimate_s(engine, serving, 4, 1000)
    assert plain == decode_step_estimate_s(engine, serving, 4, 1000, speculation=NO_SPECULATION)
    assert got > plain


def test_recent_rates_follow_the_last_window_of_sequence_steps():
    recent = RecentSpeculation(window_steps=150)
    assert recent.rates is NO_SPECULATION
    recent.update(0, 0, 0)
    assert recent.rates is NO_SPECULATION  # no step yet
    recent.update(50, 150, 100)  # copying: 3 drafts a step, 2 kept
    assert recent.rates == SpeculationRates(4.0, 3.0)
    recent.update(50, 150, 100)  # idle: the last rates stay
    assert recent.rates == SpeculationRates(4.0, 3.0)
    recent.update(150, 150, 100)  # then 100 steps without drafts
    assert recent.rates == SpeculationRates(1.0 + 150 / 150, 1.0 + 100 / 150)
    recent.update(250, 160, 100)  # the copying steps are out of the window now
    assert recent.rates == SpeculationRates(1.0 + 10 / 200, 1.0)
    recent.update(10, 20, 10)  # counters went back (a restarted engine): start over
    assert recent.rates == SpeculationRates(1.0 + 10 / 200, 1.0)  # nothing new yet
    recent.update(20, 40, 20)
    assert recent.rates == SpeculationRates(3.0, 2.0)
    with pytest.raises(ValueError, match="window_steps"):
        RecentSpeculation(0)
