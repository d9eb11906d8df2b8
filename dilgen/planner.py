"""Spec → IR. The only place that decides tiling, query classes and schedules.

Lowering, in SPEC §2 terms (LongNet Eqs. 13-15): branch i with (w, r) keeps, in head h,
the segment lanes t with t mod r == o, o = h mod r, and reads key lane j of segment s
at virtual position u_k = s*w + o + r*j. Virtual positions are raster positions, or
curve positions when a Hilbert order applies (then a table maps them to raster).

Query classes: when r | w for a set of branches that read in the query order, whether
query u is kept by such a branch depends only on u mod r; with L = lcm of those r, the
queries of residue class c = (h + d) mod L are kept by exactly the branches with
r | d. Tiling each class as a lattice u = c + L*m gives tiles whose every row has the
same key set per branch: no row mask, and no work on rows a branch does not keep.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache, reduce

import sympy

from . import ir
from .dropout_plan import DROPOUT_GLUON_DQ_DIMS, dropout_refusal, dropout_tuning
from .gluon_plan import (gluon_curve_lanes, gluon_dkdv, gluon_dkdv_dq, gluon_dkdv_lanes, gluon_dkdv_prefetch,
                         gluon_dq, gluon_exp2, gluon_fwd, gluon_lanes, gluon_lanes_bwd, gluon_pdl, gluon_raster_lanes,
                         gluon_split, lanes_bwd_in_place_of_fused)
from .spec import Spec, SpecError, default_grid
from .support import unsupported_by_kernels
from .targets import Target

MAX_LATTICE = 64  # beyond this, classes are too thin to fill a tile: use row masks

h, d, c, m, s, j, o, u = (ir.SYM[x] for x in "h d c m s j o u".split())


def _lcm(values: list[int]) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), values, 1)


def _is_identity(rows: int, cols: int) -> bool:
    """The curve of a 1 x n or n x 1 grid is a straight walk: raster order, no table."""
    return rows == 1 or cols == 1


def _row_order(spec: Spec) -> ir.TableMap | None:
    """The permutation the runtime applies to whole rows around the kernels (Plan.row_order):
    Hilbert scope "sequence", non-causal, on one device. Dilated attention in curve order is
    the raster kernel on curve-ordered rows, so one gather of q, k, v (and a scatter of out)
    replaces a table load in every tile (issue 12: one permutation, not a slower kernel).
    Causal keeps the table: its mask compares raster positions."""
    if not spec.rows_in_curve_order:
        return None
    rows, cols = spec.hilbert.grid
    return None if _is_identity(rows, cols) else ir.TableMap(f"curve_{rows}x{cols}", "sequence", rows, cols)


def _branch_orders(spec: Spec) -> tuple[ir.TableMap | None, list[ir.TableMap | None]]:
    """The query order and each branch's order (None = raster, read without a table)."""
    hil = spec.hilbert
    if hil is None:
        return None, [None] * spec.num_branches
    if hil.scope == "sequence" and (spec.ring_size > 1 or not spec.causal):
        # the ring runs on curve-ordered rows (shard gives each rank a run of the curve), and
        # so does one device, non-causal (the runtime permutes the rows: _row_order):
        # virtual positions are the rows themselves, read with no table (dropout's coins
        # count queries in curve order too). Causal masks need raster positions: those read
        # through the table
        return None, [None] * spec.num_branches
    if hil.scope == "sequence":
        rows, cols = hil.grid
        table = None if _is_identity(rows, cols) else ir.TableMap(
            f"curve_{rows}x{cols}", "sequence", rows, cols)
        return table, [None] * spec.num_branches   # branches read in the query order
    orders: list[ir.TableMap | None] = []
    for i, (w, r) in enumerate(spec.branches()):
        rows, cols = hil.grids[i] if hil.grids is not None else default_grid(w)
        # r = 1 keeps every position of a segment whatever the order: no table needed
        # (causal masks compare raster positions in either case)
        orders.append(None if _is_identity(rows, cols) or r == 1
                      else ir.TableMap(f"segment_{rows}x{cols}", "segment", rows, cols))
    return None, orders


def _ring(spec: Spec, branches: list[ir.BranchIR]) -> ir.RingIR:
    """Lower ring_size to the ring IR (the per-N schedule is schedule.ring_schedule)."""
    if spec.ring_size == 1:
        return ir.RingIR(1)
    return ir.RingIR(
        ring_size=spec.ring_size, causal=spec.causal,
        branches=tuple(ir.RingBranch(b.index, b.segment_length, b.dilation, b.order is None)
                       for b in branches),
        one_kv_head_per_query_head=spec.num_kv_heads == spec.num_heads,
        curve=tuple(spec.hilbert.grid) if spec.hilbert is not None and spec.hilbert.scope == "sequence" else None)


TUNABLE = ("block_m", "block_n", "num_warps", "num_stages", "bwd_kv", "bwd_dq",
           "lane_fwd", "lane_dq", "lanes", "lane_tma", "lane_ws", "lane_dq_tma", "lane_tiles_fastest", "fused_dkdv", "decode",
           "curve_rows", "fused_tma", "fused_ws", "fold_scale", "bwd_tma", "lattice_group",
           "dual_chain", "gluon_fwd", "gluon_dkdv", "gluon_dq", "gluon_lanes",
           "gluon_lanes_bwd", "gluon_dkdv_lanes", "gluon_curve_lanes", "gluon_raster_lanes", "gluon_pdl", "gluon_exp2", "dropout",
           "dkdv_rows_first", "gluon_dkdv_prefetch", "gluon_dkdv_dq")
LANES_CHOICES = ("auto", "all", "none", "split")


def plan(spec: Spec, target: Target, tuning: dict | None = None) -> ir.Plan:
    """Lower a validated spec for one target. `tuning` (from dilgen.autotune) overrides
    the target's block table: any of TUNABLE. Raises SpecError (one line) for a valid spec
    the kernels cannot run yet. The stages, in order: the target's tiles; which branches
    are query-lattice branches and which run as lanes; the fused kernel's block; the
    branches' index maps; the query classes; two chains per tile; the backward's dK/dV
    launch; the launch schedule; the kernel config."""
    refusal = unsupported_by_kernels(spec)
    if refusal is not None:
        raise SpecError(refusal)
    tuning = dict(tuning or {})
    dropout = bool(tuning.get("dropout", False))
    if dropout:
        refusal = dropout_refusal(spec)
        if refusal is not None:
            raise SpecError(f"{spec.name}: attention dropout {refusal}")
        lanes_plan = _dropout_lanes_plan(spec, target, tuning)
        if lanes_plan is not None:
            return lanes_plan
        tuning = dropout_tuning(spec, tuning)
    query_order, orders = _branch_orders(spec)
    tiles = _tiles(spec, target, tuning, query_order)
    lanes = _lanes(spec, target, tiles, orders)
    tiles.block_m = _nested_block_m(spec, tiles.block_m, lanes)
    branches = _branch_irs(spec, orders, query_order, lanes, tiles.block_m, tuning)
    tiling = _query_tiling(branches, lanes.lattice, tiles.block_m, query_order)
    dual_chain = _dual_chain(spec, target, tiles, branches, query_order, tuning)
    fused_dkdv = _fused_dkdv(spec, target, tiles, branches, lanes, query_order, tuning,
                             lanes_bwd_in_place_of_fused(spec, target, tiles, branches, query_order, tuning, dropout))
    if fused_dkdv:
        branches = [dataclasses.replace(b, fused_dkdv=_in_fused_dkdv(b, lanes.lattice)) for b in branches]
    gluon = dict(
        gluon_fwd=gluon_fwd(spec, target, tiles, branches, lanes.lattice, query_order, tuning),
        gluon_dkdv=gluon_dkdv(spec, target, tiles, branches, lanes.lattice, query_order, fused_dkdv, tuning),
        gluon_dq=gluon_dq(spec, target, tiles, branches, lanes.lattice, query_order, tuning,
                          DROPOUT_GLUON_DQ_DIMS if dropout else None),
        gluon_lanes=gluon_lanes(spec, target, tiles, branches, query_order, tuning),
        gluon_lanes_bwd=gluon_lanes_bwd(spec, target, tiles, branches, query_order, fused_dkdv, tuning, dropout))
    gluon["gluon_dkdv_lanes"] = gluon_dkdv_lanes(spec, target, gluon["gluon_lanes_bwd"], tuning)
    gluon["gluon_curve_lanes"] = gluon_curve_lanes(spec, branches, query_order, tuning, gluon["gluon_lanes"])
    gluon["gluon_raster_lanes"] = gluon_raster_lanes(spec, target, branches, tuning, gluon["gluon_lanes"],
                                                     gluon["gluon_curve_lanes"], dropout)
    gluon["gluon_pdl"] = gluon_pdl(spec, target, tuning, gluon["gluon_lanes"])
    gluon["gluon_dkdv_dq"] = gluon_dkdv_dq(spec, gluon["gluon_dkdv_lanes"], tuning)
    gluon["gluon_dkdv_prefetch"] = gluon_dkdv_prefetch(spec, tiles.tile_d, gluon["gluon_dkdv"], tuning)
    gluon["gluon_exp2"] = gluon_exp2(spec, target, tiles, gluon, tuning)
    tables = []
    for t in [query_order, *orders]:
        if t is not None and t not in tables:
            tables.append(t)
    # Launch schedule: an r = 1 lane branch first (it keeps every row, so it writes (out, lse)
    # without a merge), then the others as listed. With no fused kernel and a first lane of
    # r > 1, that launch also writes "no branch" into the rows its branch does not keep, and
    # no fill runs before the launches (gap_lane; D causal, H200: four 268 MB fills were 0.27
    # of 1.79 ms fwd+bwd). With no fused dK, dV launch the first per-branch one writes instead
    # of adding into zeroed buffers, and zeroes the keys no head of its group keeps (head
    # offsets "block" keep the zero fill).
    lane_order = tuple(sorted((b.index for b in branches if b.lanes),
                              key=lambda i: (branches[i].dilation != 1, i)))
    gap_lane = (lane_order[0] if lane_order and all(b.lanes for b in branches)
                and branches[lane_order[0]].dilation > 1 else None)
    dkdv_first_writes = spec.ring_size == 1 and not fused_dkdv and branches[0].head_offset is None
    return ir.Plan(
        fused_dkdv=fused_dkdv, head_dim_pad=tiles.head_dim_pad,
        spec=spec.to_json(), spec_key=spec.key(), target=target.name,
        num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        dtype=spec.dtype, causal=spec.causal, scale=spec.scale, query=tiling,
        branches=tuple(branches), config=_config(spec, target, tiles, branches, lanes, dual_chain, tuning, gluon),
        ring=_ring(spec, branches), tables=tuple(tables), row_order=_row_order(spec), dropout=dropout,
        lane_order=lane_order, gap_lane=gap_lane, dkdv_first_writes=dkdv_first_writes,
        head_base=spec.head_base)


def _dropout_lanes_plan(spec: Spec, target: Target, tuning: dict) -> ir.Plan | None:
    """A causal spec's dropout plan with its branches as lanes and every lane kernel in Gluon,
    where the tuning leaves the lanes to the planner, a branch has r = 1 (gluon_plan.gluon_lanes_bwd
    says why) and the target runs all three kernels (forward, dq, dK/dV); else None."""
    if (not spec.causal or spec.ring_size > 1 or not target.gluon_lanes_default or 1 not in spec.dilation_rates
            or tuning.get("lanes") is not None or tuning.get("gluon_lanes") is not None
            or tuning.get("gluon_dkdv_lanes") is False):
        return None
    try:
        return plan(spec, target, {**tuning, "gluon_lanes": True})
    except SpecError:       # a lane kernel that cannot run it: the fused kernels' plan
        return None


@dataclass
class _Tiles:
    """The target's tiles for this head_dim and dtype, with the tuning's overrides."""
    tile_d: int                  # the head_dim's tile width: the next power of two >= 16
    head_dim_pad: int | None     # tile_d where it differs from head_dim (masked columns)
    itemsize: int
    fused_tma: bool
    bwd_tma: bool
    block_m: int
    block_n: int
    warps: int
    stages: int
    bwd_kv: tuple
    bwd_dq: tuple
    lane_fwd: tuple
    lane_dq: tuple
    lanes_mode: str | tuple  # LANES_CHOICES, or branch indices run as lanes


def _tiles(spec: Spec, target: Target, tuning: dict, query_order) -> _Tiles:
    # head_dim any multiple of 8: the tiles are the next power of two >= 16 wide (tl.dot's
    # smallest K), masked past head_dim; tile tables are keyed by that width
    tile_d = max(16, 1 << (spec.head_dim - 1).bit_length())
    head_dim_pad = None if tile_d == spec.head_dim else tile_d
    itemsize = 4 if spec.dtype == "float32" else 2
    # the fused forward's key loads through tensor descriptors (Target.fused_tma): non-causal
    # (measured), 16-bit, queries in raster order, on one device or in a ring's windows (whose
    # keys compacted with stride g | r are still a box); a branch read through a curve table
    # keeps pointer loads (the template decides per branch; on one device such branches are
    # lane branches, so F's fused kernel, its r = 1 branch, reads through descriptors: H200,
    # forward 2.363 -> 2.279 ms); never with a padded head_dim (its masked columns are
    # pointer loads' job), tuned or not
    fused_tma = head_dim_pad is None and bool(tuning.get(
        "fused_tma", target.fused_tma and not spec.causal and itemsize == 2 and query_order is None))
    # the backward's raster loads through descriptors too (Target.bwd_tma), causal or not,
    # on one device or in a ring's windows
    bwd_tma = head_dim_pad is None and bool(tuning.get("bwd_tma", target.bwd_tma and itemsize == 2))
    block_m, block_n, warps, stages = target.block_table(tile_d, itemsize, spec.causal,
                                                         descriptors=fused_tma)
    unknown = set(tuning) - set(TUNABLE)
    if unknown:
        raise ValueError(f"unknown tuning keys {sorted(unknown)}; allowed: {TUNABLE}")
    bwd_kv, bwd_dq = target.backward_table(tile_d, itemsize, spec.causal)
    lane_fwd, lane_dq = target.lane_table(tile_d, itemsize, spec.causal)
    lanes_mode = _lanes_mode(spec, tuning.get("lanes", "auto"))
    return _Tiles(tile_d, head_dim_pad, itemsize, fused_tma, bwd_tma,
                  tuning.get("block_m", block_m), tuning.get("block_n", block_n),
                  tuning.get("num_warps", warps), tuning.get("num_stages", stages),
                  tuple(tuning.get("bwd_kv", bwd_kv)), tuple(tuning.get("bwd_dq", bwd_dq)),
                  tuple(tuning.get("lane_fwd", lane_fwd)), tuple(tuning.get("lane_dq", lane_dq)),
                  lanes_mode)


@dataclass
class _Lanes:
    """Which branches follow the query lattice and which run as lane branches."""
    lattice_ok: list             # branch i's membership follows the query lattice (r | w, raster)
    lattice: int                 # L: lcm of the fused kernel's lattice branches' r
    dkdv_lattice: int            # L of every lattice branch, lane or not (the fused dK/dV)
    lane: list                   # branch i runs in its own lane launch
    block: bool                  # head_offsets "block" (torchscale's layout)
    zero_pad: bool               # short_segments "zero_pad", non-causal
    sparse_lanes: bool           # non-causal lanes because no branch keeps every row

    def row_membership(self, i: int, r: int, order) -> bool:
        return not (self.lattice_ok[i] or r == 1 and order is None)


def _lanes_mode(spec: Spec, mode):
    """Tuning `lanes`: one of LANES_CHOICES, or the branches (their indices) that run as lane
    kernels beside the ones "auto" runs so (their lattice then leaves the fused kernel's L)."""
    if isinstance(mode, (list, tuple)):
        if not mode or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < spec.num_branches
                           for i in mode) or len(set(mode)) != len(mode):
            raise ValueError(f"tuning lanes = {list(mode)!r}: a list of distinct branch indices 0 .. "
                             f"{spec.num_branches - 1} (or one of {LANES_CHOICES})")
        return tuple(mode)
    if mode not in LANES_CHOICES:
        raise ValueError(f"tuning lanes = {mode!r}: one of {LANES_CHOICES}, or a list of branch indices")
    return mode


def _lanes(spec: Spec, target: Target, tiles: _Tiles, orders) -> _Lanes:
    # Branches whose membership follows the query lattice: r | w and no own table.
    lattice_ok = [orders[i] is None and w % r == 0 and r > 1
                  for i, (w, r) in enumerate(spec.branches())]
    lattice = _lcm([r for ok, (w, r) in zip(lattice_ok, spec.branches()) if ok])
    if lattice > MAX_LATTICE:
        lattice, lattice_ok = 1, [False] * spec.num_branches
    every_row_kept = any(r == 1 for _, r in spec.branches())
    mode, chosen = tiles.lanes_mode, ()
    if isinstance(mode, tuple):              # these branches as lanes, the others as "auto" runs them
        mode, chosen = "auto", mode
    elif mode == "split" or (mode == "auto" and target.split_wide_lattice):
        # "auto", and the branches that keep L from the Gluon forward
        mode, chosen = "auto", gluon_split(spec, target, tiles, lattice_ok)
    if mode == "auto":
        mode = target.lanes_mode(spec.causal, lattice, tiles.tile_d, every_row_kept)
    # torchscale's layout (issue 16): the fused kernel's query classes assume o = h mod r and
    # it does not count zero keys, so head_offsets "block" and (non-causal) zero padding run
    # every branch in the lane kernels, whose offsets and pad counts are per program
    block = spec.head_offsets == "block"
    zero_pad = spec.short_segments == "zero_pad" and not spec.causal
    # non-causal lanes chosen because no branch keeps every row (Target.lanes_mode) take the
    # causal lanes' descriptor loads and warp specialization (D: 0.525 -> 0.502 ms forward)
    sparse_lanes = (not spec.causal and not every_row_kept and mode == "all"
                    and not (block or zero_pad))
    if block or zero_pad:
        mode = "all"
    lanes = _Lanes(lattice_ok, lattice, lattice, [], block, zero_pad, sparse_lanes)
    # Lane branches (single device only; a ring window keeps every branch in the fused
    # kernel): those whose membership is per row (r does not divide w, or a curve table),
    # or every branch with lanes = "all" (square causal diagonals). Each runs in its own
    # launch over its kept lanes and merges into (out, lse); the fused kernel runs the rest.
    lanes.lane = [spec.ring_size == 1 and mode != "none"
                  and (mode == "all" or i in chosen or lanes.row_membership(i, r, orders[i]))
                  for i, (w, r) in enumerate(spec.branches())]
    if any(lanes.lane) and not all(lanes.lane):
        lanes.lattice = _lcm([r for i, (w, r) in enumerate(spec.branches())
                              if lattice_ok[i] and not lanes.lane[i]])
    return lanes


def _nested_block_m(spec: Spec, block_m: int, lanes: _Lanes) -> int:
    """A tile covers the virtual range [L*BM*t, L*BM*(t+1)); shrink BM (not below 16, the
    smallest tl.dot tile) until that range nests inside every segment of the fused
    kernel's branches if it can."""
    gcd_w = reduce(math.gcd, [w for i, w in enumerate(spec.segment_lengths) if not lanes.lane[i]]
                   or spec.segment_lengths)
    bm = block_m
    while bm > 16 and gcd_w % (lanes.lattice * bm) != 0:
        bm //= 2
    return bm if gcd_w % (lanes.lattice * bm) == 0 else block_m


def _branch_irs(spec: Spec, orders, query_order, lanes: _Lanes, block_m: int,
                tuning: dict) -> list[ir.BranchIR]:
    """Each branch's index maps (SPEC §2: key u = s*w + o + r*j, kept lanes u mod w mod r)."""
    # Lane branches that read through a curve table copy the rows they keep into compact
    # curve-ordered buffers once per call and walk those (BranchIR.curve_rows): a gather of
    # whole rows costs far less than table loads inside every key loop (issue 12)
    curve_rows_on = bool(tuning.get("curve_rows", True))
    branches = []
    for i, (w, r) in enumerate(spec.branches()):
        order = orders[i]
        key_map = _key_map(w, r)
        keep_map = _keep_map(w, r) if lanes.row_membership(i, r, order) else None
        if lanes.block and r > 1:
            head_offset = ir.AffineMap(sympy.floor(h / -(-spec.num_heads // r)))
        else:
            head_offset = None   # h mod r (and r = 1: 0 either way)
        branches.append(ir.BranchIR(
            index=i, segment_length=w, dilation=r, key_map=key_map, keep_map=keep_map,
            # single_segment: tiles nest in segments; a ring window must also start on a
            # tile boundary (the runtime passes ALIGNED), else its tiles loop over segments
            order=order, single_segment=lanes.lane[i] or w % (lanes.lattice * block_m) == 0,
            keys_per_query=-(-w // r), lanes=lanes.lane[i], head_offset=head_offset,
            zero_pad=lanes.zero_pad,
            curve_rows=(curve_rows_on and lanes.lane[i] and (order or query_order) is not None
                        and head_offset is None)))
    return branches


@lru_cache(maxsize=1024)
def _key_map(w: int, r: int) -> ir.AffineMap:
    """Key u = s*w + o + r*j of lane j of segment s, offset o (SPEC §2)."""
    return ir.AffineMap(sympy.expand(s * w + o + r * j))


@lru_cache(maxsize=1024)
def _keep_map(w: int, r: int) -> ir.AffineMap:
    """The lane offset of query u inside its segment, in the branch's own order: (u mod w) mod r
    (made once per (w, r): sympy's simplify takes milliseconds)."""
    return ir.AffineMap(sympy.simplify(sympy.Mod(sympy.Mod(u, w), r)))


def _query_tiling(branches, lattice: int, block_m: int, query_order) -> ir.QueryTiling:
    """Query classes of the fused kernel, longest work first: class d is kept by its
    branches with r | d."""
    work = [sum(b.keys_per_query for b in branches if not b.lanes
                and (b.keep_map is not None or delta % b.dilation == 0))
            for delta in range(lattice)]
    class_order = tuple(sorted(range(lattice), key=lambda x: (-work[x], x)))
    return ir.QueryTiling(
        lattice=lattice, class_order=class_order,
        class_work=tuple(work[x] for x in class_order), block_m=block_m,
        query_map=ir.AffineMap(sympy.expand(c + lattice * m)), order=query_order)


def _dual_chain(spec: Spec, target: Target, tiles: _Tiles, branches, query_order,
                tuning: dict) -> bool:
    """Two chains per fused tile (KernelConfig.dual_chain): both halves must share every key
    block, so every fused branch is a raster class branch whose tiles nest in segments;
    non-causal (a causal diagonal would differ per half), one device. Sets its tile."""
    fused_now = [b for b in branches if not b.lanes]
    ok = (spec.ring_size == 1 and query_order is None and not spec.causal and tiles.block_m % 32 == 0
          and bool(fused_now) and all(b.keep_map is None and b.order is None and b.single_segment
                                      for b in fused_now))
    dual = ok and bool(tuning.get("dual_chain", target.dual_chain(tiles.tile_d, tiles.itemsize)))
    if dual and "num_warps" not in tuning:
        tiles.warps = target.dual_chain_tile[0]
    if dual and "block_n" not in tuning:
        tiles.block_n = target.dual_chain_tile[1]
    return dual


def _in_fused_dkdv(b: ir.BranchIR, lattice: int) -> bool:
    """Whether the fused dK/dV takes branch b (BranchIR.fused_dkdv): membership by query class,
    and r | L, since its key class c keeps the keys of branch (w, r) in head h iff r | c - h.
    Lane branches that tuning `lanes` took out of the lattice have r not dividing L."""
    return b.keep_map is None and lattice % b.dilation == 0


def _fused_dkdv(spec: Spec, target: Target, tiles: _Tiles, branches, lanes: _Lanes,
                query_order, tuning: dict, give_way: bool = False) -> bool:
    """One dK/dV launch for every branch, over key tiles of the query lattice (keys
    u = c + L*m, class c kept by the same branches as query class c): possible when every
    branch is a raster lattice branch (no row membership, no curve table), the key tile
    nests in every segment, and there is no ring (whose windows use the per-branch kernel).
    dK, dV do not depend on the forward's query tiling, so it takes every lattice branch whose
    r divides L, lane branch or not; the row-membership branches, and lane branches that tuning
    `lanes` took out of L, take the per-branch dK/dV after it (adding into its dK, dV;
    runtime.grids.dkdv_per_branch). Sets the dK/dV tile (tiles.bwd_kv). `give_way`: untuned,
    the Gluon lane backward runs in its place (gluon_plan.lanes_bwd_in_place_of_fused)."""
    fused_set = [b for b in branches if _in_fused_dkdv(b, lanes.lattice)]

    def fusable(kv_tile) -> bool:
        return (spec.ring_size == 1 and bool(fused_set) and not lanes.block
                and target.fused_dkdv_ok(spec.causal, lanes.dkdv_lattice)
                and bool(tuning.get("fused_dkdv", not give_way))
                and not any(b.order is not None for b in fused_set) and query_order is None
                and all(b.keep_map is None for b in fused_set)
                and all(b.segment_length % (lanes.lattice * kv_tile[0]) == 0 for b in fused_set))
    fused_tile = target.fused_dkdv_tile(tiles.tile_d, tiles.itemsize, spec.causal)
    if fused_tile and "bwd_kv" not in tuning and fusable(fused_tile):
        tiles.bwd_kv = fused_tile
    return fusable(tiles.bwd_kv)


def _dkdv_rows_first(spec: Spec, tuning: dict, gluon_dkdv_lanes: bool, tile_d: int) -> bool:
    """KernelConfig.dkdv_rows_first: the tuning's, for a dropout plan (its `tl` dK/dV) or a plan
    whose per-branch dK/dV is Gluon; asked of another plan, refused. By default on for the Gluon
    per-branch dK/dV at head_dim 128 without dropout (a dropout plan's Gluon blocks hold queries
    along rows anyway): it spills 48 bytes a thread there, not 1,144 (Triton 3.6's ptxas), and
    on one H200 causal fwd+bwd takes A 4.08 ms, not 4.41, and B 19.60, not 20.54; at head_dim
    64, C takes 3.55 against 3.45, so it stays off (bench/results/backward_rows_first-2026-11-30-h200.json,
    gluon_dkdv_rows_first_spills-2026-11-30-sm90.json)."""
    if "dkdv_rows_first" not in tuning:
        return gluon_dkdv_lanes and tile_d == 128 and not tuning.get("dropout")
    asked = bool(tuning["dkdv_rows_first"])
    if asked and not tuning.get("dropout") and not gluon_dkdv_lanes:
        raise SpecError(f"{spec.name}: tuning dkdv_rows_first applies to the dropout plan's dK/dV or to the "
                        f"Gluon per-branch dK/dV, which this plan does not run; add 'dropout': True or leave it out")
    return asked


def _config(spec: Spec, target: Target, tiles: _Tiles, branches, lanes: _Lanes,
            dual_chain: bool, tuning: dict, gluon: dict | None = None) -> ir.KernelConfig:
    """The kernel config; `gluon`: the sm90 Gluon kernels' fields (gluon_plan), if any."""
    # dq keeps the forward's query tiling, so its rows may only be the block halved
    # (a halved tile still nests in every segment)
    dq_m = tiles.block_m
    while dq_m > tiles.bwd_dq[0] and dq_m % 32 == 0:
        dq_m //= 2
    # Non-causal lane branches that all walk compact curve copies (Hilbert segment scope, F)
    # read them through descriptors with 128 x 128 tiles, as the causal lanes do (H200, F
    # forward with the fused kernel's descriptors: 2.279 -> 2.182 ms, fwd+bwd 9.630 -> 9.503;
    # measured at head_dim 128 only)
    lanes_now = [b for b in branches if b.lanes]
    curve_lanes = (not spec.causal and bool(lanes_now) and all(b.curve_rows for b in lanes_now)
                   and target.lane_tma and tiles.itemsize == 2 and tiles.tile_d == 128)
    lane_fwd = tiles.lane_fwd
    if curve_lanes and "lane_fwd" not in tuning:
        lane_fwd = target.lane_table(tiles.tile_d, tiles.itemsize, causal=True)[0]
    # descriptors pay off on square causal diagonals (measured); non-causal lane branches
    # keep pointer loads, and so do padded head dims (their masked columns are pointer
    # loads' job)
    pointer_only = tiles.head_dim_pad is not None
    sixteen_bit = spec.dtype != "float32"
    return ir.KernelConfig(
        block_m=tiles.block_m, block_n=tiles.block_n, num_warps=tiles.warps,
        num_stages=tiles.stages, bwd_kv=tuple(tiles.bwd_kv),
        bwd_dq=(dq_m,) + tuple(tiles.bwd_dq[1:]),
        lane_fwd=tuple(lane_fwd), lane_dq=tuple(tiles.lane_dq),
        lane_tma=not pointer_only and bool(tuning.get("lane_tma", target.lane_tma and (
            spec.causal or lanes.sparse_lanes or curve_lanes) and sixteen_bit)),
        lane_ws=not pointer_only and bool(tuning.get("lane_ws", target.lane_ws and (
            spec.causal or lanes.sparse_lanes) and sixteen_bit)),
        lane_dq_tma=not pointer_only and bool(tuning.get("lane_dq_tma", target.lane_dq_tma
                                                         and spec.causal and sixteen_bit)),
        lane_tiles_fastest=bool(tuning.get("lane_tiles_fastest", target.lane_tiles_fastest)),
        fused_tma=tiles.fused_tma,
        fused_ws=tiles.fused_tma and bool(tuning.get("fused_ws", False)),
        fold_scale=bool(tuning.get("fold_scale", target.fold_scale)),
        dual_chain=dual_chain,
        l2_bytes=target.l2_bytes or 0,
        lattice_group=int(tuning.get("lattice_group", 0)),
        bwd_tma=tiles.bwd_tma,
        dkdv_rows_first=_dkdv_rows_first(spec, tuning, (gluon or {}).get("gluon_dkdv_lanes", False), tiles.tile_d),
        decode=tuple(tuning.get("decode", target.decode_table(tiles.tile_d, tiles.itemsize))),
        **(gluon or {}),
        dot_precision="ieee" if spec.dtype == "float32" else None)
