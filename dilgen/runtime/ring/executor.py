"""The ring's forward and backward passes over one RingRun (run.py).

Forward: each window's kernel merges its partial (out, lse) into an fp32 accumulator in
its epilogue: lse = log(e^lse_a + e^lse_b), out = (e^lse_a out_a + e^lse_b out_b) / e^lse
(LongNet Eq. 10 applied to partial key sets). Backward: dQ accumulates locally; the
partial dK, dV of remote keys go back to their owner along the reversed schedule and are
added there in fp32. Each remote step's keys are posted one step ahead, so the transfer
overlaps the kernels of the step before. Each pass runs inside a faults.Guard: a rank that
raises in it makes every rank raise RingAborted, never wait (run.at says where it was)."""
from __future__ import annotations

import math

import torch

from ..backward import backward_inputs
from ..launch import ensure_descriptor_allocator, poison
from .faults import Guard
from .heads import twin_backward, twin_forward
from .hybrid import add_local_grads, local_forward
from .lane_windows import lane_backward, lane_forward, lane_window
from .recut import recut_backward, recut_forward
from .run import RingRun, _uncompact_add


def ring_forward(run: RingRun, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of my rows."""
    with Guard(run, "forward"):
        if run.transport in ("heads", "local"):
            return twin_forward(run, q, k, v)
        if run.transport == "recut":
            return recut_forward(run, q, k, v)
        return _forward(run, q, k, v)


def ring_backward(run: RingRun, q, k, v, out, lse, grad_out, grad_lse):
    """(dq, dk, dv) of my rows; the partial dK, dV of remote keys travel home."""
    with Guard(run, "backward"):
        if run.transport in ("heads", "local"):
            return twin_backward(run, q, k, v, out, lse, grad_out, grad_lse)
        if run.transport == "recut":
            return recut_backward(run, q, k, v, out, lse, grad_out, grad_lse)
        return _backward(run, q, k, v, out, lse, grad_out, grad_lse)


def _forward(run: RingRun, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    attn, plan = run.attn, run.attn.plan
    cfg = plan["config"]
    B, H, n_loc = run.B, run.H, run.n_loc
    dev = q.device
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((B, H, n_loc), dtype=torch.float32, device=dev)
    # Remote windows first (they launch only the classes their branches keep), the local
    # window last: it covers every row, so it writes the output dtype.
    steps = run.sched["steps"][1:] + run.sched["steps"][:1]
    # how many windows write each of my query pieces: the last writes the output dtype
    todo = [0] * len(run.pieces[run.me])
    for st in steps:
        for qi, _, _ in run.launches_of(st):
            todo[qi] += 1
    hybrid = run.transport == "hybrid"
    acc = out if q.dtype == torch.float32 or (max(todo) <= 1 and not hybrid) else torch.empty(
        q.shape, dtype=torch.float32, device=dev)
    poison(out, lse, acc)
    # pieces that several windows write merge from the empty partial, lse = -inf and
    # out = 0 (rows a pruned window skipped are then merged as empty): the merge weighs the
    # accumulator's rows by e^lse = 0, so they hold zeros, not the allocation's leftovers
    # (0 * inf is NaN, and a numpy RuntimeWarning in the interpreter). "hybrid": every window
    # merges onto the local branches' (out, lse), the partial the windows start from.
    merged = [n > 1 or hybrid for n in todo]
    if hybrid:
        local_forward(run, q, k, v, acc, lse)
    for qi, several in enumerate(merged):
        if several and not hybrid:
            lse.narrow(2, run.rows0[qi], run.pieces[run.me][qi][1]).fill_(float("-inf"))
            run.piece(acc, qi).zero_()
    kernel = attn._kernel(run.interpret)
    opts = {} if run.interpret else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if cfg.get("fused_tma") and not run.interpret:
        ensure_descriptor_allocator()
    block_m = cfg["block_m"]

    def compute(step, keys):
        for li, (qi, ki, bits) in enumerate(run.launches_of(step)):
            q_off, n_q = run.pieces[run.me][qi]
            if step["offset"] == 0:
                kk, vv = run.piece(k, ki), run.piece(v, ki)
                k_off, n_k = run.pieces[run.me][ki]
                g = 1
            else:
                kk, vv = keys[ki]
                k_off, n_k, g = run.key_window(step, ki)
            lanes = merged[qi] and lane_window(run, step, bits, q_off, n_q, k_off, n_k, g, dev)
            todo[qi] -= 1
            if lanes:          # one branch's remote window as dense attention on its lanes
                lane_forward(lanes, run.piece(q, qi), kk, vv, run.piece(acc, qi), lse.narrow(2, run.rows0[qi], n_q))
                if todo[qi] == 0 and acc is not out:
                    run.piece(out, qi).copy_(run.piece(acc, qi))
                continue
            dst = run.piece(out if todo[qi] == 0 else acc, qi)
            acc_v, lse_v = run.piece(acc, qi), lse.narrow(2, run.rows0[qi], n_q)
            qv = run.piece(q, qi)
            win = run.window(step, li)
            num_m_tiles = math.ceil(math.ceil(win["n_q"] / run.lattice) / block_m)
            # one group of tiles (class-major): windows keep the order measured on 2 GPUs
            classes = run.classes(bits, full=step["offset"] == 0)
            grid = (classes.numel() * num_m_tiles, win["count"] * H)
            aligned = not run.packed and q_off % (run.lattice * block_m) == 0
            kernel[grid](
                qv, kk, vv, dst, lse_v, classes, *run.tables,
                run.N, num_m_tiles, num_m_tiles, q_off, n_q, k_off, n_k, acc_v, lse_v, *win["args"],
                run.bstride(qv), qv.stride(1), qv.stride(2),
                run.bstride(kk), kk.stride(1), kk.stride(2),
                run.bstride(vv), vv.stride(1), vv.stride(2),
                run.bstride(dst), dst.stride(1), dst.stride(2),
                run.bstride(lse_v), lse_v.stride(1),
                run.interpret, bits, g, merged[qi], aligned, run.packed, *run.drop_args(), **opts)

    if run.transport == "allgather":
        if len(steps) > 1:
            run.at = ("gather", 0, 0)
            run.gather_keys((k, v))
        for i, step in enumerate(steps):
            run.at = ("step", i, step["offset"])
            keys = run.step_keys(step) if step["offset"] else None
            run.run(lambda: compute(step, keys))
        run.gathered = None
        attn.launches += 1
        return out, lse
    pending = run.post_keys(steps[0], (k, v))
    for i, step in enumerate(steps):
        run.at = ("step", i, step["offset"])
        keys = pending.wait() if pending is not None else None
        pending = run.post_keys(steps[i + 1], (k, v)) if i + 1 < len(steps) else None
        run.run(lambda: compute(step, keys))
    attn.launches += 1
    return out, lse


def _backward(run: RingRun, q, k, v, out, lse, grad_out, grad_lse):
    attn, plan = run.attn, run.attn.plan
    kernels = attn.backward_kernels
    conf = kernels["config"]
    B, H, Hkv, n_loc = run.B, run.H, run.Hkv, run.n_loc
    group_size = H // Hkv
    dev = q.device
    grad_out, lse, delta, dlse, has_dlse = backward_inputs(out, lse, grad_out, grad_lse)
    dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=dev) for t in (q, k, v))
    launch = {name: ({} if run.interpret else dict(opts)) for name, opts in conf["launch"].items()}
    pre = attn._kernel(run.interpret, source_fn=kernels["preprocess"])
    dkdv = attn._kernel(run.interpret, source_fn=kernels["dkdv"])
    dqk = attn._kernel(run.interpret, source_fn=kernels["dq"])
    l_strides = (run.bstride(lse), lse.stride(1))
    branches = {br["index"]: br for br in plan["branches"]}
    if plan["config"].get("bwd_tma") and not run.interpret:
        ensure_descriptor_allocator()
    N = run.N

    def preprocess():
        pre[(math.ceil(n_loc / conf["pre_block"]), B * H)](
            out, grad_out, dlse, delta, n_loc,
            out.stride(0), out.stride(1), out.stride(2),
            grad_out.stride(0), grad_out.stride(1), grad_out.stride(2), *l_strides,
            has_dlse, 1, **launch["preprocess"])

    def compute(step, keys):
        """dQ of my queries and partial dK, dV of this step's keys; returns the partial
        buffers to send home (remote steps) or None (local keys, added in place)."""
        partials = None
        if step["offset"]:
            partials = [[torch.zeros_like(kk, dtype=torch.float32),
                         torch.zeros_like(vv, dtype=torch.float32)] for kk, vv in keys]
        for li, (qi, ki, bits) in enumerate(run.launches_of(step)):
            q_off, n_q = run.pieces[run.me][qi]
            win = run.window(step, li)
            if step["offset"] == 0:
                kk, vv = run.piece(k, ki), run.piece(v, ki)
                dkk, dvv = run.piece(dk, ki), run.piece(dv, ki)
                k_off, n_k = run.pieces[run.me][ki]
                g = 1
            else:
                kk, vv = keys[ki]
                dkk, dvv = partials[ki]
                k_off, n_k, g = run.key_window(step, ki)
            qv, dov, dqv = run.piece(q, qi), run.piece(grad_out, qi), run.piece(dq, qi)
            lse_v = lse.narrow(2, run.rows0[qi], n_q)
            delta_v = delta.narrow(2, run.rows0[qi], n_q)
            qs, ks, vs, dos = ((run.bstride(t), t.stride(1), t.stride(2)) for t in (qv, kk, vv, dov))
            if lanes := lane_window(run, step, bits, q_off, n_q, k_off, n_k, g, dev):   # as the forward's
                lane_backward(lanes, qv, kk, vv, run.piece(out, qi), lse_v, dov,
                              dlse.narrow(2, run.rows0[qi], n_q) if has_dlse else None, dqv, dkk, dvv)
                continue
            for idx in range(len(branches)):
                if not bits >> idx & 1:
                    continue
                br = branches[idx]
                n_seg, lanes = run.dkdv_grid(win, br, k_off, n_k)
                n_o = min(group_size, br["r"])
                # dropout: a key tile starts on a span of 32 lanes, up to 31 before the window
                n_jt = math.ceil((lanes + (31 if run.dropout_args else 0)) / conf["kv_block_n"])
                dkdv[(n_seg * n_o * n_jt, win["count"] * Hkv)](
                    qv, kk, vv, dov, dkk, dvv, lse_v, delta_v, *run.tables,
                    N, n_jt, q_off, n_q, k_off, n_k, *win["args"], *qs, *ks, *vs, *dos,
                    run.bstride(dkk), dkk.stride(1), dkk.stride(2), *l_strides,
                    run.interpret, idx, g, run.packed, *run.drop_args(), **launch["dkdv"])
            bm = conf["dq_block_m"]
            num_m_tiles = math.ceil(math.ceil(win["n_q"] / run.lattice) / bm)
            classes = run.classes(bits, full=step["offset"] == 0)
            aligned = not run.packed and q_off % (run.lattice * bm) == 0
            dqk[(classes.numel() * num_m_tiles, win["count"] * H)](
                qv, kk, vv, dov, dqv, lse_v, delta_v, classes, *run.tables,
                N, num_m_tiles, num_m_tiles, q_off, n_q, k_off, n_k, *win["args"], *qs, *ks, *vs, *dos,
                run.bstride(dqv), dqv.stride(1), dqv.stride(2), *l_strides,
                run.interpret, bits, g, True, aligned, run.packed, *run.drop_args(), **launch["dq"])
        return partials

    def settle(exchange):
        if exchange is None:
            return
        for i, g, (pk, pv) in exchange.wait():
            _uncompact_add(run.piece(dk, i), pk, g)
            _uncompact_add(run.piece(dv, i), pv, g)

    run.at = ("preprocess", 0, 0)
    run.run(preprocess)
    if run.transport == "hybrid":             # the local branches' dq, dk, dv from the merged out, lse
        add_local_grads(run, (dq, dk, dv), q, k, v, out, lse, grad_out, grad_lse)
    steps = run.sched["steps"]
    if run.transport == "allgather":
        by_rank = {}
        if len(steps) > 1:
            run.at = ("gather", 0, 0)
            run.gather_keys((k, v))
        for i, step in enumerate(steps):
            run.at = ("step", i, step["offset"])
            keys = run.step_keys(step) if step["offset"] else None
            partials = run.run(lambda: compute(step, keys))
            if partials is not None and step["ranks"][run.me]["launches"]:
                by_rank[(run.me - step["offset"]) % run.P] = partials
        if len(steps) > 1:
            run.at = ("reduce", 0, 0)
            run.scatter_partials(by_rank, dk, dv)
        run.gathered = None
        attn.launches += 1
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    pending = run.post_keys(steps[0], (k, v))
    returning = None
    for i, step in enumerate(steps):
        run.at = ("step", i, step["offset"])
        keys = pending.wait() if pending is not None else None
        pending = run.post_keys(steps[i + 1], (k, v)) if i + 1 < len(steps) else None
        partials = run.run(lambda: compute(step, keys))
        settle(returning)
        returning = run.post_returns(step, partials, k) if step["offset"] else None
    run.at = ("end", 0, 0)
    settle(returning)
    attn.launches += 1
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
