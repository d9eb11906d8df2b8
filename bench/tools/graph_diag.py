"""Probe (issue 41): where CUDA-graph capture of a dilgen call fails at config A (N = 32K) and F
("operation would make the legacy stream depend on a capturing blocking stream"), with the
whole traceback: forward alone, forward + backward, no-gradient, each on a fresh graph, with
the calls warmed on a side stream first (as torch.cuda.make_graphed_callables). JSON rows."""
from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import toolkit as tk  # noqa: E402


def capture(torch, fn) -> dict:
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        return {"ok": True}
    except Exception as e:  # noqa: BLE001
        chain, seen = [], e
        while seen is not None:
            chain.append("".join(traceback.format_exception(type(seen), seen, seen.__traceback__, chain=False)))
            seen = seen.__context__
        return {"ok": False, "tracebacks": chain}


def main() -> int:
    import torch
    import dilgen
    out, name, N = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])   # one case a process
    dev, rows = torch.device("cuda"), []
    for name, N in [(name, N)]:
        c = {**tk.CONFIGS[name], "N": N}
        kernel = dilgen.compile(tk.make_spec(name, c, False, "diag"))
        gen = torch.Generator(dev).manual_seed(N)
        q, k, v, g = (torch.randn(c["B"], N, c["H"], c["D"], device=dev, dtype=torch.bfloat16, generator=gen)
                      for _ in "qkvg")
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

        def fwd_bwd():
            out = kernel(qg, kg, vg)
            return torch.autograd.grad(out, (qg, kg, vg), g)

        def no_grad():
            with torch.no_grad():
                return kernel(q, k, v)
        for what, fn in [("no_grad", no_grad), ("fwd_grad", lambda: kernel(qg, kg, vg)), ("fwd_bwd", fwd_bwd)]:
            row = {"config": name, "N": N, "what": what, **capture(torch, fn)}
            rows.append(row)
            print(json.dumps(row)[:3000], flush=True)
        torch.cuda.synchronize()
    tk.write_json_atomic(out / f"graph_diag_{name}_{N}.json", {**tk.header(dev), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
