"""Probe (leaves the tree once answered): where a replayed call's host time goes, piece by
piece, on configs A and C (and the packed path with a packing made once), and whether
launching with raw pointers / Triton's C launch directly gives the same bits.
Writes $OUT/host_probe.json."""
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import toolkit as tk  # noqa: E402
import dilgen  # noqa: E402
from dilgen.runtime import replay, launch, op  # noqa: E402
from dilgen.runtime.backward import backward_raw  # noqa: E402
from dilgen.runtime.varlen import packing_from_cu_seqlens  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
res = {"header": tk.header(torch.device("cuda")), "rows": []}


def host(fn, calls=100, rounds=7):
    times, busy = [], True
    for _ in range(rounds):
        torch.cuda.synchronize()
        torch.cuda._sleep(300_000_000)
        ev = torch.cuda.Event()
        ev.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t0) / calls * 1e6)
        busy &= not ev.query()
    torch.cuda.synchronize()
    return round(sorted(times)[rounds // 2], 2), busy


def row(cfg, piece, fn, **kw):
    try:
        us, busy = host(fn, **kw)
        r = {"config": cfg, "piece": piece, "host_us": us, "gpu_stayed_busy": busy}
    except Exception as e:  # noqa: BLE001
        r = {"config": cfg, "piece": piece, "error": tk.short_err(e, 600), "tb": traceback.format_exc()[-1500:]}
    res["rows"].append(r)
    print(r, flush=True)


def probe(name):
    c = tk.CONFIGS[name]
    B, N, H, D = c["B"], c["N"], c["H"], c["D"]
    dev = torch.device("cuda")
    kernel = dilgen.compile(tk.make_spec(name, c, False, "probe"))
    causal = dilgen.compile(tk.make_spec(name, c, True, "probe"))
    attn = kernel.compiled_for(dev).attention
    gen = torch.Generator(dev).manual_seed(1)
    q, k, v, g = (torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in "qkvg")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    for _ in range(3):
        kernel(q, k, v)
        torch.autograd.grad(kernel(qg, kg, vg), (qg, kg, vg), g)
    torch.cuda.synchronize()
    key = replay.signature("fwd", (q, k, v))
    recipe = attn._replays.get(key)
    info = {"config": name, "piece": "info", "recipe": type(recipe).__name__,
            "launches": [], "replays": len(attn._replays)}
    out = torch.empty(B, N, H, D, device=dev, dtype=q.dtype)
    lse = torch.empty(B, H, N, device=dev, dtype=torch.float32)
    slots = (q, k, v, out, lse)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    hf = lambda *ts: [t.transpose(1, 2) for t in ts]  # noqa: E731
    row(name, "dilgen.Kernel.__call__", lambda: kernel(q, k, v))
    row(name, "attn.__call__", lambda: attn(q, k, v))
    row(name, "sdpa", lambda: sdpa(*hf(q, k, v)))
    row(name, "signature", lambda: replay.signature("fwd", (q, k, v)))
    row(name, "plain_eager+needs_grad", lambda: (op.plain_eager(q, k, v), op.needs_grad(q, k, v)))
    row(name, "2 torch.empty", lambda: (torch.empty(B, N, H, D, device=dev, dtype=q.dtype),
                                        torch.empty(B, H, N, device=dev, dtype=torch.float32)))
    row(name, "_stream(_device())", lambda: replay._stream(replay._device()))
    row(name, "torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream().cuda_stream)
    row(name, "torch._C._cuda_getCurrentRawStream", lambda: torch._C._cuda_getCurrentRawStream(0))
    from triton import knobs
    row(name, "knobs hooks", lambda: (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))
    row(name, "ensure_descriptor_allocator", launch.ensure_descriptor_allocator)
    if recipe is None or not hasattr(recipe, "launches"):
        res["rows"].append(info)
        return
    row(name, "recipe.run", lambda: recipe.run(slots))
    stream = replay._stream(replay._device())
    ref_out = None
    for i, (compiled, grid, template, holes) in enumerate(recipe.launches):
        args = list(template)
        for pos, slot in holes:
            args[pos] = slots[slot]
        args = tuple(args)
        ptrs = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        runner = compiled.run
        li = {"i": i, "grid": grid, "n_args": len(args), "n_tensors": sum(isinstance(a, torch.Tensor) for a in args),
              "global_scratch_size": getattr(runner, "global_scratch_size", None),
              "profile_scratch_size": getattr(runner, "profile_scratch_size", None),
              "launcher": type(runner).__name__, "has_launch": hasattr(runner, "launch")}
        info["launches"].append(li)
        print(li, flush=True)
        if getattr(runner, "global_scratch_size", 0):
            scratch = torch.empty(grid[0] * grid[1] * grid[2] * runner.num_ctas * runner.global_scratch_size,
                                  dtype=torch.int8, device=dev)
            row(name, f"launch{i}: C launch ptrs, scratch kept", lambda: runner.launch(
                grid[0], grid[1], grid[2], stream, compiled.function, runner.launch_cooperative_grid,
                runner.launch_pdl, scratch.data_ptr(), None, compiled.packed_metadata, None, None, None, *ptrs))
            row(name, f"launch{i}: torch.empty scratch", lambda: torch.empty(
                grid[0] * grid[1] * grid[2] * runner.global_scratch_size, dtype=torch.int8, device=dev))
        row(name, f"launch{i}: launch_compiled", lambda: launch.launch_compiled(compiled, grid, stream, args))
        row(name, f"launch{i}: compiled.run", lambda: runner(grid[0], grid[1], grid[2], stream, compiled.function,
                                                              compiled.packed_metadata, None, None, None, *args))
        row(name, f"launch{i}: compiled.run ptrs", lambda: runner(grid[0], grid[1], grid[2], stream, compiled.function,
                                                                   compiled.packed_metadata, None, None, None, *ptrs))
        if hasattr(runner, "launch") and not runner.global_scratch_size and not runner.profile_scratch_size:
            raw = runner.launch
            coop, pdl = runner.launch_cooperative_grid, runner.launch_pdl
            row(name, f"launch{i}: C launch ptrs", lambda: raw(grid[0], grid[1], grid[2], stream, compiled.function,
                                                               coop, pdl, None, None, compiled.packed_metadata,
                                                               None, None, None, *ptrs))
            row(name, f"launch{i}: C launch tensors", lambda: raw(grid[0], grid[1], grid[2], stream, compiled.function,
                                                                  coop, pdl, None, None, compiled.packed_metadata,
                                                                  None, None, None, *args))
    # bits: the recipe with pointers equals the recipe with tensors
    try:
        torch.cuda.synchronize()
        recipe.run(slots)
        torch.cuda.synchronize()
        ref_out, ref_lse = out.clone(), lse.clone()
        out.fill_(float("nan")); lse.fill_(float("nan"))
        for compiled, grid, template, holes in recipe.launches:
            args = list(template)
            for pos, slot in holes:
                args[pos] = slots[slot]
            args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
            compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                         None, None, None, *args)
        torch.cuda.synchronize()
        info["ptrs_equal"] = bool(torch.equal(out, ref_out) and torch.equal(lse, ref_lse))
    except Exception as e:  # noqa: BLE001
        info["ptrs_error"] = tk.short_err(e, 600)
    res["rows"].append(info)
    print(info, flush=True)
    # fwd + bwd pieces
    row(name, "fwd with grad (autograd.Function)", lambda: kernel(qg, kg, vg), calls=30)
    row(name, "fwd_bwd autograd.grad", lambda: torch.autograd.grad(kernel(qg, kg, vg), (qg, kg, vg), g), calls=30)
    row(name, "sdpa fwd with grad", lambda: sdpa(*hf(qg, kg, vg)), calls=30)
    row(name, "sdpa fwd_bwd", lambda: torch.autograd.grad(sdpa(*hf(qg, kg, vg)), (qg, kg, vg), g.transpose(1, 2)), calls=30)
    o2, l2 = kernel(q, k, v, return_lse=True)
    with torch.no_grad():
        row(name, "backward_raw (replayed)", lambda: backward_raw(attn, q, k, v, o2, l2, g, None), calls=30)
        bkey = replay.signature("bwd", (q, k, v, o2, l2, g), False)
        info["bwd_recipe"] = type(attn._replays.get(bkey)).__name__
        brec = attn._replays.get(bkey)
        if hasattr(brec, "launches"):
            info["bwd_launches"] = len(brec.launches)
            info["bwd_scratch"] = [getattr(c.run, "global_scratch_size", None) for c, *_ in brec.launches]
    # packed with the packing made once (no sync), and the packing alone
    rows = [t.reshape(B * N, H, D) for t in (q, k, v)]
    cu = torch.arange(0, B * N + 1, N // 4, dtype=torch.int32, device=dev)
    packing = packing_from_cu_seqlens("p", cu, B * N, q.device, None)
    with torch.no_grad():
        row(name, "packed, packing made once", lambda: op.varlen_attention_op(attn, *rows, packing), calls=30)
        row(name, "packing_from_cu_seqlens", lambda: packing_from_cu_seqlens("p", cu, B * N, q.device, None), calls=30)
        row(name, "packed call (as users)", lambda: kernel(*rows, cu_seqlens=cu), calls=30)
    # decode
    cl, q1 = torch.full((B,), N, dtype=torch.int32, device=dev), q[:, -1:].contiguous()
    for _ in range(3):
        causal.decode(q1, k, v, cl, validate=False)
    row(name, "decode validate=False", lambda: causal.decode(q1, k, v, cl, validate=False))
    row(name, "sdpa decode", lambda: sdpa(*hf(q1, k, v)))


def find_sync(label, fn):
    """The traceback of the first synchronizing torch call in fn (sync debug mode 'error')."""
    import warnings
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            fn()
        r = {"piece": label, "sync": None}
    except Exception:  # noqa: BLE001
        r = {"piece": label, "sync": traceback.format_exc()[-2500:]}
    finally:
        torch.cuda.set_sync_debug_mode(0)
    res["rows"].append(r)
    print(r, flush=True)


def bwd_breakdown(name):
    """Where a fwd_bwd's host time goes: the Function's backward, backward_raw, the rest."""
    c = tk.CONFIGS[name]
    B, N, H, D = c["B"], c["N"], c["H"], c["D"]
    dev = torch.device("cuda")
    kernel = dilgen.compile(tk.make_spec(name, c, False, "probe"))
    gen = torch.Generator(dev).manual_seed(3)
    q, k, v, g = (torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in "qkvg")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    spans = {"Function.backward": 0.0, "backward_raw": 0.0}
    orig_b, orig_raw = op._DilgenAttention.backward, op.backward_raw

    def timed(key, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spans[key] += time.perf_counter() - t0
        return wrapper
    op._DilgenAttention.backward = staticmethod(timed("Function.backward", orig_b))
    op.backward_raw = timed("backward_raw", orig_raw)
    try:
        step = lambda: torch.autograd.grad(kernel(qg, kg, vg), (qg, kg, vg), g)  # noqa: E731
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        for k_ in spans:
            spans[k_] = 0.0
        calls, rounds = 30, 7
        us, busy = host(step, calls=calls, rounds=rounds)
        per = {k_: round(v_ / (calls * rounds) * 1e6, 2) for k_, v_ in spans.items()}
        r = {"config": name, "piece": "fwd_bwd breakdown", "host_us": us, "gpu_stayed_busy": busy, **per}
    finally:
        op._DilgenAttention.backward, op.backward_raw = staticmethod(orig_b), orig_raw
    res["rows"].append(r)
    print(r, flush=True)
    rows = [t.reshape(B * N, H, D) for t in (q, k, v)]
    cu = torch.arange(0, B * N + 1, N // 4, dtype=torch.int32, device=dev)
    packing = packing_from_cu_seqlens("p", cu, B * N, q.device, None)
    mask = torch.arange(N, device=dev).expand(B, N) >= N - 64
    with torch.no_grad():
        op.varlen_attention_op(kernel.compiled_for(dev).attention, *rows, packing)
        kernel.padded(q, k, v, mask)
        find_sync(f"{name} packed, packing made once", lambda: op.varlen_attention_op(kernel.compiled_for(dev).attention, *rows, packing))
        find_sync(f"{name} padded", lambda: kernel.padded(q, k, v, mask))
        find_sync(f"{name} packed as users call", lambda: kernel(*rows, cu_seqlens=cu))


def sdpa_capture():
    """The capture harness of capture_checks with SDPA in dilgen's place."""
    c = tk.CONFIGS["A"]
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(2)
    q, k, v, g = (torch.randn(1, c["H"], c["N"], c["D"], device=dev, dtype=torch.bfloat16, generator=gen) for _ in "qkvg")
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def step():
        o = sdpa(qg, kg, vg)
        return (o, *torch.autograd.grad(o, (qg, kg, vg), g))
    try:
        fresh = step()
        graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(graph):
            cap = step()
        graph.replay()
        torch.cuda.synchronize()
        out = all(torch.equal(a, b) for a, b in zip(fresh, cap))
    except Exception as e:  # noqa: BLE001
        out = "error: " + tk.short_err(e, 300)
    res["sdpa_capture_fresh"] = out
    print("sdpa capture fresh:", out, flush=True)


def capture_checks():
    """CUDA-graph capture of A's fwd+bwd with return_lse, fresh and after replay checks."""
    from dilgen.runtime import set_poison
    c = tk.CONFIGS["A"]
    dev = torch.device("cuda")
    out = {}
    for variant in ("fresh", "after_poison_checks", "replay_off"):
        kernel = dilgen.compile(tk.make_spec("A", c, False, "cap" + variant[:3]))
        attn = kernel.compiled_for(dev).attention
        gen = torch.Generator(dev).manual_seed(2)
        q, k, v, g = (torch.randn(1, c["N"], c["H"], c["D"], device=dev, dtype=torch.bfloat16, generator=gen) for _ in "qkvg")
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def step():
            o, l = kernel(qg, kg, vg, return_lse=True)
            return (o, l, *torch.autograd.grad(o, (qg, kg, vg), g))
        replay.ENABLED = variant != "replay_off"
        try:
            if variant == "after_poison_checks":
                set_poison(True)
                attn._replays.clear()
                step(); step()
                with torch.no_grad():
                    attn._replays.clear()
                    [kernel(q, k, v, return_lse=True) for _ in range(2)]
                set_poison(False)
            torch.cuda.synchronize()
            fresh = step()
            graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                step()
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                cap = step()
            graph.replay()
            torch.cuda.synchronize()
            out[variant] = all(torch.equal(a, b) for a, b in zip(fresh, cap))
        except Exception as e:  # noqa: BLE001
            out[variant] = "error: " + tk.short_err(e, 400)
            out[variant + "_tb"] = traceback.format_exc()[-2500:]
            torch.cuda.synchronize()
        finally:
            replay.ENABLED = True
            set_poison(False)
    res["capture"] = out
    print(out, flush=True)


if __name__ == "__main__":
    tk.quiet()
    import triton
    import triton.language as tl

    @triton.jit
    def tiny(x, n):
        tl.store(x + tl.arange(0, 16), tl.arange(0, 16).to(tl.float32), mask=tl.arange(0, 16) < n)
    xx = torch.empty(16, device="cuda")
    ck = tiny[(1,)](xx, 16)
    st = replay._stream(0)
    row("-", "tiny kernel: tiny[grid]()", lambda: tiny[(1,)](xx, 16))
    row("-", "tiny kernel: compiled.run", lambda: ck.run(1, 1, 1, st, ck.function, ck.packed_metadata, None, None, None, xx, 16))
    row("-", "tiny kernel: C launch ptr", lambda: ck.run.launch(1, 1, 1, st, ck.function, False, False, None, None,
                                                               ck.packed_metadata, None, None, None, xx.data_ptr(), 16))
    for name in sys.argv[1].split(","):
        probe(name)
        with open(os.path.join(OUT, "host_probe.json"), "w") as f:
            json.dump(tk.sanitize(res), f, indent=1)
    for name in sys.argv[1].split(","):
        bwd_breakdown(name)
    if len(sys.argv) > 2:
        sdpa_capture()
        capture_checks()
    with open(os.path.join(OUT, "host_probe.json"), "w") as f:
        json.dump(tk.sanitize(res), f, indent=1)
