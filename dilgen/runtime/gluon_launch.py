"""The launches of sm90's Gluon kernels, the forward (templates/gluon_fwd.py.jinja,
KernelConfig.gluon_fwd), the causal lanes (gluon_lanes.py.jinja), the fused dK/dV
(gluon_bwd.py.jinja), the dQ (gluon_dq.py.jinja) and the causal per-branch dK/dV and lane dq
(gluon_lanes_bwd.py.jinja):
their TMA descriptors over strided views of the call's tensors, and when a call takes them.

Views (contiguous (B, N, H, D) q and out, (B, N, H_kv, D) k and v): q and out as
(B·N/L, L·H, D), whose row b·N/L + m, column c·H + h is row u = c + L·m of head h (L the
query lattice); branch i's keys as (B·N/r_i, r_i·H_kv, D), whose rows b·N/r_i + s·w_i/r_i + j
are the lane s·w_i + o + r_i·j of segment s. A 64-row (queries) or 128-row (keys) box of such a
view is a TMA load of dilated rows. The dK/dV reads the other way round: keys through the
lattice's view, each branch's query and dO lanes through (B·N/r_i, r_i·H, D). The descriptors are made on the host (made in the kernel,
by each program, they cost A 1.724 -> 1.844 ms; bench/results/gluon_dilgen_check-2026-11-27-h200.json);
a replay makes them again over the call's tensors (replay.Descriptor). Packed rows: runtime.gluon_packed."""
from __future__ import annotations

import torch

from ..gluon_plan import gluon_lane_branch, gluon_lanes_bwd_branch
from .curve_rows import copy_rows

_SM90: dict[int, bool] = {}      # device index -> compute capability 9.x


def _sm90(device: torch.device) -> bool:
    hit = _SM90.get(device.index)
    if hit is None:
        hit = _SM90[device.index] = torch.cuda.get_device_capability(device)[0] == 9
    return hit


_LAYOUTS: dict[tuple[int, int], object] = {}


def layout(rows: int, D: int):
    """The shared-memory layout of a (rows, 1, D) box of 16-bit elements (128-byte swizzle)."""
    hit = _LAYOUTS.get((rows, D))
    if hit is None:
        from triton.experimental.gluon import language as gl
        hit = _LAYOUTS[(rows, D)] = gl.NVMMASharedLayout.get_default_for([rows, 1, D], gl.bfloat16)
    return hit


def _takes(attn, fn, N: int, *tensors) -> bool:
    """Whether a call runs a Gluon kernel `fn` of the plan: not on the CPU or a GPU other than
    sm90 (a newer GPU runs sm90's plan, and wgmma is Hopper's), every segment whole, and the
    tensors contiguous and 16-byte aligned (TMA)."""
    if fn is None or tensors[0].device.type != "cuda" or not _sm90(tensors[0].device):
        return False
    if any(N % br["w"] for br in attn.plan["branches"]):
        return False
    return all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in tensors)


def gluon_launch(attn, q, k, v, out, lse, B: int, N: int, dropout: tuple = ()):
    """(kernel, grid, args, options) of the Gluon forward for this call, or None when the call
    takes the `tl` kernel instead (_takes); `dropout`: a dropout plan's arguments
    (runtime.dropout_call.dropout_args), after the others."""
    plan = attn.plan
    if plan["config"].get("gluon_fwd") is None or not _takes(attn, attn.gluon_fn, N, q, k, v, out):
        return None
    return (attn.gluon_kernel, (N // 128, B * plan["num_heads"]),
            (*gluon_args(plan, q, k, v, out, lse, B, N), *dropout), OPTIONS)


def gluon_lanes_launch(attn, q, k, v, out, lse, B: int, N: int, br: dict, accumulate: bool, clear: bool = False,
                       dropout: tuple = ()):
    """(kernel, grid, args, options) of the Gluon lanes of branch `br` for this call, or
    None when the call takes the `tl` lane kernel instead (_takes): program (s*T + t, b*H + h),
    T = w/r/128 lane tiles; `clear`: also write "no branch" into the other offsets' rows;
    `dropout` as gluon_launch's."""
    plan = attn.plan
    tile = plan["config"].get("gluon_lanes")
    curve = plan["config"].get("gluon_curve_lanes", False)
    if curve and not br.get("curve_rows"):      # a raster lane beside curve lanes: its own kernel, else `tl`
        if (not plan["config"].get("gluon_raster_lanes") or dropout or tile is None
                or not gluon_lane_branch(br["w"], br["r"], tile[0])
                or not _takes(attn, attn.gluon_raster_lanes_fn, N, q, k, v, out)):
            return None
        return (attn.gluon_raster_lanes_kernel, (N // br["w"] * (br["w"] // br["r"] // 128), B * plan["num_heads"]),
                gluon_lanes_args(plan, q, k, v, out, lse, B, N, br, accumulate, clear), lane_options(plan))
    if (tile is None or not gluon_lane_branch(br["w"], br["r"], tile[0])
            or (curve and (clear or dropout))
            or not _takes(attn, attn.gluon_lanes_fn, N, q, k, v, out)):
        return None
    grid = (N // br["w"] * (br["w"] // br["r"] // 128), B * plan["num_heads"])
    if curve:       # keys from the branch's compact curve copies, made now (recorded as temporaries)
        tables = attn._launch_tensors(N, q.device)[1]
        group = plan["num_heads"] // plan["num_kv_heads"]
        kc, vc = copy_rows(attn, False, br, tables, k, v, heads=plan["num_kv_heads"], group=group)
        fwd = tables[2 * plan["tables"].index(br["order"])]     # (fwd, inv) per table
        lists = attn._block_lists(br, N, (128, tile[0]), q.device) if plan["causal"] else ()
        return attn.gluon_lanes_kernel, grid, gluon_curve_lanes_args(plan, q, kc, vc, out, lse, fwd, B, N, br,
                                                                     accumulate, lists), OPTIONS
    return (attn.gluon_lanes_kernel, grid,
            gluon_lanes_args(plan, q, k, v, out, lse, B, N, br, accumulate, clear, dropout), lane_options(plan))


def gluon_dkdv_lanes_launch(attn, q, k, v, grad_out, lse, delta, dk, dv, B: int, N: int, br: dict,
                            accumulate: bool, clear: bool, dropout: tuple = (), dq32=None):
    """(kernel, grid, args, options) of the Gluon dK/dV of branch `br`, or None when the call
    takes the `tl` per-branch kernel (_takes; a branch gluon_lanes_bwd_branch leaves out):
    program ((s*NO + g0)*J + jt, b*H_kv + kvh); `clear`: a first launch that writes, zeroing the
    keys no head of a kv group keeps (r > group);
    `dropout` as gluon_launch's (a dropout plan's dK/dV, causal or not); `dq32`: the float32
    dQ its blocks add into (KernelConfig.gluon_dkdv_dq, gluon_dkdv_dq_taken)."""
    plan = attn.plan
    group = plan["num_heads"] // plan["num_kv_heads"]
    if (not plan["config"].get("gluon_dkdv_lanes") or not gluon_lanes_bwd_branch(br["w"], br["r"])
            or not _takes(attn, attn.gluon_dkdv_lanes_fn, N, q, k, v, grad_out, dk, dv)):
        return None
    w, r = br["w"], br["r"]
    return (attn.gluon_dkdv_lanes_kernel, (N // w * min(group, r) * (w // r // 128), B * plan["num_kv_heads"]),
            gluon_dkdv_lanes_args(plan, q, k, v, grad_out, lse, delta, dk, dv, B, N, br, accumulate, clear, dropout,
                                  dq32),
            OPTIONS if dq32 is not None else lane_options(plan, dkdv=True))


def gluon_dkdv_dq_taken(attn, q, k, v, grad_out, N: int) -> bool:
    """Whether this call's dQ comes from its Gluon per-branch dK/dV (KernelConfig.gluon_dkdv_dq):
    every branch's launch of it taken (_takes; the gradients, made by the call, are
    contiguous), each adding into zeroed dk, dv (no first launch that writes) and a float32 dQ.
    Otherwise the call runs its dq kernels as the plan without it."""
    return bool(attn.plan["config"].get("gluon_dkdv_dq") and _takes(attn, attn.gluon_dkdv_lanes_fn, N, q, k, v, grad_out))


def gluon_dq_lanes_launch(attn, q, k, v, grad_out, lse, delta, dq, B: int, N: int, br: dict, accumulate: bool,
                          clear: bool = False, dropout: tuple = ()):
    """(kernel, grid, args, options) of the Gluon dq of lane branch `br`, or None when the call
    takes the `tl` lane dq (_takes; a branch gluon_lanes_bwd_branch leaves out): program
    (s*T + t, b*H + h), as the Gluon lanes'; `clear`: also write 0 into the rows of the other
    offsets (the first lane launch, Plan.gap_lane); `dropout` as gluon_launch's."""
    plan = attn.plan
    if (not plan["config"].get("gluon_lanes_bwd") or not gluon_lanes_bwd_branch(br["w"], br["r"])
            or not _takes(attn, attn.gluon_dq_lanes_fn, N, q, k, v, grad_out, dq)):
        return None
    w, r = br["w"], br["r"]
    return (attn.gluon_dq_lanes_kernel, (N // w * (w // r // 128), B * plan["num_heads"]),
            gluon_dq_lanes_args(plan, q, k, v, grad_out, lse, delta, dq, B, N, br, accumulate, clear, dropout),
            lane_options(plan))


def gluon_dkdv_launch(attn, q, k, v, grad_out, lse, delta, dk, dv, B: int, N: int):
    """(kernel, grid, args, options) of the Gluon dK/dV for this call, or None when the call
    takes the `tl` fused dK/dV instead (_takes): program (c + L*t, b*H_kv + kvh)."""
    plan = attn.plan
    if not plan["config"].get("gluon_dkdv") or not _takes(attn, attn.gluon_dkdv_fn, N, q, k, v, grad_out, dk, dv):
        return None
    return (attn.gluon_dkdv_kernel, (N // 128, B * plan["num_kv_heads"]),
            gluon_dkdv_args(plan, q, k, v, grad_out, lse, delta, dk, dv, B, N), OPTIONS)


# 12 warps (two consumer warpgroups, a producer warp's group) at 168 registers a thread:
# one program per SM, the consumers at 240 registers, the producer at 24
OPTIONS = {"num_warps": 4, "maxnreg": 168}
PDL_OPTIONS = {**OPTIONS, "launch_pdl": True}


def lane_options(plan, dkdv: bool = False) -> dict:
    """The launch options of the Gluon lane kernels over raster rows (forward, dK/dV, dq): with
    programmatic dependent launch where the plan says (KernelConfig.gluon_pdl; the kernels wait
    where they must, common.gdc). What a merging or adding launch reads before its wait (q, k,
    v, dO, lse, Delta) was written before the launch before it started, but for a dK/dV whose
    first launch adds (no Plan.dkdv_first_writes, or gluon_dkdv_dq: every launch adds): that one
    follows the preprocess that writes Delta, so the plan's dK/dV launches go without it."""
    cfg = plan["config"]
    adds_first = dkdv and (cfg.get("gluon_dkdv_dq") or not plan.get("dkdv_first_writes"))
    return PDL_OPTIONS if cfg.get("gluon_pdl") and not adds_first else OPTIONS


def gluon_dq_launch(attn, q, k, v, grad_out, lse, delta, dq, B: int, N: int, dropout: tuple = ()):
    """(kernel, grid, args, options) of the Gluon dQ for this call, or None when the call takes
    the `tl` dq kernel instead (_takes): program (d + L*t, b*H + h), as the Gluon forward's;
    `dropout` as gluon_launch's."""
    plan = attn.plan
    if not plan["config"].get("gluon_dq") or not _takes(attn, attn.gluon_dq_fn, N, q, k, v, grad_out, dq):
        return None
    return (attn.gluon_dq_kernel, (N // 128, B * plan["num_heads"]),
            (*gluon_dq_args(plan, q, k, v, grad_out, lse, delta, dq, B, N), *dropout), OPTIONS)


def _boxes(plan: dict, B: int, N: int):
    """box(t, kind, every, rows): a TMA descriptor over a contiguous (B, N, heads, D) tensor t
    (kind "q": H heads, "kv": H_kv) viewed as (B*N/every, every*heads, D), in boxes of
    (rows, 1, D). Written out from the plan and (B, N), never asked of t, which may be one of
    Triton's MockTensors (the `dilgen build` launch model)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    D = plan["head_dim"]
    heads = {"q": plan["num_heads"], "kv": plan["num_kv_heads"]}

    def box(t, kind: str, every: int, rows: int = 64) -> TensorDescriptor:
        shape = [B * N // every, every * heads[kind], D]
        return TensorDescriptor(t, shape, [shape[1] * D, D, 1], [rows, 1, D], layout(rows, D))
    return box


def gluon_args(plan: dict, q, k, v, out, lse, B: int, N: int) -> tuple:
    """The forward's arguments: q's and out's descriptors through the lattice's view (64-row
    boxes), each lattice branch's k and v descriptors (boxes of the plan's keys per block; lane
    branches run in their own launches), lse, N."""
    box, L, block = _boxes(plan, B, N), plan["query"]["lattice"], plan["config"]["gluon_fwd"][0]
    rates = [br["r"] for br in plan["branches"] if not br["lanes"]]
    return (box(q, "q", L), box(out, "q", L), *(box(k, "kv", r, block) for r in rates),
            *(box(v, "kv", r, block) for r in rates), lse, N)


def gluon_lanes_args(plan: dict, q, k, v, out, lse, B: int, N: int, br: dict, accumulate: bool,
                     clear: bool = False, dropout: tuple = ()) -> tuple:
    """The Gluon lanes' arguments: q's and out's descriptors through the branch's
    (B*N/r, r*H, D) view (64-row boxes), k's and v's through (B*N/r, r*H_kv, D) (boxes of the
    plan's keys per block), out, lse, N; the branch's w and r, ACCUMULATE and CLEAR (constexprs);
    with `dropout` (a dropout plan's arguments), the branch's index (a constexpr) and them."""
    box, r, block = _boxes(plan, B, N), br["r"], plan["config"]["gluon_lanes"][0]
    return (box(q, "q", r), box(out, "q", r), box(k, "kv", r, block), box(v, "kv", r, block),
            out, lse, N, br["w"], r, bool(accumulate), bool(clear), *((br["index"], *dropout) if dropout else ()))


def gluon_curve_lanes_args(plan: dict, q, kc, vc, out, lse, fwd, B: int, N: int, br: dict, accumulate: bool,
                           lists: tuple = ()) -> tuple:
    """The Gluon curve lanes' arguments (KernelConfig.gluon_curve_lanes): q, the branch's curve
    table fwd, descriptors over its compact curve copies kc and vc ((B, H_kv, min(group, r),
    N/r, D): runtime.curve_rows.copy_rows) as (rows, 1, D) in boxes of the plan's keys per
    block, out, lse, a causal plan's block lists (counts, blocks: runtime.curve_rows.block_lists
    of 128-lane query tiles and blocks of the plan's keys), N; the branch's w and r,
    ACCUMULATE and CLEAR (false) as constexprs."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    D, r, block = plan["head_dim"], br["r"], plan["config"]["gluon_lanes"][0]
    rows = B * plan["num_kv_heads"] * min(plan["num_heads"] // plan["num_kv_heads"], r) * (N // r)
    box = lambda t: TensorDescriptor(t, [rows, 1, D], [D, D, 1], [block, 1, D], layout(block, D))  # noqa: E731
    return (q, fwd, box(kc), box(vc), out, lse, *lists, N, br["w"], r, bool(accumulate), False)


def gluon_dkdv_lanes_args(plan: dict, q, k, v, grad_out, lse, delta, dk, dv, B: int, N: int, br: dict,
                          accumulate: bool, clear: bool = False, dropout: tuple = (), dq32=None) -> tuple:
    """The dK/dV's arguments for branch `br`: q's and dO's descriptors through its
    (B*N/r, r*H, D) view, k's and v's through (B*N/r, r*H_kv, D) (64-row boxes), lse, Delta, dk,
    dv, the float32 dQ's descriptor where the plan's kernel adds into one (gluon_dkdv_dq, dq32_box), N; the constexprs
    w, r, NO = min(group, r), ACCUMULATE and CLEAR; with `dropout` (a dropout plan's arguments),
    the branch's index (a constexpr) and them."""
    box, w, r = _boxes(plan, B, N), br["w"], br["r"]
    group = plan["num_heads"] // plan["num_kv_heads"]
    adds_dq = plan["config"].get("gluon_dkdv_dq", False)
    if adds_dq and dq32 is None:
        raise ValueError("gluon_dkdv_lanes_args: the plan's dK/dV adds dQ (gluon_dkdv_dq), and no float32 dQ was given")
    return (box(q, "q", r), box(grad_out, "q", r), box(k, "kv", r), box(v, "kv", r), lse, delta, dk, dv,
            *((dq32_box(plan, dq32, B, N, r),) if adds_dq else ()), N, w, r, min(group, r), bool(accumulate),
            bool(clear), *((br["index"], *dropout) if dropout else ()))


def dq32_box(plan: dict, t, B: int, N: int, every: int):
    """A TMA descriptor over the float32 (B, N, H, D) dQ t viewed as q is, (B*N/every,
    every*H, D), in unswizzled (64, 1, 64) boxes: the tiles gluon_dkdv_dq's blocks add by TMA
    reduce-adds (a 256-byte row is past the 128-byte swizzle's span)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    D = plan["head_dim"]
    shape = [B * N // every, every * plan["num_heads"], D]
    return TensorDescriptor(t, shape, [shape[1] * D, D, 1], [64, 1, 64],
                            gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=3))


def gluon_dq_lanes_args(plan: dict, q, k, v, grad_out, lse, delta, dq, B: int, N: int, br: dict,
                        accumulate: bool, clear: bool = False, dropout: tuple = ()) -> tuple:
    """The dq's arguments for lane branch `br` (views as gluon_dkdv_lanes_args'): q, dO, k, v
    descriptors, lse, Delta, dq, N; the constexprs w, r, ACCUMULATE and CLEAR; with `dropout`,
    the branch's index and them."""
    box, w, r = _boxes(plan, B, N), br["w"], br["r"]
    return (box(q, "q", r), box(grad_out, "q", r), box(k, "kv", r), box(v, "kv", r), lse, delta, dq, N,
            w, r, bool(accumulate), bool(clear), *((br["index"], *dropout) if dropout else ()))


def gluon_dkdv_args(plan: dict, q, k, v, grad_out, lse, delta, dk, dv, B: int, N: int) -> tuple:
    """The dK/dV's arguments: each lattice branch's q and dO lanes as (B*N/r, r*H, D), k and v
    as the lattice's (B*N/L, L*H_kv, D) (64-row boxes), lse, Delta, dk, dv, N (lane branches
    add theirs after it)."""
    box, L = _boxes(plan, B, N), plan["query"]["lattice"]
    rates = [br["r"] for br in plan["branches"] if not br["lanes"]]
    return (*(box(q, "q", r) for r in rates), *(box(grad_out, "q", r) for r in rates),
            box(k, "kv", L), box(v, "kv", L), lse, delta, dk, dv, N)


def gluon_dq_args(plan: dict, q, k, v, grad_out, lse, delta, dq, B: int, N: int) -> tuple:
    """The dQ's arguments: q's and dO's descriptors as the forward's q, each lattice branch's k
    and v descriptors (64-row boxes), lse, Delta, dq, N (lane branches add theirs after it)."""
    box, L = _boxes(plan, B, N), plan["query"]["lattice"]
    rates = [br["r"] for br in plan["branches"] if not br["lanes"]]
    return (box(q, "q", L), box(grad_out, "q", L), *(box(k, "kv", r) for r in rates),
            *(box(v, "kv", r) for r in rates), lse, delta, dq, N)
