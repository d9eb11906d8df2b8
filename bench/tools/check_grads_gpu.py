"""Gradient check on the GPU: bf16 kernels (forward and backward) against autograd through
the float64 reference, for the tile families the GPU planner picks (head_dim 64 and 128,
causal and not, GQA). Fails (exit 1) past SPEC's bounds: 2e-2 for out, 4e-2 for gradients.

    python bench/tools/check_grads_gpu.py [case index ...]
    python bench/tools/check_grads_gpu.py --dry-run-cpu     # toy cases in Triton's interpreter
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # this checkout's dilgen

import torch  # noqa: E402

import dilgen  # noqa: E402
from dilgen.reference import differentiable_reference  # noqa: E402

BOUND_OUT, BOUND_GRAD = 2e-2, 4e-2   # SPEC §2 Tolerance: bf16, gradients twice


def rel(a, b):
    return ((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30)).item()


DEV = "cuda"


def check(w, r, H=4, D=64, N=2048, causal=True, B=2, Hkv=None, dtype="bfloat16") -> bool:
    Hkv = Hkv or H
    spec = dilgen.Spec(name=f"chk_{'_'.join(map(str, w))}_{D}_{int(causal)}_{Hkv}", num_heads=H,
                       num_kv_heads=Hkv, head_dim=D, dtype=dtype, segment_lengths=w,
                       dilation_rates=r, causal=causal)
    g = torch.Generator().manual_seed(0)
    q, go = (torch.randn(B, N, H, D, generator=g) for _ in range(2))
    k, v = (torch.randn(B, N, Hkv, D, generator=g) for _ in range(2))
    leaves = [t.to(getattr(torch, dtype)).to(DEV).requires_grad_(True) for t in (q, k, v)]
    out = dilgen.compile(spec)(*leaves)
    out.backward(go.to(DEV).to(out.dtype))
    if DEV == "cuda":
        torch.cuda.synchronize()
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ro, _ = differentiable_reference(*ref_leaves, spec)
    ro.backward(go.double())
    errs = [rel(out, ro.detach())] + [rel(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]
    ok = errs[0] < BOUND_OUT and max(errs[1:]) < BOUND_GRAD
    print(f"{'ok  ' if ok else 'FAIL'} w {w} r {r} H {H}/{Hkv} D {D} N {N} causal {causal}: "
          f"out/dq/dk/dv rel err {' '.join('%.2e' % e for e in errs)}", flush=True)
    return ok


CASES = [
    dict(w=[64, 256, 1024], r=[1, 1, 2]),
    dict(w=[32, 128, 512], r=[1, 1, 2]),
    dict(w=[256, 1024, 4096], r=[1, 1, 2]),
    dict(w=[256, 512, 1024], r=[1, 2, 4], D=128, causal=False),
    dict(w=[256, 512, 1024], r=[1, 2, 4], D=128, causal=True),
    dict(w=[512, 2048], r=[2, 4], D=128, causal=True, H=8, Hkv=2),
    dict(w=[256, 512, 1024], r=[1, 2, 4], D=64, causal=False, H=8, Hkv=1),
]

# the same tile families at toy sizes, for --dry-run-cpu (Triton's interpreter)
DRY_CASES = [
    dict(w=[16, 32, 64], r=[1, 1, 2], N=128, B=1),
    dict(w=[16, 32, 64], r=[1, 2, 4], D=32, N=128, B=1, causal=False),
    dict(w=[32, 64], r=[2, 4], D=32, N=128, B=1, causal=True, H=8, Hkv=2),
]

if __name__ == "__main__":
    argv = sys.argv[1:]
    cases = CASES
    if "--dry-run-cpu" in argv:
        argv.remove("--dry-run-cpu")
        DEV, cases = "cpu", DRY_CASES
    elif not torch.cuda.is_available():
        print("check_grads_gpu.py needs a CUDA GPU (--dry-run-cpu: toy cases on the CPU)")
        sys.exit(2)
    picked = [cases[int(i)] for i in argv] or cases
    results = [check(**c) for c in picked]
    print(f"{sum(results)}/{len(results)} within bounds")
    sys.exit(0 if all(results) else 1)
