"""GPU probe (issue 42): dK and dV of one dense branch (w = 2048, r = 1: A's first branch) as a
warp-specialized Gluon kernel, against dilgen's `tl` dK/dV kernel of the same one-branch spec.

    python3 bench/tools/gluon_dkdv_probe.py --out DIR

A program owns 128 keys of one head (two consumer warpgroups of 64 keys, K and V kept in shared
memory and dK, dV in registers) and walks the segment's query blocks of 64 rows, which a
producer warp loads by TMA (Q and dO) into a ring of stages:
    S^T = K Q^T, P^T = exp2(S^T·c − lse₂), dV += P^T dO, dP^T = V dO^T,
    dS^T = P^T ⊙ (dP^T − Δ), dK += dS^T Q   (dK scaled by the softmax scale at the end)
Checks dK, dV against dilgen's (autograd of the same spec), times both kernels (CUDA events,
back to back) and dilgen's per-kernel times (torch.profiler)."""
import argparse
import json
import math
import os
import sys
import time

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import dilgen  # noqa: E402

tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
ROWS = gl.constexpr(64)         # keys per consumer warpgroup; query rows per block
D = gl.constexpr(128)
H = gl.constexpr(16)
W = gl.constexpr(2048)          # the branch's segment length (r = 1)
STAGES = gl.constexpr(int(os.environ.get("PROBE_STAGES", "3")))    # Q / dO blocks in flight


@gluon.jit
def _producer(p):
    (q_desc, k_desc, v_desc, do_desc, Lse2, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
     b, h, k0, seg0, N, qk_scale, sm_scale) = p
    mbarrier.expect(kv_bar, 4 * ROWS * D * 2)
    for wg in gl.static_range(2):
        tma_load(k_desc, [b * N + k0 + wg * ROWS, h, 0], kv_bar, k_smem.index(wg))
        tma_load(v_desc, [b * N + k0 + wg * ROWS, h, 0], kv_bar, v_smem.index(wg))
    for j in range(W // ROWS):
        st = j % STAGES
        mbarrier.wait(empty.index(st), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(st), 2 * ROWS * D * 2)
        tma_load(q_desc, [b * N + seg0 + j * ROWS, h, 0], ready.index(st), q_smem.index(st))
        tma_load(do_desc, [b * N + seg0 + j * ROWS, h, 0], ready.index(st), do_smem.index(st))


@gluon.jit
def _consume(p, WG: gl.constexpr):
    (q_desc, k_desc, v_desc, do_desc, Lse2, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
     b, h, k0, seg0, N, qk_scale, sm_scale) = p
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout)
    dk = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    dv = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    mbarrier.wait(kv_bar, 0)
    k = k_smem.index(WG).reshape([ROWS, D])
    v = v_smem.index(WG).reshape([ROWS, D])
    base = (b * H + h).to(gl.int64) * N + seg0
    cols = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout))
    for j in range(W // ROWS):
        st = j % STAGES
        mbarrier.wait(ready.index(st), (j // STAGES) & 1)
        qj = q_smem.index(st).reshape([ROWS, D])
        doj = do_smem.index(st).reshape([ROWS, D])
        s_tok = warpgroup_mma(k, qj.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(v, doj.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        lse = gl.load(Lse2 + base + j * ROWS + cols)
        dl = gl.load(Delta + base + j * ROWS + cols)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        pt = gl.exp2(s * qk_scale - gl.expand_dims(lse, 0))
        dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), doj, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=(dp_tok,))
        dst = pt * (dp - gl.expand_dims(dl, 0))
        dk_tok = warpgroup_mma(gl.convert_layout(dst.to(dtype), a_layout), qj, dk, is_async=True)
        dv = warpgroup_mma_wait(1, deps=(dv_tok,))
        dk = warpgroup_mma_wait(0, deps=(dk_tok,))
        mbarrier.arrive(empty.index(st), count=1)
    rows = b * N + k0 + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    dcols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    offs = (gl.expand_dims(rows.to(gl.int64), 1) * H + h) * D + gl.expand_dims(dcols, 0)
    gl.store(DK + offs, (dk * sm_scale).to(dtype))
    gl.store(DV + offs, dv.to(dtype))


@gluon.jit
def _consumer0(p):
    _consume(p, 0)


@gluon.jit
def _consumer1(p):
    _consume(p, 1)


@gluon.jit
def dkdv_kernel(q_desc, k_desc, v_desc, do_desc, Lse2, Delta, DK, DV, N, qk_scale, sm_scale):
    dtype: gl.constexpr = q_desc.dtype
    k0 = gl.program_id(0) * (2 * ROWS)
    b = gl.program_id(1) // H
    h = gl.program_id(1) % H
    seg0 = (k0 // W) * W
    k_smem = gl.allocate_shared_memory(dtype, [2, ROWS, 1, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, ROWS, 1, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, ROWS, 1, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, ROWS, 1, D], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    p = (q_desc, k_desc, v_desc, do_desc, Lse2, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready,
         empty, b, h, k0, seg0, N, qk_scale, sm_scale)
    gl.warp_specialize([(_consumer0, (p,)), (_consumer1, (p,)), (_producer, (p,))], [4, 1], [240, 24])


def gluon_dkdv(q, k, v, do, lse, delta):
    B, N, _, _ = q.shape
    layout = gl.NVMMASharedLayout.get_default_for([64, 1, 128], gl.bfloat16)

    def desc(t):
        view = t.view(B * N, 16, 128)
        return TensorDescriptor(view, list(view.shape), list(view.stride()), [64, 1, 128], layout)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    scale = 1 / math.sqrt(128)
    lse2 = (lse * math.log2(math.e)).contiguous()
    dkdv_kernel[(N // 128, B * H)](desc(q), desc(k), desc(v), desc(do), lse2, delta, dk, dv, N,
                                   scale * math.log2(math.e), scale, num_warps=4, maxnreg=168)
    return dk, dv


def b2b(fn, calls=10, rounds=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        a, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(e) / calls)
    return sorted(ts)[len(ts) // 2]


def kernel_times(fn):
    """dilgen's kernels of one call by name (ms, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" or getattr(ev, "self_device_time_total", 0):
            t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
            if t:
                out[ev.key[:60]] = round(t / 1000 / max(ev.count, 1) * ev.count, 4)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    B, N, Hh, Dd, Ww = 1, 32768, 16, 128, 2048
    spec = dilgen.Spec(name="dkdv_probe", num_heads=Hh, head_dim=Dd, segment_lengths=[Ww], dilation_rates=[1],
                       dtype="bfloat16")
    kern = dilgen.Kernel(spec, None, {"gluon_fwd": False})
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v, do = (torch.randn(B, N, Hh, Dd, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = kern(*leaves, return_lse=True)
    out.backward(do)
    delta = (do.float() * out.detach().float()).sum(-1).transpose(1, 2).contiguous()     # (B, H, N)
    lse = lse.detach().contiguous()
    row = {"shape": dict(B=B, N=N, H=Hh, D=Dd, w=Ww, r=1), "date": time.strftime("%Y-%m-%d"),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": __import__("triton").__version__}
    try:
        dk, dv = gluon_dkdv(q, k, v, do, lse, delta)
        torch.cuda.synchronize()
        row["dk_rel_err_vs_tl"] = ((dk.float() - leaves[1].grad.float()).norm() / leaves[1].grad.float().norm()).item()
        row["dv_rel_err_vs_tl"] = ((dv.float() - leaves[2].grad.float()).norm() / leaves[2].grad.float().norm()).item()
        row["gluon_dkdv_ms"] = round(b2b(lambda: gluon_dkdv(q, k, v, do, lse, delta)), 4)
    except Exception as exc:  # noqa: BLE001 - recorded
        row["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    print(json.dumps(row), flush=True)

    def step():
        for t in leaves:
            t.grad = None
        kern(*leaves).backward(do)
    row["tl_fwd_bwd_ms"] = round(b2b(step), 4)
    row["tl_kernels_ms"] = kernel_times(step)
    flops = 4 * B * Hh * (N / Ww) * Ww * Ww * Dd
    row["useful_dkdv_gflop"] = round(flops * 2 / 1e9, 1)   # S, dV, dP, dK: four W×W×D products
    print(json.dumps(row), flush=True)
    row["stages"] = int(STAGES)
    with open(os.path.join(a.out, f"gluon_dkdv_probe_s{int(STAGES)}.json"), "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
