"""One rank of tests/test_dropout.py's ring check (run under torchrun: NCCL on 2 GPUs, else gloo): for each case,
the ring's rows of out, dq, dk, dv under attention dropout against the same rows of the
single-device call, both seeded alike (rank 0's seed is the ring call's), on every transport;
refused cases must raise InputError on every rank. Writes rank<r>.json into the folder of argv[1]; argv[2], if
given, names the cases to run (comma-separated; packed_spanning is the packed row)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import dilgen
from dilgen.compiler import Kernel
from dilgen.runtime.checks import InputError
from dilgen.runtime.ring import shard

CASES = [
    ("local_contiguous", dict(segment_lengths=[8, 16], dilation_rates=[1, 2]), "contiguous", None),
    ("local_zigzag_causal_gqa", dict(segment_lengths=[8, 16], dilation_rates=[1, 2], causal=True, num_kv_heads=2),
     "zigzag", None),
    ("heads_spanning", dict(segment_lengths=[8, 64], dilation_rates=[1, 4]), "contiguous", "heads"),
    ("heads_zigzag_causal_gqa_r3", dict(segment_lengths=[16, 48], dilation_rates=[1, 3], causal=True, num_kv_heads=2),
     "zigzag", "heads"),
    ("forced_ring", dict(segment_lengths=[8, 64], dilation_rates=[1, 4]), "contiguous", "ring"),
    # r = 3 over a segment spanning the ranks: key windows start off a span of 32 lanes
    ("forced_allgather_causal_gqa_r3", dict(segment_lengths=[16, 64], dilation_rates=[1, 3], causal=True,
                                            num_kv_heads=2), "contiguous", "allgather"),
    ("forced_ring_zigzag_r3", dict(segment_lengths=[16, 64], dilation_rates=[2, 3]), "zigzag", "ring"),
    # 64 lanes in one segment, zigzag chunks of 16: windows from lanes 16 and 48, so blocks
    # start on the spans at lanes 0 and 32
    ("forced_ring_zigzag_second_span", dict(segment_lengths=[16, 64], dilation_rates=[2, 1]), "zigzag", "ring"),
    # the same and r = 3 with the GPU's key blocks of 32 lanes (WIDE: the windows' blocks
    # must start on a span, not on a block of the interpreter's 16)
    ("forced_ring_zigzag_second_span_wide", dict(segment_lengths=[16, 64], dilation_rates=[2, 1]), "zigzag", "ring"),
    ("forced_ring_zigzag_r3_wide", dict(segment_lengths=[16, 64], dilation_rates=[2, 3]), "zigzag", "ring"),
    ("forced_ring_hilbert_segment", dict(segment_lengths=[16, 64], dilation_rates=[1, 2],
                                         hilbert={"scope": "segment"}), "contiguous", "ring"),
    # Hilbert scope "sequence": each rank holds a run of the curve; coins at curve positions
    ("forced_ring_hilbert_sequence", dict(segment_lengths=[16, 64], dilation_rates=[1, 2],
                                          hilbert={"scope": "sequence", "grid": [8, 8]}), "contiguous", "ring"),
    ("heads_hilbert_sequence", dict(segment_lengths=[16, 32], dilation_rates=[2, 4],
                                    hilbert={"scope": "sequence", "grid": [8, 8]}), "contiguous", "heads"),
    # rank borders moved onto multiples of 12 and 24 (zigzag: two pieces on rank 0, each drawn at its start)
    ("forced_recut_zigzag_causal_gqa_r3", dict(segment_lengths=[6, 12], dilation_rates=[1, 3], causal=True,
                                               num_kv_heads=2), "zigzag", "recut"),
    ("forced_recut_r3", dict(segment_lengths=[8, 24], dilation_rates=[1, 3]), "contiguous", "recut"),
    # hybrid: w 16 (zigzag chunks of 16) / w 8 in the single-device dropout kernels, each piece at its start and
    # each local branch on its own stream; the branch that crosses the ranks in the windows
    ("forced_hybrid_zigzag_causal_gqa_r3", dict(segment_lengths=[16, 64], dilation_rates=[1, 3], causal=True,
                                                num_kv_heads=2), "zigzag", "hybrid"),
    ("forced_hybrid_second_branch_local", dict(segment_lengths=[64, 8], dilation_rates=[4, 1]), "contiguous", "hybrid"),
    ("windows_mqa", dict(segment_lengths=[8, 64], dilation_rates=[1, 3], num_kv_heads=1), "contiguous", None),
    # traced whole by torch.compile: the ring's dropout ops draw rank 0's seed when they run
    ("compiled_zigzag_causal_gqa_r3", dict(segment_lengths=[16, 48], dilation_rates=[1, 3], causal=True,
                                           num_kv_heads=2), "zigzag", None),
]


#: a ring module built as the dropout plan (its own dropout twin) with key blocks of 32 lanes
WIDE = {"dropout": True, "block_n": 32, "bwd_kv": (32, 16, 1, 1), "bwd_dq": (16, 32, 1, 1)}


def run_case(name, fields, order, forced, rank, P):
    fields = dict(fields)
    kv = fields.pop("num_kv_heads", 4)
    common = dict(num_heads=4, num_kv_heads=kv, head_dim=16, dtype="float32", **fields)
    one = dilgen.compile(dilgen.Spec(name=f"drop_one_{name}", **common))
    ring_spec = dilgen.Spec(name=f"drop_ring_{name}", ring_size=P, **common)
    ring = Kernel(ring_spec, None, WIDE) if name.endswith("_wide") else dilgen.compile(ring_spec)
    mine_of = lambda t: shard(t, P, rank, order, spec=ring_spec)  # noqa: E731  (curve order first)
    g = torch.Generator().manual_seed(5)
    N = 64
    q, k, v = (torch.randn(1, N, h, 16, generator=g).to(DEVICE) for h in (4, kv, kv))
    go = torch.randn(1, N, 4, 16, generator=g).to(DEVICE)
    os.environ["DILGEN_RING_TRANSPORT"] = forced or "auto"
    mine = [mine_of(t).clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(77)
    try:
        call = lambda a, b, c: ring(a, b, c, dropout_p=0.3, chunk_order=order)  # noqa: E731
        if name.startswith("compiled_"):
            call = torch.compile(call, backend="aot_eager", fullgraph=True)
        out = call(*mine)
    except InputError as exc:
        return {"refused": str(exc)}
    (out * mine_of(go)).sum().backward()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(77)
    ref = one(*full, dropout_p=0.3)
    (ref * go).sum().backward()
    err = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    res = {"transport": ring.compiled_for(q.device).attention.last_ring_transport, "device": DEVICE.type,
           "out": err(out, mine_of(ref)),
           "plain_gap": err(out, mine_of(one(*(t.detach() for t in (q, k, v)))))}
    for label, a, b in zip(("dq", "dk", "dv"), mine, full):
        res[label] = err(a.grad, mine_of(b.grad))
    return res


DEVICE = torch.device("cpu")


def run_packed(rank, P):
    """A packed row of two sequences (20 and 44 rows: the second spans the ranks) on the ring
    against the single-device packed call: the rows drawn as one sequence of the whole row."""
    common = dict(num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32", segment_lengths=[8, 32],
                  dilation_rates=[1, 2])
    one = dilgen.compile(dilgen.Spec(name="drop_one_packed", **common))
    ring = dilgen.compile(dilgen.Spec(name="drop_ring_packed", ring_size=P, **common))
    g = torch.Generator().manual_seed(6)
    N, n_loc = 64, 64 // P
    q, k, v = (torch.randn(N, h, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
    go = torch.randn(N, 4, 16, generator=g).to(DEVICE)
    cu = torch.tensor([0, 20, 64], dtype=torch.int32, device=DEVICE)
    rows = slice(rank * n_loc, (rank + 1) * n_loc)
    mine = [t[rows].clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(78)
    out = ring(*mine, cu_seqlens=cu, max_seqlen=44, dropout_p=0.3)
    (out * go[rows]).sum().backward()
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(78)
    ref = one(*full, cu_seqlens=cu, max_seqlen=44, dropout_p=0.3)
    (ref * go).sum().backward()
    err = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    res = {"transport": ring.compiled_for(q.device).attention.last_ring_transport, "device": DEVICE.type,
           "out": err(out, ref[rows]),
           "plain_gap": err(out, one(*(t.detach() for t in (q, k, v)), cu_seqlens=cu, max_seqlen=44)[rows])}
    for label, a, b in zip(("dq", "dk", "dv"), mine, full):
        res[label] = err(a.grad, b.grad[rows])
    return res


def main():
    global DEVICE
    folder = Path(sys.argv[1])
    gpus = torch.cuda.device_count() >= 2                     # NCCL on 2 GPUs, else gloo on the CPU
    dist.init_process_group("nccl" if gpus else "gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    if gpus:
        DEVICE = torch.device("cuda", rank)
        torch.cuda.set_device(DEVICE)
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else [c[0] for c in CASES] + ["packed_spanning"]
    results = {name: run_case(name, f, o, forced, rank, P) for name, f, o, forced in CASES if name in names}
    os.environ["DILGEN_RING_TRANSPORT"] = "auto"
    if "packed_spanning" in names:
        results["packed_spanning"] = run_packed(rank, P)
    (folder / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
