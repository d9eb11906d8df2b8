"""One rank of tests/test_ring_capture.py's GPU check (torchrun, NCCL, 2 GPUs): for every ring
transport, a forward and a forward + backward captured in CUDA graphs after their eager
warm-up, replayed on new inputs copied into the captured tensors, give what the same call
gives eagerly on those inputs. Writes rank<r>.json into the folder of argv[1]: per case the
transport that ran and the largest relative difference of out, dq, dk, dv (replay vs eager),
or the error the capture raised."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import dilgen

N = 4096
CASES = [   # name, spec fields, chunk order, forced transport (None: the model's choice)
    ("local", dict(segment_lengths=[512, 1024], dilation_rates=[1, 2]), "contiguous", None),
    ("ring", dict(segment_lengths=[512, 4096], dilation_rates=[1, 4]), "contiguous", "ring"),
    ("allgather", dict(segment_lengths=[512, 4096], dilation_rates=[1, 4]), "contiguous", "allgather"),
    ("heads", dict(segment_lengths=[512, 4096], dilation_rates=[1, 4]), "contiguous", "heads"),
    ("recut", dict(segment_lengths=[512, 3072], dilation_rates=[1, 3]), "contiguous", "recut"),
    ("hybrid", dict(segment_lengths=[512, 4096], dilation_rates=[1, 4]), "contiguous", "hybrid"),
    ("recut_zigzag_causal_gqa", dict(segment_lengths=[256, 1536], dilation_rates=[1, 3], causal=True,
                                     num_kv_heads=2), "zigzag", "recut"),
    ("hybrid_zigzag_causal_gqa", dict(segment_lengths=[512, 4096], dilation_rates=[1, 4], causal=True,
                                      num_kv_heads=2), "zigzag", "hybrid"),
]


def _warm(step, reps=2):
    """Warm-up on a side stream, as torch.cuda.graph asks of a captured autograd step."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(reps):
            step()
    torch.cuda.current_stream().wait_stream(side)


def run_case(name, fields, order, forced, rank, P, dev):
    fields = dict(fields)
    kv = fields.pop("num_kv_heads", 4)
    spec = dilgen.Spec(name=f"cap_{name}", num_heads=4, num_kv_heads=kv, head_dim=64, dtype="bfloat16",
                       ring_size=P, **fields)
    kernel = dilgen.compile(spec)
    os.environ["DILGEN_RING_TRANSPORT"] = forced or "auto"
    g = torch.Generator(device=dev).manual_seed(11 + rank)
    n_loc = N // P

    def fresh():
        return [torch.randn(1, n_loc, h, 64, device=dev, dtype=torch.bfloat16, generator=g) for h in (4, kv, kv, 4)]

    static = [t.requires_grad_(i < 3) for i, t in enumerate(fresh())]
    call = lambda a, b, c: kernel(a, b, c, chunk_order=order)  # noqa: E731

    def fwd_bwd():
        for t in static[:3]:
            t.grad = None
        call(*static[:3]).backward(static[3])

    try:
        with torch.no_grad():
            _warm(lambda: call(*static[:3]))
            fwd_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(fwd_graph):
                out_static = call(*static[:3])
        _warm(fwd_bwd)
        bwd_graph = torch.cuda.CUDAGraph()
        for t in static[:3]:
            t.grad = None
        with torch.cuda.graph(bwd_graph):
            call(*static[:3]).backward(static[3])
    except Exception as exc:  # noqa: BLE001 - the report names what the capture raised
        return {"error": f"{type(exc).__name__}: {exc}"}
    new = fresh()
    with torch.no_grad():
        for s, t in zip(static, new):
            s.copy_(t)
    fwd_graph.replay()
    bwd_graph.replay()
    torch.cuda.synchronize(dev)
    leaves = [t.clone().requires_grad_() for t in new[:3]]
    eager = call(*leaves)
    eager.backward(new[3])
    err = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    res = {"transport": kernel.compiled_for(dev).attention.last_ring_transport, "out": err(out_static, eager)}
    res.update({label: err(s.grad, t.grad) for label, s, t in zip(("dq", "dk", "dv"), static, leaves)})
    return res


def main():
    folder = Path(sys.argv[1])
    dist.init_process_group("nccl")
    rank, P = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    results = {name: run_case(name, f, o, forced, rank, P, dev) for name, f, o, forced in CASES}
    os.environ["DILGEN_RING_TRANSPORT"] = "auto"
    (folder / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
