"""Compile report: XLA memory, collectives with executions per step (loop trip counts), per-group state bytes."""
import jax
import jax.numpy as jnp
import pytest

from helpers import steps_for, tiny_config
from jaxpar.analysis import compile_report as report
from jaxpar.analysis import hlo

# one worker builds this module's shared fixtures once (under pytest-xdist `--dist loadgroup`)
pytestmark = pytest.mark.xdist_group("test_report")

VOCAB = 250
M = 4


@pytest.fixture(scope="module")
def compiled_step():
    c = tiny_config(**{"mesh.data": 8, "train.microbatches": M, "train.global_batch_size": 32,
                       "optim.zero_stage": 2})
    s = steps_for(c, VOCAB)
    state = s.abstract_state()
    b = {"tokens": jax.ShapeDtypeStruct((32, c.model.seq_len + 1), jnp.int32, sharding=s.batch_sharding)}
    compiled = s.train.lower(state, b).compile()
    return s, state, compiled


def test_real_step_memory_collectives_and_state_bytes(compiled_step):
    s, state, compiled = compiled_step
    rep = report.compile_report(compiled, abstract_state=state, flops_per_step=1.5e9)
    mem = rep["memory"]
    for k in ("argument", "output", "temp"):
        assert mem[k] > 0, k
    assert mem["peak"] == mem["argument"] + mem["output"] + mem["temp"] - mem["alias"] > 0
    assert rep["flops_per_step"] == 1.5e9

    # ZeRO-2 data parallel: gradients reduce-scattered, params all-gathered; every entry is consistent
    assert {"reduce-scatter", "all-gather"} <= set(rep["collectives_by_kind"])
    for c in rep["collectives"]:
        assert c["bytes"] > 0 and c["total_bytes"] == c["bytes"] * c["executions"]
    # the microbatch scan is a while loop with trip count M; the reduce-scatters inside it run M times per step,
    # the params' all-gather after the update once
    entry_loops = [lp for lp in rep["loops"] if lp["trip_count"] == M and lp["source"] != "unknown"]
    assert entry_loops
    assert all(c["executions"] % M == 0 for c in rep["collectives"] if c["kind"] == "reduce-scatter")
    assert any(c["kind"] == "reduce-scatter" and c["executions"] == M for c in rep["collectives"])
    assert all(c["executions"] == 1 for c in rep["collectives"] if c["kind"] == "all-gather")
    tot = rep["collectives_by_kind"]["reduce-scatter"]
    assert tot["bytes"] == sum(c["total_bytes"] for c in rep["collectives"] if c["kind"] == "reduce-scatter")

    # per-device state bytes, independently: the bytes of each device-0 shard of a real state
    real = s.init(0)
    for group in ("params", "opt_state"):
        want = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(real[group]))
        assert rep["state_bytes"][group] == want, group
    full = sum(x.nbytes for x in jax.tree.leaves(real["params"]))
    assert rep["state_bytes"]["params"] == full  # data parallel only: replicated

    table = report.format_table(rep)
    assert "peak" in table and "all-reduce" in table and "params" in table


def test_zero1_opt_state_bytes_drop():
    def groups(zero):
        c = tiny_config(**{"mesh.data": 8, "optim.zero_stage": zero})
        s = steps_for(c, VOCAB)
        return report.state_group_bytes(s.abstract_state()), report.state_group_bytes(
            jax.eval_shape(lambda: s.init(0)), s.state_shardings)

    (z0, z0b), (z1, z1b) = groups(0), groups(1)
    assert z0 == z0b and z1 == z1b  # shardings from the leaves or from state_shardings agree
    assert z1["params"] == z0["params"]
    assert z1["opt_state"] < z0["opt_state"] / 4  # Adam moments split 8 ways (a few small leaves stay replicated)


def test_lowered_input_is_compiled():
    f = jax.jit(lambda x: jnp.sin(x) * 2)
    rep = report.compile_report(f.lower(jnp.ones((64,), jnp.float32)))
    assert rep["memory"]["argument"] == 256 and rep["collectives"] == [] and rep["state_bytes"] == {}
    assert "(none)" in report.format_table(rep)


def test_shape_bytes():
    assert hlo.shape_bytes("f32[4,128]{1,0}") == 4 * 128 * 4
    assert hlo.shape_bytes("(f32[2,2]{1,0}, bf16[3]{0})") == 16 + 6
    assert hlo.shape_bytes("(f32[4]{0:T(128)}, /*index=1*/u8[<=10]{0})") == 16 + 10
    assert hlo.shape_bytes("f32[]") == 4
    assert hlo.shape_bytes("pred[5]") == 5
    assert hlo.shape_bytes("s4[3]") == 2
    assert hlo.shape_bytes("f8e4m3fn[8,2]") == 16
    assert hlo.shape_bytes("(token[], s32[])") == 4
    assert hlo.shape_bytes("()") == 0
    with pytest.raises(ValueError):
        hlo.shape_bytes("q99[2]")


HLO = """HloModule t, entry_computation_layout={(f32[8]{0})->f32[8]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%inner_body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %y = bf16[2,3]{1,0} constant({...})
  %ar = (f32[8]{0}, bf16[2,3]{1,0}) all-reduce(%x, %y), channel_id=1, replica_groups={{0,1}}, to_apply=%add
  %x2 = f32[8]{0} get-tuple-element(%ar), index=0
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x2)
}

%inner_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (q: (s32[], f32[8])) -> (s32[], f32[8]) {
  %q = (s32[], f32[8]{0}) parameter(0)
  %w = (s32[], f32[8]{0}) while(%q), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  %v = f32[2]{0} constant({1, 2})
  %ags = (f32[2]{0}, f32[8]{0}) all-gather-start(%v), channel_id=2, replica_groups={{0,1,2,3}}, dimensions={0}
  %agd = f32[8]{0} all-gather-done(%ags)
  ROOT %r = (s32[], f32[8]{0}) tuple(%agd, %agd)
}

%outer_cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%helper (h: f32[8]) -> f32[2] {
  %h = f32[8]{0} parameter(0)
  ROOT %rs = f32[2]{0} reduce-scatter(%h), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

%plain_body (r: (s32[], f32[4])) -> (s32[], f32[4]) {
  %r = (s32[], f32[4]{0}) parameter(0)
  %z = f32[4]{0} get-tuple-element(%r), index=1
  %cps = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%z), channel_id=4, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[4]{0} collective-permute-done(%cps)
  %i = s32[] get-tuple-element(%r), index=0
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %cpd)
}

%fused_lt (f0: s32[], f1: s32[]) -> pred[] {
  %f0 = s32[] parameter(0)
  %f1 = s32[] parameter(1)
  ROOT %c = pred[] compare(%f0, %f1), direction=LT
}

%plain_cond (r: (s32[], f32[4])) -> pred[] {
  %r = (s32[], f32[4]{0}) parameter(0)
  %k = s32[] constant(7)
  %i = s32[] get-tuple-element(%r), index=0
  ROOT %f = pred[] fusion(%i, %k), kind=kLoop, calls=%fused_lt
}

%a2a_wrapped (u: f32[4]) -> f32[4] {
  %u = f32[4]{0} parameter(0)
  ROOT %a2a = f32[4]{0} all-to-all(%u), channel_id=5, replica_groups={{0,1}}, dimensions={0}
}

ENTRY %main (arg: f32[8]) -> f32[8] {
  %arg = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %arg)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%outer_cond, body=%outer_body, backend_config={"known_trip_count":{"n":"5"}}
  %c1 = f32[2]{0} call(%arg), to_apply=%helper
  %c2 = f32[2]{0} call(%arg), to_apply=%helper
  %two = s32[] constant(2)
  %z4 = f32[4]{0} slice(%arg), slice={[0:4]}
  %init2 = (s32[], f32[4]{0}) tuple(%two, %z4)
  %plain = (s32[], f32[4]{0}) while(%init2), condition=%plain_cond, body=%plain_body
  %as = ((f32[4]{0}), f32[4]{0}, s32[]) async-start(%z4), calls=%a2a_wrapped
  %ad = f32[4]{0} async-done(%as), calls=%a2a_wrapped
  %ars = f32[8]{0} all-reduce-start(%arg), channel_id=6, replica_groups={{0,1}}, to_apply=%add
  ROOT %ard = f32[8]{0} all-reduce-done(%ars)
}
"""


def test_hand_written_hlo_nested_loops_call_sites_async_and_tuples():
    r = hlo.hlo_collectives(HLO)
    got = {c["name"]: (c["kind"], c["bytes"], c["executions"], c["total_bytes"]) for c in r["collectives"]}
    assert got == {
        "ar": ("all-reduce", 8 * 4 + 6 * 2, 15, 15 * 44),  # tuple result; inner loop 3 x outer loop 5
        "ags": ("all-gather", 32, 5, 160),  # the -done's shape, not the start's tuple
        "rs": ("reduce-scatter", 8, 2, 16),  # one computation, two call sites
        "cps": ("collective-permute", 16, 5, 80),  # trip count from the condition: i from 2 while i < 7
        "a2a": ("all-to-all", 16, 1, 16),  # inside async-start's computation, once (async-done not followed)
        "ars": ("all-reduce", 32, 1, 32),  # -start counted, -done skipped
    }
    assert r["by_kind"]["all-reduce"] == {"count": 2, "executions": 16, "bytes": 15 * 44 + 32}
    loops = {lp["name"]: (lp["trip_count"], lp["source"]) for lp in r["loops"]}
    assert loops == {"w": (3, "known_trip_count"), "loop": (5, "known_trip_count"), "plain": (5, "condition")}


def test_unknown_trip_count_counts_once_and_is_flagged():
    text = HLO.replace("%n = s32[] constant(3)", "%n = s32[] get-tuple-element(%p), index=0").replace(
        ', backend_config={"known_trip_count":{"n":"3"}}', "")
    r = hlo.hlo_collectives(text)
    ar = next(c for c in r["collectives"] if c["name"] == "ar")
    assert ar["executions"] == 5
    assert ("w", 1, "unknown") in [(lp["name"], lp["trip_count"], lp["source"]) for lp in r["loops"]]
    rep = {"memory": {}, "collectives_by_kind": r["by_kind"], "loops": r["loops"]}
    assert "trip count unknown" in report.format_table(rep)


def test_escaped_backend_config_and_names_without_percent():
    text = """HloModule m
body (p: (s32[], f32[2])) -> (s32[], f32[2]) {
  p = (s32[], f32[2]{0}) parameter(0)
  x = f32[2]{0} get-tuple-element(p), index=1
  ar = f32[2]{0} all-reduce(x), replica_groups={}, to_apply=add
  ROOT t = (s32[], f32[2]{0}) tuple(x, ar)
}
cond (p: (s32[], f32[2])) -> pred[] {
  p = (s32[], f32[2]{0}) parameter(0)
  ROOT c = pred[] constant(true)
}
ENTRY main (a: (s32[], f32[2])) -> (s32[], f32[2]) {
  a = (s32[], f32[2]{0}) parameter(0)
  ROOT w = (s32[], f32[2]{0}) while(a), condition=cond, body=body, backend_config="{\\"known_trip_count\\":{\\"n\\":\\"6\\"}}"
}
"""
    r = hlo.hlo_collectives(text)
    assert [(c["name"], c["bytes"], c["executions"]) for c in r["collectives"]] == [("ar", 8, 6)]
