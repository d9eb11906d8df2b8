"""sm90's Gluon forward (KernelConfig.gluon_fwd, templates/gluon_fwd.py.jinja) on the CPU: when
the planner takes it and what it refuses by name, the generated source against a golden file,
the kernel compiled for sm90 (Triton 3.6, no GPU: its PTX has the warpgroup MMAs, the TMA
loads and the producer's register budget), and that a launch holding TMA descriptors is never
replayed. Its numbers (float64, timings) come from the GPU check, bench/results/gluon_*."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch
import triton

import dilgen
from dilgen import codegen
from dilgen.planner import plan
from dilgen.runtime import replay
from dilgen.spec import SpecError
from dilgen.targets import get_target

from conftest import needs_gluon, on_sm90

GOLDEN = Path(__file__).parent / "golden" / "gluon_fwd_sm90.py"
MARK = "# ---- sm90: the same forward in Gluon"


def _spec(**over):
    fields = dict(name="gx", num_heads=16, num_kv_heads=4, head_dim=128, segment_lengths=[2048, 4096, 8192],
                  dilation_rates=[1, 2, 4], dtype="bfloat16")
    fields.update(over)
    return dilgen.Spec(**fields)


@needs_gluon
def test_default_at_head_dim_64_and_128_and_taken_when_asked():
    """sm90's default at head_dim 128 (faster there: A, B) and 64 (C, with one exponential in
    8 on the FMA pipe); `{"gluon_fwd": false}` keeps the `tl` kernel."""
    sm90 = get_target("sm90")
    assert plan(_spec(), sm90).config.gluon_fwd == (128, 3)
    assert plan(_spec(), sm90).config.gluon_exp2 == 0
    assert plan(_spec(head_dim=64), sm90).config.gluon_fwd == (128, 3)
    assert plan(_spec(head_dim=64), sm90).config.gluon_exp2 == 8
    assert plan(_spec(head_dim=64), sm90, {"gluon_fwd": False}).config.gluon_fwd is None
    assert plan(_spec(head_dim=64), sm90, {"gluon_fwd": False}).config.gluon_exp2 == 0
    assert plan(_spec(), sm90, {"gluon_fwd": False}).config.gluon_fwd is None
    assert plan(_spec(), sm90, {"gluon_fwd": [64, 4]}).config.gluon_fwd == (64, 4)
    assert plan(_spec(causal=True), sm90).config.gluon_fwd is None      # where it cannot run: tl


@needs_gluon
@pytest.mark.parametrize("over, arch, why", [
    (dict(causal=True), "sm90", "causal specs run their branches as lane kernels"),
    (dict(ring_size=2), "sm90", "a ring runs its own window kernels"),
    (dict(dtype="float32"), "sm90", "float16 or bfloat16"),
    (dict(head_dim=48), "sm90", "head_dim 64 or 128"),
    (dict(head_dim=32), "sm90", "head_dim 64 or 128, not 32"),
    (dict(segment_lengths=[2048, 4096], dilation_rates=[1, 3], causal=True), "sm90", "causal specs"),
    (dict(segment_lengths=[4096, 8192], dilation_rates=[2, 4], head_dim=64), "sm90", "a branch with r = 1"),
    (dict(segment_lengths=[256, 1024], dilation_rates=[1, 4]), "sm90", "multiple of 128 x L = 512"),
    (dict(), "sm80", "target sm80 has no Gluon kernels"),
])
def test_refused_by_name_where_it_cannot_run(over, arch, why):
    for asked in (True, [128, 3]):
        with pytest.raises(SpecError, match=why):
            plan(_spec(**over), get_target(arch), {"gluon_fwd": asked})
    assert plan(_spec(**over), get_target(arch)).config.gluon_fwd is None   # not asked: the tl kernel


@needs_gluon
@pytest.mark.parametrize("over, lanes", [
    (dict(hilbert={"scope": "segment"}), [False, True, True]),      # F: the r = 1 branch reads no table
    (dict(segment_lengths=[2048, 4096, 8192, 16384, 32768], dilation_rates=[1, 2, 4, 6, 12]),
     [False, False, False, True, True]),                              # E: r = 6, 12 do not divide w
    (dict(hilbert={"scope": "sequence", "grid": [128, 256]}), [False, False, False]),   # rows permuted around it
])
def test_takes_the_lattice_branches_beside_lane_branches(over, lanes):
    """The Gluon forward runs the lattice branches; lane branches (r not dividing w, a Hilbert
    segment curve's) keep their launches after it, which add into its output. Its source
    streams the lattice branches' keys only, and so does the Gluon dQ beside the lanes."""
    p = plan(_spec(**over), get_target("sm90"))
    assert p.config.gluon_fwd == (128, 3) and [b.lanes for b in p.branches] == lanes
    text = codegen.emit(p)
    rest = text[text.index(MARK):]
    end = rest.find("\n# ---- sm90:", 1)
    section = rest if end < 0 else rest[:end]                          # the forward's kernels
    n = lanes.count(False)
    assert f"k{n - 1}," in section and f"k{n}," not in section and section.count("_load_branch(it, k_descs[") == n
    dq = rest[rest.index("# ---- sm90: dQ in Gluon"):] if p.config.gluon_dq else ""
    assert dq.count("_load_branch(it, k_descs[") == (n if p.config.gluon_dq else 0)
    if all(lanes[1:]):
        with pytest.raises(SpecError, match="every branch runs as lanes"):
            plan(_spec(**over), get_target("sm90"), {"lanes": "all", "gluon_fwd": True})


@needs_gluon
@pytest.mark.parametrize("asked, why", [([256, 2], "keys per block must be 64 or 128 and stages 2 to 8"),
                                        ([128, 9], "stages 2 to 8"),
                                        ([128, 4], "4 stages of 128 keys at head_dim 128 need 295936 bytes")])
def test_a_tile_that_cannot_run_is_refused_by_name(asked, why):
    """A pair form outside what the kernel takes, or more shared memory than sm90 has (a
    compile would fail with OutOfResources at the first call)."""
    with pytest.raises(SpecError, match=why):
        plan(_spec(), get_target("sm90"), {"gluon_fwd": asked})
    assert plan(_spec(head_dim=64), get_target("sm90"), {"gluon_fwd": [128, 5]}).config.gluon_fwd == (128, 5)


def _source(exp2: int = 0, dropout: bool = False, **over) -> str:
    return codegen.emit(plan(_spec(**over), get_target("sm90"), {"gluon_fwd": True, "gluon_dkdv": False,
                                                                 "gluon_dq": False, "gluon_exp2": exp2,
                                                                 "dropout": dropout}))


@needs_gluon
def test_exp2_on_the_fma_pipe_is_planned_emitted_and_refused_by_name():
    """gluon_exp2 = n: of each n exponentials a thread holds, n - 1 on the MUFU unit's ex2 and
    one as a cubic on the FMA pipe (common.jinja's gluon_exp2); 0 emits gl.exp2."""
    sm90 = get_target("sm90")
    assert plan(_spec(), sm90).config.gluon_exp2 == dict(sm90.gluon_exp2).get(128, 0)
    assert plan(_spec(), sm90, {"gluon_exp2": 4}).config.gluon_exp2 == 4
    text = _source(exp2=4)
    assert text.count("ex2.approx.ftz.f32") == 3 and "pack=4" in text and "0f3F31798D" in text
    plain = _source(exp2=0)
    assert "ex2.approx" not in plain and "gl.exp2(" in plain
    with pytest.raises(SpecError, match="gluon_exp2 needs the Gluon forward or lanes"):
        plan(_spec(), sm90, {"gluon_fwd": False, "gluon_exp2": 2})
    assert plan(_spec(), sm90, {"gluon_fwd": False, "gluon_exp2": 0}).config.gluon_exp2 == 0
    with pytest.raises(ValueError, match="gluon_exp2 = 3: 0, 2, 4 or 8"):
        plan(_spec(), sm90, {"gluon_exp2": 3})


def test_the_cubic_is_two_to_the_x_within_bfloat16s_rounding():
    """The cubic (its coefficients read from the template) and exponent-bit arithmetic of
    gluon_exp2's asm, in float32 on the CPU: relative error
    below 1e-4 on the softmax's range (x <= 0) down to -125, at most 2^-125 below (a masked score's
    -inf included)."""
    import re
    import struct
    macro = (Path(__file__).parent.parent / "templates" / "common.jinja").read_text()
    macro = macro[macro.index("macro gluon_exp2"):]
    fmas = [line for line in macro.splitlines() if "fma.rn.ftz.f32" in line]
    coefficients = [h for line in fmas for h in re.findall(r"0f([0-9A-F]{8})", line)]   # Horner: c3, c2, c1, c0
    c3, c2, c1, c0 = (struct.unpack(">f", bytes.fromhex(h))[0] for h in coefficients)
    x = torch.cat([torch.linspace(-130, 0, 200001), torch.tensor([float("-inf")])])
    c = torch.clamp(x, min=-126.0)
    t = c + 12582912.0
    f = c - (t - 12582912.0)
    p = ((c3 * f + c2) * f + c1) * f + c0
    got = (p.view(torch.int32) + (t.view(torch.int32) << 23)).view(torch.float32).double()
    want = torch.exp2(c.double())
    normal = x >= -125
    assert ((got[normal] / want[normal] - 1).abs().max() < 1e-4).item()
    assert ((got[~normal] <= 2.0 ** -125) & (got[~normal] >= 0)).all().item()


@needs_gluon
def test_generated_gluon_source_is_golden_and_stable():
    text = _source()
    assert text == _source()
    section = text[text.index(MARK):]
    if os.environ.get("DILGEN_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(section)
    assert section == GOLDEN.read_text(), ("the Gluon forward's source changed; if on purpose, "
                                           "regenerate with DILGEN_UPDATE_GOLDEN=1 and review the diff")
    codegen.check_syntax(text)
    assert "gluon_kernel=gx_gluon_fwd" in text


def _module(tmp_path, **over):
    path = tmp_path / f"gx_{abs(hash(tuple(sorted(over.items())))) % 10**6}.py"
    path.write_text(_source(**over))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@needs_gluon
@pytest.mark.skipif(not triton.__version__.startswith("3.6"),
                    reason="compiled under Triton 3.6, the GPU machines' version (CI's second run)")
@pytest.mark.parametrize("over", [dict(), dict(head_dim=64, num_kv_heads=16), dict(head_base=4),
                                  dict(head_dim=64, num_kv_heads=16, exp2=2), dict(dropout=True),
                                  dict(head_dim=64, num_kv_heads=16, exp2=8, dropout=True)])
def test_compiles_for_sm90_without_a_gpu(tmp_path, over):
    """The PTX has the warpgroup MMAs, the TMA loads, the producer's register budget, the exp2
    cubic where asked; with dropout, Philox's rounds (its multiplier 0xCD9E8D57), and the
    coins' joins and reshape landed on the accumulator's layout with no data moved (the
    template's convert_layout(..., assert_trivial=True) would not compile otherwise)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    mod = _module(tmp_path, **over)
    D = over.get("head_dim", 128)

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, 1, D], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, 1, {D}],{layout!r}>"
    sig = {"q_desc": desc(64), "o_desc": desc(64), **{f"{x}{i}": desc(128) for x in "kv" for i in range(3)},
           "Lse": "*fp32", "N": "i32"}
    if over.get("dropout"):
        sig.update(seed_ptr="*i64", drop_cut="i32", drop_scale="fp32", drop_n="i32", drop_pos0="i32",
                   drop_streams="*i64")
    kernel = triton.compile(GluonASTSource(mod.gx_gluon_fwd, sig, {}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": 168})
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
    assert ("0f3F31798D" in ptx) == bool(over.get("exp2"))     # the cubic of gluon_exp2 (its c1)
    assert ("-845247145" in ptx) == bool(over.get("dropout"))  # Philox's round multiplier B, as an s32


class _Descriptor:
    """What a host TMA descriptor looks like to the recorder: an object over a tensor view."""

    def __init__(self, base):
        self.base, self.shape, self.strides, self.padding = base, (2, 2), (2, 1), "zero"


class _Compiled:
    packed_metadata = ()


def test_a_descriptor_over_a_calls_tensor_is_made_again_by_each_replay(monkeypatch):
    q, other = torch.zeros(4), torch.zeros(4)
    attn = type("Attn", (), {"_device_tensors": {}})()
    rec = replay.Recorder()
    rec.ran.append((object(), _Compiled(), (1, 1, 1), (_Descriptor(q.view(2, 2)), 3)))
    recipe = rec.recipe((q,), attn)
    launched = []
    monkeypatch.setattr(replay, "launch_compiled", lambda c, grid, stream, args: launched.append(args))
    monkeypatch.setattr(replay, "_stream", lambda device: 0)
    monkeypatch.setattr(replay, "_device", lambda: 0)
    fresh = torch.ones(4)
    recipe.run((fresh,))
    desc, n = launched[0]
    assert n == 3 and desc.base.data_ptr() == fresh.data_ptr() and desc.shape == (2, 2) and desc.padding == "zero"
    # over a tensor that is not one of the call's: no recipe (it would keep that tensor)
    rec.ran.append((object(), _Compiled(), (1, 1, 1), (_Descriptor(other.view(2, 2)), 3)))
    assert rec.recipe((q,), attn) is None


# -- `dilgen build` (aot): the Gluon forward is compiled ahead of time like the `tl` kernels --
def _gluon_module():
    """A small sm90 Gluon plan (GQA 2, lattice 2, whole segments from N = 512), built into the
    test's cache."""
    from dilgen.compiler import build
    spec = _spec(name="gx_aot", segment_lengths=[256, 512], dilation_rates=[1, 2], num_heads=4, num_kv_heads=2)
    return build(spec, get_target("sm90"), {"gluon_fwd": True})


@needs_gluon
def test_launch_model_has_the_gluon_forward_for_whole_segments(cache_dir):
    from dilgen.aot.launch_model import kernel_roles, predicted_launches
    from dilgen.runtime.gluon_launch import OPTIONS
    attn = _gluon_module().module.attention
    roles = {role: (fn, opts) for role, fn, opts in kernel_roles(attn)}
    assert roles["gluon_forward"] == (attn.gluon_fn, OPTIONS)
    assert [x.role for x in predicted_launches(attn, 1024)].count("gluon_forward") == 1
    assert "gluon_forward" not in [x.role for x in predicted_launches(attn, 768)]   # 768 % 512: short last segment


@needs_gluon
def test_modelled_gluon_launch_specializes_as_the_runtime_s(cache_dir):
    """The model's MockTensor arguments at batch 1 give the specialization that a call's real
    arguments give (batch 2 here): one binary serves every batch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from dilgen.aot.binder import specialize
    from dilgen.aot.launch_model import predicted_launches
    from dilgen.runtime.gluon_launch import OPTIONS, gluon_args
    attn = _gluon_module().module.attention
    (model,) = [x for x in predicted_launches(attn, 1024) if x.role == "gluon_forward"]
    q = torch.randn(2, 1024, 4, 128, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1024, 2, 128, dtype=torch.bfloat16), torch.randn(2, 1024, 2, 128, dtype=torch.bfloat16)
    real = gluon_args(attn.plan, q, k, v, torch.empty_like(q), torch.empty(2, 4, 1024), 2, 1024)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    want = specialize(attn.gluon_fn, backend, real, OPTIONS)
    assert specialize(attn.gluon_fn, backend, model.args, model.launch_opts).desc == want.desc
    assert sum("tensordesc<" in str(t) for t in want.signature.values()) == 2 + 2 * 2


@needs_gluon
def test_build_compiles_the_gluon_forward_and_the_runtime_finds_it(cache_dir, monkeypatch):
    """`dilgen build` stores the Gluon forward's binary (under both CI Tritons: 3.9 names its
    TMA copies differently); a call's launch (on a pretend sm90 device) loads and launches it,
    with no JIT."""
    from triton.backends.compiler import GPUTarget
    from dilgen import aot
    from dilgen.aot import run as aot_run
    from dilgen.aot.build import compile_job, plan_jobs, store_job
    from dilgen.runtime.gluon_launch import OPTIONS, gluon_args
    compiled = _gluon_module()
    jobs, skipped = plan_jobs(compiled, get_target("sm90"), [1024])
    (job,) = [j for j in jobs if j.role == "gluon_forward"]
    assert not skipped
    store_job(job, *compile_job(job))
    launched, jit = [], []
    monkeypatch.setattr(aot_run, "_current_target", lambda: GPUTarget("cuda", 90, 32))
    monkeypatch.setattr(aot_run, "_current_device", lambda: 0)
    monkeypatch.setattr(aot_run, "_prepare", lambda kernel: None)
    monkeypatch.setattr(aot_run, "_launch_compiled", lambda kernel, grid, bound: launched.append(kernel))
    monkeypatch.setattr(aot.AOTKernel, "_jit_launch", lambda self, grid, args, opts: jit.append(grid))
    attn = compiled.module.attention
    q = torch.randn(3, 1024, 4, 128, dtype=torch.bfloat16)
    k, v = torch.randn(3, 1024, 2, 128, dtype=torch.bfloat16), torch.randn(3, 1024, 2, 128, dtype=torch.bfloat16)
    args = gluon_args(attn.plan, q, k, v, torch.empty_like(q), torch.empty(3, 4, 1024), 3, 1024)
    attn.gluon_kernel[(8, 12)](*args, **OPTIONS)
    assert jit == [] and len(launched) == 1, aot.FALLBACKS
    assert launched[0].metadata.target == GPUTarget("cuda", 90, 32) and launched[0].asm["cubin"][:4] == b"\x7fELF"


# -- on an sm90 GPU: the Gluon forward beside lane launches, float64 out, lse and gradients --
SMALL = dict(num_heads=8, num_kv_heads=2, segment_lengths=[512, 1024, 2048])
BESIDE_LANES = [
    # (id, spec fields, (B, N)): the Gluon forward's rows, then the lane launches adding into them
    ("hilbert_segment", dict(SMALL, hilbert={"scope": "segment"}), (2, 2048)),
    ("rate_6_lanes", dict(SMALL, dilation_rates=[1, 2, 6]), (1, 4096)),
    ("hilbert_sequence", dict(SMALL, hilbert={"scope": "sequence", "grid": [32, 64]}), (2, 2048)),
]


@on_sm90
@pytest.mark.parametrize("case", BESIDE_LANES, ids=[c[0] for c in BESIDE_LANES])
def test_beside_lane_branches_matches_the_float64_reference_on_sm90(case, monkeypatch):
    from conftest import check_against_reference
    from dilgen.runtime import forward
    name, over, (B, N) = case
    taken = []

    def spy(*args, real=forward.gluon_launch):
        got = real(*args)
        taken.append(got is not None)
        return got
    monkeypatch.setattr(forward, "gluon_launch", spy)
    check_against_reference(_spec(name="gxl_" + name, **over), B, N, {}, name)
    assert taken and all(taken), taken
