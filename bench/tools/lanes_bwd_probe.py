"""Probe (issue 42): A causal forward + backward per kernel (torch.profiler), the Gluon causal
backward per branch against the `tl` kernels; JSON to $OUT/lanes_bwd_probe.json."""
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
import dilgen  # noqa: E402

VARIANTS = {"default": {}, "dq_only": {"gluon_dkdv_lanes": False}, "tl_bwd": {"gluon_lanes_bwd": False}}
spec = dilgen.Spec(name="probe_a", num_heads=16, num_kv_heads=16, head_dim=128, segment_lengths=[2048, 4096, 8192],
                   dilation_rates=[1, 2, 4], dtype="bfloat16", causal=True)
gen = torch.Generator(device="cuda").manual_seed(0)
q, k, v, g = (torch.randn(1, 32768, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
NCU = os.environ.get("PROBE_NCU") == "1"     # under ncu: one profiled step of two variants
if NCU:
    VARIANTS = {k: VARIANTS[k] for k in ("default", "tl_bwd")}
result = {}
for name, tuning in VARIANTS.items():
    kern = dilgen.Kernel(spec, None, tuning)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        for t in leaves:
            t.grad = None
        kern(*leaves).backward(g)
    for _ in range(3):
        step()
    if NCU:
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        step()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        continue
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key[:90]] = [round(e.device_time_total / 1000, 3), e.count]
    result[name] = {"fwd_bwd_ms": sorted(times)[3], "kernels_ms_count": kernels}
    print(name, round(sorted(times)[3], 3), flush=True)
    for key, (ms, n) in sorted(kernels.items(), key=lambda x: -x[1][0])[:10]:
        print(f"   {ms:8.3f} ms  x{n}  {key}")
result["device"] = torch.cuda.get_device_name()
if not NCU:
    json.dump(result, open(os.path.join(os.environ.get("OUT", "."), "lanes_bwd_probe.json"), "w"), indent=1)
