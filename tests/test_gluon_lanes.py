"""sm90's Gluon causal lanes (KernelConfig.gluon_lanes, templates/gluon_lanes.py.jinja) and causal
backward per branch (KernelConfig.gluon_lanes_bwd, templates/gluon_lanes_bwd.py.jinja): when the
planner takes them and what it refuses by name, the kernels compiled for sm90 without a GPU (both
CI Tritons), their `dilgen build` launches; on an sm90 GPU, out, lse and gradients against the
float64 reference with the Gluon kernels launched for every branch, and the `tl` kernels where a
call cannot take them."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import triton

import dilgen
from dilgen import codegen
from dilgen.kernel_names import kernel_families
from dilgen.planner import plan
from dilgen.spec import SpecError
from dilgen.targets import get_target

from conftest import assert_waits_before_touching_outputs, check_against_reference, forbid_dq_kernels, needs_gluon, on_sm90

GOLDEN = Path(__file__).parent / "golden" / "gluon_lanes_sm90.py"           # the lanes
GOLDEN_BWD = Path(__file__).parent / "golden" / "gluon_lanes_bwd_sm90.py"   # dK/dV
GOLDEN_DQ = Path(__file__).parent / "golden" / "gluon_lanes_dq_sm90.py"     # to the end: the lane dq
MARK = "# ---- sm90: the lane branches in Gluon"
MARK_BWD = "# ---- sm90: the dK, dV and dQ per branch in Gluon"
MARK_DQ = "# ---- sm90: the lane dq per branch in Gluon"


def _spec(**over):
    fields = dict(name="gla", num_heads=16, num_kv_heads=4, head_dim=128, segment_lengths=[2048, 4096, 8192],
                  dilation_rates=[1, 2, 4], dtype="bfloat16", causal=True)
    fields.update(over)
    return dilgen.Spec(**fields)


def test_lane_launches_go_with_pdl_where_what_they_read_first_is_final():
    """KernelConfig.gluon_pdl (sm90's default with the Gluon lanes, a dropout plan's too, a tuning
    declines it): the lane forward and dq launch with programmatic dependent launch; the dK/dV only
    where its first launch writes (Plan.dkdv_first_writes; else that launch adds, right after the
    preprocess whose Delta it reads before its wait) and adds no dQ."""
    from dilgen.runtime.gluon_launch import OPTIONS, PDL_OPTIONS, lane_options
    sm90 = get_target("sm90")
    p = plan(_spec(), sm90)
    assert p.config.gluon_pdl and p.dkdv_first_writes
    assert not plan(_spec(), sm90, {"gluon_pdl": False}).config.gluon_pdl
    assert not plan(_spec(), get_target("sm80")).config.gluon_pdl
    with pytest.raises(SpecError, match="gluon_pdl cannot run here: no branch runs in the Gluon lanes"):
        plan(_spec(), sm90, {"gluon_pdl": True, "gluon_lanes": False})
    with pytest.raises(SpecError, match="gluon_pdl takes true or false"):
        plan(_spec(), sm90, {"gluon_pdl": 1})
    assert plan(_spec(), sm90, {"dropout": True}).config.gluon_pdl
    assert not plan(_spec(), sm90, {"dropout": True, "gluon_pdl": False}).config.gluon_pdl
    js = p.to_json()
    assert lane_options(js) == lane_options(js, dkdv=True) == PDL_OPTIONS and PDL_OPTIONS["launch_pdl"]
    assert lane_options({**js, "dkdv_first_writes": False}, dkdv=True) == OPTIONS
    assert lane_options({**js, "dkdv_first_writes": False}) == PDL_OPTIONS
    assert lane_options({**js, "config": {**js["config"], "gluon_dkdv_dq": True}}, dkdv=True) == OPTIONS
    assert lane_options(plan(_spec(), sm90, {"gluon_pdl": False}).to_json()) == OPTIONS
    assert kernel_families(p).endswith("; the Gluon lane launches overlap (programmatic dependent launch)")


@needs_gluon
def test_default_for_causal_lanes_and_taken_when_asked():
    sm90 = get_target("sm90")
    assert plan(_spec(), sm90).config.gluon_lanes == (128, 3)
    assert plan(_spec(), sm90, {"gluon_lanes": [64, 4]}).config.gluon_lanes == (64, 4)
    assert plan(_spec(), sm90, {"gluon_lanes": False}).config.gluon_lanes is None
    assert plan(_spec(), get_target("sm80")).config.gluon_lanes is None
    low = _spec(head_dim=64, num_kv_heads=16, segment_lengths=[1024, 2048, 4096])
    assert plan(low, sm90).config.gluon_lanes is None                     # no lane branch: the fused kernel
    assert plan(low, sm90, {"lanes": "all"}).config.gluon_lanes == (128, 3)
    assert plan(_spec(causal=False), sm90).config.gluon_lanes is None      # the Gluon forward's work
    for causal in (True, False):     # no r = 1 branch: every branch as lanes, the first clears the gaps
        no_r1 = plan(_spec(dilation_rates=[2, 4, 8], causal=causal), sm90, {"gluon_lanes": True})
        assert no_r1.config.gluon_lanes == (128, 3) and no_r1.gap_lane == 0
        # causal: level with the `tl` lanes, so asked for; non-causal at head_dim 128: in place of
        # the fused dK/dV, queries along rows (Target.gluon_lanes_bwd_no_r1)
        assert (no_r1.config.gluon_lanes_bwd is None) == causal and not no_r1.fused_dkdv
        assert no_r1.config.dkdv_rows_first == (not causal)
        asked = plan(_spec(dilation_rates=[2, 4, 8], causal=causal), sm90, {"gluon_lanes_bwd": True, "fused_dkdv": False})
        assert asked.config.gluon_lanes_bwd == 4 and asked.config.gluon_dkdv_lanes and asked.dkdv_first_writes
    for declined in ({"gluon_lanes_bwd": False}, {"fused_dkdv": True}):    # the fused `tl` dK/dV, as asked
        kept = plan(_spec(dilation_rates=[2, 4, 8], causal=False), sm90, declined)
        assert kept.fused_dkdv and kept.config.gluon_lanes_bwd is None
    low_no_r1 = plan(_spec(dilation_rates=[2, 4, 8], causal=False, head_dim=64), sm90)
    assert low_no_r1.fused_dkdv and low_no_r1.config.gluon_lanes_bwd is None       # head_dim 64: not measured
    for long_lane, rates in ((4096, [2]), (131072, [8])):    # lanes of 1024 < w / r keys: the fused dK/dV
        long_no_r1 = plan(_spec(segment_lengths=[long_lane], dilation_rates=rates, causal=False), sm90)
        assert long_no_r1.fused_dkdv and long_no_r1.config.gluon_lanes_bwd is None, long_lane
    with pytest.raises(SpecError, match="gluon_lanes_bwd cannot run here: the backward runs the fused dK/dV"):
        plan(_spec(dilation_rates=[2, 4, 8], causal=False), sm90, {"gluon_lanes_bwd": True, "fused_dkdv": True})
    assert plan(_spec(dilation_rates=[2, 4, 8], causal=False), sm90).config.gluon_lanes == (128, 3)
    assert plan(_spec(dilation_rates=[2, 4, 8]), sm90).config.gluon_lanes is None    # causal: level, asked for
    longnet = _spec(segment_lengths=[2048, 8192, 32768], dilation_rates=[1, 6, 12])   # r = 6, 12 do not divide w
    assert plan(longnet, sm90).config.gluon_lanes == (128, 3)             # branch 0 Gluon, 1, 2 `tl`
    assert plan(longnet, sm90).config.gluon_lanes_bwd is None
    assert plan(_spec(), sm90).config.gluon_lanes_bwd == 4
    assert plan(low, sm90).config.gluon_lanes_bwd == 4 and plan(low, sm90).config.gluon_dkdv_lanes  # head_dim 64
    assert plan(low, sm90, {"gluon_lanes_bwd": False}).config.gluon_lanes_bwd is None
    assert plan(_spec(), sm90, {"gluon_lanes_bwd": 2}).config.gluon_lanes_bwd == 2
    assert plan(_spec(causal=False), sm90).config.gluon_lanes_bwd is None
    assert plan(_spec(), sm90).config.gluon_dkdv_lanes
    assert not plan(_spec(), sm90, {"gluon_dkdv_lanes": False}).config.gluon_dkdv_lanes     # the lane dq only
    assert not plan(_spec(), sm90, {"gluon_lanes_bwd": False}).config.gluon_dkdv_lanes
    with pytest.raises(SpecError, match="gluon_dkdv_lanes needs the Gluon causal backward"):
        plan(longnet, sm90, {"gluon_dkdv_lanes": True})           # r = 6 and 12: no Gluon causal backward
    # a branch whose w / r is no multiple of 128 runs in the `tl` kernels beside the Gluon ones
    part = plan(_spec(segment_lengths=[128, 512], dilation_rates=[1, 8]), sm90, {"gluon_lanes_bwd": True})
    assert part.config.gluon_lanes_bwd == 4 and part.config.gluon_dkdv_lanes
    assert "dK/dV Gluon (per branch, 4 stages, queries along rows; tl for branch 1)" in kernel_families(part)
    keys = plan(_spec(head_dim=64, num_kv_heads=16, segment_lengths=[1024, 2048, 4096]), sm90)   # keys along rows
    assert "dK/dV Gluon (per branch, 4 stages)" in kernel_families(keys)
    assert "dQ Gluon lanes (4 stages; tl for branch 1)" in kernel_families(part)
    e_causal = _spec(num_kv_heads=16, segment_lengths=[2048, 4096, 8192, 16384, 32768], dilation_rates=[1, 2, 4, 6, 12])
    assert plan(e_causal, sm90).config.gluon_lanes_bwd == 4          # config E causal: r = 6, 12 over rows
    names = kernel_families(plan(e_causal, sm90))
    assert "lanes Gluon over rows (branches 3, 4)" in names and "tl for" not in names and "tl lanes" not in names
    assert "tl for branches 3, 4" in kernel_families(plan(e_causal, sm90, {"dropout": True}))   # no packed kernels
    with pytest.raises(SpecError, match="gluon_lanes_bwd cannot run here: no branch has r . w with w / r a multiple"):
        plan(_spec(segment_lengths=[64, 512], dilation_rates=[1, 8]), sm90, {"gluon_lanes_bwd": True})


@needs_gluon
@pytest.mark.parametrize("over, tuning, why", [
    (dict(causal=False), {}, "the plan has no lane branch"),      # the Gluon forward's work
    (dict(hilbert={"scope": "segment"}), {"curve_rows": False}, "Hilbert orders"),   # curve lanes: test_gluon_curve
    (dict(dtype="float32"), {}, "float16 or bfloat16"),
    (dict(head_dim=32), {}, "head_dim 64 or 128, not 32"),
    (dict(segment_lengths=[64, 512], dilation_rates=[1, 8]), {}, "no lane branch has r | w with w / r a multiple"),
    (dict(head_dim=64, num_kv_heads=16, segment_lengths=[1024, 2048], dilation_rates=[1, 2]), {}, "no lane branch"),
    (dict(), {"gluon_lanes": [128, 8]}, "need 558080 bytes"),
    (dict(), {"gluon_lanes": [32, 3]}, "keys per block must be 64 or 128"),
])
def test_refused_by_name_where_it_cannot_run(over, tuning, why):
    asked = {"gluon_lanes": True, **tuning}
    with pytest.raises(SpecError, match=why):
        plan(_spec(**over), get_target("sm90"), asked)
    if "gluon_lanes" not in tuning:
        assert plan(_spec(**over), get_target("sm90"), tuning).config.gluon_lanes is None   # not asked: tl


@needs_gluon
def test_generated_source_is_golden_and_stable():
    text = codegen.emit(plan(_spec(), get_target("sm90")))
    assert text == codegen.emit(plan(_spec(), get_target("sm90")))
    sections = ((GOLDEN, text[text.index(MARK):text.index(MARK_BWD)]),
                (GOLDEN_BWD, text[text.index(MARK_BWD):text.index(MARK_DQ)]), (GOLDEN_DQ, text[text.index(MARK_DQ):]))
    for golden, section in sections:
        if os.environ.get("DILGEN_UPDATE_GOLDEN") == "1":
            golden.write_text(section)
        assert section == golden.read_text(), (f"the Gluon lanes' source changed ({golden.name}); if on purpose, "
                                               "regenerate with DILGEN_UPDATE_GOLDEN=1 and review the diff")
    codegen.check_syntax(text)
    assert "gluon_lanes=gla_gluon_lanes,\n" in text and "gluon_dq_lanes=gla_gluon_dq_lanes,\n" in text
    assert "gluon_dq_lanes_packed=gla_gluon_dq_lanes_packed)" in text
    assert "gla_gluon_fwd" not in text


def _module(tmp_path, **over):
    path = tmp_path / f"gla_{abs(hash(repr(sorted(over.items())))) % 10**6}.py"
    path.write_text(codegen.emit(plan(_spec(**over), get_target("sm90"),
                                      {"gluon_lanes": True, "gluon_lanes_bwd": True,
                                       **({} if over.get("causal", True) else {"fused_dkdv": False}),
                                       **({"lanes": "all"} if over.get("head_dim") == 64 else {})})))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_gluon
@pytest.mark.parametrize("over", [dict(), dict(head_dim=64, num_kv_heads=16, segment_lengths=[1024, 2048, 4096]),
                                  dict(head_base=16, num_kv_heads=1), dict(causal=False, dilation_rates=[2, 4, 8])])
def test_compiles_for_sm90_without_a_gpu(tmp_path, over):
    """The three variants (writing, merging, writing and clearing the gaps) of a branch of rate
    2, under both CI Tritons."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    mod = _module(tmp_path, **over)
    D = over.get("head_dim", 128)

    def desc(rows):
        return f"tensordesc<bf16[{rows}, 1, {D}],{gl.NVMMASharedLayout.get_default_for([rows, 1, D], gl.bfloat16)!r}>"
    sig = {"q_desc": desc(64), "o_desc": desc(64), "k_desc": desc(128), "v_desc": desc(128), "Out": "*bf16",
           "Lse": "*fp32", "N": "i32", "W": "constexpr", "R": "constexpr", "ACCUMULATE": "constexpr",
           "CLEAR": "constexpr"}
    for merge, clear in ((False, False), (True, False), (False, True)):
        kernel = triton.compile(GluonASTSource(mod.gla_gluon_lanes, sig, {(7,): 4096, (8,): 2, (9,): merge,
                                                                          (10,): clear}),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
        assert kernel.metadata.shared <= get_target("sm90").smem_bytes
        assert_waits_before_touching_outputs(kernel.asm["ttgir"], merge, forward=True)
    box = desc(64)     # the lane backward: adding, and (no r = 1 branch) writing and clearing the gaps
    views = {"q_desc": box, "do_desc": box, "k_desc": box, "v_desc": box, "Lse": "*fp32", "Delta": "*fp32"}
    dkdv = {**views, "DK": "*bf16", "DV": "*bf16", "N": "i32", "W": "constexpr", "R": "constexpr", "NO": "constexpr",
            "ACCUMULATE": "constexpr", "CLEAR": "constexpr"}
    dq = {**views, "DQ": "*bf16", "N": "i32", "W": "constexpr", "R": "constexpr", "ACCUMULATE": "constexpr",
          "CLEAR": "constexpr"}
    for merge, clear in ((True, False),) + (((False, True),) if 1 not in over.get("dilation_rates", [1]) else ()):
        for fn, sig, consts in ((mod.gla_gluon_dkdv_lanes, dkdv, {(9,): 4096, (10,): 2, (11,): 2, (12,): merge,
                                                                  (13,): clear}),
                                (mod.gla_gluon_dq_lanes, dq, {(8,): 4096, (9,): 2, (10,): merge, (11,): clear})):
            kernel = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                                    options={"num_warps": 4, "maxnreg": 168, "launch_pdl": True})
            assert "wgmma.mma_async" in kernel.asm["ptx"] and kernel.metadata.shared <= get_target("sm90").smem_bytes
            assert kernel.metadata.launch_pdl
            assert_waits_before_touching_outputs(kernel.asm["ttgir"], merge, forward=False)



@needs_gluon
@pytest.mark.parametrize("head_dim, tuning", [(128, {"gluon_dkdv_dq": True}), (64, {"gluon_dkdv_dq": True}),
                                              (128, {"dkdv_rows_first": True})])
def test_dkdv_adding_dq_compiles_for_sm90_with_tma_reduce_adds(tmp_path, head_dim, tuning):
    """{"gluon_dkdv_dq": true} without dropout: the per-branch Gluon dK/dV's blocks hold queries
    along rows and add scale * dS K into a float32 DQ by TMA reduce-adds of (64, 1, 64) tiles
    (the template's _dq_add emits the `tl` descriptor's reduce, which the backend's TMA lowering
    stages in shared memory); under both CI Tritons it compiles for sm90 to
    cp.reduce.async.bulk.tensor, with no element-wise atomic, in the target's shared memory.
    Off by default; the fused dK/dV, which adds no dQ, refuses it by name.
    {"dkdv_rows_first": true}: the same blocks adding no dQ."""
    import re
    from triton.experimental.gluon import language as gl
    from conftest import compile_sm90, load_emitted
    adds_dq = tuning.get("gluon_dkdv_dq", False)
    sm90, spec = get_target("sm90"), _spec(name=f"gdq{head_dim}_{int(adds_dq)}", head_dim=head_dim)
    assert plan(spec, sm90).config.gluon_dkdv_lanes and not plan(spec, sm90).config.gluon_dkdv_dq
    planned = plan(spec, sm90, tuning)
    text = codegen.emit(planned)
    assert ("create_descriptor_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD" in text) == adds_dq and "_keep64(" not in text
    assert f"def {spec.name}_gluon_dkdv_lanes_rows_block(" in text
    mod = load_emitted(tmp_path / f"{spec.name}.py", text)
    box = f"tensordesc<bf16[64, 1, {head_dim}],{gl.NVMMASharedLayout.get_default_for([64, 1, head_dim], gl.bfloat16)!r}>"
    dq_box = f"tensordesc<fp32[64, 1, 64],{gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3)!r}>"
    sig = {**{x: box for x in ("q_desc", "do_desc", "k_desc", "v_desc")}, "Lse": "*fp32", "Delta": "*fp32",
           "DK": "*bf16", "DV": "*bf16", **({"DQ": dq_box} if adds_dq else {}), "N": "i32",
           **{x: "constexpr" for x in ("W", "R", "NO", "ACCUMULATE", "CLEAR")}}
    kernel = compile_sm90(getattr(mod, f"{spec.name}_gluon_dkdv_lanes"), sig,
                          {"W": 4096, "R": 2, "NO": 2, "ACCUMULATE": True, "CLEAR": False})
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and ("cp.reduce.async.bulk.tensor.3d" in ptx) == adds_dq
    assert not re.search(r"(red|atom)\.[a-z.]*add\.f32", ptx)
    assert kernel.metadata.shared <= sm90.smem_bytes, (planned.config.gluon_lanes_bwd, kernel.metadata.shared)
    with pytest.raises(SpecError, match="gluon_dkdv_dq cannot run here: a plan whose per-branch dK/dV is not Gluon"):
        plan(_spec(name="gdq_fused", causal=False), sm90, {"gluon_dkdv_dq": True})


@needs_gluon
def test_launch_model_has_a_gluon_lane_launch_per_branch(cache_dir):
    """Whole segments only: one launch per lane branch, the r = 1 branch's writing, the others
    merging, each specialized for its branch's (w, r)."""
    from dilgen.aot.launch_model import kernel_roles, predicted_launches
    from dilgen.compiler import build
    spec = _spec(name="gla_aot", segment_lengths=[256, 512], dilation_rates=[1, 2], num_heads=4, num_kv_heads=2)
    attn = build(spec, get_target("sm90")).module.attention
    assert dict((role, fn) for role, fn, _ in kernel_roles(attn))["gluon_lanes"] is attn.gluon_lanes_fn
    launches = [x for x in predicted_launches(attn, 1024) if x.role == "gluon_lanes"]
    assert [x.args[-4:] for x in launches] == [(256, 1, False, False), (512, 2, True, False)]
    dkdv = [x.args[-5:] for x in predicted_launches(attn, 1024) if x.role == "gluon_dkdv_lanes"]
    dq = [x.args[-4:] for x in predicted_launches(attn, 1024) if x.role == "gluon_dq_lanes"]
    assert dkdv == [(256, 1, 1, False, True), (512, 2, 2, True, False)]      # (w, r, NO, ACCUMULATE, CLEAR)
    assert dq == [(256, 1, False, False), (512, 2, True, False)]
    assert not [x for x in predicted_launches(attn, 768) if x.role == "gluon_lanes"]   # a short last segment
    mixed = build(_spec(name="gla_aot6", segment_lengths=[256, 1024], dilation_rates=[1, 6], num_heads=4,
                        num_kv_heads=2), get_target("sm90"), {"gluon_lanes": True}).module.attention
    assert [x.args[-4:] for x in predicted_launches(mixed, 1024) if x.role == "gluon_lanes"] == [(256, 1, False, False)]
    mha = build(_spec(name="gla_aot6_mha", segment_lengths=[256, 512, 1024], dilation_rates=[1, 2, 6], num_heads=4,
                      num_kv_heads=4), get_target("sm90")).module.attention     # L = 2: per-branch dK/dV, r = 6 `tl`
    assert [x.args[-5:] for x in predicted_launches(mha, 1024) if x.role == "gluon_dkdv_lanes"] == \
        [(256, 1, 1, False, True), (512, 2, 1, True, False)]      # NO = min(group 1, r)
    assert [x.args[-4:] for x in predicted_launches(mha, 1024) if x.role == "gluon_dq_lanes"] == \
        [(256, 1, False, False), (512, 2, True, False)]
    no_r1 = build(_spec(name="gla_aot_gap", segment_lengths=[512, 1024], dilation_rates=[2, 4], num_heads=4,
                        num_kv_heads=2, causal=False), get_target("sm90"),
                  {"gluon_lanes_bwd": True, "fused_dkdv": False}).module.attention
    assert [x.args[-4:] for x in predicted_launches(no_r1, 1024) if x.role == "gluon_lanes"] == \
        [(512, 2, False, True), (1024, 4, True, False)]     # the first writes the other offsets' rows too
    assert [x.args[-5:] for x in predicted_launches(no_r1, 1024) if x.role == "gluon_dkdv_lanes"] == \
        [(512, 2, 2, False, True), (1024, 4, 2, True, False)]   # and zeroes the keys no head of a group keeps
    assert [x.args[-4:] for x in predicted_launches(no_r1, 1024) if x.role == "gluon_dq_lanes"] == \
        [(512, 2, False, True), (1024, 4, True, False)]


@needs_gluon
def test_build_compiles_each_gluon_lane_kernel_as_the_runtime_specializes_it(cache_dir):
    """`dilgen build` compiles a binary per branch of each of the three kernels; the model's
    launch at batch 1 specializes as a call's real arguments at batch 2 do (the branch's w, r
    and ACCUMULATE are constexprs of both), with the runtime's launch options (launch_pdl)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from dilgen.aot.binder import specialize
    from dilgen.aot.build import compile_job, plan_jobs
    from dilgen.compiler import build
    from dilgen.aot.launch_model import predicted_launches
    from dilgen.runtime.gluon_launch import gluon_dkdv_lanes_args, lane_options
    spec = _spec(name="gla_build", segment_lengths=[256, 512], dilation_rates=[1, 2], num_heads=4, num_kv_heads=2)
    compiled = build(spec, get_target("sm90"))
    jobs, skipped = plan_jobs(compiled, get_target("sm90"), [1024])
    roles = [j.role for j in jobs]
    assert not skipped and all(roles.count(r) == 2 for r in ("gluon_lanes", "gluon_dkdv_lanes", "gluon_dq_lanes"))
    for role in ("gluon_lanes", "gluon_dkdv_lanes", "gluon_dq_lanes"):
        cubin, meta = compile_job([j for j in jobs if j.role == role][-1])
        assert cubin[:4] == b"\x7fELF" and '"shared"' in meta
    attn = compiled.module.attention
    model = [x for x in predicted_launches(attn, 1024) if x.role == "gluon_dkdv_lanes"][-1]
    q, do = (torch.randn(2, 1024, 4, 128, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 1024, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    real = gluon_dkdv_lanes_args(attn.plan, q, k, v, do, torch.randn(2, 4, 1024), torch.randn(2, 4, 1024),
                                 torch.empty_like(k), torch.empty_like(v), 2, 1024, attn.plan["branches"][1], True)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    opts = lane_options(attn.plan)       # as runtime/gluon_launch.py launches it: sm90 with PDL
    assert opts["launch_pdl"] and model.launch_opts == opts
    want = specialize(attn.gluon_dkdv_lanes_fn, backend, real, opts)
    assert specialize(attn.gluon_dkdv_lanes_fn, backend, model.args, model.launch_opts).desc == want.desc


# -- on an sm90 GPU: float64 out, lse and gradients, the Gluon lanes launched ----------------
SMALL = dict(segment_lengths=[512, 1024, 2048])     # 128-lane tiles in every segment
GPU_CASES = [
    # (id, spec fields, (B, N), tuning)
    ("a_like_gqa", dict(SMALL, num_heads=8, num_kv_heads=2), (2, 2048), {}),
    ("mha_fp16_64_keys", dict(SMALL, num_heads=4, num_kv_heads=4, dtype="float16"), (1, 4096),
     {"gluon_lanes": [64, 4]}),
    ("gqa_2_rate_past_group", dict(SMALL, num_heads=8, num_kv_heads=4), (1, 2048), {}),   # r = 4 > 2 heads a group
    ("head_base_mqa", dict(num_heads=4, num_kv_heads=1, head_base=4, segment_lengths=[512, 1024],
                           dilation_rates=[1, 2]), (2, 2048), {}),
    ("head_dim_64_all_lanes", dict(SMALL, num_heads=8, num_kv_heads=8, head_dim=64), (1, 4096),
     {"lanes": "all", "gluon_lanes": True, "gluon_lanes_bwd": True}),
    ("head_dim_64_exp2_4", dict(SMALL, num_heads=8, num_kv_heads=8, head_dim=64), (1, 4096),
     {"lanes": "all", "gluon_lanes": True, "gluon_lanes_bwd": True, "gluon_exp2": 4}),
    # LongNet's r = 6 and 12 do not divide w: causal, those branches run the lanes, dK/dV and dq
    # over rows that start anywhere (the packed kernels, a sequence per batch item) after the
    # Gluon ones, their lanes of 341 or 342 rows and N not a multiple of r (rows past the views'
    # N // r rows)
    ("rate_6_mixed", dict(num_heads=4, num_kv_heads=2, segment_lengths=[512, 2048], dilation_rates=[1, 6]),
     (1, 2048), {}),
    ("longnet_rates_mixed", dict(num_heads=8, num_kv_heads=2, segment_lengths=[512, 1024, 2048, 4096],
                                 dilation_rates=[1, 2, 6, 12]), (1, 4096), {}),
    ("longnet_rates_batch_mixed", dict(num_heads=8, num_kv_heads=2, segment_lengths=[512, 1024, 2048],
                                       dilation_rates=[1, 2, 6], head_base=4), (3, 2048), {}),
    # no r = 1 branch: the first launch writes "no branch" (0, -inf) into the other offsets' rows,
    # and where the Gluon lane backward is asked for, its first launches 0 into the rows and keys
    # no branch keeps (config D's shape: r past the group); non-causal, in place of the fused dK/dV
    ("no_r1_causal_gaps", dict(SMALL, num_heads=8, num_kv_heads=2, dilation_rates=[2, 4, 8]), (2, 2048),
     {"gluon_lanes": True, "gluon_lanes_bwd": True}),
    ("no_r1_non_causal_gaps", dict(SMALL, num_heads=8, num_kv_heads=2, dilation_rates=[2, 4, 8], causal=False),
     (2, 2048), {"gluon_lanes_bwd": True, "fused_dkdv": False}),
    ("no_r1_non_causal_exp2_2", dict(SMALL, num_heads=8, num_kv_heads=2, dilation_rates=[2, 4, 8], causal=False),
     (2, 2048), {"gluon_exp2": 2, "gluon_lanes_bwd": True, "fused_dkdv": False}),
    ("no_r1_d_like_mha", dict(num_heads=4, num_kv_heads=4, segment_lengths=[1024, 4096], dilation_rates=[4, 16],
                              causal=False), (1, 8192), {"gluon_lanes_bwd": True, "fused_dkdv": False}),
    ("no_r1_d_like_gqa_causal", dict(num_heads=8, num_kv_heads=2, segment_lengths=[1024, 4096],
                                     dilation_rates=[4, 16]), (2, 4096), {"gluon_lanes": True, "gluon_lanes_bwd": True}),
    # config D's shape untuned: non-causal at head_dim 128, every kernel Gluon (Target.gluon_lanes_bwd_no_r1)
    ("d_like_default", dict(num_heads=4, num_kv_heads=4, segment_lengths=[1024, 4096], dilation_rates=[4, 16],
                            causal=False), (1, 8192), {}),
    # a short last segment: the call takes the `tl` lane kernel (every segment must be whole)
    ("short_last_segment_tl", dict(SMALL, num_heads=4, num_kv_heads=2), (1, 2048 + 512), {}),
    # dQ added by the dK/dV's blocks (gluon_dkdv_dq): no dq kernel runs
    ("dkdv_dq_gqa", dict(SMALL, num_heads=8, num_kv_heads=2), (2, 2048), {"gluon_dkdv_dq": True}),
    ("dkdv_dq_head_dim_64_fp16", dict(SMALL, num_heads=8, num_kv_heads=8, head_dim=64, dtype="float16"), (1, 4096),
     {"gluon_dkdv_dq": True}),
    ("dkdv_dq_no_r1_non_causal", dict(SMALL, num_heads=8, num_kv_heads=2, dilation_rates=[2, 4, 8], causal=False),
     (2, 2048), {"gluon_lanes_bwd": True, "fused_dkdv": False, "gluon_dkdv_dq": True}),
    # the dK/dV's blocks with queries along rows, adding no dQ (dkdv_rows_first: the default at
    # head_dim 128), or with keys along rows
    ("rows_first_gqa", dict(SMALL, num_heads=8, num_kv_heads=2), (2, 2048), {"dkdv_rows_first": True}),
    ("rows_first_head_dim_64_no_r1", dict(SMALL, num_heads=8, num_kv_heads=8, head_dim=64, dilation_rates=[2, 4, 8]),
     (1, 4096), {"lanes": "all", "gluon_lanes": True, "gluon_lanes_bwd": True, "dkdv_rows_first": True}),
    ("keys_first_gqa", dict(SMALL, num_heads=8, num_kv_heads=2), (2, 2048), {"dkdv_rows_first": False}),
]


@on_sm90
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_matches_the_float64_reference_on_sm90(case, monkeypatch):
    from dilgen.runtime import forward
    name, over, (B, N), tuning = case
    spec = _spec(name="gla_" + name, **over)
    from dilgen.runtime import backward
    taken = {}
    for module, launch, key in ((forward, "gluon_lanes_launch", None), (backward, "gluon_dkdv_lanes_launch", None),
                                (backward, "gluon_dq_lanes_launch", None), (forward, "one_sequence_launches", "rows_fwd"),
                                (backward, "one_sequence_launches", "rows_bwd")):
        def spy(*args, real=getattr(module, launch), key=key or launch, **kw):
            got = real(*args, **kw)
            taken.setdefault(key, []).append(got is not None and got != [])
            return got
        monkeypatch.setattr(module, launch, spy)
    if tuning.get("gluon_dkdv_dq"):
        forbid_dq_kernels(monkeypatch)
    check_against_reference(spec, B, N, tuning, name)
    if tuning.get("gluon_dkdv_dq"):     # every branch's dK/dV in Gluon, adding dQ; no dq launch at all
        assert all(taken["gluon_dkdv_lanes_launch"]) and "gluon_dq_lanes_launch" not in taken, taken
    elif name == "rate_6_mixed":      # L = 1: the fused dK/dV, so no Gluon lane backward; r = 6's forward over rows
        assert taken["gluon_lanes_launch"] == [True, False] and not any(taken["gluon_dkdv_lanes_launch"]) \
            and taken["gluon_dq_lanes_launch"] == [False, False] and taken["rows_fwd"] == [True] \
            and not any(taken.get("rows_bwd", [])), taken
    elif name.endswith("_mixed"):   # r = 6, 12: forward, dK/dV and dq over rows, a sequence per batch item
        want = [r in (1, 2) for r in over["dilation_rates"]]
        assert all(taken[x] == want for x in ("gluon_lanes_launch", "gluon_dkdv_lanes_launch",
                                               "gluon_dq_lanes_launch")), taken
        assert taken["rows_fwd"] == [True] * want.count(False) and taken["rows_bwd"] == [True] * (2 * want.count(False))
    else:
        taken.pop("rows_fwd", None), taken.pop("rows_bwd", None)     # r | w: no branch runs over rows
        assert len(taken) == 3 and all(all(t) == (not name.endswith("_tl")) for t in taken.values()), taken


@on_sm90
def test_replayed_calls_are_the_tl_kernels_within_rounding():
    """A repeated call replays its launches, the descriptors made again over its tensors: every
    call's out and lse equal the `tl` lane kernels' to rounding (one block order, other tiles),
    its gradients the `tl` backward's."""
    from conftest import rel_error
    spec = _spec(name="gla_replay", num_heads=8, num_kv_heads=2, **SMALL)
    gluon, tl = dilgen.Kernel(spec), dilgen.Kernel(spec, None, {"gluon_lanes": False})
    tl_bwd = dilgen.Kernel(spec, None, {"gluon_lanes_bwd": False})
    gen = torch.Generator(device="cuda").manual_seed(7)
    for call in range(4):
        q = torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(2, 2048, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        (out, lse), (out_tl, lse_tl) = (kern(q, k, v, return_lse=True) for kern in (gluon, tl))
        assert not out.isnan().any() and rel_error(out, out_tl) < 1e-2, f"call {call}: out"
        assert (lse - lse_tl).abs().max() < 1e-3, f"call {call}: lse"
        g = torch.randn(out.shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        grads = []
        for kern in (gluon, tl_bwd):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            kern(*leaves).backward(g)
            grads.append([t.grad for t in leaves])
        for name, a, b in zip("qkv", *grads):
            assert not a.isnan().any() and rel_error(a, b) < 1e-2, f"call {call}: d{name}"
    attn = gluon.compiled_for(torch.device("cuda")).attention
    assert attn.plan["config"]["gluon_lanes"] and attn.plan["config"]["gluon_lanes_bwd"]
    assert attn._replays, "no call was recorded for replay"
