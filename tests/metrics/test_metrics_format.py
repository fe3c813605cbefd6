from halfmoon.metrics.format import fmt_ms, fmt_num


def test_fmt_num_and_ms():
    assert fmt_num(None) == "-" and fmt_ms(None) == "-"
    assert fmt_num(1234567) == "1,234,567"
    assert fmt_num(0.12345) == "0.123" and fmt_num(2.5, 1) == "2.5"
    assert fmt_ms(0.0123) == "12.3"
