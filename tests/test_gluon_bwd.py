"""sm90's Gluon dK/dV (KernelConfig.gluon_dkdv, templates/gluon_bwd.py.jinja): when the planner
takes it and what it refuses by name, the kernel compiled for sm90 without a GPU (its PTX has
the warpgroup MMAs, the TMA loads and the producer's register budget), its `dilgen build`
launch; on an sm90 GPU, gradients against the float64 reference with the Gluon kernel launched,
and the `tl` kernel's where a call cannot take it."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import pytest
import torch
import triton

import dilgen
from dilgen import codegen
from dilgen.planner import plan
from dilgen.spec import SpecError
from dilgen.targets import get_target

from conftest import check_against_reference, needs_gluon, on_sm90

GOLDEN = Path(__file__).parent / "golden" / "gluon_bwd_sm90.py"         # the dK/dV's section
GOLDEN_DQ = Path(__file__).parent / "golden" / "gluon_dq_sm90.py"       # the dQ's, to the end
MARK = "# ---- sm90: the fused dK, dV in Gluon"
MARK_DQ = "# ---- sm90: dQ in Gluon"


def _spec(**over):
    fields = dict(name="gb", num_heads=16, num_kv_heads=4, head_dim=128, segment_lengths=[2048, 4096, 8192],
                  dilation_rates=[1, 2, 4], dtype="bfloat16")
    fields.update(over)
    return dilgen.Spec(**fields)


@needs_gluon
def test_default_at_head_dim_128_and_taken_when_asked():
    sm90 = get_target("sm90")
    assert plan(_spec(), sm90).config.gluon_dkdv == 4
    assert plan(_spec(head_dim=64), sm90).config.gluon_dkdv == 4
    assert plan(_spec(), sm90, {"gluon_dkdv": True}).config.gluon_dkdv == 4
    assert plan(_spec(), sm90, {"gluon_dkdv": 3}).config.gluon_dkdv == 3
    assert plan(_spec(), sm90, {"gluon_dkdv": False}).config.gluon_dkdv is None
    assert plan(_spec(causal=True), sm90).config.gluon_dkdv is None      # where it cannot run: tl
    assert plan(_spec(), get_target("sm80")).config.gluon_dkdv is None
    assert plan(_spec(), sm90).config.gluon_dq == 4
    assert plan(_spec(head_dim=64), sm90).config.gluon_dq is None       # level at head_dim 64: tl
    assert plan(_spec(head_dim=64), sm90, {"gluon_dq": True}).config.gluon_dq == 4
    with pytest.raises(SpecError, match="gluon_dq takes true, false or the stages 2 to 8"):
        plan(_spec(), sm90, {"gluon_dq": 9})
    with pytest.raises(SpecError, match="causal specs run their branches as lane kernels"):
        plan(_spec(causal=True), sm90, {"gluon_dq": True})


@needs_gluon
def test_beside_lane_branches_by_default_and_off_where_told(monkeypatch):
    """Beside lane branches of row membership (r not dividing w, Hilbert curve lanes), the Gluon
    dK/dV and dQ take the lattice branches by default on sm90 (the launches' descriptors name
    those only) and the lanes add theirs after; told off (tuning false, or a target without
    gluon_bwd_beside_lanes) they leave every branch to the `tl` kernels."""
    from dilgen.runtime import gluon_launch
    monkeypatch.setattr(gluon_launch, "_boxes", lambda plan, B, N: lambda t, kind, every, rows=64: (kind, every))
    sm90, off = get_target("sm90"), {"gluon_dkdv": False, "gluon_dq": False}
    unflagged = dataclasses.replace(sm90, gluon_bwd_beside_lanes=False)
    for over, rates, lanes in ((dict(segment_lengths=[2048, 4096, 16384], dilation_rates=[1, 2, 6]), [1, 2], {}),
                               (dict(hilbert={"scope": "segment"}), [1], {}),
                               (dict(), [1, 2], {"lanes": [2]})):       # a lattice branch tuning chose as lanes
        assert plan(_spec(**over), sm90, {**off, **lanes}).config.gluon_dkdv is None
        assert plan(_spec(**over), unflagged, lanes).config.gluon_dkdv is None
        p = plan(_spec(**over), sm90, lanes)
        assert (p.config.gluon_dkdv, p.config.gluon_dq) == (4, 4)
        js = p.to_json()
        dkdv = gluon_launch.gluon_dkdv_args(js, *[None] * 8, 1, 16384)
        dq = gluon_launch.gluon_dq_args(js, *[None] * 7, 1, 16384)
        assert dkdv[:2 * len(rates)] == tuple(("q", r) for r in rates) * 2
        assert dq[2:2 + 2 * len(rates)] == tuple(("kv", r) for r in rates) * 2


@needs_gluon
@pytest.mark.parametrize("over, tuning, why", [
    (dict(causal=True), {}, "causal specs run their branches as lane kernels"),
    (dict(hilbert={"scope": "segment"}, segment_lengths=[2048], dilation_rates=[1]), {}, "Hilbert orders"),
    (dict(dtype="float32"), {}, "float16 or bfloat16"),
    (dict(head_dim=32), {}, "head_dim 64 or 128, not 32"),
    (dict(), {"fused_dkdv": False}, "per-branch dK/dV kernels"),
    (dict(segment_lengths=[256, 1024], dilation_rates=[1, 4]), {}, "multiple of 128 x L = 512"),
    (dict(), {"gluon_dkdv": 8}, "8 stages at head_dim 128 need 328704 bytes"),
    (dict(), {"gluon_dkdv": 1}, "the stages 2 to 8"),
])
def test_refused_by_name_where_it_cannot_run(over, tuning, why):
    asked = {"gluon_dkdv": True, **tuning}
    with pytest.raises(SpecError, match=why):
        plan(_spec(**over), get_target("sm90"), asked)
    if "gluon_dkdv" not in tuning:
        assert plan(_spec(**over), get_target("sm90"), tuning).config.gluon_dkdv is None  # not asked: tl


@needs_gluon
def test_a_sequence_curve_on_one_device_takes_the_gluon_backward():
    """Scope "sequence", non-causal, on one device permutes whole rows into curve order around
    the kernels (planner._row_order) and reads no table: its sm90 plan is its raster twin's,
    Gluon dK/dV and dQ included. Causal keeps the table (its mask compares raster positions)."""
    sm90, curve = get_target("sm90"), {"scope": "sequence", "grid": [64, 64]}
    p, raster = plan(_spec(hilbert=curve), sm90), plan(_spec(), sm90)
    assert p.row_order is not None
    assert (p.config.gluon_dkdv, p.config.gluon_dq) == (raster.config.gluon_dkdv, raster.config.gluon_dq) == (4, 4)
    causal = plan(_spec(hilbert=curve, causal=True), sm90)
    assert causal.row_order is None and causal.config.gluon_dkdv is None
    drop = plan(_spec(hilbert=curve), sm90, {"dropout": True})     # the dropout plan's Gluon dQ and dK/dV too
    assert drop.row_order is not None and drop.config.gluon_dq == 4 and drop.config.gluon_dkdv_lanes


@needs_gluon
def test_the_lse_and_delta_prefetch_is_a_knob_refused_without_the_gluon_dkdv():
    """gluon_dkdv_prefetch: off by default at head_dim 128 (where holding two blocks' lse and
    Delta spills), on at 64; false emits each block's loads at its top; asked of a plan with no
    Gluon dK/dV, or as a non-bool, refused by name."""
    sm90 = get_target("sm90")
    assert not plan(_spec(), sm90).config.gluon_dkdv_prefetch
    assert plan(_spec(head_dim=64), sm90).config.gluon_dkdv_prefetch
    on = plan(_spec(), sm90, {"gluon_dkdv_prefetch": True})
    assert on.config.gluon_dkdv_prefetch and on.key() != plan(_spec(), sm90).key()
    assert "lse_next" in codegen.emit(on) and "lse_next" not in codegen.emit(plan(_spec(), sm90))
    with pytest.raises(SpecError, match="gluon_dkdv_prefetch needs the Gluon dK/dV"):
        plan(_spec(), sm90, {"gluon_dkdv": False, "gluon_dkdv_prefetch": False})
    with pytest.raises(SpecError, match="gluon_dkdv_prefetch takes true or false"):
        plan(_spec(), sm90, {"gluon_dkdv_prefetch": 1})


@needs_gluon
def test_generated_source_is_golden_and_stable():
    text = codegen.emit(plan(_spec(), get_target("sm90")))
    assert text == codegen.emit(plan(_spec(), get_target("sm90")))
    dkdv, dq = text[text.index(MARK):text.index(MARK_DQ)], text[text.index(MARK_DQ):]
    for golden, section in ((GOLDEN, dkdv), (GOLDEN_DQ, dq)):
        if os.environ.get("DILGEN_UPDATE_GOLDEN") == "1":
            golden.write_text(section)
        assert section == golden.read_text(), (f"the Gluon backward's source changed ({golden.name}); if on "
                                               f"purpose, regenerate with DILGEN_UPDATE_GOLDEN=1 and review the diff")
    codegen.check_syntax(text)
    assert "gluon_kernel=gb_gluon_fwd,\n" in text and "gluon_dkdv=gb_gluon_dkdv,\n" in text
    assert "gluon_dq=gb_gluon_dq,\n" in text and "gluon_dkdv_packed=gb_gluon_dkdv_packed,\n" in text


def _module(tmp_path, prefetch: bool = True, **over):
    path = tmp_path / f"gb_{abs(hash(repr(sorted(over.items())))) % 10**6}_{int(prefetch)}.py"
    path.write_text(codegen.emit(plan(_spec(**over), get_target("sm90"), {"gluon_dkdv": True, "gluon_dq": True,
                                                                          "gluon_dkdv_prefetch": prefetch})))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_gluon
@pytest.mark.parametrize("over", [dict(), dict(head_dim=64, num_kv_heads=16), dict(head_base=16, num_kv_heads=1),
                                  dict(prefetch=False),
                                  # beside lane branches (asked by tuning): r = 6 not dividing w (E), and
                                  # Hilbert curve lanes (F); the kernels take the lattice branches only
                                  dict(segment_lengths=[2048, 4096, 16384], dilation_rates=[1, 2, 6], nb=2),
                                  dict(hilbert={"scope": "segment"}, nb=1)])
def test_compiles_for_sm90_without_a_gpu(tmp_path, over):
    """Under both CI Tritons (3.9 names its TMA copies differently)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    over = dict(over)
    nb = over.pop("nb", 3)      # the lattice branches the kernels take
    mod = _module(tmp_path, **over)
    D = over.get("head_dim", 128)
    desc = f"tensordesc<bf16[64, 1, {D}],{gl.NVMMASharedLayout.get_default_for([64, 1, D], gl.bfloat16)!r}>"
    sig = {**{f"{x}{i}": desc for x in ("q", "do") for i in range(nb)}, "k_desc": desc, "v_desc": desc,
           "Lse": "*fp32", "Delta": "*fp32", "DK": "*bf16", "DV": "*bf16", "N": "i32"}
    dq_sig = {"q_desc": desc, "do_desc": desc, **{f"{x}{i}": desc for x in "kv" for i in range(nb)},
              "Lse": "*fp32", "Delta": "*fp32", "DQ": "*bf16", "N": "i32"}
    for fn, signature in ((mod.gb_gluon_dkdv, sig), (mod.gb_gluon_dq, dq_sig)):
        kernel = triton.compile(GluonASTSource(fn, signature, {}), target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": 4, "maxnreg": 168})
        ptx = kernel.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
        assert kernel.metadata.shared <= get_target("sm90").smem_bytes


def _aot_module():
    from dilgen.compiler import build
    spec = _spec(name="gb_aot", segment_lengths=[256, 512], dilation_rates=[1, 2], num_heads=4, num_kv_heads=2)
    return build(spec, get_target("sm90"), {"gluon_dq": True})


@needs_gluon
def test_launch_model_has_the_gluon_dkdv_and_it_specializes_as_the_runtime_s(cache_dir):
    """Whole segments only; the model's MockTensors at batch 1 give the specialization of a
    call's real arguments at batch 2 (one binary serves every batch)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from dilgen.aot.binder import specialize
    from dilgen.aot.launch_model import kernel_roles, predicted_launches
    from dilgen.runtime.gluon_launch import OPTIONS, gluon_dkdv_args
    attn = _aot_module().module.attention
    roles = {role: fn for role, fn, _ in kernel_roles(attn)}
    assert roles["gluon_dkdv"] is attn.gluon_dkdv_fn and roles["gluon_dq"] is attn.gluon_dq_fn
    assert [x.role for x in predicted_launches(attn, 1024)].count("gluon_dq") == 1
    assert not {"gluon_dkdv", "gluon_dq"} & {x.role for x in predicted_launches(attn, 768)}   # a short last segment
    (model,) = [x for x in predicted_launches(attn, 1024) if x.role == "gluon_dkdv"]
    q, do = (torch.randn(2, 1024, 4, 128, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(2, 1024, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    lse, delta = torch.randn(2, 4, 1024), torch.randn(2, 4, 1024)
    real = gluon_dkdv_args(attn.plan, q, k, v, do, lse, delta, torch.empty_like(k), torch.empty_like(v), 2, 1024)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    want = specialize(attn.gluon_dkdv_fn, backend, real, OPTIONS)
    assert specialize(attn.gluon_dkdv_fn, backend, model.args, model.launch_opts).desc == want.desc
    assert sum("tensordesc<" in str(t) for t in want.signature.values()) == 2 * 2 + 2


@needs_gluon
def test_launch_model_runs_every_lane_branch_per_branch_after_the_gluon_dkdv(cache_dir):
    """Beside a lane branch (here a lattice one tuning chose), the Gluon dK/dV takes the others
    and the per-branch `tl` dK/dV runs the lane branch after it (compiled for a call of whole
    segments); a short last segment leaves the `tl` fused dK/dV, which covers the branches
    whose r divides its L = 2, and the per-branch dK/dV of the chosen r = 4 branch after it."""
    from dilgen.aot.launch_model import predicted_launches
    from dilgen.compiler import build
    spec = _spec(name="gb_aot_lanes", segment_lengths=[256, 512, 1024], dilation_rates=[1, 2, 4], num_heads=4,
                 num_kv_heads=2)
    attn = build(spec, get_target("sm90"), {"lanes": [2], "gluon_dkdv": True, "gluon_dq": True}).module.attention
    whole = [x.role for x in predicted_launches(attn, 2048)]
    assert whole.count("gluon_dkdv") == 1 and whole.count("dkdv") == 1
    short = [x.role for x in predicted_launches(attn, 1792)]
    assert short.count("dkdv_fused") == 1 and "gluon_dkdv" not in short and short.count("dkdv") == 1


# -- on an sm90 GPU: float64 gradients, the Gluon kernel launched --------------------------
SMALL = dict(segment_lengths=[512, 1024, 2048])     # whole 128 x L tiles; a float64 reference of N^2 per head
GPU_CASES = [
    # (id, spec fields, (B, N), tuning)
    ("a_like_gqa", dict(SMALL, num_heads=8, num_kv_heads=2), (2, 2048), {"gluon_dq": True}),
    ("a_like_gqa_prefetch", dict(SMALL, num_heads=8, num_kv_heads=2), (1, 2048),
     {"gluon_dq": True, "gluon_dkdv_prefetch": True}),
    ("mha_fp16_stages3", dict(SMALL, num_heads=4, num_kv_heads=4, dtype="float16"), (1, 4096),
     {"gluon_dkdv": 3, "gluon_dq": 3}),
    ("head_base_mqa", dict(num_heads=4, num_kv_heads=1, head_base=4, segment_lengths=[512, 1024],
                           dilation_rates=[1, 2]), (2, 2048), {"gluon_dq": True}),
    ("head_dim_64_two_stages", dict(SMALL, num_heads=8, num_kv_heads=8, head_dim=64), (1, 4096),
     {"gluon_dkdv": 2, "gluon_dq": 2}),
    # one exponential in 2 (head_dim 64) or 4 of the Gluon forward's softmax as a cubic
    ("head_dim_64_default", dict(SMALL, num_heads=8, num_kv_heads=8, head_dim=64), (1, 4096),   # gluon_exp2 = 8
     {"gluon_dkdv": True, "gluon_dq": True}),
    ("head_dim_64_exp2_2", dict(SMALL, num_heads=8, num_kv_heads=8, head_dim=64), (1, 4096),
     {"gluon_fwd": True, "gluon_dkdv": True, "gluon_dq": True, "gluon_exp2": 2}),
    ("a_like_gqa_exp2_4", dict(SMALL, num_heads=8, num_kv_heads=2), (2, 2048), {"gluon_dq": True, "gluon_exp2": 4}),
    # beside lane branches (asked by tuning): the lattice branches in Gluon, then the `tl` lane
    # branches adding into dk, dv and dq: r = 6 not dividing w (E), Hilbert curve lanes (F)
    ("beside_r6_lanes_gqa", dict(num_heads=8, num_kv_heads=2, segment_lengths=[512, 1024, 1536],
                                 dilation_rates=[1, 2, 5]), (1, 3072), {"gluon_dkdv": True, "gluon_dq": True}),
    ("beside_curve_lanes", dict(num_heads=4, num_kv_heads=4, segment_lengths=[512, 1024, 2048],
                                dilation_rates=[1, 2, 4], hilbert={"scope": "segment"}), (1, 4096),
     {"gluon_dkdv": True, "gluon_dq": True}),
    ("beside_chosen_lane", dict(SMALL, num_heads=8, num_kv_heads=4), (1, 4096),
     {"lanes": [2], "gluon_dkdv": True, "gluon_dq": True}),
    # rows permuted into a sequence curve's order around the kernels (no table)
    ("hilbert_sequence", dict(SMALL, num_heads=4, num_kv_heads=4, hilbert={"scope": "sequence", "grid": [32, 64]}),
     (1, 2048), {"gluon_dkdv": True, "gluon_dq": True}),
    # a short last segment: the call takes the `tl` kernels (every segment must be whole)
    ("short_last_segment_tl", dict(SMALL, num_heads=4, num_kv_heads=2), (1, 2048 + 512), {"gluon_dq": True}),
]


@on_sm90
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_gradients_match_the_float64_reference_on_sm90(case, monkeypatch):
    from dilgen.runtime import backward
    name, over, (B, N), tuning = case
    spec = _spec(name="gb_" + name, **over)
    taken = []
    for launch in ("gluon_dkdv_launch", "gluon_dq_launch"):
        def spy(*args, real=getattr(backward, launch)):
            got = real(*args)
            taken.append(got is not None)
            return got
        monkeypatch.setattr(backward, launch, spy)
    check_against_reference(spec, B, N, tuning, name)
    assert taken == [not name.endswith("_tl")] * 2, taken       # dK/dV, then dQ


@on_sm90
def test_replayed_backward_equals_the_tl_plan_bit_for_bit():
    """A repeated call replays its recorded launches, the Gluon kernels' descriptors made again
    over the call's tensors (replay.Descriptor): every call's gradients equal the `tl` fused
    dK/dV plan's bit for bit, the first (recording) and the later (replayed) ones alike; with
    the Gluon dQ too (summed in another order: within 1e-2)."""
    from conftest import rel_error
    spec = _spec(name="gb_replay", num_heads=8, num_kv_heads=2, **SMALL)
    gluon, tl = dilgen.Kernel(spec), dilgen.Kernel(spec, None, {"gluon_dkdv": False})
    with_dq = dilgen.Kernel(spec, None, {"gluon_dq": True})
    gen = torch.Generator(device="cuda").manual_seed(5)
    for call in range(4):
        q, g = (torch.randn(2, 2048, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        k, v = (torch.randn(2, 2048, 2, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        grads = []
        for kern in (gluon, tl, with_dq):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            kern(*leaves).backward(g)
            grads.append([t.grad for t in leaves])
        for name, a, b, c in zip("qkv", *grads):
            assert not a.isnan().any() and torch.equal(a, b), f"call {call}: d{name} differs from the tl plan's"
            assert not c.isnan().any() and rel_error(c, b) < 1e-2, f"call {call}: d{name} with the Gluon dQ"
    for kern, flag in ((gluon, "gluon_dkdv"), (with_dq, "gluon_dq")):
        attn = kern.compiled_for(torch.device("cuda")).attention
        assert attn.plan["config"][flag] and attn._replays, "no call was recorded for replay"


@needs_gluon
def test_dq_by_tma_reduce_add_has_a_name_in_triton_3_9_only():
    """Issue 42 asked for dQ by TMA reduce-add or a separate pass, whichever measures faster.
    Gluon's hopper.tma in Triton 3.6 (the GPU machines') names no reduce; the templates reach
    it there through the `tl` descriptor's reduce op (gluon_lanes_bwd's _dq_add, compiled in
    test_gluon_lanes.py under both Tritons). Triton 3.9 adds tma.async_atomic_add: the smallest
    kernel using it, a 64 x 64 float32 tile added into dq's rows from a swizzled shared-memory
    tile, compiles there for sm90 to cp.reduce.async.bulk.tensor."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, tma
    if triton.__version__.startswith("3.6"):
        assert not hasattr(tma, "async_atomic_add")
        return

    @gluon.jit
    def dq_add(dq_desc, X):
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [2, 16], [4, 1], [1, 0])
        m = gl.arange(0, 64, layout=gl.SliceLayout(1, layout))
        n = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        smem = gl.allocate_shared_memory(gl.float32, [64, 64], dq_desc.layout)
        smem.store(gl.load(X + gl.expand_dims(m, 1) * 64 + gl.expand_dims(n, 0)))
        fence_async_shared()
        tma.async_atomic_add(dq_desc, [0, 0], smem)
        tma.store_wait(0)

    layout = gl.NVMMASharedLayout.get_default_for([64, 64], gl.float32)
    sig = {"dq_desc": f"tensordesc<fp32[64, 64],{layout!r}>", "X": "*fp32"}
    kernel = triton.compile(GluonASTSource(dq_add, sig, {}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4})
    assert "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in kernel.asm["ptx"]
