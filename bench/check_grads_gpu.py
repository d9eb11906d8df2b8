"""Gradient check on the GPU for given specs (bf16 kernel vs float64 reference)."""
import sys, torch, dilgen, traceback
from dilgen.reference import differentiable_reference

def rel(a, b):
    return ((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30)).item()

def check(w, r, H=4, D=64, N=2048, dtype="bfloat16", causal=True, B=2):
    spec = dilgen.Spec(name=f"chk_{'_'.join(map(str, w))}_{D}", num_heads=H, head_dim=D, dtype=dtype,
                       segment_lengths=w, dilation_rates=r, causal=causal)
    g = torch.Generator().manual_seed(0)
    q, k, v, go = (torch.randn(B, N, H, D, generator=g) for _ in range(4))
    leaves = [t.to(getattr(torch, dtype)).cuda().requires_grad_(True) for t in (q, k, v)]
    out = dilgen.compile(spec)(*leaves)
    out.backward(go.cuda().to(out.dtype))
    torch.cuda.synchronize()
    ref_leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    ro, _ = differentiable_reference(*ref_leaves, spec)
    ro.backward(go.double())
    errs = [rel(out, ro.detach())] + [rel(a.grad, b.grad) for a, b in zip(leaves, ref_leaves)]
    print(w, r, H, D, N, dtype, "out/dq/dk/dv rel err", ["%.2e" % e for e in errs], flush=True)

CASES = [([64, 256, 1024], [1, 1, 2]), ([32, 128, 512], [1, 1, 2]), ([256, 1024, 4096], [1, 1, 2])]
if __name__ == "__main__":
    for i in map(int, sys.argv[1:] or range(len(CASES))):
        check(*CASES[i])
