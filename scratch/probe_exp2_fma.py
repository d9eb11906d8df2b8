"""Probe (issue 33; leaves the tree after one run): does computing part of a tile's exp2 with a
polynomial on the FMA pipes (FlashAttention-4) pay off in Triton 3.6 on the H200, for plain
attention over gathered rows at head_dim 64 (C's work) and 128 (A's)?"""
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import toolkit as tk  # noqa: E402


@triton.jit
def _exp2_fma(x):
    # 2^x = 2^j * 2^f, j = round(x), f in [-0.5, 0.5]: 2^f by a degree-3 polynomial (rel err 7.6e-5)
    x = tl.maximum(x, -126.0)
    t = x + 12582912.0
    j = t.to(tl.int32, bitcast=True) - 0x4B400000
    f = x - (t - 12582912.0)
    p = 0.9999284604353998 + f * (0.6932614449372138 + f * (0.242605428044283 + f * 0.05516651933327181))
    return (p.to(tl.int32, bitcast=True) + (j << 23)).to(tl.float32, bitcast=True)


@triton.jit
def _exp2_mix(x, BM: tl.constexpr, BN: tl.constexpr, FMA: tl.constexpr):
    if FMA == 0:
        return tl.math.exp2(x)
    elif FMA == 2:      # half of the columns on the FMA pipes
        a, b = tl.split(tl.reshape(x, [BM, BN // 2, 2]))
        return tl.reshape(tl.join(tl.math.exp2(a), _exp2_fma(b)), [BM, BN])
    elif FMA == 4:      # a quarter
        a, b = tl.split(tl.reshape(x, [BM, BN // 2, 2]))
        b1, b2 = tl.split(tl.reshape(b, [BM, BN // 4, 2]))
        b = tl.reshape(tl.join(tl.math.exp2(b1), _exp2_fma(b2)), [BM, BN // 2])
        return tl.reshape(tl.join(tl.math.exp2(a), b), [BM, BN])
    else:               # every column
        return _exp2_fma(x)


@triton.jit
def _step(q, k, v, m_i, l_i, acc, qk_scale, BM: tl.constexpr, BN: tl.constexpr, FMA: tl.constexpr):
    qk = tl.dot(q, tl.trans(k))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = _exp2_mix(qk * qk_scale - m_new[:, None], BM, BN, FMA)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attn(Q, K, V, O, L, qk_scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
          SUB: tl.constexpr, FMA: tl.constexpr):
    pid_m = tl.program_id(0)
    row0 = tl.program_id(1).to(tl.int64) * L
    qd = tl.make_tensor_descriptor(Q + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BM, D])
    kd = tl.make_tensor_descriptor(K + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    vd = tl.make_tensor_descriptor(V + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BN, D])
    od = tl.make_tensor_descriptor(O + row0 * D, shape=[L, D], strides=[D, 1], block_shape=[BM, D])
    m0 = pid_m * BM * SUB
    q0 = qd.load([m0, 0])
    m_0 = tl.full([BM], float("-inf"), tl.float32)
    l_0 = tl.zeros([BM], tl.float32)
    a_0 = tl.zeros([BM, D], tl.float32)
    if SUB == 2:
        q1 = qd.load([m0 + BM, 0])
        m_1 = tl.full([BM], float("-inf"), tl.float32)
        l_1 = tl.zeros([BM], tl.float32)
        a_1 = tl.zeros([BM, D], tl.float32)
    for j0 in tl.range(0, L, BN):
        k = kd.load([j0, 0])
        v = vd.load([j0, 0])
        m_0, l_0, a_0 = _step(q0, k, v, m_0, l_0, a_0, qk_scale, BM, BN, FMA)
        if SUB == 2:
            m_1, l_1, a_1 = _step(q1, k, v, m_1, l_1, a_1, qk_scale, BM, BN, FMA)
    od.store([m0, 0], (a_0 / l_0[:, None]).to(O.dtype.element_ty))
    if SUB == 2:
        od.store([m0 + BM, 0], (a_1 / l_1[:, None]).to(O.dtype.element_ty))


def main():
    from dilgen.runtime.launch import ensure_descriptor_allocator
    ensure_descriptor_allocator()
    out = Path(os.environ.get("OUT", "/tmp"))
    res = tk.header("cuda", extra={"produced_by": f"scratch/probe_exp2_fma.py@{tk.commit()}"})
    rows = res["rows"] = {}
    for D, nseq, Lr, shapes in ((64, 1792, 1024, [(64, 64, 2, 4, 3), (64, 128, 2, 4, 3), (128, 64, 1, 8, 3)]),
                                (128, 448, 2048, [(128, 64, 1, 8, 3), (128, 128, 1, 8, 2)])):
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(nseq, Lr, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q[:4], k[:4], v[:4]).float()
        flops = 4 * nseq * Lr * Lr * D
        for BM, BN, SUB, warps, stages in shapes:
            for FMA in (0, 4, 2, 1):
                tag = f"D{D}_bm{BM}_bn{BN}_sub{SUB}_w{warps}_s{stages}_fma{FMA}"
                try:
                    o = torch.empty_like(q)
                    grid = (Lr // (BM * SUB), nseq)
                    fn = lambda: _attn[grid](q, k, v, o, Lr, D ** -0.5 * 1.4426950408889634, D=D, BM=BM, BN=BN,  # noqa: E731
                                             SUB=SUB, FMA=FMA, num_warps=warps, num_stages=stages)
                    fn()
                    torch.cuda.synchronize()
                    t = tk.time_ms(fn, warmup=5, reps=20)["median"]
                    rows[tag] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1),
                                 "rel_err": tk.rel_err(o[:4].float(), ref)}
                except Exception as e:  # noqa: BLE001
                    rows[tag] = {"error": tk.short_err(e, 800)}
                tk.log(f"{tag}: {rows[tag]}")
    tk.write_json_atomic(out / "exp2_fma.json", tk.sanitize(res))


if __name__ == "__main__":
    main()
