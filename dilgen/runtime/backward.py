"""Backward launches (dq, dk, dv) for a generated module's BACKWARD_KERNELS.

Three kernel families, emitted by templates/attention_bwd.py.jinja:
  preprocess  Delta = rowsum(dO * O) - dlse            (B, H, N) float32
  dkdv_fused  when the plan allows (plan["fused_dkdv"]): one launch over key tiles of the
              query lattice computes every branch's dK, dV and writes them once in k's
              dtype (no float32 buffers); on sm90 its Gluon twin where the plan has one
              (templates/gluon_bwd.py.jinja, gluon_launch.gluon_dkdv_launch)
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
from .gluon_launch import (gluon_dkdv_dq_taken, gluon_dkdv_launch, gluon_dkdv_lanes_launch, gluon_dq_launch,
                           gluon_dq_lanes_launch)
from .gluon_packed import (gluon_dkdv_lanes_packed_launch, gluon_dkdv_packed_launch, gluon_dq_lanes_packed_launch,
                           gluon_dq_packed_launch, one_sequence_launches)
from .grids import dkdv_per_branch, lane_grid, lane_launch_grid, lane_order, lattice_group_tiles
from .interpreter import interpreting
from .launch import ensure_descriptor_allocator, poison
from .replay import Recorder, enabled, keep, lookup, recording_into, signature, split_dropout
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


def backward_raw(attn, q, k, v, out, lse, grad_out, grad_lse, packing=None, dropout: tuple = ()):
    """Return (dq, dk, dv) for one forward call; grad_lse may be None. With a `packing`
    (dilgen.runtime.varlen.Packing) q, k, v are rows (total, heads, D) of several sequences,
    lse is (H, total), and every kernel runs with VARLEN. dropout: the forward's (seed,
    drop_cut, drop_scale) (a dropout plan: the kernels draw the forward's mask again)."""
    row_order = attn.plan.get("row_order")
    if row_order is not None and packing is None:   # curve-ordered rows (tables.row_order_tensors)
        fwd, inv = row_order_tensors(row_order, q.shape[1], q.device)
        rows = lambda x: None if x is None else x.index_select(1, fwd)
        values = lambda x: None if x is None else x.index_select(2, fwd)
        grads = _backward(attn, rows(q), rows(k), rows(v), rows(out), values(lse), rows(grad_out),
                          values(grad_lse), None, dropout)
        return tuple(g.index_select(1, inv) for g in grads)
    return _backward(attn, q, k, v, out, lse, grad_out, grad_lse, packing, dropout)


class _Rows:
    """Where a backward's rows are: (B, N) and the strides the kernels take; for a packing,
    program b is sequence b (it moves the row pointers itself, batch strides are 0)."""

    def __init__(self, attn, q, k, v, out, lse, grad_out, packing, class_order, groups=None):
        plan, dev = attn.plan, q.device
        fixed = packing is None
        lead = (lambda t: (t.stride(0), t.stride(1), t.stride(2))) if fixed else \
               (lambda t: (0, t.stride(0), t.stride(1)))
        self.q, self.k, self.v, self.do, self.o = (lead(t) for t in (q, k, v, grad_out, out))
        self.l = (lse.stride(0), lse.stride(1)) if fixed else (0, lse.stride(0))
        self.varlen = not fixed
        if fixed:
            self.B, self.N = q.shape[0], q.shape[1]
            self.rows = self.N         # positions per batch element for the preprocess
            self.tables = attn._launch_tensors(self.N, dev)[1]
            self.groups = [((class_order, class_order), self.B, self.N)]
            self.covers_all, self.pre_b = True, self.B
        else:
            self.B, self.N = packing.num_seqs, packing.max_len
            self.rows = q.shape[0]
            self.tables = packed_tables(plan, packing, self.rows, dev)
            self.groups = [((st, ln), int(st.numel()), n) for st, ln, n in groups]
            # the preprocess sees every row as one batch element: it needs no sequences
            self.covers_all, self.pre_b = packing.covers_all, 1


def _backward(attn, q, k, v, out, lse, grad_out, grad_lse, packing, dropout=()):
    plan, conf = attn.plan, attn.backward_kernels["config"]
    # kept on the device by the module: a tensor made from a host list here would be a
    # blocking copy, which waits for the forward and leaves the GPU idle while the
    # backward's launches are queued
    class_order = attn._class_order(q.device)
    grad_out, lse, delta, dlse, has_dlse = backward_inputs(out, lse, grad_out, grad_lse)
    covers_all = packing is None or packing.covers_all
    # a plan whose Gluon dK/dV adds dQ (KernelConfig.gluon_dkdv_dq): every branch's launch
    # adds into zeroed dk, dv and, by reductions, a float32 dQ; no dq kernel runs
    dq32 = (torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            if packing is None and gluon_dkdv_dq_taken(attn, q, k, v, grad_out, q.shape[-3]) else None)
    lanes = lane_order(plan)
    has_fused_q = any(not br["lanes"] for br in plan["branches"])
    dq_writes_all = covers_all and (has_fused_q or (lanes and plan["branches"][lanes[0]]["r"] == 1))
    # otherwise the first dq lane launch writes 0 into the rows its branch does not keep
    # (Plan.gap_lane), and the first per-branch dK, dV launch writes (Plan.dkdv_first_writes):
    # no zero fills, except with padding rows between sequences
    dq_clears = covers_all and plan.get("gap_lane") is not None
    dkdv_clears = covers_all and plan.get("dkdv_first_writes", False) and dq32 is None
    # Launches that add into a gradient (lane dq after the fused dq or another lane branch,
    # per-branch dK, dV) read-add-write it in the inputs' dtype: each adds a float32 partial
    # sum rounded once, and the <= 5 roundings of a row stay far inside SPEC's gradient bounds
    # (bf16 rel 4e-2), while float32 buffers cost a zero fill of twice the bytes and a
    # conversion pass (D causal, H200: 0.9 of 2.9 ms fwd+bwd).
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    poison(dq, delta)
    if dq32 is None and not (dq_writes_all or dq_clears):
        dq.zero_()              # no launch writes every row of dq
    # the fused launch writes every row (lane branches add to it), or the first per-branch launch does
    dkdv_writes_all = (conf.get("fused_dkdv", False) and covers_all) or dkdv_clears
    make = torch.empty if dkdv_writes_all else torch.zeros   # per-branch launches add into zeros
    dk = make(k.shape, dtype=k.dtype, device=q.device)
    dv = make(v.shape, dtype=v.dtype, device=q.device)
    if dkdv_writes_all:
        poison(dk, dv)
    groups = None if packing is None else packing.groups(plan["num_heads"])
    seq_slots = () if packing is None else tuple(t for st, ln, _ in groups for t in (st, ln))
    drop_slots, drop_key = split_dropout(dropout)
    slots = (q, k, v, out, lse, grad_out, delta, dlse, dq, dk, dv, *seq_slots, *drop_slots)
    record = False
    if q.device.type == "cuda" and enabled() and dq32 is None:   # dq32: a conversion no recipe keeps
        # a call like an earlier one: its launches (a packing: the same launch groups; dropout:
        # the same p, the forward's seed a slot)
        key = signature("bwd", (*slots[:6], *drop_slots), (has_dlse, drop_key)) if packing is None else \
            signature("vbwd", (*slots[:6], *seq_slots, *drop_slots),
                      (has_dlse, packing.buckets, packing.max_len, packing.covers_all, drop_key))
        recipe, record = lookup(attn, key)
        if recipe is not None:
            recipe.run(slots)
            attn.launches += 1
            return dq, dk, dv
    at = _Rows(attn, q, k, v, out, lse, grad_out, packing, class_order, groups)
    if at.B == 0 or at.N == 0:
        return dq, dk, dv
    recorder = Recorder() if record else None
    run = _Launches(attn, at, class_order, packing, (q, k, v, grad_out, lse, delta), dq, dk, recorder, dropout, dq32)

    def launches():
        run.preprocess(out, dlse, has_dlse)
        for seqs, B, N in at.groups:   # packed batches: one group per length class
            run.dkdv(seqs, B, N, dk, dv, dkdv_clears)
            if dq32 is None:
                run.dq(seqs, B, N, dq, has_fused_q, lanes,
                       accumulate=has_fused_q or not (dq_writes_all or dq_clears), clear=dq_clears)
        if dq32 is not None:
            dq.copy_(dq32)

    # device-side tensor descriptors: the `tl` TMA kernels', the Gluon packed kernels' partial blocks
    # (the packed lanes also run a fixed-length call's branches with r not dividing w)
    packed_gluon = (attn.gluon_dq_packed_fn, attn.gluon_dkdv_packed_fn) if packing is not None else ()
    allocator = bool((plan["config"].get("lane_dq_tma") and lanes) or plan["config"].get("bwd_tma")
                     or any(fn is not None for fn in (*packed_gluon, attn.gluon_dkdv_lanes_packed_fn,
                                                      attn.gluon_dq_lanes_packed_fn)))
    if run.interpret:
        with interpreting():
            launches()
    else:
        if allocator:
            ensure_descriptor_allocator()
        with recording_into(recorder):     # copies of curve-ordered rows are recorded too
            launches()
    if recorder is not None:
        keep(attn, key, recorder.recipe(slots, attn, allocator))
    attn.launches += 1
    return dq, dk, dv


class _Launches:
    """The backward's launches for one call: the preprocess, dK/dV (fused and per branch),
    dq (fused and per lane branch), with the call's tensors, strides and tables."""

    def __init__(self, attn, at: _Rows, class_order, packing, tensors, dq, dk, recorder=None, dropout=(), dq32=None):
        self.attn, self.at, self.class_order, self.packing = attn, at, class_order, packing
        self.dropout = dropout         # a dropout plan's (seed, drop_cut, drop_scale): dkdv, dq
        self.dq32 = dq32               # the float32 dQ the Gluon dK/dV adds into (gluon_dkdv_dq), or None
        self.recorder = recorder       # replay.Recorder: launches noted for a replay
        self.plan, self.kernels = attn.plan, attn.backward_kernels
        self.conf = self.kernels["config"]
        self.q, self.k, self.v, self.grad_out, self.lse, self.delta = tensors
        self.interpret = self.q.device.type == "cpu"
        self.launch = {name: ({} if self.interpret else dict(opts))
                       for name, opts in self.conf["launch"].items()}
        self.H, self.Hkv = self.plan["num_heads"], self.plan["num_kv_heads"]
        self.lattice = self.plan["query"]["lattice"]
        self.dk_strides = (0 if at.varlen else dk.stride(0), dk.stride(-3), dk.stride(-2))
        self.dq_strides = (0 if at.varlen else dq.stride(0), dq.stride(-3), dq.stride(-2))
        self.common = (*at.q, *at.k, *at.v, *at.do)          # q, k, v, dO strides

    def _launch(self, name: str, grid, *args) -> None:
        kernel = self.attn._kernel(self.interpret, source_fn=self.kernels[name])
        self._run(kernel, grid, args, self.launch[name])

    def _run(self, kernel, grid, args: tuple, options: dict) -> None:
        if self.recorder is not None:
            self.recorder.launch(kernel, grid, args, options)
        else:
            kernel[grid](*args, **options)

    def preprocess(self, out, dlse, has_dlse) -> None:
        """Delta at the rows a branch keeps (Plan.delta_step, fixed-length calls), else every row."""
        at = self.at
        step = 1 if at.varlen else self.conf.get("delta_step", 1)
        self._launch("preprocess", (math.ceil(math.ceil(at.rows / step) / self.conf["pre_block"]), at.pre_b * self.H),
            out, self.grad_out, dlse, self.delta, at.rows, *at.o, *at.do, *at.l,
            has_dlse, step)

    def dkdv(self, seqs, B: int, N: int, dk, dv, clears: bool) -> None:
        """The fused launch covers the fused kernel's branches; per-branch launches the rest
        (every branch without the fused launch)."""
        plan, conf, at, kv_bn = self.plan, self.conf, self.at, self.conf["kv_block_n"]
        q, k, v, grad_out, lse, delta = self.q, self.k, self.v, self.grad_out, self.lse, self.delta
        fused = conf.get("fused_dkdv", False)
        if self.interpret or not fused:
            gluon = None
        elif at.varlen:
            gluon = None if self.dropout else \
                gluon_dkdv_packed_launch(self.attn, q, k, v, grad_out, lse, delta, dk, dv, seqs, B, N)
        else:
            gluon = gluon_dkdv_launch(self.attn, q, k, v, grad_out, lse, delta, dk, dv, B, N)
        if gluon is not None:       # the fused kernel's work, in Gluon (sm90)
            self._run(*gluon)
        elif fused:
            n_kt = math.ceil(math.ceil(N / self.lattice) / kv_bn)
            group_kt = lattice_group_tiles(plan, n_kt, kv_bn, 2 * (self.H // self.Hkv) * q.shape[-1] * q.element_size())
            self._launch("dkdv_fused", (self.lattice * n_kt, B * self.Hkv),
                q, k, v, grad_out, dk, dv, lse, delta,
                N, n_kt, group_kt, *seqs, *self.common, *self.dk_strides, *at.l,
                self.interpret, at.varlen)
        # after the fused launch, the branches it does not cover (grids.dkdv_per_branch)
        per_branch = dkdv_per_branch(plan, fused, gluon is not None)
        accumulate, clear = not clears, clears
        for br in per_branch:
            w, r = br["w"], br["r"]
            if self.interpret:
                gluon = None
            elif at.varlen:
                gluon = gluon_dkdv_lanes_packed_launch(self.attn, q, k, v, grad_out, lse, delta, dk, dv, seqs, B, N, br,
                                                       accumulate, clear, self.dropout)
            else:
                gluon = gluon_dkdv_lanes_launch(self.attn, q, k, v, grad_out, lse, delta, dk, dv, B, N, br, accumulate,
                                                clear, self.dropout, self.dq32)
                if gluon is None and self.dq32 is None:     # r not dividing w: over rows, a sequence per batch item
                    rows = one_sequence_launches(gluon_dkdv_lanes_packed_launch, self.attn, B, N, br, q, k, v,
                                                 grad_out, lse, delta, dk, dv, tail=(accumulate, clear, self.dropout))
                    for launch in rows:
                        self._run(*launch)
                    if rows:
                        accumulate, clear = True, False
                        continue
            if gluon is not None:   # the same work in Gluon (sm90)
                self._run(*gluon)
                accumulate, clear = True, False
                continue
            if self.dq32 is not None:   # gluon_dkdv_dq_taken said every branch runs it: no dQ may go missing
                raise RuntimeError(f"{plan['spec']['name']}: branch {br['index']}'s Gluon dK/dV, which adds its dQ, "
                                   f"was not taken")
            n_seg = math.ceil(N / w)
            n_o = min(self.H // self.Hkv, r)
            n_jt = math.ceil(math.ceil(min(w, N) / r) / kv_bn)
            copies, flag = (), ()
            if self.attn.curve_kernel is not None:    # the plan has curve_rows branches
                curve = uses_curve_rows(plan, br["index"], self.packing)
                copies = ((*copy_rows(self.attn, self.interpret, br, at.tables, q, grad_out, heads=self.H, group=1),
                           *copy_rows(self.attn, self.interpret, br, at.tables, lse, delta, heads=self.H, group=1,
                                      positions_last=True))
                          if curve else (q, grad_out, lse, delta))
                if plan["causal"]:      # query block lists of a curve's causal mask, per key tile
                    copies += (self.attn._block_lists(br, N, (kv_bn, conf["kv_block_m"]), q.device, keys_listed=False)
                               if curve else (self.class_order, self.class_order))
                flag = (curve,)
            self._launch("dkdv", (n_seg * n_o * n_jt, B * self.Hkv),
                q, k, v, grad_out, dk, dv, lse, delta, *copies, *at.tables,
                N, n_jt, *seqs, *self.common, *self.dk_strides, *at.l,
                self.interpret, br["index"], accumulate, clear, at.varlen, *flag, *self.dropout)
            accumulate, clear = True, False

    def dq(self, seqs, B: int, N: int, dq, has_fused_q: bool, lanes, accumulate: bool,
           clear: bool) -> None:
        """The fused dq (the forward's query tiling, every fused branch), then one launch per
        lane branch adding into it."""
        plan, conf, at = self.plan, self.conf, self.at
        q, k, v, grad_out, lse, delta = self.q, self.k, self.v, self.grad_out, self.lse, self.delta
        if self.interpret or not has_fused_q:
            gluon = None
        elif at.varlen:
            gluon = gluon_dq_packed_launch(self.attn, q, k, v, grad_out, lse, delta, dq, seqs, B, N, self.dropout)
        else:
            gluon = gluon_dq_launch(self.attn, q, k, v, grad_out, lse, delta, dq, B, N, self.dropout)
        if gluon is not None:       # the fused dq's work, in Gluon (sm90)
            self._run(*gluon)
        elif has_fused_q:
            bm = conf["dq_block_m"]
            num_m_tiles = math.ceil(math.ceil(N / self.lattice) / bm)
            group_tiles = lattice_group_tiles(plan, num_m_tiles, bm, 2 * k.shape[-1] * k.element_size())
            self._launch("dq", (self.lattice * num_m_tiles, B * self.H),
                q, k, v, grad_out, dq, lse, delta, self.class_order, *at.tables,
                N, num_m_tiles, group_tiles, *seqs, *self.common, *self.dq_strides, *at.l,
                self.interpret, at.varlen, *self.dropout)
        for i in lanes:
            br = plan["branches"][i]
            if self.interpret:
                gluon = None
            elif at.varlen:
                gluon = gluon_dq_lanes_packed_launch(self.attn, q, k, v, grad_out, lse, delta, dq, seqs, B, N, br,
                                                     accumulate, clear, self.dropout)
            else:
                gluon = gluon_dq_lanes_launch(self.attn, q, k, v, grad_out, lse, delta, dq, B, N, br, accumulate, clear,
                                              self.dropout)
                if gluon is None:   # r not dividing w: over rows, a sequence per batch item
                    rows = one_sequence_launches(gluon_dq_lanes_packed_launch, self.attn, B, N, br, q, k, v, grad_out,
                                                 lse, delta, dq, tail=(accumulate, clear, self.dropout))
                    for launch in rows:
                        self._run(*launch)
                    if rows:
                        accumulate, clear = True, False
                        continue
            if gluon is not None:   # the same work in Gluon (sm90)
                self._run(*gluon)
                accumulate, clear = True, False
                continue
            n_seg, n_tiles = lane_grid(br, N, conf["lane_dq_block_m"])
            kv, flag = (), ()
            if self.attn.curve_kernel is not None:    # the plan has curve_rows branches
                kv, flag = lane_key_args(self.attn, self.interpret, br, at.tables, k, v, self.packing,
                                         plan["config"]["lane_dq"], self.class_order)
            self._launch("dq_lanes", lane_launch_grid(plan, B * self.H, n_seg, n_tiles, at.varlen),
                q, k, v, *kv, grad_out, dq, lse, delta, *at.tables,
                N, n_tiles, *seqs, *self.common, *self.dq_strides, *at.l,
                self.interpret, i, accumulate, clear, at.varlen, *flag, *self.dropout)
            accumulate, clear = True, False
