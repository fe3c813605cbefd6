"""Fitting a measured profile, using it as a cost model, and its JSON file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from halfmoon.core.errors import HalfmoonError
from halfmoon.costmodel import (
    CostModel,
    CostProfile,
    PrefillPoint,
    ProfileCostModel,
    build_cost_model,
    fit_profile,
)

CREATED = "2025-01-01T00:00:00+00:00"
PREFILL_GRID = [(n, c) for n in (512, 1024, 2048, 4096, 8192, 16384) for c in (0, 4096, 32768)]
DECODE_GRID = [(b, b * L) for b in (1, 4, 16, 64) for L in (256, 2048, 16384)]


def _roofline_profile() -> tuple[CostProfile, object]:
    # 512+ new tokens keep the 70B prefill compute-bound, where the roofline is exactly
    # const + n + n*(n+2c) shaped; decode stays memory-bound (linear in context).
    roofline = build_cost_model("llama2-70b", "a800")
    prefill = [(n, c, roofline.prefill_time_s(n, c)) for n, c in PREFILL_GRID]
    decode = [(b, ctx, roofline.decode_step_time_s(b, ctx)) for b, ctx in DECODE_GRID]
    return fit_profile(prefill, decode, "llama2-70b", "8xa800", CREATED), roofline


def test_fit_reproduces_roofline_points() -> None:
    profile, roofline = _roofline_profile()
    assert profile.prefill.max_rel_error < 0.02
    assert profile.decode.max_rel_error < 0.02
    for n, c in PREFILL_GRID:
        assert profile.prefill_s(n, c) == pytest.approx(roofline.prefill_time_s(n, c), rel=0.03)
    for b, ctx in DECODE_GRID:
        assert profile.decode_step_s(b, ctx) == pytest.approx(
            roofline.decode_step_time_s(b, ctx), rel=0.03
        )


def test_fit_recovers_a_known_quadratic_with_noise() -> None:
    rng = np.random.default_rng(7)
    truth = (0.004, 2e-5, 3e-9)  # seconds, s/token, s/pair-ish

    def prefill_s(n: int, c: int) -> float:
        return truth[0] + truth[1] * n + truth[2] * n * (n + 2 * c)

    points = [
        PrefillPoint(n, c, prefill_s(n, c) * (1 + rng.normal(0, 0.005)))
        for n in (16, 64, 256, 1024, 4096)
        for c in (0, 1000, 8000)
    ]
    decode = [(b, ctx, 0.002 + 1e-4 * b + 1e-7 * ctx) for b in (1, 2, 8) for ctx in (100, 5000)]
    profile = fit_profile(points, decode, created=CREATED)
    assert profile.prefill.coefficients == pytest.approx(truth, rel=0.1)
    assert profile.prefill.max_rel_error < 0.03
    assert profile.decode.coefficients == pytest.approx((0.002, 1e-4, 1e-7), rel=1e-6)
    # Interpolation between grid points stays close to the truth.
    assert profile.prefill_s(2000, 3000) == pytest.approx(prefill_s(2000, 3000), rel=0.03)


def test_profile_cost_model_is_a_cost_model_with_monotone_prefill() -> None:
    profile, roofline = _roofline_profile()
    model = ProfileCostModel.from_roofline(profile, roofline)
    assert isinstance(model, CostModel)
    assert model.kv_bytes_per_token == roofline.kv_bytes_per_token
    assert model.kv_capacity_tokens() == roofline.kv_capacity_tokens()
    assert model.transfer_time_s(1e9) == pytest.approx(roofline.transfer_time_s(1e9))
    assert model.prefill_time_s(2048, 1000) < model.prefill_time_s(2048, 20000)
    assert model.prefill_time_s(0, 5000) == 0.0
    assert model.decode_step_time_s(8, 10_000) < model.decode_step_time_s(8, 100_000)
    with pytest.raises(ValueError, match="batch_size must be >= 0"):
        model.decode_step_time_s(-1, 0)


def test_save_load_round_trip(tmp_path: Path) -> None:
    profile, _ = _roofline_profile()
    path = tmp_path / "profile.json"
    profile.save(path)
    loaded = CostProfile.load(path)
    assert loaded == profile
    assert loaded.prefill_s(3000, 100) == profile.prefill_s(3000, 100)
    data = json.loads(path.read_text())
    assert data["format"] == "halfmoon-cost-profile" and data["device"] == "8xa800"


def test_default_created_is_an_iso_timestamp() -> None:
    points = [(n, 0, 0.001 * n) for n in (1, 2, 3)]
    profile = fit_profile(points, [(1, c, 0.01 + c * 1e-6) for c in (1, 10, 100)])
    assert profile.created[:2] == "20" and "T" in profile.created


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "p.json"
    path.write_text(text)
    return path


def test_load_errors_name_the_file_and_the_problem(tmp_path: Path) -> None:
    with pytest.raises(HalfmoonError, match=r"cost profile .*missing\.json: no such file"):
        CostProfile.load(tmp_path / "missing.json")
    with pytest.raises(HalfmoonError, match=r"p\.json: not valid JSON \(line 1 column 2"):
        CostProfile.load(_write(tmp_path, "{oops"))
    with pytest.raises(HalfmoonError, match="expected a JSON object, got list"):
        CostProfile.load(_write(tmp_path, "[1, 2]"))
    good = _roofline_profile()[0].to_dict()
    del good["decode"]
    with pytest.raises(HalfmoonError, match="missing key"):
        CostProfile.load(_write(tmp_path, json.dumps(good)))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(extra=1), "unexpected key"),
        (lambda d: d.update(format="other"), "format is 'other'"),
        (lambda d: d.update(version=99), "unsupported version 99"),
        (lambda d: d.update(device=3), "'device' must be a string"),
        (lambda d: d["prefill"].update(coefficients=[1.0]), "coefficients must be 3 finite"),
        (lambda d: d["prefill"].update(coefficients=[1, "x", 2]), "coefficients must be 3"),
        (lambda d: d["decode"].update(features=["1"]), "'decode': features must be"),
        (lambda d: d["decode"].pop("num_points"), "'decode': missing key"),
        (lambda d: d["decode"].update(max_rel_error=-1), "max_rel_error must be"),
    ],
)
def test_malformed_profile_contents(tmp_path: Path, mutate, message: str) -> None:
    data = _roofline_profile()[0].to_dict()
    mutate(data)
    with pytest.raises(HalfmoonError, match=message):
        CostProfile.load(_write(tmp_path, json.dumps(data)))


def test_fit_input_errors() -> None:
    decode = [(1, c, 0.01) for c in (1, 10, 100)]
    with pytest.raises(ValueError, match="need at least 3 prefill points, got 2"):
        fit_profile([(1, 0, 0.1), (2, 0, 0.2)], decode)
    with pytest.raises(ValueError, match="prefill point 1 seconds must be > 0"):
        fit_profile([(1, 0, 0.1), (2, 0, 0.0), (3, 0, 0.3)], decode)
    with pytest.raises(ValueError, match="decode point 0 token/batch count must be >= 0"):
        fit_profile([(n, 0, 0.1 * n) for n in (1, 2, 3)], [(-1, 1, 0.1)] + decode)


def test_noisy_points_never_give_negative_costs():
    """A curve bent down by noise would call long prefills free; coefficients stay >= 0."""
    from halfmoon.costmodel.profile import fit_profile

    prefill = [(32, 0, 0.010), (128, 0, 0.011), (512, 0, 0.060), (1024, 0, 0.065),
               (256, 512, 0.030), (128, 1024, 0.020)]  # fmt: skip
    decode = [(1, 64, 0.004), (4, 1024, 0.003), (8, 4096, 0.009), (16, 4096, 0.008)]
    profile = fit_profile(prefill, decode, created="2026-01-01T00:00:00+00:00")
    assert all(c >= 0 for c in profile.prefill.coefficients)
    assert all(c >= 0 for c in profile.decode.coefficients)
    assert profile.prefill_s(8000, 0) > profile.prefill_s(1024, 0) > 0


def _small_profile(**serving: float) -> CostProfile:
    from halfmoon.costmodel.serving import ServingTerms

    prefill = [(n, 0, 1e-4 * n + 0.003) for n in (64, 256, 1024)]
    decode = [(b, b * 256, 0.002 + 1e-4 * b) for b in (1, 4, 16)]
    return fit_profile(prefill, decode, "tiny", "cpu", "2026-01-01", ServingTerms(**serving))


def test_serving_terms_round_trip_and_default_to_zero(tmp_path: Path) -> None:
    from halfmoon.costmodel.serving import ServingTerms

    profile = _small_profile(request_overhead_s=0.005, kv_import_s_per_token=2e-7)
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = CostProfile.load(path)
    assert loaded == profile
    assert loaded.serving.request_overhead_s == 0.005
    assert loaded.serving.decode_per_seq_overhead_s == 0.0
    # a file written before the serving section existed still loads, with zero terms
    data = json.loads(path.read_text())
    del data["serving"]
    assert CostProfile.from_dict(data).serving == ServingTerms()
    assert loaded.with_serving(ServingTerms()).serving == ServingTerms()
    assert ServingTerms(prefill_handoff_s_per_token=1.0).replace(
        prefill_handoff_s_per_token=None, request_overhead_s=2.0
    ) == ServingTerms(request_overhead_s=2.0, prefill_handoff_s_per_token=1.0)


@pytest.mark.parametrize(
    ("serving", "message"),
    [
        ({"request_overhead_s": -1.0}, "request_overhead_s"),
        ({"kv_import_s_per_token": "fast"}, "kv_import_s_per_token"),
        ({"cpu_share": 0.5}, "unknown term"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_bad_serving_terms_are_named(serving, message: str) -> None:
    data = _small_profile().to_dict()
    data["serving"] = serving
    with pytest.raises(HalfmoonError, match=message):
        CostProfile.from_dict(data, "p.json")
