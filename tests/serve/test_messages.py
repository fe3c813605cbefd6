"""The typed control-plane messages: every kind round-trips through the signed framing,
and a malformed one is refused with a ProtocolError naming the kind and the field."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import random
import struct
from typing import Any

import msgpack
import pytest

from halfmoon.core.request import SamplingParams, StructuredOutput, TokenLogprob
from halfmoon.serve.control import messages as m
from halfmoon.serve.control.protocol import ProtocolError, hashes_to_wire

SECRET = b"messages-test-secret"
HASHES = hashes_to_wire([1, 2**128 - 1])
STRUCTURED = StructuredOutput(
    "json", '{"type": "object"}', compact=True, closed=True, whitespace="[ ]", reasoning="first"
)
PARAMS = m.WireParams.of(SamplingParams(max_tokens=8, temperature=0.5, seed=3, logprobs=2,
                                        logit_bias=((5, -2.5),), presence_penalty=0.5,
                                        min_p=0.05, allowed_token_ids=(5, 9),
                                        structured=STRUCTURED, bad_words=("x",),
                                        thinking_token_budget=12))  # fmt: skip
P0 = m.Endpoints(instance_id="p0", command="tcp://h:1", transfer="h:2", incarnation="i1")
D0 = m.Endpoints(instance_id="d0", command="tcp://h:3", transfer="h:4")
TOKENS = m.Tokens(request_id="r", index=0, token_ids=[7], finish_reason=None,
                  logprobs=m.logprobs_to_wire((TokenLogprob(-0.5, ((7, -0.5), (9, -1.0))),)),
                  cached_tokens=16, kv_bytes=1024)  # fmt: skip

#: One example of every message kind, every optional field set where there is one.
EXAMPLES: dict[str, m.Message] = {msg.wire_name: msg for msg in [
    m.Schedule(request_id="r", input_length=40, output_length=8, block_size=16, hashes=HASHES,
               coupled=True, priority=-2, prefill_only=True, msg_id=3),
    m.PlacementDecision(accepted=True, prefill=P0, decode=D0, cache_source=P0, cached_tokens=16,
                        est_ttft_s=0.25, why="kvcache-centric",
                        replications=[m.Replication(source=P0, target=P0, hashes=HASHES,
                                                    reason="hot")],
                        group=[P0, P0], cpp_chunk_tokens=64, decision_s=1e-4, msg_id=3),
    m.Release(request_id="r"),
    m.FirstTokenSeen(request_id="r"),
    m.InstanceFailed(instance_id="p0", incarnation="i1"),
    m.Ping(msg_id=1),
    m.ConductorPong(instances={"p0": "prefill"}, endpoints={"p0": "tcp://h:1"},
                    incarnations={"p0": "i1"},
                    members={"p0": m.Member(instance_id="p0", command="tcp://h:1",
                                            transfer="h:2", role="prefill")},
                    draining=["d9"], integrity="ok", num_placements=2,
                    store_stats={"p0": {"corrupt": 0, "ssd_hits": 4}},
                    cluster=m.ClusterIdentity(block_size=16, model="tiny#00", dtype="float32"),
                    msg_id=1),
    m.Error(error="boom", request_id="r", retryable=True, suspect="d0", unsupported=True),
    m.AdapterUpdate(op="load", adapter=m.AdapterRecord(name="sql", path="/a/sql",
                                                       tag="0123456789ab"), msg_id=4),
    m.AdaptersOk(adapters=[m.AdapterRecord(name="sql", path="/a/sql", tag="0123456789ab")],
                 msg_id=4),
    m.UpdateWeights(op="stage", weights=m.WeightsRecord(path="/ckpt/step-20", version="20"),
                    msg_id=6),
    m.UpdateWeights(op="query", msg_id=7),
    m.WeightsOk(weights=m.WeightsRecord(path="/ckpt/step-20", version="20"), msg_id=6),
    m.WeightsOk(msg_id=7),
    m.Sleep(op="sleep", msg_id=8),
    m.SleepState(sleeping=True, released_bytes=64 * 2**20, msg_id=8),
    m.Profile(op="start", config='{"torch_profiler_dir": "/tmp/t"}', prefix="run1",
              delay_iterations=2, max_iterations=5, msg_id=9),
    m.ProfileState(active=False, traces=["/tmp/t/run1.decode-0.pt.trace.json.gz"], msg_id=9),
    m.ResetPrefixCache(external=True, msg_id=5),
    m.CacheReset(success=False, reason="2 requests hold blocks", msg_id=5),
    m.Register(instance_id="p0", role="prefill", command_endpoint="tcp://h:1",
               transfer_endpoint="h:2", kv_capacity_tokens=4096, kv_bytes_per_token=64,
               hidden_bytes_per_token=128, profile={"prefill": [[1, 2.5]], "name": "x"},
               incarnation="i1", block_size=16, model="tiny#00", dtype="float32",
               draining=True, blocks=[m.HeldBlocks(tier="ssd", hashes=HASHES)],
               adapters=[m.AdapterRecord(name="sql", path="/a/sql", tag="0123456789ab")],
               weights=m.WeightsRecord(path="/ckpt/step-20", version="20"), msg_id=0),
    m.Registered(instance_id="p0", msg_id=0),
    m.Registered(instance_id="p0", weights=m.WeightsRecord(path="/ckpt/step-20", version="20"),
                 msg_id=0),
    m.Refused(instance_id="p0", error="block size 32 (the cluster's is 16)", msg_id=0),
    m.RegisterAgain(),
    m.Events(instance_id="p0", events=[
        m.BlockEvent(kind="stored", hashes=HASHES, tier="ssd"),
        m.BlockEvent(kind="evicted", hashes=HASHES),
        m.LifecycleEvent(kind="prefill_started", request_id="r"),
        m.LifecycleEvent(kind="prefill_finished", request_id="r", cached_tokens=32),
        m.LifecycleEvent(kind="request_finished", request_id="r", num_output_tokens=17),
        m.LoadEvent(num_running=2, context_tokens=64, kv_used_tokens=64,
                    kv_capacity_tokens=4096, store={"corrupt": 1}),
    ]),
    m.Heartbeat(instance_id="p0"),
    m.Drain(instance_id="d1", msg_id=1),
    m.Draining(instance_id="d1", msg_id=1),
    m.Generate(request_id="r", token_ids=[1, 2, 3], params=PARAMS, cache_salt="tenant"),
    m.Expect(request_id="r", params=PARAMS, num_prompt_tokens=3, num_stages=2, est_ttft_s=1.5,
             prefill_instance="p0", cache_salt="tenant"),
    m.Prefill(request_id="r", token_ids=[1, 2, 3], params=PARAMS, decode=D0, cache_source=P0,
              cached_tokens=16, replications=[], cache_salt="tenant"),
    m.CppPrefill(request_id="r", token_ids=[1, 2, 3], params=PARAMS, stage=0, num_stages=2,
                 chunk_tokens=64, next_transfer="h:2", group=["p0", "p1"],
                 commands=["tcp://h:1", "tcp://h:5"], decode=D0, cached_tokens=0,
                 cache_source=P0, cache_salt="tenant"),
    m.Replicate(hashes=HASHES, source="h:2"),
    m.Abort(request_id="r"),
    m.Lost(instance_id="d0"),
    m.Handoff(request_id="r", token_ids=[1, 2, 3, 7], num_prompt_tokens=3,
              num_computed_tokens=3, seed=2**63 - 1),
    m.PrefillDone(request_id="r", token_ids=[1, 2, 3], session="r", num_tokens=3, streamed=True,
                  cached_tokens=2, kv_bytes=4096, prompt_logprobs=m.logprobs_to_wire(
                      (TokenLogprob(-1.5, ((4, -0.5),), 3), TokenLogprob(-0.25, (), 1)))),
    m.CppOffer(request_id="r", stage=1, blocks=2),
    m.CppStart(request_id="r", start_blocks=2),
    TOKENS,
    m.Batch(messages=[TOKENS, m.Tokens(request_id="s", index=4, token_ids=[8, 9],
                                       finish_reason="stop"),
                      m.Tokens(request_id="e", index=0, token_ids=[], finish_reason="stop",
                               embedding=struct.pack("<3f", 0.5, -1.0, 2.0))]),
    m.WorkerPong(instance_id="p0", role="prefill", num_running=1, num_waiting=0,
                 num_free_blocks=12, num_steps=40, integrity="ok",
                 stats={"blocks_pulled": 3, "ratio": 0.5}, msg_id=2),
    m.StatusQuery(num_decisions=5, msg_id=4),
    m.ClusterStatus(instances=[m.InstanceStatus(instance_id="p0", role="prefill",
                                                state="healthy", seen_s_ago=0.1, num_waiting=2,
                                                store={"dram_blocks": 3})],
                    conductor={"policy": "kvcache-centric", "slo": {"ttft_s": 30.0}},
                    decisions=[{"request_id": "r", "accepted": False, "candidates": []}],
                    msg_id=4),
    m.MetricsQuery(msg_id=5),
    m.MetricsText(instance_id="p0", role="prefill", text="halfmoon:x 1.0\n", msg_id=5),
    m.WorkloadQuery(window_s=30.0, msg_id=6),
    m.WorkloadWindow(window_s=30.0, arrivals=[m.Arrival(age_s=1.5, input_length=40,
                                                        output_length=8, hashes=HASHES,
                                                        prefill_only=True)],
                     prefill=["prefill-0"], decode=["decode-0"], draining=[],
                     profile={"model_name": "tiny"}, kv_bytes_per_token=2048,
                     decode_kv_capacity_tokens=4096, conductor="{}", msg_id=6),
]}  # fmt: skip


def test_there_is_an_example_of_every_kind():
    assert set(EXAMPLES) == set(m.MESSAGE_TYPES)
    assert all(type(msg) is m.MESSAGE_TYPES[name] for name, msg in EXAMPLES.items())
    assert all(cls.__doc__ and "->" in cls.__doc__ for cls in m.MESSAGE_TYPES.values())


@pytest.mark.parametrize("kind", sorted(m.MESSAGE_TYPES))
def test_every_kind_round_trips_through_the_signed_framing(kind):
    msg = EXAMPLES[kind]
    assert m.decode_message(m.encode_message(msg, SECRET), SECRET) == msg
    wire = m.to_wire(msg)
    assert wire["type"] == kind and m.from_wire(wire) == msg


def test_typed_views_of_the_wire_forms():
    assert EXAMPLES["schedule"].block_hashes == [1, 2**128 - 1]
    assert EXAMPLES["replicate"].block_hashes == [1, 2**128 - 1]
    assert EXAMPLES["decision"].replications[0].block_hashes == [1, 2**128 - 1]
    assert TOKENS.token_logprobs == (TokenLogprob(-0.5, ((7, -0.5), (9, -1.0))),)
    params = SamplingParams(max_tokens=8, temperature=0.5, seed=3, logprobs=2,
                            logit_bias=((5, -2.5),), presence_penalty=0.5, min_p=0.05,
                            allowed_token_ids=(5, 9), structured=STRUCTURED,
                            bad_words=("x",), thinking_token_budget=12)  # fmt: skip
    assert PARAMS.to_params() == params
    assert m.params_from_wire(m.params_to_wire(params)) == params
    urgent = SamplingParams(max_tokens=4, priority=-7)  # (the priority policy's order)
    assert m.params_from_wire(m.params_to_wire(urgent)).priority == -7
    adapted = SamplingParams(max_tokens=4, lora="sql-lora")  # (the adapter travels too)
    assert m.params_from_wire(m.params_to_wire(adapted)).lora == "sql-lora"
    assert m.Member(instance_id="p0", command="tcp://h:1", transfer="h:2",
                    role="prefill").endpoints() == dataclasses.replace(P0, incarnation="")  # fmt: skip


def test_fields_left_at_a_none_default_are_not_sent():
    wire = m.to_wire(m.Tokens(request_id="r", index=3, token_ids=[5]))
    assert wire == {"type": "tokens", "request_id": "r", "index": 3, "token_ids": [5],
                    "kv_bytes": 0}  # fmt: skip
    assert "group" not in m.to_wire(m.PlacementDecision(accepted=False, reject_code="ttft"))


def test_an_int_is_a_float_but_a_bool_is_not_an_int():
    wire = m.to_wire(m.Expect(request_id="r", params=PARAMS, num_prompt_tokens=3))
    decoded = m.from_wire({**wire, "est_ttft_s": 2})
    assert decoded.est_ttft_s == 2.0 and isinstance(decoded.est_ttft_s, float)
    with pytest.raises(
        ProtocolError, match=r"'expect' message: num_prompt_tokens: expected int, got bool"
    ):
        m.from_wire({**wire, "num_prompt_tokens": True})
    with pytest.raises(ProtocolError, match=r"'tokens' message: index: expected int, got bool"):
        m.to_wire(m.Tokens(request_id="r", index=True, token_ids=[]))  # a sender's bug, too


def _required_fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]  # fmt: skip


@pytest.mark.parametrize("kind", sorted(m.MESSAGE_TYPES))
def test_each_malformation_is_refused_naming_kind_and_field(kind):
    wire = m.to_wire(EXAMPLES[kind])
    for name in _required_fields(m.MESSAGE_TYPES[kind]):
        missing = {k: v for k, v in wire.items() if k != name}
        with pytest.raises(ProtocolError, match=rf"malformed '{kind}' message: {name}: missing"):
            m.from_wire(missing)
    with pytest.raises(ProtocolError, match=rf"'{kind}' message: bogus: unknown field"):
        m.from_wire({**wire, "bogus": 1})
    for name in wire:
        if name != "type":  # a set is no wire value of any field
            with pytest.raises(ProtocolError, match=rf"'{kind}' message: {name}: expected"):
                m.from_wire({**wire, name: {"a set"}})


def test_nested_fields_are_named_by_their_path():
    prefill = m.to_wire(EXAMPLES["prefill"])
    cases = [
        ({**prefill, "decode": {"instance_id": "d0", "transfer": "h:4"}},
         "'prefill' message: decode.command: missing"),
        ({**prefill, "token_ids": [1, "2"]}, r"'prefill' message: token_ids\[1\]: expected int"),
        ({**prefill, "params": {**prefill["params"], "top_p": "1"}},
         "'prefill' message: params.top_p: expected float, got str"),
        ({"type": "events", "instance_id": "p0", "events": [{"kind": "warmed", "hashes": b""}]},
         r"'events' message: events\[0\].kind: 'warmed' is not one of"),
        ({"type": "events", "instance_id": "p0", "events": [{"kind": "load", "store": {"x": 1.5}}]},
         r"'events' message: events\[0\].store\['x'\]: expected int, got float"),
        ({"type": "batch", "messages": [{"type": "error", "error": "x"}]},
         r"'batch' message: messages\[0\].type: expected a 'tokens' message"),
        ({"type": "nonsense"}, "'nonsense' message: type: unknown message type"),
        ({"type": 5}, "'5' message: type: unknown message type"),
    ]  # fmt: skip
    for data, error in cases:
        with pytest.raises(ProtocolError, match=error):
            m.from_wire(data)


def test_a_refusal_carries_what_the_receiver_needs_to_answer():
    with pytest.raises(m.MalformedMessage) as refused:
        m.from_wire({"type": "prefill", "request_id": "r7", "msg_id": 9})
    assert (refused.value.kind, refused.value.field) == ("prefill", "token_ids")
    assert (refused.value.msg_id, refused.value.request_id) == (9, "r7")
    with pytest.raises(ProtocolError, match="unknown event kind 'warmed'"):
        m.event_entry("warmed", hashes=b"")
    with pytest.raises(ProtocolError, match="bad 'prefill_started' event"):
        m.event_entry("prefill_started", hashes=b"")
    assert m.event_entry("stored", hashes=HASHES) == m.BlockEvent(kind="stored", hashes=HASHES)


def _junk(rng: random.Random, depth: int = 0) -> Any:
    choices = [None, True, rng.randint(-(2**63), 2**64 - 1), rng.random(), "", "x" * rng.randint(0, 9),
               b"\x00" * rng.randint(0, 33), rng.choice(sorted(m.MESSAGE_TYPES))]  # fmt: skip
    if depth < 3:
        choices += [[_junk(rng, depth + 1) for _ in range(rng.randint(0, 3))],
                    {rng.choice(["kind", "type", "a", "hashes"]): _junk(rng, depth + 1)
                     for _ in range(rng.randint(0, 3))}]  # fmt: skip
    return rng.choice(choices)


def _mutate(rng: random.Random, value: Any) -> Any:
    """``value`` with one part dropped, replaced by junk, or cut short."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = rng.choice(list(value))
        out = dict(value)
        if rng.random() < 0.3:
            del out[key]
        else:
            out[key] = _mutate(rng, value[key])
        return out
    if isinstance(value, (list, bytes, str)) and value and rng.random() < 0.5:
        return value[: rng.randrange(len(value))]
    if isinstance(value, list) and value:
        i = rng.randrange(len(value))
        return [*value[:i], _mutate(rng, value[i]), *value[i + 1 :]]
    return _junk(rng)


def test_random_and_truncated_messages_raise_only_protocol_errors():
    rng = random.Random(18)
    wires = [m.to_wire(msg) for msg in EXAMPLES.values()]
    for _ in range(5_000):
        if rng.random() < 0.1:
            data = _junk(rng)
        elif rng.random() < 0.2:
            fields = {rng.choice(["request_id", "events", "params", "x"]): _junk(rng, 1)
                      for _ in range(rng.randint(0, 4))}  # fmt: skip
            data = {"type": rng.choice(sorted(m.MESSAGE_TYPES)), **fields}
        else:
            data = _mutate(rng, _mutate(rng, rng.choice(wires)))
        try:
            msg = m.from_wire(data)
        except ProtocolError:
            continue
        assert m.from_wire(m.to_wire(msg)) == msg  # what is accepted is well-formed


def test_signed_junk_bodies_raise_only_protocol_errors():
    rng = random.Random(7)
    bodies = [msgpack.packb(m.to_wire(msg)) for msg in EXAMPLES.values()]
    refused = 0
    for _ in range(5_000):
        body = rng.choice(bodies)
        cut = body[: rng.randrange(len(body))] if rng.random() < 0.5 else body
        junk = bytearray(cut)
        for _ in range(rng.randint(0, 3)):
            if junk:
                junk[rng.randrange(len(junk))] = rng.randrange(256)
        frames = [bytes(junk), hmac.new(SECRET, bytes(junk), hashlib.sha256).digest()]
        try:
            msg = m.decode_message(frames, SECRET)
        except ProtocolError:
            refused += 1
            continue
        assert m.from_wire(m.to_wire(msg)) == msg  # what is accepted is well-formed
    assert refused > 1_000  # most junk is refused (and only ever as a ProtocolError)


def test_an_embedding_travels_as_float32():
    msg = m.Tokens(request_id="e", index=0, token_ids=[], finish_reason="stop",
                   embedding=struct.pack("<3f", 0.5, -1.0, 2.0))  # fmt: skip
    back = m.decode_message(m.encode_message(msg, b"k" * 32), b"k" * 32)
    assert back.embedding_values == (0.5, -1.0, 2.0)
    assert m.Tokens(request_id="r", index=0, token_ids=[1]).embedding_values is None
    params = m.WireParams.of(SamplingParams(max_tokens=1, embed=True)).to_params()
    assert params.embed


def test_only_an_embeddings_prefill_goes_without_a_decode_worker():
    embed = m.WireParams.of(SamplingParams(max_tokens=1, embed=True))
    msg = m.Prefill(request_id="e", token_ids=[1, 2], params=embed)
    assert m.decode_message(m.encode_message(msg, SECRET), SECRET) == msg
    with pytest.raises(ValueError, match="names the decode worker"):
        m.Prefill(request_id="g", token_ids=[1, 2], params=PARAMS)
    generation = {k: v for k, v in m.to_wire(EXAMPLES["prefill"]).items() if k != "decode"}
    with pytest.raises(ProtocolError, match="'prefill' message: .*names the decode worker"):
        m.from_wire(generation)
