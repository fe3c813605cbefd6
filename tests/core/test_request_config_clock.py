import pytest

from halfmoon.core import IdGenerator, ManualClock, Request, SamplingParams
from halfmoon.core.config import SLOConfig


def test_request_validates_hash_count():
    Request("r", 0.0, input_length=1025, output_length=1, block_hashes=(1, 2, 3))
    with pytest.raises(ValueError, match="expected 3"):
        Request("r", 0.0, input_length=1025, output_length=1, block_hashes=(1, 2))
    with pytest.raises(ValueError, match="input_length"):
        Request("r", 0.0, input_length=0, output_length=1)


def test_request_full_blocks():
    r = Request("r", 0.0, input_length=40, output_length=1, block_size_tokens=16)
    assert r.num_full_blocks == 2


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ],
)
def test_sampling_params_errors(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kwargs)


def test_slo_config():
    assert SLOConfig().tbt_metric == "top10mean"
    with pytest.raises(ValueError, match="unknown tbt metric"):
        SLOConfig(tbt_metric="p50")
    with pytest.raises(ValueError, match="positive"):
        SLOConfig(ttft_s=0)


def test_manual_clock_and_ids():
    clock = ManualClock()
    clock.advance(1.5)
    clock.advance_to(2.0)
    assert clock.now() == 2.0
    with pytest.raises(ValueError):
        clock.advance_to(1.0)
    gen = IdGenerator("p")
    assert [gen.next(), gen.next()] == ["p-0", "p-1"]


def test_logprobs_option_is_bounded_and_survives_the_wire():
    from halfmoon.core.request import TokenLogprob
    from halfmoon.serve.control.messages import (
        logprobs_from_wire,
        logprobs_to_wire,
        params_from_wire,
        params_to_wire,
    )

    for bad in (-1, 21):
        with pytest.raises(ValueError, match="logprobs must be in"):
            SamplingParams(logprobs=bad)
    for value in (None, 0, 20):
        params = SamplingParams(max_tokens=3, logprobs=value, seed=4)
        assert params_from_wire(params_to_wire(params)) == params
    penalised = SamplingParams(presence_penalty=-0.5, frequency_penalty=2, repetition_penalty=1.2)
    assert penalised.has_penalties and not SamplingParams().has_penalties
    assert params_from_wire(params_to_wire(penalised)) == penalised
    biased = SamplingParams(logit_bias=((5, 100.0), (9, -2.5)))
    assert params_from_wire(params_to_wire(biased)) == biased
    with pytest.raises(ValueError, match="logit_bias values"):
        SamplingParams(logit_bias=((5, 100.5),))
    for bad in ({"presence_penalty": 2.1}, {"frequency_penalty": -2.5}, {"repetition_penalty": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    entries = (TokenLogprob(-0.5, ((3, -0.5), (9, -1.25))), TokenLogprob(-2.0))
    assert logprobs_from_wire(logprobs_to_wire(entries)) == entries
