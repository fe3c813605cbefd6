"""A pruned decision equals the exhaustive one (every instance evaluated), on random
clusters and event streams: same placement, same tie-breaking, same rejections."""

import random

import pytest

from halfmoon.conductor import (
    BlockEvicted,
    BlockStored,
    Conductor,
    ConductorConfig,
    DecodeStarted,
    FirstToken,
    LoadReport,
    PrefillFinished,
    PrefillStarted,
    RejectCode,
    RequestFinished,
)
from halfmoon.core.clock import ManualClock
from halfmoon.core.config import SLOConfig
from halfmoon.core.request import Request
from halfmoon.costmodel import build_cost_model
from halfmoon.costmodel.speculation import NO_SPECULATION, SpeculationRates
from halfmoon.costmodel.throughput import ThroughputCostModel

BLOCK = 16


def _cost_models(rng):
    """Round numbers, so that estimates tie often; sometimes a roofline model."""
    fast = ThroughputCostModel(1000.0, 1024, 1e9, 0.01, 1e-6)
    slow = ThroughputCostModel(500.0, 2048, 1e9, 0.02, 2e-6)
    roofline = build_cost_model("llama3-8b", "a800", 1)
    return rng.choice([[fast], [fast, slow], [roofline], [roofline, fast]])


class Twin:
    """The same cluster twice: one Conductor prunes, the other evaluates everything."""

    def __init__(self, rng, seed):
        self.rng = rng
        self.clock = ManualClock()
        config = ConductorConfig(
            block_size_tokens=BLOCK,
            early_reject=rng.choice(["none", "snapshot", "predict"]),
            kvcache_balancing_threshold=rng.choice([0.0, 0.1, 0.5]),
            balancing=rng.choice(["fixed", "adaptive"]),
            slo=SLOConfig(ttft_s=rng.choice([2.0, 30.0]), tbt_s=rng.choice([0.05, 1.0])),
            cpp_stages=rng.choice([1, 1, 2]),
            cpp_min_tokens=64,
            cpp_hidden_bytes_per_token=512,
            hot_min_requests=rng.choice([0, 2]),
            link_backlog=rng.choice([False, True]),
            prefill_calibration=rng.choice([False, True]),
            prefix_fetch=rng.choice(["queued", "overlap"]),
            # drawn apart, so that the other draws stay those of the streams before it
            decode_time_by_prefix=random.Random(seed + 1).random() < 0.5,
        )
        models = _cost_models(rng)
        self.pruned, self.full = (
            Conductor(config, models[0], self.clock, random.Random(seed)) for _ in range(2)
        )
        self.models = models
        self.prefill, self.decode = [], []
        self.names = 0
        for _ in range(rng.randint(1, 12)):
            self.add("P", self.prefill)
        for _ in range(rng.randint(1, 10)):
            self.add("D", self.decode)
        self.live: list[tuple[str, str, str]] = []  # (request, prefill, decode)
        self.num = 0
        # Odd seeds give requests priorities (the priority policy's estimates), drawn
        # apart so that the other draws stay those of a priority-free stream.
        self.priorities = random.Random(seed) if seed % 2 else None

    def add(self, kind, names):
        self.names += 1
        iid = f"{kind}{self.names}"
        cm = self.rng.choice(self.models)
        capacity = self.rng.choice([2_000, 1_000_000])
        for c in (self.pruned, self.full):
            if kind == "P":
                c.add_prefill_instance(iid, cm)
            else:
                c.add_decode_instance(iid, cm, kv_capacity_tokens=capacity)
        names.append(iid)

    def send(self, event):
        self.pruned.handle(event)
        self.full.handle(event)

    def step(self):
        rng = self.rng
        roll = rng.random()
        if roll < 0.25:
            self.schedule()
        elif roll < 0.45:
            iid = rng.choice(self.prefill)
            first = rng.randrange(4)  # a few shared document starts
            for h in range(rng.randint(1, 12)):
                self.send(BlockStored(first * 100 + h, instance_id=iid))
        elif roll < 0.5:
            h = rng.randrange(4) * 100 + rng.randrange(12)
            self.send(BlockEvicted(h, instance_id=rng.choice(self.prefill)))
        elif roll < 0.75 and self.live:
            self.advance(self.live[rng.randrange(len(self.live))])
        elif roll < 0.8:
            iid = rng.choice(self.prefill + self.decode)
            self.send(
                LoadReport(
                    iid,
                    num_running=rng.randint(0, 4),
                    context_tokens=rng.randint(0, 3000),
                    queued_prefill_tokens=rng.choice([0, 0, rng.randint(1, 5000)]),
                    # a decode instance that speculates: its steps cost more rows
                    **rng.choice(
                        [
                            {},
                            {},
                            {"spec_rows_per_seq": 2.6, "spec_tokens_per_step": 1.9},
                            {"spec_rows_per_seq": 1.3, "spec_tokens_per_step": 1.0},
                        ]
                    ),
                )
            )
        elif roll < 0.82 and len(self.prefill) > 1:
            self.remove(self.prefill)
        elif roll < 0.84 and len(self.decode) > 1:
            self.remove(self.decode)
        elif roll < 0.86:
            kind = rng.choice("PD")
            self.add(kind, self.prefill if kind == "P" else self.decode)
        else:
            self.clock.advance(rng.choice([0.0, 0.01, 0.25, 1.0]))

    def remove(self, names):
        iid = names.pop(self.rng.randrange(len(names)))
        for c in (self.pruned, self.full):
            c.remove_instance(iid)
        self.live = [x for x in self.live if iid not in x[1:]]

    def advance(self, entry):
        rid, p, d = entry
        kind = self.rng.randrange(3)
        if kind == 0:
            self.send(PrefillStarted(p, rid))
        elif kind == 1:
            self.send(PrefillFinished(p, rid))
            self.send(FirstToken("", rid))
            self.send(DecodeStarted(d, rid))
        else:
            self.send(RequestFinished(d, rid))
            self.live.remove(entry)

    def schedule(self):
        rng = self.rng
        self.num += 1
        first = rng.randrange(4) * 100
        shared = tuple(range(first, first + rng.randint(0, 12)))
        fresh = tuple(range(10**6 + self.num * 100, 10**6 + self.num * 100 + rng.randint(0, 8)))
        hashes = shared + fresh
        length = max(1, len(hashes) * BLOCK - rng.randrange(BLOCK))
        priority = self.priorities.choice([0, 0, -1, 3]) if self.priorities else 0
        request = Request(
            f"r{self.num}", 0.0, length, rng.randint(1, 50), hashes, BLOCK, priority=priority
        )
        got = self.pruned.schedule(request)
        want = self.full.schedule(request, exhaustive=True)
        assert (got.accepted, got.reject_code, got.reject_reason) == (
            want.accepted,
            want.reject_code,
            want.reject_reason,
        )
        assert got.prefill == want.prefill and got.decode == want.decode
        assert got.replications == want.replications and got.why == want.why
        assert set(got.candidates) <= set(want.candidates)
        assert got.num_candidates == len(want.candidates)
        assert set(got.decode_candidates) <= set(want.decode_candidates)
        if got.accepted:
            self.live.append((request.request_id, got.prefill.instance_id, got.decode.instance_id))
            if self.pruned.config.prefill_calibration:  # as live workers do: on arrival
                self.send(PrefillStarted(got.prefill.instance_id, request.request_id))
        self.pruned.check_integrity()


@pytest.mark.parametrize("seed", range(60))
def test_pruned_decisions_equal_exhaustive(seed):
    rng = random.Random(seed)
    twin = Twin(rng, seed)
    for _ in range(150):
        twin.step()
    assert twin.num > 0


def test_calibrated_scales_reach_the_pruned_decisions():
    """Calibration on, the scales the random streams teach differ from 1 (so the seeds
    above compare pruned and exhaustive decisions on scaled estimates too)."""
    scales, lateness = [], []
    for seed in range(60):
        rng = random.Random(seed)
        twin = Twin(rng, seed)
        for _ in range(150):
            twin.step()
        scales += [c["scale"] for c in twin.pruned.prefill_calibration.values()]
        assert twin.pruned.prefill_calibration == twin.full.prefill_calibration
        lateness.append(twin.pruned.ttft_lateness_s)
        assert twin.pruned.ttft_lateness_s == twin.full.ttft_lateness_s
    assert sum(s != 1.0 for s in scales) >= 5
    assert sum(late > 0 for late in lateness) >= 5


def test_pruned_explanation_counts_the_rest(make_conductor):
    c = make_conductor(num_prefill=12, num_decode=6)
    for h in range(4):
        c.handle(BlockStored(h, instance_id="P3"))
    request = Request("r", 0.0, 20 * BLOCK, 8, tuple(range(20)), BLOCK)
    d = c.schedule(request)
    assert d.prefill.instance_id == "P3" and d.num_candidates == 12 + 11
    assert len(d.candidates) < d.num_candidates and d.num_decode_candidates == 6
    text = d.explain()
    assert "prefill candidate(s) not listed" in text and "decode instance(s) not listed" in text


def test_decode_tie_goes_to_the_earlier_instance(make_conductor):
    # The worked example's model ignores the batch size: D1 (3 running, no context) and
    # D2 (idle) tie; D2 sorts first in the pruned order, D1 still wins the tie.
    pruned, full = make_conductor(num_prefill=1, num_decode=2), make_conductor(1, 2)
    request = Request("r", 0.0, 4 * BLOCK, 8, tuple(range(4)), BLOCK)
    for c in (pruned, full):
        c.handle(LoadReport("D1", num_running=3, context_tokens=0))
    got = pruned.schedule(request)
    assert got.decode.instance_id == "D1" and [d.instance_id for d in got.decode_candidates] == [
        "D1",
        "D2",
    ]
    assert got.decode == full.schedule(request, exhaustive=True).decode


def test_prefix_durations_reach_the_pruned_predictions():
    """With ``decode_time_by_prefix``, the random streams above place requests with a
    predicted decode duration on instances whose forecast then uses it (so the seeds
    compare pruned and exhaustive predictions with per-request durations too)."""
    predicted = 0
    for seed in range(60):
        rng = random.Random(seed)
        twin = Twin(rng, seed)
        for _ in range(150):
            twin.step()
            if twin.pruned.config.early_reject == "predict":
                predicted += sum(len(d.predicted_s) for d in twin.pruned._decode.values())
    assert predicted >= 50


def test_a_speculating_decode_instance_is_estimated_by_its_rows(make_conductor):
    """A decode instance whose load reports say it speculates: its batch's step is
    estimated over the rows its drafts add, so the Conductor places on the instance
    that does not (at equal load) and rejects early by TBT where the rows would break
    the SLO; its generated tokens grow by the tokens a step gives. A report that cannot
    be rates (tokens above rows) counts as no speculation."""
    c = make_conductor(num_prefill=1, num_decode=2, early_reject="snapshot",
                       slo=SLOConfig(ttft_s=30.0, tbt_s=10.0))  # fmt: skip
    for iid, rows, tokens in (("D1", 3.0, 2.0), ("D2", 1.0, 1.0)):
        c.handle(LoadReport(iid, num_running=6, context_tokens=6000, spec_rows_per_seq=rows,
                            spec_tokens_per_step=tokens))  # fmt: skip
    d1, d2 = c._decode["D1"], c._decode["D2"]  # noqa: SLF001 - the books under test
    assert d1.speculation == SpeculationRates(3.0, 2.0) and d2.speculation == NO_SPECULATION
    model = d1.cost_model
    assert d1.step_time_s(6, 6000) == pytest.approx(model.decode_step_time_s(18, 18000))
    assert d1.token_time_s(6, 6000) == pytest.approx(d1.step_time_s(6, 6000) / 2)
    request = Request("r", 0.0, 4 * BLOCK, 8, tuple(range(4)), BLOCK)
    decision = c.schedule(request)
    assert decision.accepted and decision.decode.instance_id == "D2"
    est = {d.instance_id: d.est_tbt_s for d in decision.decode_candidates}
    assert est["D1"] > est["D2"]
    # an SLO between the two estimates: the speculating instance alone would break it
    tight = make_conductor(num_prefill=1, num_decode=1, early_reject="snapshot",
                           slo=SLOConfig(ttft_s=30.0, tbt_s=(est["D1"] + est["D2"]) / 2))  # fmt: skip
    tight.handle(LoadReport("D1", num_running=6, context_tokens=6000))
    assert tight.schedule(Request("a", 0.0, 4 * BLOCK, 8, tuple(range(4)), BLOCK)).accepted
    tight.handle(LoadReport("D1", num_running=6, context_tokens=6000, spec_rows_per_seq=3.0,
                            spec_tokens_per_step=2.0))  # fmt: skip
    refused = tight.schedule(Request("b", 0.0, 4 * BLOCK, 8, tuple(range(4)), BLOCK))
    assert not refused.accepted and refused.reject_code == RejectCode.TBT
    tight.handle(LoadReport("D1", num_running=6, context_tokens=6000, spec_rows_per_seq=1.5,
                            spec_tokens_per_step=2.0))  # fmt: skip
    assert tight._decode["D1"].speculation == NO_SPECULATION  # noqa: SLF001
