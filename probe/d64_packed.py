"""Probe: causal packed fwd+bwd at head_dim 64, Gluon per-branch dK/dV over packed rows vs tl."""
import json, os, random, sys, time, subprocess
import torch
import dilgen
from dilgen.runtime import backward as bwd

out_dir = os.environ["OUT"]
rng, docs, total = random.Random(0), [], 0
while total < 131072:
    docs.append(min(int(2 ** rng.uniform(8, 14)), 131072 - total)); total += docs[-1]
cu = [0]
for n in docs: cu.append(cu[-1] + n)
spec = dilgen.Spec(name="p64", num_heads=32, num_kv_heads=32, head_dim=64, segment_lengths=[2048, 4096, 8192],
                   dilation_rates=[1, 2, 4], dtype="bfloat16", causal=True)
kernel = dilgen.compile(spec)
import dataclasses
kernel_tl = dilgen.compile(dataclasses.replace(spec, name="p64tl"))
g = torch.Generator().manual_seed(1)
q, k, v = (torch.randn(total, 32, 64, generator=g).to(torch.bfloat16).cuda().requires_grad_() for _ in range(3))
do = torch.randn(total, 32, 64, generator=g).to(torch.bfloat16).cuda()
cut = torch.tensor(cu, dtype=torch.int32).cuda()
real = bwd.gluon_dkdv_lanes_packed_launch
taken = []
def spy(*a):
    r = real(*a); taken.append(r is not None); return r
def step(packed=True, kern=None):
    for t in (q, k, v): t.grad = None
    if packed:
        o = (kern or kernel)(q, k, v, cu_seqlens=cut)
    else:
        o = kernel(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))[0]
    o.backward(do)
def timeit(fn, reps=10):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    ts.sort(); return ts[len(ts) // 2]
res = {}
bwd.gluon_dkdv_lanes_packed_launch = spy
res["varlen_gluon_dkdv_ms"] = timeit(step); res["gluon_taken"] = sum(taken); 
grads_g = [t.grad.clone() for t in (q, k, v)]
bwd.gluon_dkdv_lanes_packed_launch = lambda *a: None
taken.clear(); bwd.gluon_dkdv_lanes_packed_launch = lambda *a: taken.append("tl")
res["varlen_tl_dkdv_ms"] = timeit(lambda: step(kern=kernel_tl)); res["tl_calls"] = len(taken)
grads_t = [t.grad.clone() for t in (q, k, v)]
res["rel_diff_gluon_vs_tl"] = [float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(grads_g, grads_t)]
bwd.gluon_dkdv_lanes_packed_launch = real
res["one_sequence_ms"] = timeit(lambda: step(False))
res.update(sequences=len(docs), tokens=total, spec="H 32, D 64, w 2K/4K/8K, r 1/2/4, causal, bf16, MHA",
           device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
           commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip())
print(json.dumps(res, indent=1))
json.dump(res, open(f"{out_dir}/d64_packed.json", "w"), indent=1)
