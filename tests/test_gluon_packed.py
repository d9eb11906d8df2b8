"""sm90's Gluon kernels over packed rows (the `_packed` forward, dQ and dK/dV of
templates/gluon_fwd.py.jinja, gluon_dq.py.jinja, gluon_bwd.py.jinja; runtime.gluon_packed
gluon_packed_launch, gluon_dq_packed_launch, gluon_dkdv_packed_launch): on the CPU, which
plans carry them, when a call takes them and that they compile for sm90; on an sm90 GPU,
packed and padded batches against the float64 reference run on each sequence alone (outputs
poisoned first), with short segments, partial blocks, tiles past a sequence's end, and
non-finite values in the rows beside a sequence that must not reach it."""
from __future__ import annotations

import importlib.util

import pytest
import torch
import triton

import dilgen
from dilgen.reference import differentiable_reference
from dilgen.runtime import gluon_launch, gluon_packed

from conftest import needs_gluon, on_sm90, rel_error
from packed_checks import check_sequences, offsets, packed_inputs

SMALL = dict(num_heads=8, num_kv_heads=2, head_dim=128, segment_lengths=[512, 1024, 2048],
             dilation_rates=[1, 2, 4], dtype="bfloat16")


def _spec(name, **over):
    return dilgen.Spec(name=name, **dict(SMALL, **over))


def _module(tmp_path, spec, dropout=False):
    from dilgen import codegen
    from dilgen.planner import plan
    from dilgen.targets import get_target
    path = tmp_path / f"{spec.name}.py"
    path.write_text(codegen.emit(plan(spec, get_target("sm90"), {"dropout": dropout})))
    found = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(found)
    found.loader.exec_module(mod)
    return mod


@needs_gluon
def test_plans_without_dropout_carry_the_packed_forward(tmp_path):
    plain = _module(tmp_path, _spec("gp_plain"))
    attn = plain.attention
    assert attn.gluon_packed_fn is plain.gp_plain_gluon_fwd_packed
    assert attn.gluon_dq_packed_fn is plain.gp_plain_gluon_dq_packed
    assert attn.gluon_dkdv_packed_fn is plain.gp_plain_gluon_dkdv_packed
    dropped = _module(tmp_path, _spec("gp_drop"), dropout=True)
    assert dropped.attention.gluon_packed_fn is None and not hasattr(dropped, "gp_drop_gluon_fwd_packed")
    assert dropped.attention.gluon_dq_packed_fn is None and dropped.attention.gluon_dkdv_packed_fn is None


@needs_gluon
def test_a_cpu_call_or_dropout_takes_the_tl_kernel(tmp_path):
    attn = _module(tmp_path, _spec("gp_cpu")).attention
    q = torch.randn(64, 8, 128, dtype=torch.bfloat16)
    k = v = torch.randn(64, 2, 128, dtype=torch.bfloat16)
    seqs = (torch.tensor([0], dtype=torch.int32), torch.tensor([64], dtype=torch.int32))
    out, lse = torch.empty_like(q), torch.empty(8, 64)
    assert gluon_packed.gluon_packed_launch(attn, q, k, v, out, lse, seqs, 1, 64) is None


@needs_gluon
@pytest.mark.skipif(not triton.__version__.startswith("3.6"),
                    reason="compiled under Triton 3.6, the GPU machines' version (CI's second run)")
@pytest.mark.parametrize("kind", ["fwd", "dq", "dkdv"])
def test_compiles_for_sm90_without_a_gpu(tmp_path, kind):
    """The PTX has the warpgroup MMAs, TMA loads through the host descriptors, and the
    descriptors a lane's partial last block is read through, made in the kernel."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    mod = _module(tmp_path, _spec("gp_ptx_" + kind))

    def desc(rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, 1, 128], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, 1, 128],{layout!r}>"
    seqs = {"SeqStart": "*i32", "SeqLen": "*i32", "rows": "i32"}
    if kind == "fwd":
        sig = {"q_desc": desc(64), "o_desc": desc(64), **{f"{x}{i}": desc(128) for x in "kv" for i in range(3)},
               "V": "*bf16", "Out": "*bf16", "Lse": "*fp32", **seqs}
    elif kind == "dq":
        sig = {"q_desc": desc(64), "do_desc": desc(64), **{f"{x}{i}": desc(64) for x in "kv" for i in range(3)},
               "K": "*bf16", "V": "*bf16", "Lse": "*fp32", "Delta": "*fp32", "DQ": "*bf16", **seqs}
    else:
        sig = {**{f"{x}{i}": desc(64) for x in ("q", "do") for i in range(3)}, "k_desc": desc(64),
               "v_desc": desc(64), "Q": "*bf16", "DO": "*bf16", "Lse": "*fp32", "Delta": "*fp32",
               "DK": "*bf16", "DV": "*bf16", **seqs}
    fn = getattr(mod, f"gp_ptx_{kind}_gluon_{kind}_packed")
    kernel = triton.compile(GluonASTSource(fn, sig, {}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": 168})
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
    assert "tensormap.replace" in ptx                  # the partial blocks' descriptors, made in the kernel
    assert kernel.metadata.global_scratch_size >= 128 * 3


@needs_gluon
def test_build_models_the_packed_kernels_as_the_runtime_launches_them(cache_dir):
    """`dilgen build`'s launch model has the packed forward, dQ and dK/dV for a packed call of
    N rows where N is a multiple of L, and its MockTensor arguments give the specialization of
    a call's real ones: the binaries it stores are the ones the runtime looks up."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from dilgen.aot.binder import specialize
    from dilgen.aot.build import plan_jobs
    from dilgen.aot.launch_model import predicted_launches
    from dilgen.compiler import build
    from dilgen.targets import get_target
    compiled = build(_spec("gp_aot"), get_target("sm90"), {})
    attn, plan = compiled.module.attention, compiled.module.attention.plan
    roles = ("gluon_forward_packed", "gluon_dq_packed", "gluon_dkdv_packed")
    model = {x.role: x for x in predicted_launches(attn, 4096) if x.role in roles}
    assert set(model) == set(roles)
    assert not {x.role for x in predicted_launches(attn, 4098)} & set(roles)     # 4098 rows: not a multiple of 4
    jobs, _ = plan_jobs(compiled, get_target("sm90"), [4096])
    assert set(roles) <= {j.role for j in jobs}
    q, g, out, dq = (torch.randn(4096, 8, 128, dtype=torch.bfloat16) for _ in range(4))
    k, v, dk, dv = (torch.randn(4096, 2, 128, dtype=torch.bfloat16) for _ in range(4))
    lse, delta = torch.empty(8, 4096), torch.empty(8, 4096)
    seqs = (torch.tensor([0, 1000], dtype=torch.int32), torch.tensor([1000, 3096], dtype=torch.int32))
    real = {"gluon_forward_packed": gluon_packed.gluon_packed_args(plan, q, k, v, out, lse, seqs, 4096),
            "gluon_dq_packed": gluon_packed.gluon_dq_packed_args(plan, q, k, v, g, lse, delta, dq, seqs, 4096),
            "gluon_dkdv_packed": gluon_packed.gluon_dkdv_packed_args(plan, q, k, v, g, lse, delta, dk, dv, seqs,
                                                                    4096)}
    backend = make_backend(GPUTarget("cuda", 90, 32))
    for role in roles:
        fn = model[role].source_fn
        want = specialize(fn, backend, real[role], gluon_launch.OPTIONS).desc
        assert specialize(fn, backend, model[role].args, model[role].launch_opts).desc == want, role


# -- on an sm90 GPU ---------------------------------------------------------------------
# (id, spec fields, sequence lengths): the rows a multiple of the lattice L, so the Gluon
# forward takes every launch group
PACKED = [
    # short sequences (one short segment per branch), partial key blocks, a 7-row sequence
    ("short_and_long", dict(), [1000, 4096, 389, 2178, 7, 518]),
    ("head_dim_64_mha", dict(head_dim=64, num_kv_heads=8), [3000, 130, 2048, 1006]),
    ("head_base", dict(head_base=4), [2051, 515, 1470]),
    ("lanes_beside", dict(dilation_rates=[1, 2, 6]), [3001, 1100, 127]),   # r = 6 runs as `tl` lanes after it
]


def _taken(monkeypatch):
    from dilgen.runtime import forward
    taken = []

    def spy(*args, real=forward.gluon_packed_launch):
        got = real(*args)
        taken.append(got is not None)
        return got
    monkeypatch.setattr(forward, "gluon_packed_launch", spy)
    return taken


@on_sm90
@pytest.mark.parametrize("case", PACKED, ids=[c[0] for c in PACKED])
def test_packed_rows_match_the_float64_reference_on_sm90(case, monkeypatch):
    name, over, lengths = case
    spec = _spec("gp_" + name, **over)
    cu = offsets(lengths)
    taken = _taken(monkeypatch)
    q, k, v = packed_inputs(spec, cu[-1], seed=len(name))
    out, lse = dilgen.compile(spec)(q, k, v, cu_seqlens=torch.tensor(cu, dtype=torch.int32), return_lse=True)
    assert taken and all(taken), taken
    check_sequences(spec, q, k, v, out, lse, cu)


@on_sm90
def test_the_rows_beside_a_sequence_never_reach_it_on_sm90(monkeypatch):
    """Sequence 1 (389 rows) ends in partial key blocks; the rows after it, sequence 2's, hold
    inf and NaN in k and v. Every other sequence is exact."""
    spec = _spec("gp_beside")
    cu = [0, 1000, 1389, 2400, 4096]
    taken = _taken(monkeypatch)
    q, k, v = packed_inputs(spec, cu[-1], seed=11)
    k[1389:1400], v[1389:1400] = float("inf"), float("nan")
    out, lse = dilgen.compile(spec)(q, k, v, cu_seqlens=torch.tensor(cu, dtype=torch.int32), return_lse=True)
    assert taken and all(taken), taken
    check_sequences(spec, q, k, v, out, lse, cu, skip={2})


@on_sm90
def test_a_padded_batch_with_nan_padding_matches_on_sm90(monkeypatch):
    spec = _spec("gp_padded")
    B, N, valid = 3, 2048, [2048, 700, 1301]
    mask = torch.arange(N)[None, :] >= torch.tensor(valid)[:, None]
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, N, h, 128, generator=g).to(torch.bfloat16).cuda() for h in (8, 2, 2))
    for t in (q, k, v):
        t[mask.cuda()] = float("nan")
    taken = _taken(monkeypatch)
    out, lse = dilgen.compile(spec).padded(q, k, v, mask.cuda(), return_lse=True)
    assert taken and all(taken), taken
    for b, n in enumerate(valid):
        ro, rl = differentiable_reference(*(t[b:b + 1, :n].double().cpu() for t in (q, k, v)), spec)
        assert rel_error(out[b, :n].cpu(), ro[0]) < 2e-2, f"item {b}"
        assert (out[b, n:] == 0).all(), f"item {b}: padding rows"


GRADS = [
    # (id, spec fields, sequence lengths, the sequence whose first rows hold inf and NaN)
    ("gqa_d128", dict(), [1500, 389, 2111, 1000], 2),
    ("mha_d64_prefetch", dict(head_dim=64, num_kv_heads=8), [130, 3000, 2046, 4], 2),
    ("lanes_beside", dict(dilation_rates=[1, 2, 6]), [2600, 777, 1043], 2),
]


@on_sm90
@pytest.mark.parametrize("case", GRADS, ids=[c[0] for c in GRADS])
def test_gradients_of_packed_rows_on_sm90(case, monkeypatch):
    """The Gluon forward, dQ and dK/dV of packed rows: dq, dk, dv of every sequence exact, the
    one whose rows hold inf and NaN (q, k, v and the output gradient) excepted: the lanes
    before it end in partial blocks and must not read them."""
    from dilgen.runtime import backward
    name, over, lengths, bad = case
    spec = _spec("gp_grad_" + name, **over)
    cu = offsets(lengths)
    kernel = dilgen.compile(spec)
    q, k, v = packed_inputs(spec, cu[-1], seed=len(name))
    taken = _taken(monkeypatch)
    for fn, cfg in (("gluon_dq_packed_launch", "gluon_dq"), ("gluon_dkdv_packed_launch", "gluon_dkdv")):
        if kernel.compiled_for(q.device).attention.plan["config"].get(cfg):    # else `tl` (explain says which)
            def spy(*args, real=getattr(backward, fn)):
                got = real(*args)
                taken.append(got is not None)
                return got
            monkeypatch.setattr(backward, fn, spy)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(q.dtype).cuda()
    for t in (q, k, v, grad):
        t[cu[bad]:cu[bad] + 5] = float("nan")
        t[cu[bad] + 5:cu[bad] + 9] = float("inf")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = kernel(q, k, v, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    (out * grad).sum().backward()
    assert len(taken) >= 2 and all(taken), taken      # forward, dK/dV (and dQ) per launch group
    for b in range(len(lengths)):
        a, e = cu[b], cu[b + 1]
        if b == bad:
            continue
        ref_in = [t.detach()[a:e].double().cpu().unsqueeze(0).requires_grad_() for t in (q, k, v)]
        ro, _ = differentiable_reference(*ref_in, spec)
        (ro[0] * grad[a:e].double().cpu()).sum().backward()
        assert rel_error(out[a:e], ro[0]) < 2e-2, f"sequence {b}: out"
        for mine, ref, what in zip((q, k, v), ref_in, "qkv"):
            assert torch.isfinite(mine.grad[a:e]).all(), f"sequence {b}: d{what} not finite"
            assert rel_error(mine.grad[a:e], ref.grad[0]) < 4e-2, f"sequence {b}: d{what}"


@on_sm90
def test_replays_and_a_cuda_graph_give_the_bits_of_a_fresh_call_on_sm90(monkeypatch):
    """Packed calls of one layout replay the first one's Gluon launches (host descriptors made
    again over the call's tensors, the in-kernel ones in fresh scratch) with their own offsets;
    a capture in a CUDA graph replays to the eager call's bits. Forward and gradients."""
    from dilgen.runtime import replay
    spec = _spec("gp_replay")
    kernel = dilgen.compile(spec)
    taken = _taken(monkeypatch)

    def step(q, k, v, cu):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = kernel(*leaves, cu_seqlens=cu, return_lse=True)
        g = torch.ones_like(out)
        return (out, lse, *torch.autograd.grad(out, leaves, g))
    for i, lens in enumerate(([1000, 389, 2711], [389, 2711, 1000], [2711, 1000, 389])):   # one layout
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).cuda()
        q, k, v = packed_inputs(spec, 4100, seed=30 + i)
        got = step(q, k, v, cu)
        replay.ENABLED = False
        try:
            want = step(q, k, v, cu)
        finally:
            replay.ENABLED = True
        assert all(torch.equal(a, b) for a, b in zip(got, want)), i
    assert taken and all(taken)
    attn = kernel.compiled_for(q.device).attention
    assert {key[0] for key, r in attn._replays.items() if hasattr(r, "launches")} >= {"vfwd", "vbwd"}
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
