"""The serving path's terms (ServingTerms) in the simulated instances, checked by hand
against the conftest's cost model (2,000 tok/s prefill, 12.5 ms + 27 ns/context-token steps)."""

import json
import math
import statistics
from pathlib import Path

import pytest

from halfmoon.cli import main
from halfmoon.costmodel.profile import fit_profile
from halfmoon.costmodel.serving import ServingTerms
from halfmoon.sim.host import Host
from halfmoon.sim.network import kv_stream_tail_s

KV_BYTES_PER_TOKEN = 320 * 1024
LINK_BYTES_PER_S = 100e9


def _records(result):
    return {record.request_id: record for record in result.records}


def _step_s(context_tokens: int) -> float:
    return 0.0125 + 2.7e-8 * context_tokens


def test_request_overhead_delays_only_the_request(run_sim, make_request) -> None:
    """Two requests arriving together on 1M: both start 5 ms late; the instance is not
    held meanwhile, so the second still follows the first's prefill at once."""
    terms = ServingTerms(request_overhead_s=0.005)
    requests = [make_request("a", 0.0, 1000, 1), make_request("b", 0.0, 1000, 1)]
    base, _ = run_sim("1M", requests)
    late, _ = run_sim("1M", requests, serving=terms)
    for rid in ("a", "b"):
        assert _records(late)[rid].ttft_s == pytest.approx(_records(base)[rid].ttft_s + 0.005)
    assert _records(late)["a"].ttft_s == pytest.approx(0.005 + 1000 / 2000.0)


def test_prefill_handoff_occupies_the_prefill_instance(run_sim, make_request) -> None:
    """TTFT = prefill + hand-over (the stream's tail is inside it); the next prompt waits
    for the hand-over too."""
    handoff_s = 0.2  # 50 us per prompt token
    requests = [make_request("a", 0.0, 4000, 2), make_request("b", 0.0, 4000, 2)]
    terms = ServingTerms(prefill_handoff_s_per_token=handoff_s / 4000)
    result, sim = run_sim("1P1D", requests, serving=terms)
    a, b = _records(result)["a"], _records(result)["b"]
    compute_s = 4000 / 2000.0
    tail_s = kv_stream_tail_s(compute_s, 0.0, 4000 * KV_BYTES_PER_TOKEN / LINK_BYTES_PER_S, 80)
    assert tail_s < handoff_s  # so the hand-over, not the stream, ends the prefill side
    assert a.prefill_done_s == pytest.approx(compute_s + handoff_s)
    assert a.ttft_s == pytest.approx(compute_s + handoff_s)
    assert b.prefill_done_s == pytest.approx(2 * (compute_s + handoff_s))
    assert sim.prefill["P1"].busy_s == pytest.approx(2 * (compute_s + handoff_s))


def test_decode_per_sequence_overhead_and_kv_import(run_sim, make_request) -> None:
    """A step costs the engine's step + batch * per-seq; the step a request joins also
    pays its prompt's import."""
    terms = ServingTerms(decode_per_seq_overhead_s=0.001, kv_import_s_per_token=1e-6)
    result, _ = run_sim("1P1D", [make_request("r", 0.0, 4000, 4)], serving=terms)
    gaps = _records(result)["r"].tbt_gaps_s
    expected = [_step_s(4000 + k) + 0.001 for k in (1, 2, 3)]
    expected[0] += 4000 * 1e-6  # the first step after joining imports 4,000 tokens of KV
    assert gaps == pytest.approx(expected, abs=1e-12)


def test_decode_per_step_overhead_whatever_the_batch(run_sim, make_request) -> None:
    """The per-step term is paid once per step: two sequences' gaps grow by it, not by
    twice it (the per-sequence term grows with the batch)."""
    terms = ServingTerms(decode_step_overhead_s=0.003)
    requests = [make_request("a", 0.0, 4000, 6), make_request("b", 0.0, 4000, 6)]
    plain, _ = run_sim("1P1D", requests)
    slow, _ = run_sim("1P1D", requests, serving=terms)
    for rid in ("a", "b"):
        extra = [
            s - p
            for s, p in zip(
                _records(slow)[rid].tbt_gaps_s, _records(plain)[rid].tbt_gaps_s, strict=True
            )
        ]
        assert extra == pytest.approx([0.003] * 5, abs=1e-9)
    result, _ = run_sim("1M", [make_request("c", 0.0, 2100, 3)], serving=terms)
    gaps = _records(result)["c"].tbt_gaps_s
    assert gaps == pytest.approx([_step_s(2100 + k) + 0.003 for k in (1, 2)])


def test_step_wait_adds_an_exponential_wait_to_every_step(run_sim, make_request) -> None:
    """Each step waits an exponential time with the given mean, whatever its length:
    the gaps' extra over the plain run averages the mean and is never negative."""
    requests = [make_request("a", 0.0, 2000, 400)]
    plain, _ = run_sim("1P1D", requests)
    slow, _ = run_sim("1P1D", requests, serving=ServingTerms(step_wait_mean_s=0.004))
    extra = [
        s - p
        for s, p in zip(
            _records(slow)["a"].tbt_gaps_s, _records(plain)["a"].tbt_gaps_s, strict=True
        )
    ]
    assert min(extra) >= 0
    assert sum(extra) / len(extra) == pytest.approx(0.004, rel=0.15)
    assert statistics.median(extra) == pytest.approx(0.004 * math.log(2), rel=0.2)
    coupled, _ = run_sim("1M", requests, serving=ServingTerms(step_wait_mean_s=0.004))
    base, _ = run_sim("1M", requests)
    assert sum(_records(coupled)["a"].tbt_gaps_s) > sum(_records(base)["a"].tbt_gaps_s) + 1.0


def test_joining_request_slows_the_running_ones(run_sim, make_request) -> None:
    """While "b" joins, "a"'s gap includes b's KV import."""
    terms = ServingTerms(kv_import_s_per_token=1e-5)
    requests = [make_request("a", 0.0, 1000, 400), make_request("b", 0.6, 1000, 2)]
    result, _ = run_sim("1P1D", requests, serving=terms)
    a = _records(result)["a"]
    longest = max(a.tbt_gaps_s[1:])
    assert longest == pytest.approx(1000 * 1e-5 + 0.0125, rel=0.01)  # ~ one import + step
    assert sorted(a.tbt_gaps_s[1:])[-2] < 0.015  # every other later gap is a plain step


def test_coupled_steps_pay_the_per_sequence_overhead(run_sim, make_request) -> None:
    terms = ServingTerms(decode_per_seq_overhead_s=0.002)
    result, _ = run_sim("1M", [make_request("a", 0.0, 2100, 3)], serving=terms)
    gaps = _records(result)["a"].tbt_gaps_s
    assert gaps == pytest.approx([_step_s(2100 + k) + 0.002 for k in (1, 2)])


def test_zero_terms_change_nothing(run_sim, make_request) -> None:
    requests = [make_request(f"r{i}", 0.3 * i, 1500 + 100 * i, 5) for i in range(6)]
    for cluster in ("1P1D", "2M"):
        plain, _ = run_sim(cluster, requests)
        zero, _ = run_sim(cluster, requests, serving=ServingTerms())
        assert plain.report == zero.report


def _profile(tmp_path: Path, serving: ServingTerms) -> Path:
    prefill = [(n, 0, n / 1000.0 + 0.01) for n in (1000, 4000, 16000, 32000)]
    decode = [(b, ctx, 0.02 + 1e-8 * ctx) for b, ctx in ((1, 1000), (8, 64000), (32, 500000))]
    path = tmp_path / "profile.json"
    fit_profile(prefill, decode, "tiny", "test", created="2026-01-01", serving=serving).save(path)
    return path


def _simulate(capsys, tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "r.json"
    code = main(["simulate", "--dataset", "leval", "--rate", "0.5", "--num-requests", "6",
                 "--cluster", "1P1D", "--model", "tiny", "--gpus-per-instance", "1",
                 "--json", str(out), *argv])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(out.read_text())


def test_cli_reads_terms_from_the_profile_and_flags_override(capsys, tmp_path: Path) -> None:
    plain = _simulate(capsys, tmp_path, "--profile", str(_profile(tmp_path, ServingTerms())))
    with_terms = _profile(tmp_path, ServingTerms(request_overhead_s=0.5))
    slow = _simulate(capsys, tmp_path, "--profile", str(with_terms))
    assert slow["ttft_s"]["p50"] == pytest.approx(plain["ttft_s"]["p50"] + 0.5, abs=1e-6)
    overridden = _simulate(
        capsys, tmp_path, "--profile", str(with_terms), "--request-overhead-s", "0"
    )
    assert overridden["ttft_s"] == plain["ttft_s"]


def test_cli_length_scale_shrinks_the_workload(capsys, tmp_path: Path) -> None:
    full = _simulate(capsys, tmp_path)
    small = _simulate(capsys, tmp_path, "--length-scale", "0.0625")
    assert small["num_requests"] == full["num_requests"] == 6
    # 32 tokens per block instead of 512: 16x shorter prompts, much faster prefills
    assert small["e2e_s"]["mean"] < full["e2e_s"]["mean"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--length-scale", "0.3"], "whole number"),
        (["--length-scale", "2"], "length-scale"),
        (["--decode-per-seq-overhead-s", "-1"], "decode-per-seq-overhead-s"),
        (["--kv-import-s-per-token", "nan"], "kv-import-s-per-token"),
        (["--host-cores", "0"], "host_cores"),
    ],
)
def test_cli_bad_scale_or_terms(capsys, argv: list[str], message: str) -> None:
    code = main(["simulate", "--dataset", "leval", "--rate", "1", "--num-requests", "3", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]


def test_step_jitter_is_lognormal_around_the_median_and_seeded(run_sim, make_request) -> None:
    terms = ServingTerms(step_jitter_sigma=0.3)
    requests = [make_request("r", 0.0, 1000, 601)]
    first, _ = run_sim("1P1D", requests, serving=terms)
    again, _ = run_sim("1P1D", requests, serving=terms)
    other, _ = run_sim("1P1D", requests, serving=terms, seed=1)
    gaps = first.records[0].tbt_gaps_s
    assert gaps == again.records[0].tbt_gaps_s  # deterministic for a seed
    assert gaps != other.records[0].tbt_gaps_s
    ratios = sorted(gap / _step_s(1000 + k) for k, gap in enumerate(gaps[1:], start=2))
    assert ratios[len(ratios) // 2] == pytest.approx(1.0, abs=0.06)
    assert ratios[int(0.9 * len(ratios))] == pytest.approx(math.exp(1.2816 * 0.3), rel=0.1)


def test_host_slowdown_formula() -> None:
    host = Host(cores=2, cpu_s_per_token=0.001)
    assert host.start("P1") == 1.0  # one busy process, two cores
    assert host.start("D1", tokens_per_s=500.0) == pytest.approx((2 + 0.5) / 2)
    host.stop("P1")
    assert host.start("D1", tokens_per_s=500.0) == 1.0  # 1.5 cores of demand
    assert host.num_busy == 1 and host.background_cores() == pytest.approx(0.5)
    assert host.max_slowdown == pytest.approx(1.25)
    with pytest.raises(ValueError, match="cores"):
        Host(cores=0)


def test_instances_sharing_one_core_slow_each_other(run_sim, make_request) -> None:
    """1P1D on one core: b's prefill runs while a decodes, so both run at half speed;
    with two cores nobody waits."""
    requests = [make_request("a", 0.0, 1000, 30), make_request("b", 0.6, 1000, 2)]
    shared, sim = run_sim("1P1D", requests, host_cores=1.0)
    alone, _ = run_sim("1P1D", requests, host_cores=2.0)
    plain, _ = run_sim("1P1D", requests)
    assert _records(alone)["b"].ttft_s == pytest.approx(_records(plain)["b"].ttft_s)
    assert _records(shared)["b"].ttft_s > 1.9 * (1000 / 2000.0)  # prefill at half speed
    assert max(_records(shared)["a"].tbt_gaps_s) > 1.9 * _step_s(1030)
    assert sim.host is not None and sim.host.max_slowdown == pytest.approx(2.0)
    assert sim.host.num_busy == 0  # everyone told the host when it went idle
