"""Probe: decode host time per call in one process, the step cache on and off (A/B)."""
import json, os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import dilgen
from dilgen.runtime import decode as dec

def t_us(fn, reps=1000):
    for _ in range(30):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t) / reps * 1e6)
    return round(min(rounds), 1)

def plain_launch(attention, launchers, grids, args, options, sizes, strides, tensors):
    for launcher, grid, a, o in zip(launchers, grids, args, options):
        launcher.jit_fn[grid](*a, **o)

res = {}
spec = dilgen.Spec(name="probe_dec", num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                   segment_lengths=[2048, 4096, 8192, 16384, 32768], dilation_rates=[1, 2, 4, 8, 16], causal=True)
att = dilgen.compile(spec).compiled_for(torch.device("cuda")).attention
fast = dec._launch
for B, N in ((1, 16384), (8, 16384), (1, 131072)):
    q = torch.randn(B, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, N, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    sl = torch.full((B,), N, dtype=torch.int32, device="cuda")
    with torch.inference_mode():
        want = dec.decode(att, q, k, v, sl, validate=False)
        for name, launch in (("step cache", fast), ("triton.jit each launch", plain_launch), ("step cache again", fast)):
            dec._launch = launch
            got = dec.decode(att, q, k, v, sl, validate=False)
            assert torch.equal(got, want), name
            res[f"B{B} N{N} {name} us"] = t_us(lambda: dec.decode(att, q, k, v, sl, validate=False))
        dec._launch = fast
        res[f"B{B} N{N} validate=True us"] = t_us(lambda: dec.decode(att, q, k, v, sl, validate=True), reps=300)
        res[f"B{B} N{N} check_decode_inputs us"] = t_us(lambda: dec.check_decode_inputs(att.spec, q, k, v, sl, False))
print(json.dumps(res, indent=1))
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "decode_ab.json"), "w"), indent=1)
