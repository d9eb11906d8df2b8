"""The links of a process group, measured (what the ring cost model's link rates are): a
ring shift, an all-gather, an all-to-all and a 4-byte shift's latency, each the slowest rank's.
`dilgen calibrate` keeps them in the machine's record; a ring call's first measurement
(runtime/ring/measure.py) keeps them for the process."""
from __future__ import annotations

from .stats import device_sync, median_seconds


def measure_links(group, device, nbytes: int, reps: int = 5) -> dict:
    """GB/s of a ring shift (send to the next rank, receive from the previous), of an
    all-gather (bytes received per rank) and an all-to-all (bytes sent per rank), and the
    latency (µs) of a 4-byte shift: each the slowest rank's (one all-reduce MAX of the
    times), so every rank holds the same numbers."""
    import torch
    import torch.distributed as dist
    P, me = dist.get_world_size(group), dist.get_rank(group)
    if P == 1:
        return {}
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(P))
    nxt, prv = ranks[(me + 1) % P], ranks[(me - 1) % P]
    sync = device_sync(device)
    n = max(nbytes // P * P, P)
    send, recv = torch.ones(n, dtype=torch.uint8, device=device), torch.empty(n, dtype=torch.uint8, device=device)
    tiny_s, tiny_r = send[:4].clone(), recv[:4].clone()
    gathered = torch.empty(n * P, dtype=torch.uint8, device=device)

    def shift(a, b):
        ops = [dist.P2POp(dist.isend, a, nxt, group), dist.P2POp(dist.irecv, b, prv, group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    times = torch.tensor([median_seconds(lambda: shift(send, recv), sync, reps),
                          median_seconds(lambda: dist.all_gather_into_tensor(gathered, send, group=group), sync, reps),
                          median_seconds(lambda: dist.all_to_all_single(recv, send, group=group), sync, reps),
                          median_seconds(lambda: shift(tiny_s, tiny_r), sync, reps)], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    ring_s, gather_s, a2a_s, lat_s = times.tolist()
    return {"link_gbytes_s": n / ring_s / 1e9, "allgather_gbytes_s": n * (P - 1) / gather_s / 1e9,
            "alltoall_gbytes_s": n * (P - 1) / P / a2a_s / 1e9, "step_latency_us": lat_s * 1e6}
