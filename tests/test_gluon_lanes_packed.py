"""sm90's causal Gluon lanes over packed rows, forward and backward (templates/gluon_lanes.py.jinja
`_lanes_packed`, gluon_lanes_bwd.py.jinja `_dkdv_lanes_packed` and `_dq_lanes_packed`;
runtime.gluon_packed): on the CPU, which plans carry the kernels, when a launch takes them,
that they compile for sm90 and that `dilgen build` models them; on an sm90 GPU, packed causal
batches against the float64 reference run on each sequence alone (outputs poisoned first),
with short last segments, lanes that end inside a block, tiles past a lane's end, and inf
and NaN in the rows beside a sequence that must not reach it."""
from __future__ import annotations

import pytest
import torch
import triton

import dilgen
from dilgen.reference import differentiable_reference
from dilgen.runtime import gluon_launch, gluon_packed

from conftest import assert_waits_before_touching_outputs, compile_sm90, load_emitted, needs_gluon, on_sm90, rel_error
from packed_checks import check_sequences, offsets, packed_inputs

CAUSAL = dict(num_heads=8, num_kv_heads=2, head_dim=128, segment_lengths=[512, 1024, 2048],
              dilation_rates=[1, 2, 4], dtype="bfloat16", causal=True)


def _spec(name, **over):
    return dilgen.Spec(name=name, **dict(CAUSAL, **over))


def _plan(spec, tuning: dict):
    from dilgen.planner import plan
    from dilgen.targets import get_target
    return plan(spec, get_target("sm90"), tuning)


def _emitted(tmp_path, spec, plan):
    from dilgen import codegen
    return load_emitted(tmp_path / f"{spec.name}.py", codegen.emit(plan))


def _module(tmp_path, spec, dropout=False):
    return _emitted(tmp_path, spec, _plan(spec, {"dropout": dropout}))


@needs_gluon
def test_causal_plans_without_dropout_carry_the_packed_lanes(tmp_path):
    mod = _module(tmp_path, _spec("lp_plain"))
    assert mod.attention.gluon_lanes_packed_fn is mod.lp_plain_gluon_lanes_packed
    assert mod.attention.gluon_dkdv_lanes_packed_fn is mod.lp_plain_gluon_dkdv_lanes_packed
    assert mod.attention.gluon_dq_lanes_packed_fn is mod.lp_plain_gluon_dq_lanes_packed
    dropped = _module(tmp_path, _spec("lp_drop"), dropout=True)
    assert dropped.attention.gluon_lanes_packed_fn is None and not hasattr(dropped, "lp_drop_gluon_lanes_packed")
    assert dropped.attention.gluon_dkdv_lanes_packed_fn is None and dropped.attention.gluon_dq_lanes_packed_fn is None
    plain = _module(tmp_path, _spec("lp_nc", causal=False))     # no lane branch: the lattice's packed kernels
    assert plain.attention.gluon_lanes_packed_fn is None and plain.attention.gluon_packed_fn is not None


PACKED_FNS = ("gluon_packed", "gluon_dkdv_packed", "gluon_dq_packed", "gluon_lanes_packed", "gluon_dkdv_lanes_packed",
              "gluon_dq_lanes_packed")


@needs_gluon
@pytest.mark.parametrize("over, tuning", [({}, {}), ({}, {"dropout": True}), ({"causal": False}, {}),
                                          ({}, {"gluon_dkdv_dq": True}), ({"head_dim": 64, "num_kv_heads": 8}, {}),
                                          ({}, {"gluon_dkdv_lanes": False})],
                         ids=["causal", "dropout", "non_causal", "dkdv_adds_dq", "head_dim_64", "tl_dkdv"])
def test_a_module_carries_the_packed_kernels_its_plan_names(over, tuning, tmp_path):
    """Plan.gluon_packed_kernels is the one place that says which Gluon kernels over packed rows
    a plan's module carries (the templates emit and pass exactly those)."""
    spec = _spec("pk", **over)
    p = _plan(spec, tuning)
    attn = _emitted(tmp_path, spec, p).attention
    assert {name for name in PACKED_FNS if getattr(attn, name + "_fn") is not None} == p.gluon_packed_kernels
    assert bool(p.gluon_packed_kernels) != p.dropout


@needs_gluon
def test_a_cpu_call_a_clearing_launch_or_fewer_rows_than_the_rate_take_the_tl_lanes(tmp_path):
    attn = _module(tmp_path, _spec("lp_cpu")).attention
    br = attn.plan["branches"][2]                 # w = 2048, r = 4
    seqs = (torch.tensor([0], dtype=torch.int32), torch.tensor([64], dtype=torch.int32))

    def launch(rows, device="cpu", clear=False):
        q = torch.randn(rows, 8, 128, dtype=torch.bfloat16, device=device)
        k = v = torch.randn(rows, 2, 128, dtype=torch.bfloat16, device=device)
        return gluon_packed.gluon_lanes_packed_launch(attn, q, k, v, torch.empty_like(q),
                                                      torch.empty(8, rows, device=device), seqs, 1, rows, br,
                                                      True, clear)
    assert launch(64) is None                                     # the CPU
    if torch.cuda.is_available() and gluon_launch._sm90(torch.device("cuda")):
        assert launch(64, "cuda") is not None
        assert launch(64, "cuda", clear=True) is None             # a first launch writing the gaps: `tl`
        assert launch(66, "cuda") is not None                     # rows past the views' 66 // 4: in-kernel boxes
        assert launch(3, "cuda") is None                          # fewer rows than r = 4: `tl`


@needs_gluon
@pytest.mark.skipif(not triton.__version__.startswith("3.6"),
                    reason="compiled under Triton 3.6, the GPU machines' version (CI's second run)")
def test_compiles_for_sm90_without_a_gpu(tmp_path):
    """The forward, dK/dV and dq, writing and adding: the PTX has the warpgroup MMAs, TMA loads
    through the host descriptors and the descriptors a lane's last block is read through, made
    in the kernel; under programmatic dependent launch each waits where the fixed-length lanes do
    (a writing one before it reads even the group's starts)."""
    from triton.experimental.gluon import language as gl
    mod = _module(tmp_path, _spec("lp_ptx"))

    def desc(rows):
        return f"tensordesc<bf16[{rows}, 1, 128],{gl.NVMMASharedLayout.get_default_for([rows, 1, 128], gl.bfloat16)!r}>"
    sig = {"q_desc": desc(64), "o_desc": desc(64), "k_desc": desc(128), "v_desc": desc(128), "Q": "*bf16",
           "K": "*bf16", "V": "*bf16", "Out": "*bf16", "Lse": "*fp32", "SeqStart": "*i32", "SeqLen": "*i32", "N": "i32",
           "W": "constexpr", "R": "constexpr", "ACCUMULATE": "constexpr"}
    seqs = {"SeqStart": "*i32", "SeqLen": "*i32", "N": "i32", "W": "constexpr", "R": "constexpr"}
    views = {"q_desc": desc(64), "do_desc": desc(64), "k_desc": desc(64), "v_desc": desc(64)}
    dkdv = {**views, "Q": "*bf16", "DO": "*bf16", "K": "*bf16", "V": "*bf16", "Lse": "*fp32", "Delta": "*fp32", "DK": "*bf16", "DV": "*bf16",
            **seqs, "NO": "constexpr", "ACCUMULATE": "constexpr"}
    dq = {**views, "Q": "*bf16", "DO": "*bf16", "K": "*bf16", "V": "*bf16", "Lse": "*fp32", "Delta": "*fp32", "DQ": "*bf16", **seqs,
          "ACCUMULATE": "constexpr"}
    for merge in (False, True):
        for fn, signature, consts in ((mod.lp_ptx_gluon_lanes_packed, sig, {(12,): 1024, (13,): 2, (14,): merge}),
                                      (mod.lp_ptx_gluon_dkdv_lanes_packed, dkdv,
                                       {(15,): 1024, (16,): 2, (17,): 2, (18,): merge}),
                                      (mod.lp_ptx_gluon_dq_lanes_packed, dq, {(14,): 1024, (15,): 2, (16,): merge})):
            kernel = compile_sm90(fn, signature, consts, **gluon_launch.lane_options(mod.attention.plan))
            ptx = kernel.asm["ptx"]
            assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
            assert "tensormap.replace" in ptx
            assert kernel.metadata.global_scratch_size >= 128 and kernel.metadata.launch_pdl
            assert_waits_before_touching_outputs(kernel.asm["ttgir"], merge, forward=fn is mod.lp_ptx_gluon_lanes_packed,
                                                  packed=True)


@needs_gluon
def test_build_models_the_packed_lanes_as_the_runtime_launches_them(cache_dir):
    """`dilgen build`'s launch model has the packed lanes of every branch for a packed call of N
    rows (the first, r = 1, writing; the others merging), and its MockTensor arguments give a
    real call's specialization."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from dilgen.aot.binder import specialize
    from dilgen.aot.launch_model import predicted_launches
    from dilgen.compiler import build
    from dilgen.runtime.grids import lane_order
    from dilgen.targets import get_target
    attn = build(_spec("lp_aot"), get_target("sm90"), {}).module.attention
    launches = predicted_launches(attn, 4096)
    model = [x for x in launches if x.role == "gluon_lanes_packed"]
    assert len(model) == 3
    assert [x.role for x in launches].count("gluon_dkdv_lanes_packed") == 3
    assert [x.role for x in launches].count("gluon_dq_lanes_packed") == 3
    assert len([x for x in predicted_launches(attn, 4097) if x.role == "gluon_lanes_packed"]) == 3   # rows off r too
    assert [x.role for x in predicted_launches(attn, 4097)].count("gluon_dq_lanes_packed") == 3
    assert all(x.launch_opts == gluon_launch.lane_options(attn.plan, dkdv=x.role == "gluon_dkdv_lanes_packed")
               and x.launch_opts.get("launch_pdl") for x in launches if x.role.endswith("lanes_packed"))
    q, out = (torch.randn(4096, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(4096, 2, 128, dtype=torch.bfloat16) for _ in range(2))
    seqs = (torch.tensor([0, 1000], dtype=torch.int32), torch.tensor([1000, 3096], dtype=torch.int32))
    backend = make_backend(GPUTarget("cuda", 90, 32))
    for n, (launch, i) in enumerate(zip(model, lane_order(attn.plan))):
        br = attn.plan["branches"][i]
        real = gluon_packed.gluon_lanes_packed_args(attn.plan, q, k, v, out, torch.empty(8, 4096), seqs, 4096, br,
                                                    n > 0)
        want = specialize(launch.source_fn, backend, real, gluon_launch.lane_options(attn.plan)).desc
        assert specialize(launch.source_fn, backend, launch.args, launch.launch_opts).desc == want, n


# -- on an sm90 GPU ---------------------------------------------------------------------
PACKED = [
    # short sequences (a short last segment per branch), lanes ending inside a key block, a 7-row one
    ("short_and_long", dict(), [1000, 4096, 389, 2178, 7, 518]),
    ("head_base_mha", dict(head_base=4, num_kv_heads=8), [2051, 515, 1470]),
    ("rate_8", dict(dilation_rates=[1, 2, 8]), [3001, 1100, 127, 4]),   # lanes of 119 to 120 keys
    # rows not a multiple of r (4,099): the lanes reaching past the views' rows // r
    ("rows_off_the_rate", dict(), [1000, 2051, 389, 659]),
    # LongNet's r = 6 does not divide w = 2048 (lanes of 341 or 342 rows), 3,999 rows
    ("longnet_rate_6", dict(dilation_rates=[1, 2, 6]), [2500, 1103, 389, 7]),
]


def _taken(monkeypatch, backward=False):
    """(launcher, took Gluon) of each packed lane launch (forward; with `backward`, dK/dV and dq too)."""
    from dilgen.runtime import backward as bwd, forward
    taken = []
    spied = [(forward, "gluon_lanes_packed_launch")]
    if backward:
        spied += [(bwd, "gluon_dkdv_lanes_packed_launch"), (bwd, "gluon_dq_lanes_packed_launch")]
    for module, name in spied:
        def spy(*args, real=getattr(module, name), name=name):
            got = real(*args)
            taken.append((name, got is not None))
            return got
        monkeypatch.setattr(module, name, spy)
    return taken


@on_sm90
@pytest.mark.parametrize("case", PACKED, ids=[c[0] for c in PACKED])
def test_packed_causal_rows_match_the_float64_reference_on_sm90(case, monkeypatch):
    name, over, lengths = case
    spec = _spec("lp_" + name, **over)
    cu = offsets(lengths, multiple=1)   # the lanes take rows that r does not divide
    taken = _taken(monkeypatch)
    q, k, v = packed_inputs(spec, cu[-1], seed=len(name))
    out, lse = dilgen.compile(spec)(q, k, v, cu_seqlens=torch.tensor(cu, dtype=torch.int32), return_lse=True)
    assert taken and all(t for _, t in taken), taken
    check_sequences(spec, q, k, v, out, lse, cu)


@on_sm90
def test_the_rows_beside_a_sequence_never_reach_it_on_sm90(monkeypatch):
    """Sequence 1 (389 rows) ends inside key blocks of every branch; the rows after it,
    sequence 2's, hold inf and NaN in q, k, v and the output gradient. Every other sequence's
    output and gradients (the Gluon dK/dV and dq) are exact."""
    spec = _spec("lp_beside")
    cu = [0, 1000, 1389, 2400, 4096]
    taken = _taken(monkeypatch, backward=True)
    q, k, v = packed_inputs(spec, cu[-1], seed=11)
    for t in (q, k, v):
        t[1389:1395], t[1395:1400] = float("inf"), float("nan")
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out, lse = dilgen.compile(spec)(*leaves, cu_seqlens=torch.tensor(cu, dtype=torch.int32), return_lse=True)
    check_sequences(spec, q, k, v, out.detach(), lse, cu, skip={2})
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype).cuda()
    grad[1389:1395], grad[1395:1400] = float("nan"), float("inf")
    (out * grad).sum().backward()
    assert all(t for _, t in taken) and len({name for name, _ in taken}) == 3, taken   # forward, dK/dV, dq
    for b in (0, 1, 3):
        a, e = cu[b], cu[b + 1]
        ref_in = [t.detach()[a:e].double().cpu().unsqueeze(0).requires_grad_() for t in (q, k, v)]
        ro, _ = differentiable_reference(*ref_in, spec)
        (ro[0] * grad[a:e].double().cpu()).sum().backward()
        for mine, ref, what in zip((q, k, v), ref_in, "qkv"):
            assert torch.isfinite(mine.grad[a:e]).all(), f"sequence {b}: d{what} not finite"
            assert rel_error(mine.grad[a:e], ref.grad[0]) < 4e-2, f"sequence {b}: d{what}"


GRADS = [
    ("gqa_d128", dict(), [1500, 389, 2111, 1000, 4]),
    ("mha_rate_8", dict(num_kv_heads=8, dilation_rates=[1, 2, 8]), [130, 3000, 2046, 7, 17]),
    ("rate_8_past_the_group", dict(dilation_rates=[1, 4, 8]), [2600, 777, 1043, 4]),   # r = 8 > 4 heads a kv head
    # head_dim 64: no lane branch (the fused `tl` forward and dq); the Gluon dK/dV per branch, keys along rows
    ("head_dim_64", dict(head_dim=64), [1500, 389, 2111, 1000, 4]),
    # rows not a multiple of r (4,099; 3,999 with LongNet's r = 6 not dividing w = 2048): the
    # blocks reaching past the views' rows // r through boxes of their own
    ("rows_off_the_rate", dict(), [1000, 2051, 389, 659]),
    ("longnet_rate_6", dict(dilation_rates=[1, 2, 6]), [2500, 1103, 389, 7]),
]


@on_sm90
@pytest.mark.parametrize("case", GRADS, ids=[c[0] for c in GRADS])
def test_gradients_of_packed_causal_rows_on_sm90(case, monkeypatch):
    """dq, dk, dv of every sequence against float64 through the Gluon dK/dV and lane dq of
    every branch (head_dim 64: the dK/dV, its plan having no lane branch)."""
    name, over, lengths = case
    spec = _spec("lp_grad_" + name, **over)
    cu = offsets(lengths, multiple=1)
    kernel = dilgen.compile(spec)
    q, k, v = packed_inputs(spec, cu[-1], seed=len(name))
    taken = _taken(monkeypatch, backward=True)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.dtype).cuda()
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = kernel(q, k, v, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    (out * grad).sum().backward()
    assert all(t for _, t in taken) and "gluon_dkdv_lanes_packed_launch" in {name for name, _ in taken}, taken
    for b in range(len(lengths)):
        a, e = cu[b], cu[b + 1]
        ref_in = [t.detach()[a:e].double().cpu().unsqueeze(0).requires_grad_() for t in (q, k, v)]
        ro, _ = differentiable_reference(*ref_in, spec)
        (ro[0] * grad[a:e].double().cpu()).sum().backward()
        assert rel_error(out[a:e], ro[0]) < 2e-2, f"sequence {b}: out"
        for mine, ref, what in zip((q, k, v), ref_in, "qkv"):
            assert rel_error(mine.grad[a:e], ref.grad[0]) < 4e-2, f"sequence {b}: d{what}"


@on_sm90
def test_replays_and_a_cuda_graph_give_the_bits_of_a_fresh_call_on_sm90(monkeypatch):
    """Packed causal calls of one layout replay the first one's launches with their own
    offsets (the in-kernel descriptors in fresh scratch); a CUDA graph replays to the eager
    call's bits. Forward and gradients."""
    from dilgen.runtime import replay
    spec = _spec("lp_replay")
    kernel = dilgen.compile(spec)
    taken = _taken(monkeypatch, backward=True)

    def step(q, k, v, cu):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = kernel(*leaves, cu_seqlens=cu, return_lse=True)
        return (out, lse, *torch.autograd.grad(out, leaves, torch.ones_like(out)))
    for i, lens in enumerate(([1000, 389, 2711], [389, 2711, 1000], [2711, 1000, 389])):   # one layout
        cu = torch.tensor(offsets(lens), dtype=torch.int32).cuda()
        q, k, v = packed_inputs(spec, 4100, seed=30 + i)
        got = step(q, k, v, cu)
        replay.ENABLED = False
        try:
            want = step(q, k, v, cu)
        finally:
            replay.ENABLED = True
        assert all(torch.equal(a, b) for a, b in zip(got, want)), i
    assert taken and all(t for _, t in taken), taken
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(q, k, v, cu)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = step(q, k, v, cu)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, want))
