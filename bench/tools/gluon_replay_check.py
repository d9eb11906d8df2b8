"""Probe (issue 42): repeated calls of the Gluon plan replay (descriptors made again over each
call's tensors) and equal the tl plan bit for bit; host µs per call with the GPU kept busy,
one call against back to back, against the tl plan. One H200: python3 ... OUT_DIR"""
import json
import sys
import time

import torch

import dilgen

spec = dilgen.Spec(name="gluon_replay", num_heads=16, head_dim=128, segment_lengths=[2048, 4096, 8192],
                   dilation_rates=[1, 2, 4], dtype="bfloat16")
kg, kt = dilgen.Kernel(spec, None, {"gluon_fwd": True}), dilgen.compile(spec)
x = lambda: [torch.randn(1, 32768, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]  # noqa: E731
res = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
with torch.no_grad():
    for i in range(3):
        q, k, v = x()
        og, lg = kg(q, k, v, return_lse=True)
        ot, lt = kt(q, k, v, return_lse=True)
        res[f"call{i}_equal_tl"] = bool(torch.equal(og, ot) and torch.equal(lg, lt))
attn = kg.compiled_for(q.device).attention
res["recipes"] = sum(type(r).__name__ == "Recipe" for r in attn._replays.values())
g = torch.randn_like(q)
for i in range(2):
    grads = []
    for kern in (kg, kt):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        kern(*leaves).backward(g)
        grads.append([t.grad for t in leaves])
    res[f"fwd_bwd{i}_grads_equal_tl"] = all(torch.equal(a, b) for a, b in zip(*grads))


def host_us(fn, n=50):
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)          # the GPU stays busy: only the host is timed
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return round(t, 1)


def one_and_b2b(fn, n=20):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    ones = []
    for _ in range(5):
        torch.cuda.synchronize()
        ev[0].record(); fn(); ev[1].record(); torch.cuda.synchronize()   # noqa: E702
        ones.append(ev[0].elapsed_time(ev[1]))
    ev[0].record()
    for _ in range(n):
        fn()
    ev[1].record(); torch.cuda.synchronize()   # noqa: E702
    return round(min(ones), 4), round(ev[0].elapsed_time(ev[1]) / n, 4)


with torch.no_grad():
    for tag, kern in (("gluon", kg), ("tl", kt)):
        res[f"{tag}_host_us"] = host_us(lambda kern=kern: kern(q, k, v))
        res[f"{tag}_one_call_b2b_ms"] = one_and_b2b(lambda kern=kern: kern(q, k, v))
print(json.dumps(res, indent=1))
json.dump(res, open(f"{sys.argv[1]}/gluon_replay_check.json", "w"), indent=1)
