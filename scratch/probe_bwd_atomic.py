"""Probe (issue 33; leaves the tree after one run): the backward as two kernels (dK/dV over
query blocks, dq over key blocks: 7 products per block pair, dilgen's structure) against one
kernel that also adds each block pair's dQ into an fp32 buffer with atomics (5 products,
cuDNN's and FlashAttention's structure), plain attention over gathered rows (A's and C's work)."""
import os
import sys
from pathlib import Path

import torch
import torch.nn.attention
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import toolkit as tk  # noqa: E402


@triton.jit
def _dkdv(Q, K, V, DO, LSE, DELTA, DK, DV, DQ32, L, qk_scale, D: tl.constexpr, BN: tl.constexpr,
          BM: tl.constexpr, ATOMIC: tl.constexpr):
    n0 = tl.program_id(0) * BN
    seq = tl.program_id(1).to(tl.int64)
    row0 = seq * L
    qd = tl.make_tensor_descriptor(Q + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BM, D])
    dod = tl.make_tensor_descriptor(DO + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BM, D])
    kd = tl.make_tensor_descriptor(K + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    vd = tl.make_tensor_descriptor(V + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    k = kd.load([n0, 0])
    v = vd.load([n0, 0])
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    offs_d = tl.arange(0, D)
    for m0 in tl.range(0, L, BM):
        q = qd.load([m0, 0])
        do = dod.load([m0, 0])
        rows = m0 + tl.arange(0, BM)
        lse2 = tl.load(LSE + row0 + rows)
        delta = tl.load(DELTA + row0 + rows)
        qkt = tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :]
        pt = tl.math.exp2(qkt)
        dv += tl.dot(pt.to(do.dtype), do)
        dpt = tl.dot(v, tl.trans(do))
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q)
        if ATOMIC:
            dq = tl.dot(tl.trans(dst.to(k.dtype)), k)
            tl.atomic_add(DQ32 + (row0 + rows)[:, None] * D + offs_d[None, :], dq, sem="relaxed")
    kd2 = tl.make_tensor_descriptor(DK + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    vd2 = tl.make_tensor_descriptor(DV + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    kd2.store([n0, 0], dk.to(DK.dtype.element_ty))
    vd2.store([n0, 0], dv.to(DV.dtype.element_ty))


@triton.jit
def _dq(Q, K, V, DO, LSE, DELTA, DQ, L, qk_scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    m0 = tl.program_id(0) * BM
    row0 = tl.program_id(1).to(tl.int64) * L
    qd = tl.make_tensor_descriptor(Q + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BM, D])
    dod = tl.make_tensor_descriptor(DO + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BM, D])
    kd = tl.make_tensor_descriptor(K + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    vd = tl.make_tensor_descriptor(V + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    q = qd.load([m0, 0])
    do = dod.load([m0, 0])
    rows = m0 + tl.arange(0, BM)
    lse2 = tl.load(LSE + row0 + rows)
    delta = tl.load(DELTA + row0 + rows)
    dq = tl.zeros([BM, D], tl.float32)
    for n0 in tl.range(0, L, BN):
        k = kd.load([n0, 0])
        v = vd.load([n0, 0])
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    qd2 = tl.make_tensor_descriptor(DQ + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BM, D])
    qd2.store([m0, 0], dq.to(DQ.dtype.element_ty))


def main():
    from dilgen.runtime.launch import ensure_descriptor_allocator
    ensure_descriptor_allocator()
    out = Path(os.environ.get("OUT", "/tmp"))
    res = tk.header("cuda", extra={"produced_by": f"scratch/probe_bwd_atomic.py@{tk.commit()}"})
    rows = res["rows"] = {}
    for D, nseq, Lr in ((128, 448, 2048), (64, 1792, 1024)):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(nseq, Lr, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        scale = D ** -0.5
        qr, kr, vr = (t[:2].float().requires_grad_(True) for t in (q, k, v))
        o_ref = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, scale=scale)
        ref = torch.autograd.grad(o_ref, (qr, kr, vr), do[:2].float())
        s = torch.einsum("bqd,bkd->bqk", q.float(), k.float()) * scale if nseq * Lr * Lr < 2**31 else None
        if s is None:
            lse_parts, o_parts = [], []
            for i in range(0, nseq, 64):
                si = torch.einsum("bqd,bkd->bqk", q[i:i + 64].float(), k[i:i + 64].float()) * scale
                lse_parts.append(torch.logsumexp(si, -1))
                o_parts.append(torch.softmax(si, -1) @ v[i:i + 64].float())
            lse, o = torch.cat(lse_parts), torch.cat(o_parts)
        else:
            lse, o = torch.logsumexp(s, -1), torch.softmax(s, -1) @ v.float()
        lse2 = (lse * 1.4426950408889634).contiguous()
        delta = (o * do.float()).sum(-1).contiguous()
        qk_scale = scale * 1.4426950408889634
        flops = 4 * nseq * Lr * Lr * D * 2.5            # the backward's useful work: 2.5x the forward
        for BN, BM, warps, stages in ((128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 8, 3)):
            dk, dv, dqo = (torch.empty_like(q) for _ in range(3))
            dq32 = torch.zeros(q.shape, device="cuda", dtype=torch.float32)
            grid_kv, grid_q = (Lr // BN, nseq), (Lr // 128, nseq)

            def two():
                _dkdv[grid_kv](q, k, v, do, lse2, delta, dk, dv, dq32, Lr, qk_scale, D=D, BN=BN, BM=BM, ATOMIC=False,
                               num_warps=warps, num_stages=stages)
                _dq[grid_q](q, k, v, do, lse2, delta, dqo, Lr, qk_scale, D=D, BM=128, BN=64 if D == 128 else 64,
                            num_warps=8, num_stages=3)

            def one():
                dq32.zero_()
                _dkdv[grid_kv](q, k, v, do, lse2, delta, dk, dv, dq32, Lr, qk_scale, D=D, BN=BN, BM=BM, ATOMIC=True,
                               num_warps=warps, num_stages=stages)
                dqo.copy_(dq32 * scale)
            for tag, fn in (("two_kernels", two), ("atomic_dq", one)):
                key = f"D{D}_kv{BN}x{BM}_w{warps}_{tag}"
                try:
                    fn()
                    torch.cuda.synchronize()
                    got = (dqo[:2] * (1.0 if tag == "atomic_dq" else scale), dk[:2] * scale, dv[:2])
                    errs = [tk.rel_err(a.float(), b) for a, b in zip(got, ref)]
                    t = tk.time_ms(fn, warmup=3, reps=10)["median"]
                    rows[key] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1), "rel_err_dq_dk_dv": errs}
                except Exception as e:  # noqa: BLE001
                    rows[key] = {"error": tk.short_err(e, 800)}
                tk.log(f"{key}: {rows[key]}")
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.CUDNN_ATTENTION]):
            qq, kk, vv = (t[None].requires_grad_(True) for t in (q, k, v))
            oo = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv)
            t = tk.time_ms(lambda: torch.autograd.grad(oo, (qq, kk, vv), do[None], retain_graph=True), warmup=3, reps=10)["median"]
            rows[f"D{D}_cudnn_backward"] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1)}
            tk.log(f"D{D} cudnn backward: {rows[f'D{D}_cudnn_backward']}")
    tk.write_json_atomic(out / "bwd_atomic.json", tk.sanitize(res))


if __name__ == "__main__":
    main()
