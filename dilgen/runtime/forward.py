"""The forward launches of a generated module (SPEC §2): the fused kernel over the
query lattice (every branch that is not a lane branch, LongNet Eq. 10's merge in one
online softmax) and one lane-kernel launch per lane branch, merging into (out, lse).

Called with the GeneratedAttention whose kernels and device tables it launches."""
from __future__ import annotations

import math

import torch

from .checks import check_inputs, check_zero_pad
from .curve_rows import lane_key_args
from .gluon_launch import gluon_lanes_launch, gluon_launch
from .gluon_packed import gluon_lanes_packed_launch, gluon_packed_launch, one_sequence_launches
from .grids import lane_grid, lane_launch_grid, lane_order, lattice_group_tiles
from .launch import ensure_descriptor_allocator, poison, run_launches
from .replay import Recorder, enabled, keep, lookup, recording_into, signature, split_dropout
from .tables import row_order_tensors
from .varlen import packed_tables


def forward_raw(attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                packing=None, dropout: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward launch without autograd: (out, lse). With a `packing`
    (dilgen.runtime.varlen.Packing), q, k, v are rows (total, heads, D) holding several
    sequences, out is (total, H, D) and lse (H, total); every kernel runs with VARLEN.
    dropout: a dropout plan's (seed, drop_cut, drop_scale) (runtime.dropout_call)."""
    row_order = attn.plan.get("row_order")
    if row_order is not None and packing is None:   # curve-ordered rows (row_order_tensors)
        check_inputs(attn.spec, q, k, v)
        fwd, inv = row_order_tensors(row_order, q.shape[1], q.device)
        out, lse = _forward(attn, *(x.index_select(1, fwd) for x in (q, k, v)), None, dropout)
        return out.index_select(1, inv), lse.index_select(2, inv)
    return _forward(attn, q, k, v, packing, dropout)


def _forward(attn, q, k, v, packing, dropout=()) -> tuple[torch.Tensor, torch.Tensor]:
    plan, cfg = attn.plan, attn.plan["config"]
    H = plan["num_heads"]
    record, groups, seq_slots = False, None, ()
    if packing is not None:   # launch groups of sequences: their starts and lengths are slots
        groups = packing.groups(H)
        seq_slots = tuple(t for st, ln, _ in groups for t in (st, ln))
    drop_slots, drop_key = split_dropout(dropout)
    if q.device.type == "cuda" and enabled():
        # a call like an earlier one launches what it launched (a packing: the same groups;
        # dropout: the same p, the seed a slot)
        key = signature("fwd", (q, k, v, *drop_slots), drop_key) if packing is None else \
            signature("vfwd", (q, k, v, *seq_slots, *drop_slots),
                      (packing.buckets, packing.max_len, packing.covers_all, drop_key))
        recipe, record = lookup(attn, key)
        if recipe is not None:
            return replay_forward(attn, recipe, q, k, v, seq_slots if packing is not None else None, drop_slots)
    interpret = q.device.type == "cpu"
    if packing is None:
        B, N = check_inputs(attn.spec, q, k, v)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
        class_order, tables = attn._launch_tensors(N, q.device)
        strides = (q.stride(0), q.stride(1), q.stride(2),
                   k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2),
                   out.stride(0), out.stride(1), out.stride(2),
                   lse.stride(0), lse.stride(1))
        groups, varlen, covers_all = [((class_order, class_order), B, N)], False, True
    else:   # program b is sequence b: it moves the row pointers itself, batch strides are 0
        B, N = packing.num_seqs, packing.max_len
        class_order = attn._class_order(q.device)
        out = torch.empty((q.shape[0], H, q.shape[2]), dtype=q.dtype, device=q.device)
        lse = torch.empty((H, q.shape[0]), dtype=torch.float32, device=q.device)
        tables = packed_tables(plan, packing, q.shape[0], q.device)
        strides = (0, q.stride(0), q.stride(1), 0, k.stride(0), k.stride(1),
                   0, v.stride(0), v.stride(1), 0, out.stride(0), out.stride(1), 0, lse.stride(0))
        groups = [((st, ln), int(st.numel()), n) for st, ln, n in groups]
        varlen, covers_all = True, packing.covers_all
    check_zero_pad(attn.spec, N)
    poison(out, lse)
    lanes = lane_order(plan)
    fused = any(not br["lanes"] for br in plan["branches"])
    # the fused kernel, or a first r = 1 lane branch, writes every row of every sequence;
    # otherwise the first lane launch also writes "no branch" (0, -inf) into the rows its
    # branch does not keep (Plan.gap_lane); with padding rows between sequences, fill first
    writes_all = covers_all and (fused or (lanes and plan["branches"][lanes[0]]["r"] == 1))
    clears = covers_all and plan.get("gap_lane") is not None
    if not (writes_all or clears):
        out.zero_()
        lse.fill_(float("-inf"))
    if B == 0 or N == 0:
        return out, lse
    launches, recorder = [], Recorder() if record else None
    with recording_into(recorder):      # copies of curve-ordered rows launch as they are made
        _launch_list(attn, launches, groups, q, k, v, out, lse, class_order, tables, strides,
                     packing, interpret, writes_all, clears, varlen, dropout)
    # device-side tensor descriptors: the `tl` TMA kernels', the Gluon packed kernels' partial
    # blocks (the packed lanes also run a fixed-length call's branches with r not dividing w)
    packed_gluon = [] if interpret else [g for g in (attn.gluon_packed_kernel if varlen else None,
                                                     attn.gluon_lanes_packed_kernel) if g is not None]
    allocator = not interpret and bool((cfg.get("lane_tma") and lanes) or cfg.get("fused_tma")
                                       or any(x[0] is g for x in launches for g in packed_gluon))
    if allocator:
        ensure_descriptor_allocator()
    if record:
        for kernel, grid, args, opts in launches:
            recorder.launch(kernel, grid, args, opts)
        recipe = recorder.recipe((q, k, v, out, lse, *seq_slots, *drop_slots), attn, allocator)
        if recipe is not None:
            recipe.fill = not (writes_all or clears)
        keep(attn, key, recipe)
    else:
        run_launches(launches, interpret)
    attn.launches += 1
    return out, lse


def _launch_list(attn, launches, groups, q, k, v, out, lse, class_order, tables, strides,
                 packing, interpret, writes_all, clears, varlen, dropout=()) -> None:
    """The forward's launches (kernel, grid, args, options) into `launches`: the fused kernel
    and one lane launch per lane branch, per launch group."""
    plan, cfg = attn.plan, attn.plan["config"]
    H, lattice = plan["num_heads"], plan["query"]["lattice"]
    lanes = lane_order(plan)
    fused = any(not br["lanes"] for br in plan["branches"])
    for seqs, B, N in groups:   # packed batches: one group per length class of sequences
        if interpret:
            gluon = None
        elif varlen:
            gluon = gluon_packed_launch(attn, q, k, v, out, lse, seqs, B, N, dropout)
        else:
            gluon = gluon_launch(attn, q, k, v, out, lse, B, N, dropout)
        if gluon is not None:       # the same work as the fused kernel, in Gluon (sm90)
            launches.append(gluon)
        elif fused:   # every branch that is not a lane branch
            num_m_tiles = math.ceil(math.ceil(N / lattice) / cfg["block_m"])
            group_tiles = lattice_group_tiles(plan, num_m_tiles, cfg["block_m"], 2 * k.shape[-1] * k.element_size())
            launches.append((attn._kernel(interpret), (lattice * num_m_tiles, B * H),
                             (q, k, v, out, lse, class_order, *tables, N, num_m_tiles, group_tiles, *seqs,
                              *strides, interpret, varlen, *dropout),
                             {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}))
        accumulate, clear = fused or not (writes_all or clears), clears
        for i in lanes:
            br = plan["branches"][i]
            if interpret:
                gluon = []
            elif varlen:
                gluon = [gluon_lanes_packed_launch(attn, q, k, v, out, lse, seqs, B, N, br, accumulate, clear, dropout)]
            else:
                gluon = [gluon_lanes_launch(attn, q, k, v, out, lse, B, N, br, accumulate, clear, dropout)]
                if gluon[0] is None:    # r not dividing w: the packed lanes, a sequence per batch item
                    gluon = one_sequence_launches(gluon_lanes_packed_launch, attn, B, N, br, q, k, v, out, lse,
                                                  tail=(accumulate, clear, dropout))
            if gluon and gluon[0] is not None:   # the same work as the lane kernel, in Gluon (sm90)
                launches.extend(gluon)
                accumulate, clear = True, False
                continue
            n_seg, n_tiles = lane_grid(br, N, cfg["lane_fwd"][0])
            kv, flag = (), ()
            if attn.curve_kernel is not None:   # the plan has curve_rows branches
                kv, flag = lane_key_args(attn, interpret, br, tables, k, v, packing,
                                         cfg["lane_fwd"], class_order)
            launches.append((attn._kernel(interpret, source_fn=attn.lane_kernel),
                             lane_launch_grid(plan, B * H, n_seg, n_tiles, varlen),
                             (q, k, v, *kv, out, lse, *tables, N, n_tiles, *seqs,
                              *strides, interpret, i, accumulate, clear, varlen, *flag, *dropout),
                             {"num_warps": cfg["lane_fwd"][2], "num_stages": cfg["lane_fwd"][3]}))
            accumulate, clear = True, False


def replay_forward(attn, recipe, q, k, v, seqs=None, drop_slots=()) -> tuple[torch.Tensor, torch.Tensor]:
    """_forward's outputs and launches for a call whose signature was recorded; `seqs`: a
    packed call's group tensors (starts, lengths of each launch group), its rows' outputs
    (rows, H, D) and lse (H, rows); `drop_slots`: a dropout call's seed and streams."""
    H = attn.plan["num_heads"]
    if seqs is None:
        B, N = q.shape[0], q.shape[1]
        out = torch.empty((B, N, H, q.shape[3]), dtype=q.dtype, device=q.device)
        lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    else:
        out = torch.empty((q.shape[0], H, q.shape[2]), dtype=q.dtype, device=q.device)
        lse = torch.empty((H, q.shape[0]), dtype=torch.float32, device=q.device)
    poison(out, lse)
    if recipe.fill:
        out.zero_()
        lse.fill_(float("-inf"))
    recipe.run((q, k, v, out, lse, *(seqs or ()), *drop_slots))
    attn.launches += 1
    return out, lse
