"""Planning requests (time and length scaling) and building their prompts."""

from __future__ import annotations

import pytest

from halfmoon.bench.workload import PromptMaker, PromptSpec, block_tokens_for_scale, plan_requests
from halfmoon.core.request import Request


def _request(rid: str, arrival_s: float, blocks: tuple[int, ...], n_in: int, n_out: int = 8):
    return Request(rid, arrival_s, n_in, n_out, blocks, 512)


def test_plan_shifts_to_zero_and_divides_by_time_scale():
    requests = [_request("a", 10.0, (1,), 100), _request("b", 12.0, (2,), 100),
                _request("c", 16.0, (3,), 100)]  # fmt: skip
    planned = plan_requests(requests, time_scale=2.0)
    assert [p.send_at_s for p in planned] == [0.0, 1.0, 3.0]
    assert [p.request.arrival_time_s for p in planned] == [0.0, 1.0, 3.0]
    assert [p.request_id for p in planned] == ["a", "b", "c"]
    assert [p.request_id for p in plan_requests(requests, max_requests=2)] == ["a", "b"]


def test_length_scale_keeps_blocks_and_scales_lengths():
    planned = plan_requests([_request("a", 0.0, (7, 8, 9), 1030, 64)], length_scale=0.0625)
    (request,) = [p.request for p in planned]
    assert request.block_size_tokens == 32
    assert request.block_hashes == (7, 8, 9)
    assert request.input_length == 65  # ceil(1030 * 32 / 512)
    assert request.output_length == 4


@pytest.mark.parametrize("scale", [0.0, -1.0, 1.5, 0.3, float("nan")])
def test_bad_length_scale(scale):
    with pytest.raises(ValueError, match="length-scale"):
        block_tokens_for_scale(scale)


def test_bad_plans():
    with pytest.raises(ValueError, match="time-scale"):
        plan_requests([_request("a", 0.0, (1,), 10)], time_scale=0.0)
    with pytest.raises(ValueError, match="max-requests"):
        plan_requests([_request("a", 0.0, (1,), 10)], max_requests=0)
    with pytest.raises(ValueError, match="no requests"):
        plan_requests([])
    with pytest.raises(ValueError, match="no block ids"):
        plan_requests([Request("a", 0.0, 10, 1)])


def test_prompts_share_exactly_the_shared_blocks():
    maker = PromptMaker(PromptSpec(vocab_size=4096, min_token_id=16, salt=3), 32)
    planned = plan_requests(
        [_request("a", 0.0, (5, 6, 7), 1500), _request("b", 1.0, (5, 6, 9), 1400)],
        length_scale=0.0625,
    )
    a, b = (maker.prompt_ids(p.request) for p in planned)
    assert (len(a), len(b)) == (planned[0].request.input_length, planned[1].request.input_length)
    assert a[:64] == b[:64]  # two shared 32-token blocks
    assert a[64:70] != b[64:70]
    assert all(16 <= t < 4096 and isinstance(t, int) for t in a + b)
    other = PromptMaker(PromptSpec(salt=4), 32).prompt_ids(planned[0].request)
    assert other[:32] != a[:32]  # another salt: another token universe


def test_prompt_maker_checks_block_size_and_spec():
    maker = PromptMaker(PromptSpec(), 32)
    with pytest.raises(ValueError, match="32"):
        maker.prompt_ids(_request("a", 0.0, (1,), 100))
    with pytest.raises(ValueError, match="min token id"):
        PromptSpec(vocab_size=10, min_token_id=10)
    with pytest.raises(ValueError, match="salt"):
        PromptSpec(salt=-1)
