"""The launches of sm90's Gluon kernels over packed rows (runtime.varlen): the forward, dQ and
dK/dV of the lattice branches (templates/gluon_fwd.py.jinja, gluon_dq.py.jinja,
gluon_bwd.py.jinja: their `_packed` kernels) and a causal plan's lanes, per-branch dK/dV and
lane dq (gluon_lanes.py.jinja `_lanes_packed`, gluon_lanes_bwd.py.jinja `_dkdv_lanes_packed`,
`_dq_lanes_packed`), and when a launch group takes them. The lane kernels also run a
fixed-length causal call's branches whose r does not divide w, one sequence per batch item
(one_sequence_launches): a lane that starts anywhere is what they take.

Packed rows take the fixed-length kernels' host descriptors over all the rows (B = 1, N = rows;
runtime.gluon_launch): sequence b's lane starting at row p0 is row p0 // r, column
(p0 mod r)·H + h of a branch's view, whatever b's start. The views hold rows // r rows; a
lane's partial last block, and a block reaching past the views' rows (rows not a multiple of
r), is read, and stored row by row, through a descriptor made in the kernel (common.jinja
gluon_lane_box), which ends at the lane's last row. The lane launches go as the fixed-length ones (gluon_launch.lane_options: with
programmatic dependent launch where the plan says); the lattice launches without it."""
from __future__ import annotations

import torch

from ..gluon_plan import gluon_rows_lane_branch, gluon_rows_lanes_bwd_branch
from .gluon_launch import OPTIONS, _boxes, _sm90, gluon_args, gluon_dkdv_args, gluon_dq_args, lane_options


def _packed_takes(attn, fn, dropout: tuple, *tensors, every: int = 0) -> bool:
    """Whether a launch group of packed rows runs the Gluon kernel `fn`: no dropout, sm90, the
    tensors contiguous and 16-byte aligned, and the rows a multiple of `every` (default the
    lattice L: each branch's view (rows/r, r*H_kv, D) then holds every row; TMA reads zeros
    past its end; the lanes take every = 1: a lane reaching past its view's rows // r rows reads
    and stores there through a box of its own)."""
    q = tensors[0]
    return not (dropout or fn is None or q.shape[0] % (every or attn.plan["query"]["lattice"])
                or q.device.type != "cuda" or not _sm90(q.device)
                or not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors))


def _packed_grid(plan: dict, B: int, N: int, heads: str = "num_heads") -> tuple:
    """(L * tiles of 128 lattice rows of the longest sequence N, B sequences * the plan's
    `heads`: query heads, or kv heads for the dK/dV)."""
    L = plan["query"]["lattice"]
    return L * -(-(-(-N // L)) // 128), B * plan[heads]


def gluon_packed_launch(attn, q, k, v, out, lse, seqs: tuple, B: int, N: int, dropout: tuple = ()):
    """(kernel, grid, args, options) of the Gluon forward over packed rows for one launch group
    (`seqs`: its starts and lengths, B sequences, the longest N), or None when the group takes
    the `tl` kernel (_packed_takes)."""
    if not _packed_takes(attn, attn.gluon_packed_fn, dropout, q, k, v, out):
        return None
    return (attn.gluon_packed_kernel, _packed_grid(attn.plan, B, N),
            gluon_packed_args(attn.plan, q, k, v, out, lse, seqs, q.shape[0]), OPTIONS)


def gluon_packed_args(plan: dict, q, k, v, out, lse, seqs: tuple, rows: int) -> tuple:
    """The packed forward's arguments: the fixed-length forward's descriptors over all the
    rows (gluon_args at B = 1, N = rows), v and out (partial blocks, row-by-row stores), lse,
    the group's starts and lengths, rows."""
    return (*gluon_args(plan, q, k, v, out, lse, 1, rows)[:-2], v, out, lse, *seqs, rows)


def gluon_dq_packed_args(plan: dict, q, k, v, grad_out, lse, delta, dq, seqs: tuple, rows: int) -> tuple:
    """The packed dQ's arguments: gluon_dq_args' descriptors at B = 1, N = rows, k and v,
    lse, Delta, dq, the group's starts and lengths, rows."""
    return (*gluon_dq_args(plan, q, k, v, grad_out, lse, delta, dq, 1, rows)[:-4], k, v, lse, delta, dq, *seqs, rows)


def gluon_dkdv_packed_args(plan: dict, q, k, v, grad_out, lse, delta, dk, dv, seqs: tuple, rows: int) -> tuple:
    """The packed dK/dV's arguments: gluon_dkdv_args' descriptors at B = 1, N = rows, q and dO,
    lse, Delta, dk, dv, the group's starts and lengths, rows."""
    return (*gluon_dkdv_args(plan, q, k, v, grad_out, lse, delta, dk, dv, 1, rows)[:-5], q, grad_out, lse, delta,
            dk, dv, *seqs, rows)


def gluon_dq_packed_launch(attn, q, k, v, grad_out, lse, delta, dq, seqs: tuple, B: int, N: int, dropout: tuple = ()):
    """(kernel, grid, args, options) of the Gluon dQ over packed rows for one launch group, or
    None (as gluon_packed_launch)."""
    if not (attn.plan["config"].get("gluon_dq")
            and _packed_takes(attn, attn.gluon_dq_packed_fn, dropout, q, k, v, grad_out, dq)):
        return None
    return (attn.gluon_dq_packed_kernel, _packed_grid(attn.plan, B, N),
            gluon_dq_packed_args(attn.plan, q, k, v, grad_out, lse, delta, dq, seqs, q.shape[0]), OPTIONS)


def gluon_dkdv_packed_launch(attn, q, k, v, grad_out, lse, delta, dk, dv, seqs: tuple, B: int, N: int):
    """(kernel, grid, args, options) of the Gluon dK/dV over packed rows for one launch group,
    or None (as gluon_packed_launch): program (c + L*t, b*H_kv + kvh)."""
    plan = attn.plan
    if not (plan["config"].get("gluon_dkdv")
            and _packed_takes(attn, attn.gluon_dkdv_packed_fn, (), q, k, v, grad_out, dk, dv)):
        return None
    return (attn.gluon_dkdv_packed_kernel, _packed_grid(plan, B, N, "num_kv_heads"),
            gluon_dkdv_packed_args(plan, q, k, v, grad_out, lse, delta, dk, dv, seqs, q.shape[0]), OPTIONS)




def gluon_lanes_packed_launch(attn, q, k, v, out, lse, seqs: tuple, B: int, N: int, br: dict, accumulate: bool,
                              clear: bool = False, dropout: tuple = ()):
    """(kernel, grid, args, options) of a causal plan's Gluon lanes of branch `br` over packed
    rows for one launch group (as gluon_packed_launch), or None when it takes the `tl` lane
    kernel: a first launch that clears other offsets' rows (Plan.gap_lane), dropout, a branch
    the Gluon lanes leave out (gluon_rows_lane_branch), fewer rows than r, or _packed_takes.
    Program (s*T + t, b*H + h): segment s of the group's longest sequence N (its last maybe
    short), T = ceil(w/r/128) lane tiles."""
    plan = attn.plan
    tile = plan["config"].get("gluon_lanes")
    w, r = br["w"], br["r"]
    if (clear or tile is None or not gluon_rows_lane_branch(w, r, tile[0]) or q.shape[0] < r
            or not _packed_takes(attn, attn.gluon_lanes_packed_fn, dropout, q, k, v, out, every=1)):
        return None
    return (attn.gluon_lanes_packed_kernel, (-(-N // w) * -(-w // (128 * r)), B * plan["num_heads"]),
            gluon_lanes_packed_args(plan, q, k, v, out, lse, seqs, q.shape[0], br, accumulate), lane_options(plan))


def gluon_lanes_packed_args(plan: dict, q, k, v, out, lse, seqs: tuple, rows: int, br: dict,
                            accumulate: bool) -> tuple:
    """The packed lanes' arguments: gluon_lanes_args' descriptors at B = 1, N = rows (views of
    rows // r rows), q, k, v and out (a lane's blocks past its end or past the views' rows), lse,
    the group's starts and lengths, rows; the branch's w and r and ACCUMULATE (constexprs)."""
    box, r, block = _boxes(plan, 1, rows), br["r"], plan["config"]["gluon_lanes"][0]
    return (box(q, "q", r), box(out, "q", r), box(k, "kv", r, block), box(v, "kv", r, block), q, k, v, out, lse,
            *seqs, rows, br["w"], r, bool(accumulate))


def one_sequence(attn, N: int, device) -> tuple:
    """(starts, lengths) of one sequence of N rows on `device`, made once: a fixed-length call
    runs the lanes over rows that start anywhere per batch item (one_sequence_launches)."""
    key = (N, "one_sequence", str(device))
    hit = attn._device_tensors.get(key)
    if hit is None:
        hit = attn._keep(key, (torch.zeros(1, dtype=torch.int32, device=device),
                               torch.full((1,), N, dtype=torch.int32, device=device)))
    return hit


def one_sequence_launches(launch, attn, B: int, N: int, br: dict, *tensors, tail: tuple = ()) -> list:
    """A fixed-length call's Gluon lane launches (forward, dK/dV or dq) of a branch with r not
    dividing w (LongNet's r = 6 and 12), which the fixed-length lane kernels leave out: `launch`
    (gluon_lanes_packed_launch, gluon_dkdv_lanes_packed_launch or gluon_dq_lanes_packed_launch)
    over one sequence per batch item, tensors[i][b] ((N, H, D) rows, (H, N) lse and Delta),
    one launch each, `tail` its arguments after the branch; [] when it does not take the
    branch and the `tl` kernel runs it, and for a call with a short segment (Gluon takes whole
    segments of a fixed-length call, as gluon_launch._takes: short_segments "zero_pad" pads them)."""
    if br["w"] % br["r"] == 0 or any(N % b["w"] for b in attn.plan["branches"]):
        return []
    seqs = one_sequence(attn, N, tensors[0].device)
    launches = [launch(attn, *(t[b] for t in tensors), seqs, 1, N, br, *tail) for b in range(B)]
    return [] if None in launches else launches


def gluon_dkdv_lanes_packed_launch(attn, q, k, v, grad_out, lse, delta, dk, dv, seqs: tuple, B: int, N: int,
                                   br: dict, accumulate: bool, clear: bool = False, dropout: tuple = ()):
    """(kernel, grid, args, options) of a causal plan's Gluon dK/dV of branch `br` over packed
    rows for one launch group, or None when it takes the `tl` per-branch kernel: a first
    launch that must zero keys no head of a kv group keeps (clear with r > group), dropout, a
    branch the Gluon lane backward leaves out (gluon_rows_lanes_bwd_branch), fewer rows than r,
    or _packed_takes. Program ((s*NO + g0)*J + jt, b*H_kv + kvh), NO = min(group, r), J =
    ceil(w/r/128) key tiles."""
    plan = attn.plan
    w, r = br["w"], br["r"]
    group = plan["num_heads"] // plan["num_kv_heads"]
    if ((clear and r > group) or not gluon_rows_lanes_bwd_branch(w, r) or q.shape[0] < r
            or not _packed_takes(attn, attn.gluon_dkdv_lanes_packed_fn, dropout, q, k, v, grad_out, dk, dv, every=1)):
        return None
    return (attn.gluon_dkdv_lanes_packed_kernel, (-(-N // w) * min(group, r) * -(-w // (128 * r)), B * plan["num_kv_heads"]),
            gluon_dkdv_lanes_packed_args(plan, q, k, v, grad_out, lse, delta, dk, dv, seqs, q.shape[0], br, accumulate),
            lane_options(plan, dkdv=True))


def gluon_dkdv_lanes_packed_args(plan: dict, q, k, v, grad_out, lse, delta, dk, dv, seqs: tuple, rows: int, br: dict,
                                 accumulate: bool) -> tuple:
    """The packed dK/dV's arguments: gluon_dkdv_lanes_args' descriptors at B = 1, N = rows (views
    of rows // r rows), q, dO, k and v (a lane's blocks past its end or past the views' rows), lse,
    Delta, dk, dv, the group's starts and lengths, rows; the constexprs w, r, NO and ACCUMULATE."""
    box, w, r = _boxes(plan, 1, rows), br["w"], br["r"]
    group = plan["num_heads"] // plan["num_kv_heads"]
    return (box(q, "q", r), box(grad_out, "q", r), box(k, "kv", r), box(v, "kv", r), q, grad_out, k, v, lse, delta,
            dk, dv, *seqs, rows, w, r, min(group, r), bool(accumulate))


def gluon_dq_lanes_packed_launch(attn, q, k, v, grad_out, lse, delta, dq, seqs: tuple, B: int, N: int, br: dict,
                                 accumulate: bool, clear: bool = False, dropout: tuple = ()):
    """(kernel, grid, args, options) of a causal plan's Gluon lane dq of branch `br` over packed
    rows for one launch group, or None when it takes the `tl` lane dq (a first launch that
    clears, dropout, a branch the Gluon lane backward leaves out, fewer rows than r,
    _packed_takes): program (s*T + t, b*H + h), T = ceil(w/r/128) query tiles."""
    plan = attn.plan
    w, r = br["w"], br["r"]
    if (clear or not gluon_rows_lanes_bwd_branch(w, r) or q.shape[0] < r
            or not _packed_takes(attn, attn.gluon_dq_lanes_packed_fn, dropout, q, k, v, grad_out, dq, every=1)):
        return None
    return (attn.gluon_dq_lanes_packed_kernel, (-(-N // w) * -(-w // (128 * r)), B * plan["num_heads"]),
            gluon_dq_lanes_packed_args(plan, q, k, v, grad_out, lse, delta, dq, seqs, q.shape[0], br, accumulate),
            lane_options(plan))


def gluon_dq_lanes_packed_args(plan: dict, q, k, v, grad_out, lse, delta, dq, seqs: tuple, rows: int, br: dict,
                               accumulate: bool) -> tuple:
    """The packed lane dq's arguments: gluon_dq_lanes_args' descriptors at B = 1, N = rows (views
    of rows // r rows), q, dO, k and v (a lane's blocks past its end or past the views' rows), lse,
    Delta, dq, the group's starts and lengths, rows; the constexprs w, r and ACCUMULATE."""
    box, r = _boxes(plan, 1, rows), br["r"]
    return (box(q, "q", r), box(grad_out, "q", r), box(k, "kv", r), box(v, "kv", r), q, grad_out, k, v, lse, delta,
            dq, *seqs, rows, br["w"], r, bool(accumulate))
