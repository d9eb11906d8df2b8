"""GPU probe (issue 42): dK and dV of every branch in one warp-specialized Gluon program per key
tile (the `tl` fused dK/dV's work with FlashAttention-3's shape), against dilgen's `tl` kernels.

    python3 bench/tools/gluon_dkdv_fused_probe.py --out DIR

A program owns 128 keys of class c (rows u = c + L*m, L = max r) of one kv head: K, V stay in
shared memory (two consumer warpgroups of 64 keys), dK, dV in registers. For each query head
of its group and each branch (w, r) that keeps the class (r | c - h), a producer warp streams
the segment's query lanes u = s*w + o + r*j (o = h mod r) of Q and dO by TMA through the
(B*N/r, r*H, D) view into a ring of stages; per block of 64 lanes:
    S^T = K Q^T, P^T = exp2(S^T*c - lse2), dV += P^T dO, dP^T = V dO^T,
    dS^T = P^T * (dP^T - Delta), dK += dS^T Q      (dK times the softmax scale at the end)
Non-causal, raster, whole segments (N a multiple of every w; L*128 divides every w)."""
import argparse
import json
import math
import os
import sys
import time

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
import dilgen  # noqa: E402

KERNEL = r'''
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
ROWS = gl.constexpr(64)         # keys per consumer warpgroup; query lanes per block
H = gl.constexpr(__H__)
HKV = gl.constexpr(__HKV__)
D = gl.constexpr(__D__)
L = gl.constexpr(__L__)
STAGES = gl.constexpr(__STAGES__)


@gluon.jit
def _produce_branch(it, qd, dod, q_smem, do_smem, ready, empty, b, h, c, u0, N,
                    W: gl.constexpr, R: gl.constexpr):
    if (c - h) % R == 0:
        row0 = b * (N // R) + (u0 // W) * (W // R)
        col = (h % R) * H + h
        for j in range((W // R) // ROWS):
            st = it % STAGES
            mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(st), 2 * ROWS * D * 2)
            tma_load(qd, [row0 + j * ROWS, col, 0], ready.index(st), q_smem.index(st))
            tma_load(dod, [row0 + j * ROWS, col, 0], ready.index(st), do_smem.index(st))
            it += 1
    return it


@gluon.jit
def _producer(p):
    (qds, dods, k_desc, v_desc, Lse2, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
     b, kvh, c, m0, N, qk_scale, sm_scale) = p
    mbarrier.expect(kv_bar, 4 * ROWS * D * 2)
    for wg in gl.static_range(2):
        tma_load(k_desc, [b * (N // L) + m0 + wg * ROWS, c * HKV + kvh, 0], kv_bar, k_smem.index(wg))
        tma_load(v_desc, [b * (N // L) + m0 + wg * ROWS, c * HKV + kvh, 0], kv_bar, v_smem.index(wg))
    u0 = c + L * m0
    it = c * 0
    for g in range(H // HKV):
        h = kvh * (H // HKV) + g
        it = _produce_branch(it, qds[0], dods[0], q_smem, do_smem, ready, empty, b, h, c, u0, N, __W0__, __R0__)
        it = _produce_branch(it, qds[1], dods[1], q_smem, do_smem, ready, empty, b, h, c, u0, N, __W1__, __R1__)
        it = _produce_branch(it, qds[2], dods[2], q_smem, do_smem, ready, empty, b, h, c, u0, N, __W2__, __R2__)


@gluon.jit
def _consume_branch(it, dk, dv, k, v, q_smem, do_smem, ready, empty, Lse2, Delta, b, h, c, u0, N, qk_scale,
                    W: gl.constexpr, R: gl.constexpr):
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, ROWS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    if (c - h) % R == 0:
        s_zero = gl.zeros([ROWS, ROWS], gl.float32, layout=s_layout)
        lane0 = (b * H + h).to(gl.int64) * N + (u0 // W) * W + h % R
        cols = gl.arange(0, ROWS, layout=gl.SliceLayout(0, s_layout)) * R
        for j in range((W // R) // ROWS):
            st = it % STAGES
            mbarrier.wait(ready.index(st), (it // STAGES) & 1)
            qj = q_smem.index(st).reshape([ROWS, D])
            doj = do_smem.index(st).reshape([ROWS, D])
            s_tok = warpgroup_mma(k, qj.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(v, doj.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            lse = gl.load(Lse2 + lane0 + j * (ROWS * R) + cols)
            dl = gl.load(Delta + lane0 + j * (ROWS * R) + cols)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            pt = gl.exp2(s * qk_scale - gl.expand_dims(lse, 0))
            dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), doj, dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=(dp_tok,))
            dst = pt * (dp - gl.expand_dims(dl, 0))
            dk_tok = warpgroup_mma(gl.convert_layout(dst.to(dtype), a_layout), qj, dk, is_async=True)
            dv = warpgroup_mma_wait(1, deps=(dv_tok,))
            dk = warpgroup_mma_wait(0, deps=(dk_tok,))
            mbarrier.arrive(empty.index(st), count=1)
            it += 1
    return it, dk, dv


@gluon.jit
def _consume(p, WG: gl.constexpr):
    (qds, dods, k_desc, v_desc, Lse2, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
     b, kvh, c, m0, N, qk_scale, sm_scale) = p
    dtype: gl.constexpr = q_smem.dtype
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])
    dk = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    dv = gl.zeros([ROWS, D], gl.float32, layout=o_layout)
    mbarrier.wait(kv_bar, 0)
    k = k_smem.index(WG).reshape([ROWS, D])
    v = v_smem.index(WG).reshape([ROWS, D])
    u0 = c + L * m0
    it = c * 0
    for g in range(H // HKV):
        h = kvh * (H // HKV) + g
        it, dk, dv = _consume_branch(it, dk, dv, k, v, q_smem, do_smem, ready, empty, Lse2, Delta, b, h, c, u0, N,
                                     qk_scale, __W0__, __R0__)
        it, dk, dv = _consume_branch(it, dk, dv, k, v, q_smem, do_smem, ready, empty, Lse2, Delta, b, h, c, u0, N,
                                     qk_scale, __W1__, __R1__)
        it, dk, dv = _consume_branch(it, dk, dv, k, v, q_smem, do_smem, ready, empty, Lse2, Delta, b, h, c, u0, N,
                                     qk_scale, __W2__, __R2__)
    keys = c + L * (m0 + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout)))
    dcols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    offs = ((b * N + gl.expand_dims(keys, 1)).to(gl.int64) * HKV + kvh) * D + gl.expand_dims(dcols, 0)
    gl.store(DK + offs, (dk * sm_scale).to(dtype))
    gl.store(DV + offs, dv.to(dtype))


@gluon.jit
def _consumer0(p):
    _consume(p, 0)


@gluon.jit
def _consumer1(p):
    _consume(p, 1)


@gluon.jit
def dkdv_fused_kernel(q0, q1, q2, do0, do1, do2, k_desc, v_desc, Lse2, Delta, DK, DV, N, qk_scale, sm_scale):
    qds = (q0, q1, q2)
    dods = (do0, do1, do2)
    dtype: gl.constexpr = k_desc.dtype
    t = gl.program_id(0)
    c = t % L                       # the classes of a tile side by side: they read the same lanes
    m0 = (t // L) * (2 * ROWS)
    b = gl.program_id(1) // HKV
    kvh = gl.program_id(1) % HKV
    k_smem = gl.allocate_shared_memory(dtype, [2, ROWS, 1, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, ROWS, 1, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, ROWS, 1, D], k_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, ROWS, 1, D], k_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    p = (qds, dods, k_desc, v_desc, Lse2, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
         b, kvh, c, m0, N, qk_scale, sm_scale)
    gl.warp_specialize([(_consumer0, (p,)), (_consumer1, (p,)), (_producer, (p,))], [4, 1], [240, 24])
'''
_MODULES = {}


def kernel_module(H, HKV, D, ws, rs, stages):
    """The kernel with this case's constants printed in (Gluon's warp_specialize passes its
    partitions' arguments as values: constants travel in the source, as dilgen's templates do)."""
    import importlib.util
    import tempfile
    key = (H, HKV, D, tuple(ws), tuple(rs), stages)
    if key not in _MODULES:
        text = KERNEL
        for name, value in dict(H=H, HKV=HKV, D=D, L=max(rs), STAGES=stages, W0=ws[0], R0=rs[0], W1=ws[1],
                                R1=rs[1], W2=ws[2], R2=rs[2]).items():
            text = text.replace(f"__{name}__", str(value))
        path = os.path.join(tempfile.mkdtemp(), f"dkdv_fused_{len(_MODULES)}.py")
        with open(path, "w") as f:
            f.write(text)
        spec = importlib.util.spec_from_file_location(f"dkdv_fused_{len(_MODULES)}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _MODULES[key] = mod
    return _MODULES[key]


def gluon_dkdv_fused(q, k, v, do, lse, delta, ws, rs, stages=3):
    B, N, H, D = q.shape
    HKV = k.shape[2]
    L = max(rs)
    layout = gl.NVMMASharedLayout.get_default_for([64, 1, D], gl.bfloat16)

    def desc(t, r):
        view = t.view(B * N // r, r * t.shape[2], D)
        return TensorDescriptor(view, list(view.shape), list(view.stride()), [64, 1, D], layout)
    dk, dv = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))   # poisoned: unwritten rows show
    scale = 1 / math.sqrt(D)
    lse2 = (lse * math.log2(math.e)).contiguous()
    qds = tuple(desc(q, r) for r in rs)
    dods = tuple(desc(do, r) for r in rs)
    grid = (N // 128, B * HKV)      # N // L // 128 tiles times L classes
    kernel = kernel_module(H, HKV, D, ws, rs, stages).dkdv_fused_kernel
    kernel[grid](*qds, *dods, desc(k, L), desc(v, L), lse2, delta, dk, dv, N, scale * math.log2(math.e), scale,
                 num_warps=4, maxnreg=168)
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
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if t:
            out[ev.key[:60]] = round(t / 1000, 4)
    return out


CASES = [
    # name, B, N, H, H_kv, D, ws, rs
    ("A", 1, 32768, 16, 16, 128, [2048, 4096, 8192], [1, 2, 4]),
    ("A_gqa_small", 2, 8192, 8, 2, 128, [2048, 4096, 8192], [1, 2, 4]),
    ("B_like", 1, 65536, 16, 16, 128, [4096, 8192, 16384], [1, 2, 4]),
]


def run_case(name, B, N, H, HKV, D, ws, rs, stages_list):
    spec = dilgen.Spec(name=f"dkdv_fused_{name.lower()}", num_heads=H, num_kv_heads=HKV, head_dim=D, segment_lengths=ws,
                       dilation_rates=rs, dtype="bfloat16")
    kern = dilgen.Kernel(spec)
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, do = (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(B, N, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = kern(*leaves, return_lse=True)
    out.backward(do)
    delta = (do.float() * out.detach().float()).sum(-1).transpose(1, 2).contiguous()     # (B, H, N)
    lse = lse.detach().contiguous()
    row = {"case": name, "shape": dict(B=B, N=N, H=H, H_kv=HKV, D=D, ws=ws, rs=rs)}
    flops = sum(4 * B * H * (N / w) * (w / r) ** 2 * D for w, r in zip(ws, rs))
    row["useful_dkdv_gflop"] = round(2 * flops / 1e9, 1)    # S, dP, dV, dK: twice the forward's
    for stages in stages_list:
        key = f"stages{stages}"
        try:
            dk, dv = gluon_dkdv_fused(q, k, v, do, lse, delta, ws, rs, stages)
            torch.cuda.synchronize()
            rk = ((dk.float() - leaves[1].grad.float()).norm() / leaves[1].grad.float().norm()).item()
            rv = ((dv.float() - leaves[2].grad.float()).norm() / leaves[2].grad.float().norm()).item()
            ms = b2b(lambda: gluon_dkdv_fused(q, k, v, do, lse, delta, ws, rs, stages))
            row[key] = {"dk_rel_err_vs_tl": rk, "dv_rel_err_vs_tl": rv, "nan": bool(dk.isnan().any() or dv.isnan().any()),
                        "ms": round(ms, 4), "useful_tflops": round(row["useful_dkdv_gflop"] / ms, 1)}
        except Exception as exc:  # noqa: BLE001 - recorded
            import traceback
            row[key] = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps(row), flush=True)

    def step():
        for t in leaves:
            t.grad = None
        kern(*leaves).backward(do)
    row["tl_fwd_bwd_ms"] = round(b2b(step), 4)
    row["tl_kernels_ms"] = kernel_times(step)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--cases", default="A,A_gqa_small,B_like")
    ap.add_argument("--stages", default="2,3,4")
    a = ap.parse_args()
    rows = []
    meta = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__}
    for case in CASES:
        if case[0] in a.cases.split(","):
            rows.append(run_case(*case, [int(s) for s in a.stages.split(",")]))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(a.out, "gluon_dkdv_fused_probe.json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
