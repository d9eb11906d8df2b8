"""The main job on a bundled spec: compile it, run a forward call, check it against the
float64 reference. On a GPU it runs the spec as written, on N = 4 x its longest segment.
Without one it runs a shrunk copy of the spec in Triton's interpreter (which runs each tile
op in numpy): every segment divided by longest // 64, so the longest is about 64 tokens
(none below 8); at most 4 query heads (fewer kv heads, the same query heads per kv head;
one kv head's group if that is larger); head_dim at most 32; on N = 2 x the longest segment
+ 5 tokens. The dilation rates, dtype, causality and every other field are kept.

    python examples/quickstart.py [examples/specs/longnet_base.json]
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import dilgen
from dilgen.reference import reference_attention

TOL = {"bfloat16": 2e-2, "float16": 5e-3, "float32": 1e-4}


def main(path: str) -> int:
    spec = dilgen.load_spec(path)
    gpu = torch.cuda.is_available()
    if gpu:
        device, n, batch = torch.device("cuda"), 4 * max(spec.segment_lengths), 1
    else:
        spec = cpu_spec(spec)
        device, n, batch = torch.device("cpu"), 2 * max(spec.segment_lengths) + 5, 1
    dtype = getattr(torch, spec.dtype)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, n, spec.num_heads, spec.head_dim, generator=gen).to(dtype).to(device)
    k = torch.randn(batch, n, spec.num_kv_heads, spec.head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(batch, n, spec.num_kv_heads, spec.head_dim, generator=gen).to(dtype).to(device)

    kernel = dilgen.compile(spec)
    t0 = time.perf_counter()
    out, lse = kernel(q, k, v, return_lse=True)
    if gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    ref = reference_attention(q[:, :8192], k[:, :8192], v[:, :8192], spec) if n > 8192 else \
        reference_attention(q, k, v, spec)
    rows = ref.shape[1]
    got = out[:, :rows].double().cpu()
    # With n > 8192 the reference sees a prefix; rows of segments cut by the prefix differ,
    # so compare only the rows of the whole segments inside it.
    whole = rows if n <= 8192 else rows - rows % max(spec.segment_lengths)
    err = ((got[:, :whole] - ref[:, :whole]).norm() / ref[:, :whole].norm()).item()
    where = "GPU " + torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter)"
    print(f"spec {spec.name}: B={batch} N={n} H={spec.num_heads} D={spec.head_dim} {spec.dtype} on {where}")
    print(f"forward: {elapsed * 1e3:.1f} ms (first call, includes compile); "
          f"relative error vs float64 reference: {err:.3e} (tolerance {TOL[spec.dtype]:.0e})")
    ok = err < TOL[spec.dtype] and not torch.isnan(out).any()
    ok = check_generated_module(path, device) and ok
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def cpu_spec(spec: dilgen.Spec) -> dilgen.Spec:
    """The spec shrunk for the interpreter (the module docstring says how); every feature kept."""
    scale = max(1, max(spec.segment_lengths) // 64)
    kv_heads = max(1, min(spec.num_kv_heads, 4 // spec.group_size))
    return spec.replace(segment_lengths=[max(w // scale, 8) for w in spec.segment_lengths],
                        num_heads=kv_heads * spec.group_size, num_kv_heads=kv_heads,
                        head_dim=min(spec.head_dim, 32))


def check_generated_module(path: str, device: torch.device) -> bool:
    """The module `dilgen compile` wrote (generated/<name>.py, README command 1), imported
    by file path, so this works from any folder: a short input against the reference."""
    import importlib.util
    spec = dilgen.load_spec(path)
    module_path = Path(__file__).resolve().parent.parent / "generated" / f"{spec.name}.py"
    if not module_path.exists():
        print(f"({module_path} not there: run `dilgen compile {path}` to emit it)")
        return True
    loader = importlib.util.spec_from_file_location(f"generated_{spec.name}", module_path)
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    if module.SPEC != spec.to_json():
        print(f"({module_path} was emitted from another version of the spec: skipped)")
        return True
    gen = torch.Generator().manual_seed(1)
    dtype = getattr(torch, spec.dtype)
    n = 48 if device.type == "cpu" else 4096     # short: the float64 reference is dense
    q, k, v = (torch.randn(1, n, h, spec.head_dim, generator=gen).to(dtype).to(device)
               for h in (spec.num_heads, spec.num_kv_heads, spec.num_kv_heads))
    out = module.attention(q, k, v)
    ref = reference_attention(q, k, v, spec)
    err = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    print(f"{module_path.relative_to(module_path.parent.parent)} ({module.PLAN['target']} plan, as "
          f"`dilgen compile` wrote it): N={n}, relative error {err:.3e}")
    return err < TOL[spec.dtype] and not torch.isnan(out).any()


if __name__ == "__main__":
    default = Path(__file__).resolve().parent / "specs" / "longnet_base.json"
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(default)))
