"""Probe (leaves the tree once answered): where backward_raw's host time goes on autograd's
thread against the main thread (config C), by cProfile inside the call. $OUT/bwd_probe.txt"""
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import toolkit as tk  # noqa: E402
import dilgen  # noqa: E402
from dilgen.runtime import op  # noqa: E402

c = tk.CONFIGS["C"]
B, N, H, D = c["B"], c["N"], c["H"], c["D"]
dev = torch.device("cuda")
kernel = dilgen.compile(tk.make_spec("C", c, False, "bprobe"))
attn = kernel.compiled_for(dev).attention
gen = torch.Generator(dev).manual_seed(3)
q, k, v, g = (torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in "qkvg")
qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
prof = cProfile.Profile()
real = op.backward_raw
spans = []


def wrapped(*a, **kw):
    t0 = time.perf_counter()
    prof.enable()
    try:
        return real(*a, **kw)
    finally:
        prof.disable()
        spans.append(time.perf_counter() - t0)


step = lambda: torch.autograd.grad(kernel(qg, kg, vg), (qg, kg, vg), g)  # noqa: E731
for _ in range(5):
    step()
torch.cuda.synchronize()
op.backward_raw = wrapped
torch.cuda._sleep(400_000_000)
for _ in range(200):
    step()
op.backward_raw = real
out = io.StringIO()
out.write(f"autograd thread: backward_raw median {sorted(spans)[100] * 1e6:.1f} us (profiled)\n")
pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
o2, l2 = kernel(q, k, v, return_lse=True)
torch.cuda.synchronize()
prof2, spans2 = cProfile.Profile(), []
torch.cuda._sleep(400_000_000)
with torch.no_grad():
    for _ in range(200):
        t0 = time.perf_counter()
        prof2.enable()
        real(attn, q, k, v, o2, l2, g, None)
        prof2.disable()
        spans2.append(time.perf_counter() - t0)
out.write(f"main thread: backward_raw median {sorted(spans2)[100] * 1e6:.1f} us (profiled)\n")
pstats.Stats(prof2, stream=out).sort_stats("tottime").print_stats(30)
# unprofiled spans
spans3 = []
def timed(*a, **kw):
    t0 = time.perf_counter()
    try:
        return real(*a, **kw)
    finally:
        spans3.append(time.perf_counter() - t0)
op.backward_raw = timed
torch.cuda.synchronize()
torch.cuda._sleep(400_000_000)
for _ in range(200):
    step()
op.backward_raw = real
out.write(f"autograd thread unprofiled: backward_raw median {sorted(spans3)[100] * 1e6:.1f} us\n")
text = out.getvalue()
print(text[:20000])
open(os.path.join(os.environ.get("OUT", "/tmp"), "bwd_probe.txt"), "w").write(text)
