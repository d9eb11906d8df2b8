"""sm90's Gluon lanes over Hilbert curve branches (KernelConfig.gluon_curve_lanes,
templates/gluon_lanes.py.jinja): a non-causal Hilbert segment plan's lane branches read their
keys from the compact curve copies (runtime/curve_rows.py) through descriptors and gather and
scatter their query rows through the curve table. On the CPU: when the planner takes them and
what it refuses by name, the kernel compiled for sm90 (both CI Tritons), its `dilgen build`
launch; on an sm90 GPU: out, lse and gradients against the float64 reference with the Gluon
curve lanes launched for every curve branch, and replayed calls equal to fresh ones. On by default;
{"gluon_curve_lanes": false} declines them."""
from __future__ import annotations

import pytest
import torch

import dilgen
from dilgen import codegen
from dilgen.planner import plan
from dilgen.spec import SpecError
from dilgen.targets import get_target

from conftest import check_against_reference, compile_sm90, load_emitted, needs_gluon, on_sm90

ASK = {"gluon_curve_lanes": True}
HILBERT = {"scope": "segment"}


def _spec(**over):
    fields = dict(name="glc", num_heads=16, num_kv_heads=4, head_dim=128, segment_lengths=[2048, 4096, 8192],
                  dilation_rates=[1, 2, 4], dtype="bfloat16", hilbert=HILBERT)
    fields.update(over)
    return dilgen.Spec(**fields)


@needs_gluon
def test_taken_by_default_and_declined_where_asked():
    sm90 = get_target("sm90")
    taken = plan(_spec(), sm90).config
    assert taken.gluon_curve_lanes and taken.gluon_lanes == (128, 3) and taken.gluon_fwd == (128, 3)
    assert plan(_spec(), sm90, ASK).config == taken
    declined = plan(_spec(), sm90, {"gluon_curve_lanes": False}).config
    assert not declined.gluon_curve_lanes and declined.gluon_lanes is None        # the `tl` curve lanes
    assert not plan(_spec(hilbert={"scope": "sequence", "grid": [64, 64]}), sm90).config.gluon_curve_lanes  # not asked
    causal = plan(_spec(causal=True), sm90).config     # causal too (the r = 1 branch's lanes stay `tl`)
    assert causal.gluon_curve_lanes and causal.gluon_lanes == (128, 3) and causal.gluon_lanes_bwd is None
    assert plan(_spec(), get_target("sm80"), {}).config.gluon_curve_lanes is False
    assert plan(_spec(head_dim=64, num_kv_heads=16, segment_lengths=[1024, 2048, 4096]), sm90, ASK).config.gluon_curve_lanes
    assert "gluon_curve_lanes" not in declined.to_json()


@needs_gluon
@pytest.mark.parametrize("over, tuning, why", [
    (dict(hilbert=None), ASK, "needs lane branches with Hilbert curve tables"),
    (dict(hilbert={"scope": "sequence", "grid": [64, 64]}), ASK, "queries are in curve order|needs lane branches "
                                                                  "with Hilbert curve tables"),
    ({}, {"gluon_curve_lanes": 1}, "takes true or false"),
    ({}, {"gluon_curve_lanes": True, "curve_rows": False}, "needs lane branches with Hilbert curve tables"),
    ({}, {"gluon_curve_lanes": True, "gluon_lanes": False}, None),
])
def test_refused_by_name_where_it_cannot_run(over, tuning, why):
    sm90 = get_target("sm90")
    if why is None:     # the lanes declined: no curve lanes in Gluon, nothing refused
        assert not plan(_spec(**over), sm90, tuning).config.gluon_curve_lanes
        return
    with pytest.raises(SpecError, match=why):
        plan(_spec(**over), sm90, tuning)


def _module(tmp_path, **over):
    text = codegen.emit(plan(_spec(**over), get_target("sm90"), ASK))
    return load_emitted(tmp_path / f"glc_{abs(hash(repr(sorted(over.items())))) % 10**6}.py", text)


@needs_gluon
@pytest.mark.parametrize("over", [dict(), dict(num_kv_heads=8), dict(num_kv_heads=16),
                                  dict(head_dim=64, num_kv_heads=16, segment_lengths=[1024, 2048, 4096]),
                                  dict(causal=True), dict(causal=True, head_dim=64, segment_lengths=[1024, 2048, 4096])])
def test_compiles_for_sm90_without_a_gpu(tmp_path, over):
    """The writing and merging variants of a branch of rate 4 (kv groups of 4, 2 and 1 heads:
    a copy per offset, per query head, one; causal: the block lists), under both CI Tritons:
    wgmma, the keys by TMA, no query or output descriptor."""
    from triton.experimental.gluon import language as gl
    mod = _module(tmp_path, **over)
    D = over.get("head_dim", 128)
    desc = f"tensordesc<bf16[128, 1, {D}],{gl.NVMMASharedLayout.get_default_for([128, 1, D], gl.bfloat16)!r}>"
    lists = {"Counts": "*i32", "Lists": "*i32"} if over.get("causal") else {}
    sig = {"Q": "*bf16", "Fwd": "*i32", "k_desc": desc, "v_desc": desc, "Out": "*bf16", "Lse": "*fp32", **lists,
           "N": "i32", "W": "constexpr", "R": "constexpr", "ACCUMULATE": "constexpr", "CLEAR": "constexpr"}
    at = len(lists)
    for merge in (False, True):
        kernel = compile_sm90(mod.glc_gluon_lanes, sig, {(7 + at,): 8192, (8 + at,): 4, (9 + at,): merge,
                                                         (10 + at,): False})
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
        assert "cp.async.bulk.tensor.3d.global.shared" not in ptx      # outputs scattered, not stored by TMA
        assert kernel.metadata.shared <= get_target("sm90").smem_bytes


@needs_gluon
def test_build_compiles_the_curve_lanes_as_the_runtime_specializes_them(cache_dir):
    """`dilgen build` has a curve-lane launch per curve branch, merging after the Gluon forward's
    r = 1 branch, and its arguments specialize as a call's real ones (batch 2) do."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from dilgen.aot.binder import specialize
    from dilgen.aot.launch_model import predicted_launches
    from dilgen.compiler import build
    from dilgen.runtime.gluon_launch import OPTIONS, gluon_curve_lanes_args
    spec = _spec(name="glc_aot", num_heads=4, num_kv_heads=2, segment_lengths=[256, 1024, 2048])
    attn = build(spec, get_target("sm90"), ASK).module.attention
    launches = [x for x in predicted_launches(attn, 2048) if x.role == "gluon_lanes"]
    assert [x.args[-4:] for x in launches] == [(1024, 2, True, False), (2048, 4, True, False)]
    br = attn.plan["branches"][2]
    q = torch.randn(2, 2048, 4, 128, dtype=torch.bfloat16)
    kc = torch.randn(2, 2, 2, 2048 // 4, 128, dtype=torch.bfloat16)
    real = gluon_curve_lanes_args(attn.plan, q, kc, kc.clone(), torch.empty_like(q), torch.randn(2, 4, 2048),
                                  torch.zeros(2048, dtype=torch.int32), 2, 2048, br, True)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    want = specialize(attn.gluon_lanes_fn, backend, real, OPTIONS).desc
    assert specialize(attn.gluon_lanes_fn, backend, launches[-1].args, launches[-1].launch_opts).desc == want
    causal = build(_spec(name="glc_aot_causal", num_heads=4, num_kv_heads=2, segment_lengths=[256, 1024, 2048],
                         causal=True), get_target("sm90"), ASK).module.attention
    launches = [x for x in predicted_launches(causal, 2048) if x.role == "gluon_lanes"]     # r = 1: `tl` lanes
    assert [x.args[-4:] for x in launches] == [(1024, 2, True, False), (2048, 4, True, False)]
    assert len(launches[0].args) == len(real) + 2       # the block lists


RASTER = {**ASK, "gluon_raster_lanes": True}


@needs_gluon
def test_raster_lanes_beside_the_curve_ones_by_default(tmp_path, cache_dir):
    """F causal's r = 1 branch reads no curve table: on sm90 by default (or asked,
    gluon_raster_lanes) a second Gluon lane kernel built for raster rows runs it (told false,
    the `tl` lanes); it compiles for sm90 as the raster lanes do, and `dilgen build` has its
    launch; refused by name where it cannot run."""
    from dilgen.aot.launch_model import predicted_launches
    from dilgen.kernel_names import kernel_families
    from dilgen.compiler import build
    sm90 = get_target("sm90")
    causal = _spec(causal=True)
    assert not plan(causal, sm90, {"gluon_raster_lanes": False}).config.gluon_raster_lanes
    assert plan(causal, sm90).config.gluon_raster_lanes                       # the sm90 default
    p = plan(causal, sm90, RASTER)
    assert p.config.gluon_raster_lanes and p.config.to_json()["gluon_raster_lanes"]
    assert "lanes Gluon (branch 0), lanes Gluon curve (branches 1, 2)" in kernel_families(p)
    assert "lanes Gluon curve (branches 1, 2), lanes tl (branch 0)" in kernel_families(
        plan(causal, sm90, {"gluon_raster_lanes": False}))
    with pytest.raises(SpecError, match="gluon_raster_lanes cannot run here: the plan's lanes do not run"):
        plan(causal, sm90, {"gluon_curve_lanes": False, "gluon_raster_lanes": True})
    with pytest.raises(SpecError, match="gluon_raster_lanes takes true or false"):
        plan(causal, sm90, {"gluon_raster_lanes": 1})
    mod = load_emitted(tmp_path / "glc_raster.py", codegen.emit(p))
    assert mod.attention.gluon_raster_lanes_fn is mod.glc_gluon_raster_lanes
    from triton.experimental.gluon import language as gl

    def desc(rows):
        return f"tensordesc<bf16[{rows}, 1, 128],{gl.NVMMASharedLayout.get_default_for([rows, 1, 128], gl.bfloat16)!r}>"
    sig = {"q_desc": desc(64), "o_desc": desc(64), "k_desc": desc(128), "v_desc": desc(128), "Out": "*bf16",
           "Lse": "*fp32", "N": "i32", "W": "constexpr", "R": "constexpr", "ACCUMULATE": "constexpr",
           "CLEAR": "constexpr"}
    kernel = compile_sm90(mod.glc_gluon_raster_lanes, sig, {(7,): 2048, (8,): 1, (9,): False, (10,): False})
    assert "wgmma.mma_async" in kernel.asm["ptx"] and kernel.metadata.shared <= sm90.smem_bytes
    attn = build(_spec(name="glc_aot_raster", causal=True, num_heads=4, num_kv_heads=2,
                       segment_lengths=[256, 1024, 2048]), sm90, RASTER).module.attention
    roles = [x.role for x in predicted_launches(attn, 2048)]
    assert roles.count("gluon_raster_lanes") == 1 and roles.count("gluon_lanes") == 2


# -- on an sm90 GPU: float64 out, lse and gradients, the Gluon curve lanes launched ----------
GPU_CASES = [
    # (id, spec fields, (B, N))
    ("gqa_4", dict(num_heads=8, num_kv_heads=2, segment_lengths=[512, 1024, 2048]), (2, 2048)),
    ("gqa_2_rate_past_group", dict(num_heads=8, num_kv_heads=4, segment_lengths=[512, 1024, 2048]), (1, 4096)),
    ("mha_head_dim_64", dict(num_heads=4, num_kv_heads=4, head_dim=64, segment_lengths=[512, 1024, 2048]), (1, 4096)),
    ("causal_gqa_4", dict(num_heads=8, num_kv_heads=2, segment_lengths=[512, 1024, 2048], causal=True), (2, 2048)),
    ("causal_head_dim_64", dict(num_heads=4, num_kv_heads=4, head_dim=64, segment_lengths=[512, 1024, 2048],
                                causal=True), (1, 4096)),
]


def _spy(monkeypatch) -> list:
    from dilgen.runtime import forward
    taken = []

    def spy(*args, real=forward.gluon_lanes_launch):
        got = real(*args)
        taken.append(got is not None)
        return got
    monkeypatch.setattr(forward, "gluon_lanes_launch", spy)
    return taken


@on_sm90
def test_raster_lanes_beside_curve_lanes_match_the_float64_reference_on_sm90(monkeypatch):
    """Asked (gluon_raster_lanes): every lane branch of a causal curve plan in Gluon, the r = 1
    branch in the raster kernel first."""
    taken = _spy(monkeypatch)
    check_against_reference(_spec(name="glc_raster_causal", num_heads=8, num_kv_heads=2,
                                  segment_lengths=[512, 1024, 2048], causal=True), 1, 4096, RASTER, "raster")
    assert taken[-3:] == [True, True, True], taken


@on_sm90
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_matches_the_float64_reference_on_sm90(case, monkeypatch):
    name, over, (B, N) = case
    taken = _spy(monkeypatch)
    spec = _spec(name="glc_" + name, **over)
    check_against_reference(spec, B, N, ASK, name)
    # both curve branches, after the r = 1 branch: the Gluon forward's; causal at head_dim 128 the
    # Gluon raster lanes' (sm90's default), at head_dim 64 the fused `tl` forward's (no lane launch)
    raster = plan(spec, get_target("sm90"), ASK).config.gluon_raster_lanes
    assert raster == (over.get("causal", False) and over.get("head_dim", 128) == 128), raster
    want = [True] * (3 if raster else 2)
    assert taken[-len(want):] == want and not any(taken[:-len(want)]), taken


@on_sm90
@pytest.mark.parametrize("causal", [False, True])
def test_replayed_calls_equal_fresh_ones_and_the_tl_curve_lanes(causal):
    """Repeated calls replay their launches (the compact copies allocated afresh, the
    descriptors made again over them): each equals a module that never replays bit for bit,
    and the `tl` curve lanes to rounding."""
    from conftest import rel_error
    from dilgen.runtime import replay, set_poison
    spec = _spec(name=f"glc_replay_{int(causal)}", num_heads=8, num_kv_heads=2, segment_lengths=[512, 1024, 2048],
                 causal=causal)
    gluon, plain, tl = (dilgen.Kernel(spec, None, t) for t in (ASK, dict(ASK), {"gluon_curve_lanes": False}))
    gen = torch.Generator(device="cuda").manual_seed(9)
    set_poison(True)
    try:
        for call in range(3):
            q = torch.randn(2, 4096, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
            k, v = (torch.randn(2, 4096, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in "kv")
            out, lse = gluon(q, k, v, return_lse=True)
            replay.ENABLED = False
            try:
                want, want_lse = plain(q, k, v, return_lse=True)
            finally:
                replay.ENABLED = True
            assert torch.equal(out, want) and torch.equal(lse, want_lse), f"call {call}"
            out_tl, lse_tl = tl(q, k, v, return_lse=True)
            assert rel_error(out, out_tl) < 1e-2 and (lse - lse_tl).abs().max() < 1e-3, f"call {call}"
    finally:
        set_poison(False)
    attn = gluon.compiled_for(torch.device("cuda")).attention
    assert any(key[0] == "fwd" and hasattr(r, "launches") for key, r in attn._replays.items())
