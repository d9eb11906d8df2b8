"""Attention dropout in sm90's Gluon kernels (issue 60): the dropout plan's forward, its dQ
and, where a tuning asks, its per-branch dK/dV draw the mask's coins in the wgmma accumulator's
registers (common.gluon_coins). On the CPU: the plan, and the kernels compiled for sm90 (no
GPU), whose coin layout conversions move no data (assert_trivial) and whose PTX has Philox's
rounds. On an sm90 GPU: out, lse and every gradient against the float64 reference under the
same mask, on fresh random inputs."""
from __future__ import annotations

import pytest
import torch

import dilgen
from dilgen import codegen
from dilgen.planner import plan
from dilgen.targets import get_target

from conftest import (TOL, assert_waits_before_touching_outputs, compile_sm90, forbid_dq_kernels, load_emitted, needs_gluon,
                      on_sm90, rel_error)

SMALL = dict(num_heads=8, num_kv_heads=2, segment_lengths=[512, 1024, 2048], dilation_rates=[1, 2, 4])
DROP_ARGS = dict(seed_ptr="*i64", drop_cut="i32", drop_scale="fp32", drop_n="i32", drop_pos0="i32",
                 drop_streams="*i64")


def _spec(name: str, **over) -> dilgen.Spec:
    fields = dict(name=name, num_heads=16, num_kv_heads=4, head_dim=128, segment_lengths=[2048, 4096, 8192],
                  dilation_rates=[1, 2, 4], dtype="bfloat16")
    fields.update(over)
    return dilgen.Spec(**fields)


@needs_gluon
def test_the_dropout_plans_dq_is_gluon_at_head_dim_64_and_128_unless_a_tuning_declines():
    """At head_dim 64 the plain plan keeps the `tl` dQ; the dropout plan takes the Gluon one,
    which draws its coins in registers. Causal specs keep `tl` (and refuse it when asked)."""
    sm90 = get_target("sm90")
    for head_dim in (64, 128):
        assert plan(_spec("gd", head_dim=head_dim), sm90, {"dropout": True}).config.gluon_dq == 4
    assert plan(_spec("gd", head_dim=64), sm90).config.gluon_dq is None
    assert plan(_spec("gd"), sm90, {"dropout": True, "gluon_dq": False}).config.gluon_dq is None
    assert plan(_spec("gd", causal=True), sm90, {"dropout": True}).config.gluon_dq is None
    with pytest.raises(dilgen.SpecError, match="tuning gluon_dq cannot run here: causal"):
        plan(_spec("gd", causal=True), sm90, {"dropout": True, "gluon_dq": True})


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_the_dropout_plans_lane_dkdv_is_gluon_by_default_and_where_a_tuning_asks(causal):
    """The dropout plan's per-branch dK/dV is Gluon at 3 stages (its (P Z)^T and dS^T tiles
    need the room), causal or not, by default and where {"gluon_dkdv_lanes": true} asks; the
    `tl` one where it declines, where a branch's w / r is no multiple of 128 lanes and on sm80;
    refused by name where it is asked and cannot run."""
    sm90 = get_target("sm90")
    spec = _spec("gdl", causal=causal)
    for tuning in ({}, {"gluon_dkdv_lanes": True}):
        config = plan(spec, sm90, {"dropout": True, **tuning}).config
        assert config.gluon_dkdv_lanes and config.gluon_lanes_bwd == 3
    declined = plan(spec, sm90, {"dropout": True, "gluon_dkdv_lanes": False}).config
    assert not declined.gluon_dkdv_lanes and declined.gluon_lanes_bwd is None and declined.gluon_lanes is None
    odd = _spec("gdl", causal=causal, segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 48])
    assert plan(odd, sm90, {"dropout": True}).config.gluon_lanes_bwd == 3      # branch 2 in the `tl` kernel
    with pytest.raises(dilgen.SpecError, match="gluon_dkdv_dq cannot run here: a branch's dK/dV runs in the `tl`"):
        plan(odd, sm90, {"dropout": True, "gluon_dkdv_dq": True})             # that kernel adds no dQ
    every_odd = _spec("gdl", causal=causal, segment_lengths=[1000, 4096, 8192], dilation_rates=[1, 3, 48])
    assert plan(every_odd, sm90, {"dropout": True}).config.gluon_lanes_bwd is None
    assert not plan(spec, get_target("sm80"), {"dropout": True}).config.gluon_dkdv_lanes
    assert plan(spec, sm90, {"dropout": True, "gluon_dkdv_lanes": 2}).config.gluon_lanes_bwd == 2
    text = codegen.emit(plan(spec, sm90, {"dropout": True, "gluon_dkdv_lanes": True}))
    assert "gluon_dkdv_lanes=gdl_gluon_dkdv_lanes" in text
    assert "def gdl_gluon_dkdv_lanes_rows_block(" in text and "_keep64(" in text
    with pytest.raises(dilgen.SpecError, match="gluon_lanes_bwd cannot run here: a ring"):
        plan(_spec("gdl", causal=causal, ring_size=2), sm90, {"dropout": True, "gluon_dkdv_lanes": True})
    with pytest.raises(dilgen.SpecError, match="8 stages at head_dim 128 need"):
        plan(spec, sm90, {"dropout": True, "gluon_dkdv_lanes": 8})


@needs_gluon
def test_the_dropout_plans_lanes_are_gluon_by_default_and_where_a_tuning_asks():
    """A causal spec's branches as lanes (as its plain plan runs them), the forward, dq and
    dK/dV each a Gluon lane kernel with the forward's coins: by default where all of them run,
    and where {"gluon_lanes": true} asks; {"gluon_lanes": false} declines them; a non-causal
    spec, whose branches are lattice branches, refused by name."""
    sm90 = get_target("sm90")
    for tuning in ({}, {"gluon_lanes": True}):
        p = plan(_spec("gdf", causal=True), sm90, {"dropout": True, **tuning})
        assert all(b.lanes for b in p.branches) and p.config.gluon_lanes == (128, 3)
        assert p.config.gluon_lanes_bwd == 3 and p.config.gluon_dkdv_lanes and p.config.gluon_dq is None
    text = codegen.emit(p)
    for role in ("gluon_lanes", "gluon_dkdv_lanes", "gluon_dq_lanes"):
        assert f"{role}=gdf_{role}" in text
    declined = plan(_spec("gdf", causal=True), sm90, {"dropout": True, "gluon_lanes": False})
    assert not any(b.lanes for b in declined.branches) and declined.config.gluon_lanes is None
    assert declined.config.gluon_dkdv_lanes     # the per-branch dK/dV is still Gluon
    kept = plan(_spec("gdf", causal=True), sm90, {"dropout": True, "gluon_lanes": True, "gluon_dkdv_lanes": False})
    assert kept.config.gluon_lanes and not kept.config.gluon_dkdv_lanes
    with pytest.raises(dilgen.SpecError, match="gluon_lanes cannot run here: the plan has no lane branch"):
        plan(_spec("gdf"), sm90, {"dropout": True, "gluon_lanes": True})


@needs_gluon
@pytest.mark.parametrize("causal", [False, True])
def test_the_dropout_plans_dkdv_adds_dq_where_a_tuning_asks(causal):
    """{"gluon_dkdv_dq": true}: the dropout plan's Gluon per-branch dK/dV adds each block's dQ
    share into a float32 buffer (the module's kernel takes DQ, its blocks TMA reduce-adds); off by
    default; refused by name with the `tl` dK/dV and for a value not a bool."""
    sm90 = get_target("sm90")
    spec = _spec("gdq", causal=causal)
    assert not plan(spec, sm90, {"dropout": True}).config.gluon_dkdv_dq
    p = plan(spec, sm90, {"dropout": True, "gluon_dkdv_dq": True})
    assert p.config.gluon_dkdv_dq and p.config.gluon_dkdv_lanes
    text = codegen.emit(p)
    assert "Lse, Delta, DK, DV, DQ, N, W: gl.constexpr" in text and "gdq_gluon_dq_add(dq_desc, [dq_row, dq_col, 0]" in text
    assert "_dq_add" not in codegen.emit(plan(spec, sm90, {"dropout": True}))
    for tuning, why in (({"dropout": True, "gluon_dkdv_lanes": False, "gluon_dkdv_dq": True}, "is not Gluon"),
                        ({"dropout": True, "gluon_dkdv_dq": 1}, "takes true or false")):
        with pytest.raises(dilgen.SpecError, match=f"tuning gluon_dkdv_dq.*{why}"):
            plan(spec, sm90, tuning)
    with pytest.raises(dilgen.SpecError, match="gluon_dkdv_dq cannot run here"):
        plan(spec, get_target("sm80"), {"dropout": True, "gluon_dkdv_dq": True})


@needs_gluon
@pytest.mark.parametrize("head_dim, causal, adds_dq", [(128, False, False), (64, True, False), (128, False, True),
                                                       (64, True, True)])
def test_the_dropout_lane_dkdv_compiles_for_sm90_without_a_gpu(tmp_path, head_dim, causal, adds_dq):
    """Under both CI Tritons: the queries-along-rows blocks with the forward's coins compile for
    sm90; each consumer's (P Z)^T and dS^T are stored, fenced and barriered before the wgmma
    that reads them (a 128-thread named barrier: the warpgroup's); with gluon_dkdv_dq, dQ's
    shares reach the float32 buffer by TMA reduce-adds (the template's _dq_add), and by nothing
    else, in the target's shared memory."""
    import re
    from triton.experimental.gluon import language as gl
    spec = _spec(f"gdl_{head_dim}_{int(causal)}_{int(adds_dq)}", head_dim=head_dim, causal=causal)
    tuning = {"dropout": True, "gluon_dkdv_lanes": True, **({"gluon_dkdv_dq": True} if adds_dq else {})}
    mod = load_emitted(tmp_path / f"{spec.name}.py", codegen.emit(plan(spec, get_target("sm90"), tuning)))
    layout = gl.NVMMASharedLayout.get_default_for([64, 1, head_dim], gl.bfloat16)
    desc = f"tensordesc<bf16[64, 1, {head_dim}],{layout!r}>"
    sig = {**{x: desc for x in ("q_desc", "do_desc", "k_desc", "v_desc")}, "Lse": "*fp32", "Delta": "*fp32",
           "DK": "*bf16", "DV": "*bf16", **({"DQ": f"tensordesc<fp32[64, 1, 64],{gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)!r}>"}
              if adds_dq else {}), "N": "i32",
           **{x: "constexpr" for x in ("W", "R", "NO", "ACCUMULATE", "CLEAR", "BI")}, **DROP_ARGS}
    kernel = compile_sm90(getattr(mod, f"{spec.name}_gluon_dkdv_lanes"), sig,
                          {"W": 4096, "R": 2, "NO": 2, "ACCUMULATE": True, "CLEAR": False, "BI": 1}, launch_pdl=True)
    if not adds_dq:     # its blocks add dQ as they go: runtime.gluon_launch.lane_options launches it without PDL
        assert_waits_before_touching_outputs(kernel.asm["ttgir"], True, forward=False)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "-845247145" in ptx     # Philox's round multiplier B, as an s32
    assert re.search(r"fence\.proxy\.async[^\n]*\n(?:[^\n]*\n){0,3}?\s*bar\.sync\s+\d+, 128;", ptx)
    assert ("cp.reduce.async.bulk.tensor.3d" in ptx) == adds_dq
    assert not re.search(r"(red|atom)\.[a-z.]*add\.f32", ptx)                # no element-wise atomics
    assert kernel.metadata.shared <= get_target("sm90").smem_bytes


@needs_gluon
def test_the_dropout_lane_forward_and_dq_compile_for_sm90_without_a_gpu(tmp_path):
    """Under both CI Tritons: the causal lane forward and dq with the forward's coins (their
    conversions trivial, the template's assert_trivial), writing and merging, each waiting for
    the launch before where the lanes without dropout do (programmatic dependent launch: the
    coins' seed and offsets are inputs, final before the chain's first launch)."""
    from triton.experimental.gluon import language as gl
    spec = _spec("gdf_c", causal=True)
    p = plan(spec, get_target("sm90"), {"dropout": True, "gluon_lanes": True})
    mod = load_emitted(tmp_path / f"{spec.name}.py", codegen.emit(p))

    def desc(rows: int) -> str:
        return f"tensordesc<bf16[{rows}, 1, 128],{gl.NVMMASharedLayout.get_default_for([rows, 1, 128], gl.bfloat16)!r}>"
    keys = p.config.gluon_lanes[0]
    lanes = {"q_desc": desc(64), "o_desc": desc(64), "k_desc": desc(keys), "v_desc": desc(keys), "Out": "*bf16",
             "Lse": "*fp32", "N": "i32", **{x: "constexpr" for x in ("W", "R", "ACCUMULATE", "CLEAR", "BI")}, **DROP_ARGS}
    dq = {**{x: desc(64) for x in ("q_desc", "do_desc", "k_desc", "v_desc")}, "Lse": "*fp32", "Delta": "*fp32",
          "DQ": "*bf16", "N": "i32", **{x: "constexpr" for x in ("W", "R", "ACCUMULATE", "CLEAR", "BI")}, **DROP_ARGS}
    assert p.config.gluon_pdl
    for role, sig, consts in (("lanes", lanes, {"CLEAR": False}), ("dq_lanes", dq, {"CLEAR": False})):
        for merge in (True, False):
            kernel = compile_sm90(getattr(mod, f"{spec.name}_gluon_{role}"), sig,
                                  {"W": 4096, "R": 2, "ACCUMULATE": merge, "BI": 1, **consts}, launch_pdl=True)
            assert "wgmma.mma_async" in kernel.asm["ptx"] and "-845247145" in kernel.asm["ptx"], role
            assert_waits_before_touching_outputs(kernel.asm["ttgir"], merge, forward=role == "lanes")


@needs_gluon
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_dropout_dq_compiles_for_sm90_without_a_gpu(tmp_path, head_dim):
    """Under both CI Tritons (the GPU machines' 3.6 and pip's 3.9): the coins' joins and reshape
    move no data (the template's assert_trivial), and the PTX has Philox's rounds."""
    from triton.experimental.gluon import language as gl
    spec = _spec(f"gd_{head_dim}", head_dim=head_dim)
    mod = load_emitted(tmp_path / f"{spec.name}.py",
                       codegen.emit(plan(spec, get_target("sm90"), {"dropout": True, "gluon_dq": True})))
    layout = gl.NVMMASharedLayout.get_default_for([64, 1, head_dim], gl.bfloat16)
    desc = f"tensordesc<bf16[64, 1, {head_dim}],{layout!r}>"
    sig = {"q_desc": desc, "do_desc": desc, **{f"{x}{i}": desc for x in "kv" for i in range(3)},
           "Lse": "*fp32", "Delta": "*fp32", "DQ": "*bf16", "N": "i32", **DROP_ARGS}
    kernel = compile_sm90(getattr(mod, f"{spec.name}_gluon_dq"), sig)
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "-845247145" in ptx     # Philox's round multiplier B, as an s32


@needs_gluon
def test_the_launch_models_dropout_kernels_specialize_as_the_runtimes(cache_dir):
    """`dilgen build --dropout` compiles the Gluon forward and dQ a call then launches: the
    launch model's arguments (aot.launch_model) and a call's (runtime.gluon_launch, then
    dropout_args at two drop rates and row offsets, which do not specialize) give one
    specialization each."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from dilgen.aot.binder import specialize
    from dilgen.aot.launch_model import predicted_launches
    from dilgen.compiler import build
    from dilgen.runtime.dropout_call import dropout_args
    from dilgen.runtime.gluon_launch import OPTIONS, gluon_args, gluon_dkdv_lanes_args, gluon_dq_args
    spec = _spec("gd_aot", segment_lengths=[256, 512], dilation_rates=[1, 2], num_heads=4, num_kv_heads=2)
    attn = build(spec, get_target("sm90"), {"dropout": True, "gluon_dq": True,
                                            "gluon_dkdv_lanes": True}).module.attention
    launches = predicted_launches(attn, 1024)
    models = {x.role: x for x in launches if x.role in ("gluon_forward", "gluon_dq")}
    assert set(models) == {"gluon_forward", "gluon_dq"}
    q = torch.randn(2, 1024, 4, 128, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1024, 2, 128, dtype=torch.bfloat16), torch.randn(2, 1024, 2, 128, dtype=torch.bfloat16)
    f32, backend = torch.empty(2, 4, 1024), make_backend(GPUTarget("cuda", 90, 32))
    calls = {"gluon_forward": (attn.gluon_fn, gluon_args(attn.plan, q, k, v, torch.empty_like(q), f32, 2, 1024)),
             "gluon_dq": (attn.gluon_dq_fn, gluon_dq_args(attn.plan, q, k, v, q, f32, f32, q, 2, 1024))}
    for role, (fn, args) in calls.items():
        want = specialize(fn, backend, models[role].args, models[role].launch_opts).desc
        for p, pos0 in ((0.1, 3), (0.25, 0)):   # cuts 6554 and 16384: one divides by 16
            seed, cut, scale, n, _, streams = dropout_args(attn, q, p, 7)
            assert specialize(fn, backend, (*args, seed, cut, scale, n, pos0, streams), OPTIONS).desc == want, role
    lanes = [x for x in launches if x.role == "gluon_dkdv_lanes"]     # one per branch, the first writing
    assert len(lanes) == 2
    for model, br, accumulate in zip(lanes, attn.plan["branches"], (False, True)):
        want = specialize(attn.gluon_dkdv_lanes_fn, backend, model.args, model.launch_opts).desc
        seed, cut, scale, n, _, streams = dropout_args(attn, q, 0.1, 7)
        args = gluon_dkdv_lanes_args(attn.plan, q, k, v, q, f32, f32, k, v, 2, 1024, br, accumulate,
                                     not accumulate, (seed, cut, scale, n, 3, streams))
        assert specialize(attn.gluon_dkdv_lanes_fn, backend, args, OPTIONS).desc == want, br["index"]


@needs_gluon
def test_the_launch_models_dropout_lane_kernels_specialize_as_the_runtimes(cache_dir):
    """A causal dropout plan's Gluon lane kernels ({"gluon_lanes": true}): the launch model's
    arguments and a call's (the branch's index a constexpr, then dropout_args) give one
    specialization per launch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from dilgen.aot.binder import specialize
    from dilgen.aot.launch_model import predicted_launches
    from dilgen.compiler import build
    from dilgen.runtime.dropout_call import dropout_args
    from dilgen.runtime.gluon_launch import gluon_dkdv_lanes_args, gluon_dq_lanes_args, gluon_lanes_args, lane_options
    spec = _spec("gdf_aot", segment_lengths=[256, 512], dilation_rates=[1, 2], num_heads=4, num_kv_heads=2,
                 causal=True)
    attn = build(spec, get_target("sm90"), {"dropout": True, "gluon_lanes": True}).module.attention
    q = torch.randn(2, 1024, 4, 128, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1024, 2, 128, dtype=torch.bfloat16), torch.randn(2, 1024, 2, 128, dtype=torch.bfloat16)
    f32, backend, plan_ = torch.empty(2, 4, 1024), make_backend(GPUTarget("cuda", 90, 32)), attn.plan
    seed, cut, scale, n, _, streams = dropout_args(attn, q, 0.1, 7)
    drop = (seed, cut, scale, n, 5, streams)
    calls = {"gluon_lanes": (attn.gluon_lanes_fn, lambda br, acc: gluon_lanes_args(
                 plan_, q, k, v, q, f32, 2, 1024, br, acc, False, drop)),
             "gluon_dq_lanes": (attn.gluon_dq_lanes_fn, lambda br, acc: gluon_dq_lanes_args(
                 plan_, q, k, v, q, f32, f32, q, 2, 1024, br, acc, dropout=drop)),
             "gluon_dkdv_lanes": (attn.gluon_dkdv_lanes_fn, lambda br, acc: gluon_dkdv_lanes_args(
                 plan_, q, k, v, q, f32, f32, k, v, 2, 1024, br, acc, not acc, drop))}
    models = [x for x in predicted_launches(attn, 1024) if x.role in calls]
    assert sorted({x.role for x in models}) == sorted(calls)
    for role, (fn, args) in calls.items():
        launches = [x for x in models if x.role == role]
        assert len(launches) == 2, role                  # one per branch, the first writing
        for model, br, accumulate in zip(launches, plan_["branches"], (False, True)):
            want = specialize(fn, backend, model.args, model.launch_opts).desc
            opts = lane_options(plan_, dkdv=role == "gluon_dkdv_lanes")     # as runtime.gluon_launch launches them
            assert opts["launch_pdl"] == (role != "gluon_dkdv_lanes" or bool(plan_["dkdv_first_writes"]))
            assert specialize(fn, backend, args(br, accumulate), opts).desc == want, (role, br["index"])


@needs_gluon
def test_the_launch_models_dkdv_adding_dq_specializes_as_the_runtimes(cache_dir):
    """{"gluon_dkdv_dq": true}: every branch's Gluon dK/dV adds (ACCUMULATE, into zeroed dk and
    dv) and takes a descriptor over the float32 dQ after dv (q's view, (64, 1, 64) boxes), in
    the launch model as in a call."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from dilgen.aot.binder import specialize
    from dilgen.aot.launch_model import predicted_launches
    from dilgen.compiler import build
    from dilgen.runtime.dropout_call import dropout_args
    from dilgen.runtime.gluon_launch import OPTIONS, gluon_dkdv_lanes_args
    spec = _spec("gdq_aot", segment_lengths=[256, 512], dilation_rates=[1, 2], num_heads=4, num_kv_heads=2)
    attn = build(spec, get_target("sm90"), {"dropout": True, "gluon_dkdv_dq": True}).module.attention
    q = torch.randn(2, 1024, 4, 128, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1024, 2, 128, dtype=torch.bfloat16), torch.randn(2, 1024, 2, 128, dtype=torch.bfloat16)
    f32, backend, plan_ = torch.empty(2, 4, 1024), make_backend(GPUTarget("cuda", 90, 32)), attn.plan
    seed, cut, scale, n, _, streams = dropout_args(attn, q, 0.1, 7)
    drop, dq32 = (seed, cut, scale, n, 5, streams), torch.zeros(q.shape)
    launches = [x for x in predicted_launches(attn, 1024) if x.role == "gluon_dkdv_lanes"]
    assert len(launches) == 2
    for model, br in zip(launches, plan_["branches"]):
        args = gluon_dkdv_lanes_args(plan_, q, k, v, q, f32, f32, k, v, 2, 1024, br, True, dropout=drop, dq32=dq32)
        r = br["r"]
        assert args[8].base is dq32 and list(args[8].shape) == [2 * 1024 // r, r * 4, 128]
        assert list(args[8].block_shape) == [64, 1, 64]
        want = specialize(attn.gluon_dkdv_lanes_fn, backend, model.args, model.launch_opts).desc
        assert specialize(attn.gluon_dkdv_lanes_fn, backend, args, OPTIONS).desc == want, br["index"]
    with pytest.raises(ValueError, match="no float32 dQ was given"):
        gluon_dkdv_lanes_args(plan_, q, k, v, q, f32, f32, k, v, 2, 1024, plan_["branches"][0], True, dropout=drop)


VARIANTS = {"r6": dict(dilation_rates=[1, 2, 6]), "no_r1": dict(dilation_rates=[4, 8, 16]),
            "hilbert": dict(hilbert={"scope": "sequence", "grid": [32, 64]})}


@on_sm90
@pytest.mark.parametrize("head_dim, causal, knob", [(128, False, "gluon_dkdv_lanes"), (64, False, "gluon_dkdv_lanes"),
                                                    (128, True, "gluon_dkdv_lanes"), (128, True, "gluon_lanes"),
                                                    (128, False, "gluon_dkdv_dq"), (64, True, "gluon_dkdv_dq"),
                                                    (128, False, "gluon_dkdv_lanes r6"), (128, True, "gluon_lanes r6"),
                                                    (128, False, "gluon_dkdv_lanes no_r1"),
                                                    (128, True, "gluon_lanes no_r1"), (128, False, "lanes"),
                                                    (128, False, "gluon_dkdv_lanes hilbert")])
def test_gluon_dropout_lane_kernels_match_the_float64_reference_on_sm90(head_dim, causal, knob, monkeypatch):
    """The per-branch Gluon dK/dV ({"gluon_dkdv_lanes": true}), a causal spec's lane forward,
    dq and dK/dV ({"gluon_lanes": true}), and the dK/dV adding dQ ({"gluon_dkdv_dq": true}: no
    dq kernel launched), under the same mask as the float64 reference: every branch's launch
    of them taken, out and every gradient exact. "r6": the last branch's r = 6 does not divide
    w, so its launches are the `tl` kernels' beside the Gluon ones, drawing the same coins.
    "no_r1" (r 4, 8, 16): the first launches write 0 into the rows and keys no branch keeps
    (dK, dV, dQ poisoned first). "lanes" ({"lanes": "all"}, non-causal): every branch a lane
    branch, so the Gluon lane dq runs beside the dK/dV, in its non-causal form (every key block).
    "hilbert": a sequence curve, its rows permuted around the kernels (the coins count them in
    curve order)."""
    from dilgen.reference import differentiable_reference
    from dilgen.runtime import backward, forward
    from dilgen.runtime.dropout_call import _DropoutFunction, dropout_args
    from dilgen.runtime.registry import twin
    knob, _, rates = knob.partition(" ")
    spec = _spec(f"gdl_{head_dim}_{int(causal)}_{knob}{rates}", head_dim=head_dim, causal=causal,
                 **{**SMALL, **VARIANTS.get(rates, {})})
    taken = {}
    spied = [(backward, "gluon_dkdv_lanes_launch")] + ([(forward, "gluon_lanes_launch"),
                                                        (backward, "gluon_dq_lanes_launch")] if knob == "gluon_lanes" else
                                                       [(backward, "gluon_dq_lanes_launch")] if knob == "lanes" else [])
    for module, name in spied:
        def spy(*args, real=getattr(module, name), name=name):
            got = real(*args)
            taken.setdefault(name, []).append(got is not None)
            return got
        monkeypatch.setattr(module, name, spy)
    if knob == "gluon_dkdv_dq":         # dQ comes from the dK/dV's blocks alone
        forbid_dq_kernels(monkeypatch)
    gen = torch.Generator().manual_seed(head_dim + causal)
    q, k, v = (torch.randn(1, 2048, h, head_dim, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
               for h in (8, 2, 2))
    attn = dilgen.compile(spec).compiled_for(q.device).attention
    drop = twin(attn, q.device, tuning={"dropout": True, **({"lanes": "all"} if knob == "lanes" else {knob: True})})
    p, seed = 0.2, 70 + head_dim
    out, lse = _DropoutFunction.apply(q, k, v, drop, dropout_args(drop, q, p, seed), None)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out)
    (out * grad).sum().backward()       # dK and dV poisoned first (conftest): an unwritten key fails
    assert taken == {name: [True, True, rates != "r6"] for _, name in spied}, taken
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref_out, _ = differentiable_reference(*ref_in, spec, dropout_p=p, seed=seed)
    (ref_out * grad.double().cpu()).sum().backward()
    tol = TOL["bfloat16"]
    assert rel_error(out, ref_out) < tol
    for mine, ref in zip((q, k, v), ref_in):
        assert torch.isfinite(mine.grad).all() and rel_error(mine.grad, ref.grad) < 2 * tol


@on_sm90
@pytest.mark.parametrize("head_dim, gluon_dq", [(64, False), (128, False), (64, True), (128, True)])
def test_gluon_dropout_matches_the_float64_reference_on_sm90(head_dim, gluon_dq, monkeypatch):
    """The Gluon forward (and dQ where asked) under the same mask as the float64 reference:
    out, lse and every gradient (dK/dV in the `tl` kernel)."""
    from dilgen.reference import differentiable_reference
    from dilgen.runtime import backward, forward
    from dilgen.runtime.dropout_call import _DropoutFunction, dropout_args
    from dilgen.runtime.registry import twin
    spec = _spec(f"gd_{head_dim}_{int(gluon_dq)}", head_dim=head_dim, **SMALL)
    taken = {"gluon_launch": [], "gluon_dq_launch": []}
    for module, name in ((forward, "gluon_launch"), (backward, "gluon_dq_launch")):
        def spy(*args, real=getattr(module, name), name=name):
            got = real(*args)
            taken[name].append(got is not None)
            return got
        monkeypatch.setattr(module, name, spy)
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(1, 2048, h, head_dim, generator=gen).to(torch.bfloat16).cuda().requires_grad_()
               for h in (8, 2, 2))
    attn = dilgen.compile(spec).compiled_for(q.device).attention
    drop = twin(attn, q.device, tuning={"dropout": True, "gluon_dq": gluon_dq})
    p, seed = 0.2, 60 + head_dim
    out, lse = _DropoutFunction.apply(q, k, v, drop, dropout_args(drop, q, p, seed), None)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out)
    (out * grad).sum().backward()
    assert taken == {"gluon_launch": [True], "gluon_dq_launch": [gluon_dq]}, taken
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = differentiable_reference(*ref_in, spec, dropout_p=p, seed=seed)
    (ref_out * grad.double().cpu()).sum().backward()
    tol = TOL["bfloat16"]
    assert rel_error(out, ref_out) < tol and rel_error(lse.cpu(), ref_lse) < tol
    for mine, ref in zip((q, k, v), ref_in):
        assert rel_error(mine.grad, ref.grad) < 2 * tol
    plain = differentiable_reference(*(t.detach() for t in ref_in), spec)[0]
    assert rel_error(out, plain) > 10 * tol          # the mask mattered
