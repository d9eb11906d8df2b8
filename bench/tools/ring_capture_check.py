"""Probe (issue 41, item 3): ring calls captured in CUDA graphs over NCCL replay equal to eager.

    torchrun --nproc-per-node 2 bench/tools/ring_capture_check.py --out DIR

Per case (transport, causal, GQA, Hilbert segments): eager warm-up on a side stream, then a
no-gradient forward and a forward + backward captured; new random inputs copied into the
static tensors, both graphs replayed, and their outputs and gradients compared with eager
calls on the same inputs (bits, and max |diff|). Times one call eager and replayed. Last, a
capture of a call that never ran eagerly must be refused by name. Rank 0 writes JSON."""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist

import dilgen

CASES = [
    dict(name="raster_ring", w=[2048, 8192], r=[1, 4], kv=8, causal=False, transport="ring"),
    dict(name="causal_gqa_ring", w=[2048, 8192], r=[1, 4], kv=2, causal=True, transport="ring"),
    dict(name="raster_allgather", w=[2048, 8192], r=[1, 4], kv=8, causal=False, transport="allgather"),
    dict(name="raster_heads", w=[2048, 8192], r=[1, 4], kv=8, causal=False, transport="heads"),
    dict(name="hilbert_segment", w=[4096, 16384], r=[1, 4], kv=8, causal=False, transport="auto",
         hilbert={"scope": "segment"}),
]
B, N, H, D = 1, 16384, 8, 64


def timed(fn, reps=20):
    torch.cuda.synchronize()
    one = []
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        one.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return round(min(one) * 1e3, 4), round((time.perf_counter() - t0) / reps * 1e3, 4)


def run_case(c, P, rank, dev):
    os.environ["DILGEN_RING_TRANSPORT"] = c["transport"]
    spec = dilgen.Spec(name=c["name"], num_heads=H, num_kv_heads=c["kv"], head_dim=D,
                       segment_lengths=c["w"], dilation_rates=c["r"], causal=c["causal"],
                       ring_size=P, dtype="bfloat16", hilbert=c.get("hilbert"))
    kern = dilgen.compile(spec)
    n = N // P
    gen = torch.Generator(device=dev).manual_seed(1000 + rank)
    shapes = [(B, n, H, D), (B, n, c["kv"], D), (B, n, c["kv"], D), (B, n, H, D)]
    fresh = lambda: [torch.randn(s, device=dev, dtype=torch.bfloat16, generator=gen) for s in shapes]  # noqa: E731
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sq, sk, sv, sgo = fresh()
        leaves = [t.requires_grad_() for t in (sq, sk, sv)]
        for _ in range(2):
            out = kern(*leaves)
            out.backward(sgo)
            for t in leaves:
                t.grad = None
        with torch.no_grad():
            kern(*leaves)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g_fwd, g_train = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g_fwd):
        out_fwd = kern(*(t.detach() for t in leaves))
    with torch.cuda.graph(g_train):
        out_train = kern(*leaves)
        out_train.backward(sgo)
    grads = [t.grad for t in leaves]
    row = dict(case=c["name"], transport=kern.compiled_for(dev).attention.last_ring_transport, trials=[])
    for _ in range(2):
        new = fresh()
        with torch.no_grad():
            for s, x in zip((sq, sk, sv, sgo), new):
                s.copy_(x)
        g_fwd.replay()
        g_train.replay()
        torch.cuda.synchronize()
        e_leaves = [x.clone().requires_grad_() for x in new[:3]]
        e_out = kern(*e_leaves)
        e_out.backward(new[3])
        got = [out_fwd, out_train, *grads]
        want = [e_out.detach(), e_out.detach(), *(t.grad for t in e_leaves)]
        row["trials"].append({name: {"equal": bool(torch.equal(a, b)),
                                     "max_abs_diff": float((a.float() - b.float()).abs().max()),
                                     "nan": bool(torch.isnan(a).any())}
                              for name, a, b in zip(("fwd_graph", "train_graph_out", "dq", "dk", "dv"), got, want)})
    with torch.no_grad():
        row["fwd_eager_ms_one_b2b"] = timed(lambda: kern(sq.detach(), sk.detach(), sv.detach()))
    row["fwd_graph_ms_one_b2b"] = timed(g_fwd.replay)
    row["train_graph_ms_one_b2b"] = timed(g_train.replay)
    return row


def refused_without_warm_up(P, dev):
    """A capture of a call that never ran eagerly is refused by name (RingError)."""
    os.environ["DILGEN_RING_TRANSPORT"] = "ring"
    spec = dilgen.Spec(name="cold", num_heads=H, num_kv_heads=H, head_dim=D, segment_lengths=[4096],
                       dilation_rates=[2], ring_size=P, dtype="bfloat16")
    kern = dilgen.compile(spec)
    q = torch.randn(B, 2048, H, D, device=dev, dtype=torch.bfloat16)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.no_grad(), torch.cuda.graph(g):
            kern(q, q, q)
    except Exception as exc:  # noqa: BLE001 - recorded
        return f"{type(exc).__name__}: {exc}"[:400]
    return "not refused"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    P = dist.get_world_size()
    rows = []
    for c in CASES:
        try:
            rows.append(run_case(c, P, rank, dev))
        except Exception as exc:  # noqa: BLE001 - recorded per case
            rows.append(dict(case=c["name"], error=f"{type(exc).__name__}: {exc}"[:600]))
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    cold = refused_without_warm_up(P, dev)
    if rank == 0:
        print("cold:", cold, flush=True)
        res = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                   triton=__import__("triton").__version__, device=torch.cuda.get_device_name(dev),
                   ranks=P, shape=dict(B=B, N=N, H=H, D=D), cases=rows, cold_capture=cold)
        with open(os.path.join(args.out, "ring_capture_check.json"), "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
