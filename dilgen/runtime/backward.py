"""Backward launches (dq, dk, dv) for a generated module's BACKWARD_KERNELS.

Three kernel families, emitted by templates/attention_bwd.py.jinja:
  preprocess  Delta = rowsum(dO * O) - dlse            (B, H, N) float32
  dkdv_fused  when the plan allows (plan["fused_dkdv"]): one launch over key tiles of the
              query lattice computes every branch's dK, dV and writes them once in k's
              dtype (no float32 buffers)
  dkdv        otherwise one launch per branch (constexpr BRANCH), key-major in its lanes;
              each launch adds its branch's dK, dV (summed over the query heads of the
              kv group, in float32) into dk, dv in k's dtype, so keys kept by several
              branches get the sum, in a fixed order (deterministic, no atomics)
  dq          the forward's query tiling, all branches in one program; writes every row
"""
from __future__ import annotations

import math

import torch

from .curve_rows import copy_rows, lane_key_args, uses_curve_rows
from .grids import lane_grid, lane_launch_grid, lane_order, lattice_group_tiles
from .interpreter import interpreting
from .launch import ensure_descriptor_allocator, poison
from .tables import row_order_tensors
from .varlen import packed_tables


def backward_inputs(out, lse, grad_out, grad_lse):
    """(grad_out, lse, delta, dlse, has_dlse) as the kernels take them: grad_out zeros
    when None and contiguous in head_dim; lse contiguous, so Lse, Delta and dlse share
    the (B, H, rows) strides; delta an empty float32 buffer for the preprocess kernel;
    dlse float32 (delta itself, unused, when there is no lse gradient)."""
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    lse = lse.contiguous()
    has_dlse = grad_lse is not None
    delta = torch.empty(lse.shape, dtype=torch.float32, device=lse.device)
    if has_dlse:
        dlse = grad_lse.to(torch.float32).contiguous()
        # rows with lse = -inf have P = 0 whatever their gradient; keep NaN/inf out of Delta
        dlse = torch.where(torch.isfinite(lse), dlse, torch.zeros_like(dlse))
    else:
        dlse = delta
    return grad_out, lse, delta, dlse, has_dlse


def backward_raw(attn, q, k, v, out, lse, grad_out, grad_lse, packing=None):
    """Return (dq, dk, dv) for one forward call; grad_lse may be None. With a `packing`
    (dilgen.runtime.varlen.Packing) q, k, v are rows (total, heads, D) of several sequences,
    lse is (H, total), and every kernel runs with VARLEN."""
    row_order = attn.plan.get("row_order")
    if row_order is not None and packing is None:   # curve-ordered rows (tables.row_order_tensors)
        fwd, inv = row_order_tensors(row_order, q.shape[1], q.device)
        rows = lambda x: None if x is None else x.index_select(1, fwd)
        values = lambda x: None if x is None else x.index_select(2, fwd)
        grads = _backward(attn, rows(q), rows(k), rows(v), rows(out), values(lse), rows(grad_out),
                          values(grad_lse), None)
        return tuple(g.index_select(1, inv) for g in grads)
    return _backward(attn, q, k, v, out, lse, grad_out, grad_lse, packing)


def _backward(attn, q, k, v, out, lse, grad_out, grad_lse, packing):
    kernels = attn.backward_kernels
    conf = kernels["config"]
    plan = attn.plan
    dev = q.device
    interpret = dev.type == "cpu"
    # kept on the device by the module: a tensor made from a host list here would be a
    # blocking copy, which waits for the forward and leaves the GPU idle while the
    # backward's launches are queued
    class_order = attn._class_order(dev)
    H = plan["num_heads"]
    Hkv = plan["num_kv_heads"]
    group = H // Hkv
    grad_out, lse, delta, dlse, has_dlse = backward_inputs(out, lse, grad_out, grad_lse)
    if packing is None:
        B, N = q.shape[0], q.shape[1]
        rows = N       # positions per batch element for the preprocess
        _, tables = attn._launch_tensors(N, dev)
        groups, varlen, covers_all = [((class_order, class_order), B, N)], False, True
        q_strides = (q.stride(0), q.stride(1), q.stride(2))
        k_strides = (k.stride(0), k.stride(1), k.stride(2))
        v_strides = (v.stride(0), v.stride(1), v.stride(2))
        do_strides = (grad_out.stride(0), grad_out.stride(1), grad_out.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
        o_strides = (out.stride(0), out.stride(1), out.stride(2))
        pre_b = B
    else:   # program b is sequence b: it moves the row pointers itself, batch strides are 0
        B, N = packing.num_seqs, packing.max_len
        rows = q.shape[0]
        tables = packed_tables(plan, packing, rows, dev)
        groups = [((st, ln), int(st.numel()), n) for st, ln, n in packing.groups(H)]
        varlen, covers_all = True, packing.covers_all
        q_strides = (0, q.stride(0), q.stride(1))
        k_strides = (0, k.stride(0), k.stride(1))
        v_strides = (0, v.stride(0), v.stride(1))
        do_strides = (0, grad_out.stride(0), grad_out.stride(1))
        l_strides = (0, lse.stride(0))
        o_strides = (0, out.stride(0), out.stride(1))
        pre_b = 1      # the preprocess sees every row as one batch element: it needs no sequences

    lanes = lane_order(plan)
    has_fused_q = any(not br["lanes"] for br in plan["branches"])
    fused = conf.get("fused_dkdv", False)
    # dK, dV: the fused launch covers the fused kernel's branches; per-branch launches the rest
    per_branch = ([br for br in plan["branches"] if br["membership"] == "row"] if fused
                  else plan["branches"])
    dq_writes_all = covers_all and (has_fused_q or (lanes and plan["branches"][lanes[0]]["r"] == 1))
    # otherwise the first dq lane launch writes 0 into the rows its branch does not keep
    # (Plan.gap_lane), and the first per-branch dK, dV launch writes (Plan.dkdv_first_writes):
    # no zero fills, except with padding rows between sequences
    dq_clears = covers_all and plan.get("gap_lane") is not None
    dkdv_clears = covers_all and plan.get("dkdv_first_writes", False)
    # Launches that add into a gradient (lane dq after the fused dq or another lane branch,
    # per-branch dK, dV) read-add-write it in the inputs' dtype: each adds a float32 partial
    # sum rounded once, and the <= 5 roundings of a row stay far inside SPEC's gradient bounds
    # (bf16 rel 4e-2), while float32 buffers cost a zero fill of twice the bytes and a
    # conversion pass (D causal, H200: 0.9 of 2.9 ms fwd+bwd).
    dq = torch.empty(q.shape, dtype=q.dtype, device=dev)
    poison(dq, delta)
    if not (dq_writes_all or dq_clears):
        dq.zero_()              # no launch writes every row of dq
    # the fused launch writes every row (lane branches add to it), or the first per-branch launch does
    dkdv_writes_all = (fused and covers_all) or dkdv_clears
    if dkdv_writes_all:
        dk = torch.empty(k.shape, dtype=k.dtype, device=dev)
        dv = torch.empty(v.shape, dtype=v.dtype, device=dev)
    else:       # per-branch launches add into zeroed buffers (and padding rows stay 0)
        dk = torch.zeros(k.shape, dtype=k.dtype, device=dev)
        dv = torch.zeros(v.shape, dtype=v.dtype, device=dev)
    if dkdv_writes_all:
        poison(dk, dv)
    if B == 0 or N == 0:
        return dq, dk, dv
    lattice = plan["query"]["lattice"]

    curve_kernel = attn.curve_kernel is not None
    launch = {name: ({} if interpret else dict(opts)) for name, opts in conf["launch"].items()}
    pre = attn._kernel(interpret, source_fn=kernels["preprocess"])
    dkdv = attn._kernel(interpret, source_fn=kernels["dkdv"])
    dqk = attn._kernel(interpret, source_fn=kernels["dq"])
    dk_strides = (0 if varlen else dk.stride(0), dk.stride(-3), dk.stride(-2))
    dq_strides = (0 if varlen else dq.stride(0), dq.stride(-3), dq.stride(-2))

    def launches():
        pre[(math.ceil(rows / conf["pre_block"]), pre_b * H)](
            out, grad_out, dlse, delta, rows, *o_strides, *do_strides, *l_strides,
            has_dlse, **launch["preprocess"])
        kv_bn = conf["kv_block_n"]
        for seqs, B, N in groups:   # packed batches: one group per length class
            if fused:
                n_kt = math.ceil(math.ceil(N / lattice) / kv_bn)
                group_kt = lattice_group_tiles(plan, n_kt, kv_bn, 2 * (H // Hkv) * q.shape[-1] * q.element_size())
                dkdv_fused = attn._kernel(interpret, source_fn=kernels["dkdv_fused"])
                dkdv_fused[(lattice * n_kt, B * Hkv)](
                    q, k, v, grad_out, dk, dv, lse, delta,
                    N, n_kt, group_kt, *seqs, *q_strides, *k_strides, *v_strides, *do_strides,
                    *dk_strides, *l_strides,
                    interpret, varlen, **launch["dkdv_fused"])
            accumulate, clear = not dkdv_clears, dkdv_clears
            for br in per_branch:
                w, r = br["w"], br["r"]
                n_seg = math.ceil(N / w)
                n_o = min(group, r)
                n_jt = math.ceil(math.ceil(min(w, N) / r) / kv_bn)
                copies, flag = (), ()
                if curve_kernel:    # the plan has curve_rows branches
                    curve = uses_curve_rows(plan, br["index"], packing)
                    copies = ((*copy_rows(attn, interpret, br, tables, q, grad_out, heads=H, group=1),
                               *copy_rows(attn, interpret, br, tables, lse, delta, heads=H, group=1,
                                          positions_last=True))
                              if curve else (q, grad_out, lse, delta))
                    if plan["causal"]:      # query block lists of a curve's causal mask, per key tile
                        copies += (attn._block_lists(br, N, (kv_bn, conf["kv_block_m"]), dev, keys_listed=False)
                                   if curve else (class_order, class_order))
                    flag = (curve,)
                dkdv[(n_seg * n_o * n_jt, B * Hkv)](
                    q, k, v, grad_out, dk, dv, lse, delta, *copies, *tables,
                    N, n_jt, *seqs, *q_strides, *k_strides, *v_strides, *do_strides,
                    *dk_strides, *l_strides,
                    interpret, br["index"], accumulate, clear, varlen, *flag, **launch["dkdv"])
                accumulate, clear = True, False
            if has_fused_q:
                bm = conf["dq_block_m"]
                num_m_tiles = math.ceil(math.ceil(N / lattice) / bm)
                group_tiles = lattice_group_tiles(plan, num_m_tiles, bm, 2 * k.shape[-1] * k.element_size())
                dqk[(lattice * num_m_tiles, B * H)](
                    q, k, v, grad_out, dq, lse, delta, class_order, *tables,
                    N, num_m_tiles, group_tiles, *seqs, *q_strides, *k_strides, *v_strides, *do_strides,
                    *dq_strides, *l_strides,
                    interpret, varlen, **launch["dq"])
            accumulate, clear = has_fused_q or not (dq_writes_all or dq_clears), dq_clears
            for i in lanes:
                br = plan["branches"][i]
                n_seg, n_tiles = lane_grid(br, N, conf["lane_dq_block_m"])
                dq_lanes = attn._kernel(interpret, source_fn=kernels["dq_lanes"])
                kv, flag = (), ()
                if curve_kernel:    # the plan has curve_rows branches
                    kv, flag = lane_key_args(attn, interpret, br, tables, k, v, packing,
                                             plan["config"]["lane_dq"], class_order)
                dq_lanes[lane_launch_grid(plan, B * H, n_seg, n_tiles, varlen)](
                    q, k, v, *kv, grad_out, dq, lse, delta, *tables,
                    N, n_tiles, *seqs, *q_strides, *k_strides, *v_strides, *do_strides,
                    *dq_strides, *l_strides,
                    interpret, i, accumulate, clear, varlen, *flag, **launch["dq_lanes"])
                accumulate, clear = True, False

    if interpret:
        with interpreting():
            launches()
    else:
        if (plan["config"].get("lane_dq_tma") and lanes) or plan["config"].get("bwd_tma"):
            ensure_descriptor_allocator()
        launches()
    attn.launches += 1
    return dq, dk, dv
