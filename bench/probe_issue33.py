"""Probe (issue 33, leaves the tree after one run): where the forward and backward time goes
against the vendor floor, and forward variants.

  python bench/probe_issue33.py --out DIR [--parts profile,variants,diag,nan]

profile:  torch.profiler CUDA time per kernel of one dilgen forward + backward (A, C, F; causal
          A, C) and of cuDNN on rows gathered beforehand (bench/peers.lane_floor), fwd and fwd+bwd.
variants: exact forward variants (planner tuning keys), timed beside the default, output
          compared with the default's.
diag:     diagnostic text edits of the fused forward (inexact: timing only): no exp2, no
          rescale, no softmax at all (the loop's loads and two dots).
nan:      a minimal guard that keeps a non-finite value from rows that do not attend to it
          (issue 35 item 3): its cost on A and B forward.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402

import torch  # noqa: E402

import dilgen  # noqa: E402
from dilgen import codegen  # noqa: E402
from dilgen.compiler import Kernel  # noqa: E402

EDITS = {}   # spec name -> list of (old, new) applied to the emitted source
_emit = codegen.emit


def _patched_emit(plan):
    src = _emit(plan)
    for old, new in EDITS.get(plan.spec["name"], []):
        assert old in src, f"edit target missing: {old[:60]!r}"
        src = src.replace(old, new)
    return src


codegen.emit = _patched_emit
import dilgen.compiler as _c  # noqa: E402
_c.codegen.emit = _patched_emit

HELPER_P = "    p = tl.math.exp2(qk * qk_scale - m_use[:, None])\n"
DIAG = {
    "no_exp2": [(HELPER_P, "    p = qk * qk_scale - m_use[:, None]\n")],
    "no_rescale": [("    l_i = l_i * alpha + tl.sum(p, 1)\n    acc = acc * alpha[:, None] + tl.dot(",
                    "    l_i = l_i + tl.sum(p, 1)\n    acc = acc + tl.dot(")],
    "no_softmax": [(HELPER_P, "    p = qk\n"), ("    l_i = l_i * alpha + tl.sum(p, 1)\n    acc = acc * alpha[:, None] + tl.dot(",
                    "    acc = acc + tl.dot(")],
}
# issue 35 item 3: keys whose value row holds a NaN or Inf are zeroed in v, and a row that
# gives such a key probability > 0 gets l = NaN (so out = NaN there, as dense math), others untouched
NAN_GUARD = [("    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)\n",
              "    bad = tl.max(tl.where(tl.abs(v.to(tl.float32)) < float('inf'), 0.0, 1.0), 1) > 0.0\n"
              "    v = tl.where(bad[:, None], tl.zeros_like(v), v)\n"
              "    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)\n"),
             ("    l_i = l_i * alpha + tl.sum(p, 1)\n",
              "    l_i = l_i * alpha + tl.sum(p, 1) + tl.sum(tl.where(bad[None, :] & (p > 0.0), float('nan'), 0.0), 1)\n")]


def inputs(cfg, seed=0, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(seed)
    return [torch.randn(cfg["B"], cfg["N"], cfg["H"], cfg["D"], device=dev, dtype=torch.bfloat16, generator=g)
            for _ in range(4)]


def kernel(name, cfg, causal, tuning=None, edits=None, tag="base"):
    spec = tk.make_spec(name, cfg, causal, prefix=f"p33{tag}")
    if edits:
        EDITS[spec.name] = edits
    return Kernel(spec, None, tuning)


def profile_kernels(fn, reps=5):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            k = ev.name[:90]
            t = getattr(ev, "device_time", None) or getattr(ev, "cuda_time", 0)
            c = per.setdefault(k, [0.0, 0])
            c[0] += t / 1e3 / reps
            c[1] += 1
    return {k: {"ms": round(v[0], 4), "launches": v[1] // reps} for k, v in sorted(per.items(), key=lambda x: -x[1][0])}


def part_profile(res, peers):
    out = res.setdefault("profile", {})
    for name, causal in [("A", False), ("C", False), ("F", False), ("A", True), ("C", True)]:
        cfg = tk.CONFIGS[name]
        q, k, v, g = inputs(cfg)
        qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
        kern = kernel(name, cfg, causal)

        def fwd():
            with torch.no_grad():
                return kern(q, k, v)

        def fb():
            o = kern(qs, ks, vs)
            torch.autograd.grad(o, (qs, ks, vs), g)
        spec = kern.spec
        floor_f = peers.lane_floor(spec, cfg["B"], cfg["N"], "cuda", grad=False)
        floor_fb = peers.lane_floor(spec, cfg["B"], cfg["N"], "cuda", grad=True)
        row = {"dilgen_fwd_ms": tk.time_ms(fwd)["median"], "dilgen_fwd_bwd_ms": tk.time_ms(fb)["median"],
               "cudnn_floor_fwd_ms": tk.time_ms(floor_f)["median"],
               "cudnn_floor_fwd_bwd_ms": tk.time_ms(floor_fb)["median"],
               "dilgen_kernels_fwd_bwd": profile_kernels(fb), "cudnn_kernels_fwd_bwd": profile_kernels(floor_fb)}
        out[f"{name}{' causal' if causal else ''}"] = row
        tk.log(f"profile {name} causal={causal}: {json.dumps({k: v for k, v in row.items() if k.endswith('ms')})}")
        del q, k, v, g, qs, ks, vs
        torch.cuda.empty_cache()


def time_variants(res, key, name, causal, variants, edits_of=None, check=True):
    cfg = tk.CONFIGS[name]
    q, k, v, _ = inputs(cfg)
    rows = res.setdefault(key, {}).setdefault(f"{name}{' causal' if causal else ''}", {})
    base = None
    for tag, tuning in variants.items():
        try:
            edits = (edits_of or {}).get(tag)
            kern = kernel(name, cfg, causal, tuning or None, edits, tag=tag.replace("+", "_"))
            with torch.no_grad():
                t0 = time.perf_counter()
                o, lse = kern(q, k, v, return_lse=True)
                torch.cuda.synchronize()
                first = time.perf_counter() - t0
                t = tk.time_ms(lambda: kern(q, k, v), warmup=5, reps=20)
            row = {"tuning": tuning, "edits": bool(edits), "ms": round(t["median"], 4), "min_ms": round(t["min"], 4),
                   "first_call_s": round(first, 2)}
            if base is None:
                base = (o, lse)
            elif check:
                row["rel_err_vs_base"] = tk.rel_err(o, base[0])
                row["lse_max_abs_diff_vs_base"] = tk.lse_diff(lse, base[1])[0]
            rows[tag] = row
            tk.log(f"{key} {name} causal={causal} {tag}: {row}")
        except Exception as e:  # noqa: BLE001
            rows[tag] = {"tuning": tuning, "error": tk.short_err(e, 1500)}
            tk.log(f"{key} {name} {tag}: ERROR {tk.short_err(e)}")
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="profile,variants,diag,nan")
    ap.add_argument("--variants", default=None, help="JSON {config: {tag: tuning}} replacing the default set")
    a = ap.parse_args()
    parts = a.parts.split(",")
    import peers
    res = tk.header("cuda", extra={"produced_by": f"bench/probe_issue33.py@{tk.commit()}", "parts": parts})
    path = Path(a.out) / "probe33.json"
    t0 = time.time()

    def save():
        res["elapsed_s"] = round(time.time() - t0, 1)
        tk.write_json_atomic(path, tk.sanitize(res))
    if "variants" in parts:
        P, L = {"fwd_pipeline": True}, {"lazy_rescale": True}
        sets = json.loads(a.variants) if a.variants else {
            "A": {"base": {}, "pipe": P, "lazy": L, "pipe+lazy": {**P, **L}, "pipe_bn64": {**P, "block_n": 64}},
            "C": {"base": {}, "pipe": P, "lazy": L, "pipe+lazy": {**P, **L}, "pipe_s2": {**P, "num_stages": 2},
                  "pipe_w4": {**P, "num_warps": 4}},
            "A causal": {"base": {}, "pipe": P, "lazy": L, "pipe+lazy": {**P, **L}},
            "C causal": {"base": {}, "lazy": L},
            "F": {"base": {}, "pipe": P, "pipe+lazy": {**P, **L}},
        }
        for key, vs in sets.items():
            name, causal = key.split()[0], key.endswith("causal")
            time_variants(res, "variants", name, causal, vs)
            save()
    if "diag" in parts:
        for name in ("A", "C"):
            vs = {"base": {}, **{d: {} for d in DIAG}}
            time_variants(res, "diag", name, False, vs, edits_of=DIAG, check=False)
            save()
    if "nan" in parts:
        for name in ("A", "B"):
            time_variants(res, "nan_guard", name, False, {"base": {}, "nan_guard": {}},
                          edits_of={"nan_guard": NAN_GUARD})
            save()
    if "subtile" in parts:
        part_subtile(res)
        save()
    if "profile" in parts:
        part_profile(res, peers)
        save()
    save()
    tk.log(f"wrote {path}")


# ------------------------------------------------------------------ subtile microbenchmark
# Plain attention over gathered rows (B*S sequences of L rows, H heads, D), non-causal: does
# Triton 3.6 overlap one chain's softmax with another chain's dots when a program carries
# SUB independent row tiles of BM rows against the same key blocks?
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _chain_step(q, k, v, m_i, l_i, acc, qk_scale):
    qk = tl.dot(q, tl.trans(k))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _sub_attn(Q, K, V, O, L, H, qk_scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              SUB: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    row0 = bh.to(tl.int64) * L            # (B*S*H, L, D) contiguous per head
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
        m_0, l_0, a_0 = _chain_step(q0, k, v, m_0, l_0, a_0, qk_scale)
        if SUB == 2:
            m_1, l_1, a_1 = _chain_step(q1, k, v, m_1, l_1, a_1, qk_scale)
    od.store([m0, 0], (a_0 / l_0[:, None]).to(O.dtype.element_ty))
    if SUB == 2:
        od.store([m0 + BM, 0], (a_1 / l_1[:, None]).to(O.dtype.element_ty))


def part_subtile(res):
    from dilgen.runtime.launch import ensure_descriptor_allocator
    ensure_descriptor_allocator()
    rows = res.setdefault("subtile", {})
    for D, nseq, Lr in ((128, 28 * 16, 2048), (64, 28 * 2 * 32, 1024)):   # A's and C's work
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(nseq, Lr, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q[:4], k[:4], v[:4]).float()
        flops = 4 * nseq * Lr * Lr * D
        for BM, BN, SUB, warps, stages in [(128, 128, 1, 8, 2), (128, 64, 1, 8, 3), (64, 128, 2, 4, 2),
                                           (64, 64, 2, 4, 3), (128, 64, 2, 8, 2), (128, 128, 2, 8, 2),
                                           (64, 128, 2, 8, 2), (64, 64, 2, 8, 3)]:
            tag = f"D{D}_bm{BM}_bn{BN}_sub{SUB}_w{warps}_s{stages}"
            try:
                o = torch.empty_like(q)
                qk_scale = D ** -0.5 * 1.4426950408889634
                grid = (Lr // (BM * SUB), nseq)
                fn = lambda: _sub_attn[grid](q, k, v, o, Lr, 1, qk_scale, D=D, BM=BM, BN=BN, SUB=SUB,  # noqa: E731
                                             num_warps=warps, num_stages=stages)
                fn()
                torch.cuda.synchronize()
                err = tk.rel_err(o[:4].float(), ref)
                t = tk.time_ms(fn, warmup=5, reps=20)["median"]
                rows[tag] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1), "rel_err": err}
            except Exception as e:  # noqa: BLE001
                rows[tag] = {"error": tk.short_err(e, 600)}
            tk.log(f"subtile {tag}: {rows[tag]}")
        cud = lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(q[None], k[None], v[None], None, False, 0.0, False, False)  # noqa: E731
        try:
            t = tk.time_ms(cud, warmup=5, reps=20)["median"]
            rows[f"D{D}_cudnn"] = {"ms": round(t, 4), "tflops": round(flops / t / 1e9, 1)}
        except Exception as e:  # noqa: BLE001
            rows[f"D{D}_cudnn"] = {"error": tk.short_err(e, 600)}
        tk.log(f"subtile D{D} cudnn: {rows[f'D{D}_cudnn']}")


if __name__ == "__main__":
    main()
