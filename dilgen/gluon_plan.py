"""The planner's sm90 Gluon choices: whether a plan runs its forward (KernelConfig.gluon_fwd,
templates/gluon_fwd.py.jinja), its fused dK/dV (KernelConfig.gluon_dkdv,
templates/gluon_bwd.py.jinja), its dQ (KernelConfig.gluon_dq, templates/gluon_dq.py.jinja) and
its lane branches (KernelConfig.gluon_lanes, templates/gluon_lanes.py.jinja) and its causal
backward per branch (KernelConfig.gluon_lanes_bwd, templates/gluon_lanes_bwd.py.jinja) as
warp-specialized Gluon kernels, and why not (one line).

The first three take the same plans: non-causal raster rows of float16 / bfloat16 at head_dim
64 or 128, every branch a lattice branch (r | w) with the same head offsets, whole 128 x L tiles
in every segment. The lanes take the lane branches of such rows that have r | w and whole
128-lane tiles, causal or not; the causal backward per branch takes the branches so (the
`tl` kernels run the others in the same call) and needs an r = 1 branch. The runtime takes them for calls whose every segment is whole."""
from __future__ import annotations

import math

from .spec import Spec, SpecError
from .targets import Target


def gluon_available() -> bool:
    """Triton's Gluon dialect with Hopper's async warpgroup MMA (Triton 3.6 has it)."""
    try:
        from triton.experimental.gluon.language.nvidia import hopper
    except ImportError:
        return False
    return hasattr(hopper, "warpgroup_mma") and hasattr(hopper, "warpgroup_mma_wait")


def gluon_fwd(spec: Spec, target: Target, tiles, branches, lattice: int, query_order,
              tuning: dict) -> tuple[int, int] | None:
    """The Gluon forward's (keys per block, K/V stages) (KernelConfig.gluon_fwd), or None: the
    target's default for the head_dim, or the tuning's `gluon_fwd` (true, false, or the pair).
    It takes the lattice branches; lane branches beside them (r not dividing w, or a Hilbert
    curve's) keep their own launches after it. A tuning that asks for it where it cannot run
    is refused with the reason."""
    want = tuning.get("gluon_fwd", tiles.tile_d in target.gluon_fwd_default)
    if not want:
        return None
    tile = {d: (bn, st) for d, bn, st in target.gluon_fwd_tiles}.get(tiles.tile_d)
    if isinstance(want, (list, tuple)) and tile is not None:    # a head_dim the target runs
        tile = tuple(want)
    fused = [b for b in branches if not b.lanes]     # lane branches run in their own launches after it
    why = (_refusal(spec, target, tiles, fused, query_order, tile, lattice_only=True)
           or (None if fused else "every branch runs as lanes (gluon_lanes)")
           or _forward_refusal(tiles, target, fused, lattice, tile))
    if why is not None:
        if "gluon_fwd" in tuning:
            raise SpecError(f"{spec.name}: tuning gluon_fwd cannot run here: {why}")
        return None
    return tile


def gluon_lanes(spec: Spec, target: Target, tiles, branches, query_order, tuning: dict) -> tuple[int, int] | None:
    """The Gluon lanes' (keys per block, K/V stages) (KernelConfig.gluon_lanes), or None: the
    target's default for the head_dim, or the tuning's `gluon_lanes` (true, false, or the pair);
    the forward's tile by default. It takes the lane branches gluon_lane_branch admits, causal
    or not (LongNet's r = 6 and 12, which do not divide w, keep the `tl` lane kernel beside it
    in the same call; with no r = 1 branch its first launch writes "no branch" into the other
    offsets' rows); a plan with none runs none."""
    want = tuning.get("gluon_lanes", tiles.tile_d in target.gluon_lanes_default)
    if not want:
        return None
    tile = {d: (bn, st) for d, bn, st in target.gluon_fwd_tiles}.get(tiles.tile_d)
    if isinstance(want, (list, tuple)) and tile is not None:
        tile = tuple(want)
    lanes = [b for b in branches if b.lanes]
    taken = [b for b in lanes if tile and gluon_lane_branch(b.segment_length, b.dilation, tile[0])]
    curve = _curve_lanes(spec, lanes, query_order, tuning)     # else Hilbert lanes are refused below
    why = (_refusal(spec, target, tiles, branches, query_order, tile, lanes=True, curve_lanes=bool(curve))
           or (None if lanes else "the plan has no lane branch")
           or (None if taken else f"no lane branch has r | w with w / r a multiple of 128 and of {tile[0]} "
                                  "keys")
           or _forward_refusal(tiles, target, taken, 1, tile))
    if why is not None:
        if "gluon_lanes" in tuning:
            raise SpecError(f"{spec.name}: tuning gluon_lanes cannot run here: {why}")
        return None
    if spec.causal and all(b.dilation != 1 for b in branches) and "gluon_lanes" not in tuning:
        return None     # causal with no r = 1 branch: level with the `tl` lanes (H200, D 0.362 against 0.356 ms)
    return tile


# A Hilbert plan's curve lanes in Gluon by default ({"gluon_curve_lanes": false} declines them).
# H200, against the `tl` curve lanes: F forward 1.82 -> 1.68 ms, fwd+bwd 8.64 -> 8.51
# (bench/results/forward_curve_lanes-2026-11-29-h200.json); F causal forward 1.74 -> 1.43,
# fwd+bwd 6.63 -> 6.31 (forward_curve_lanes_causal-2026-11-29-h200.json)
GLUON_CURVE_LANES_DEFAULT = True


def _curve_lanes(spec: Spec, lanes, query_order, tuning: dict) -> bool | None:
    """Whether the Gluon lanes run a plan's curve lanes (KernelConfig.gluon_curve_lanes): True;
    None for a plan with no curve lanes; False for one whose curve lanes stay `tl` (a tuning's
    false, or a plan they cannot run). They take specs whose every lane branch with a curve
    table walks compact curve copies (BranchIR.curve_rows; raster lane branches, a causal
    plan's r = 1, keep the `tl` lane kernel beside them) and whose queries are raster rows;
    causal ones read the curve's causal block lists (runtime.curve_rows.block_lists)."""
    if not any(b.curve_rows for b in lanes):
        if tuning.get("gluon_curve_lanes"):
            raise SpecError(f"{spec.name}: tuning gluon_curve_lanes needs lane branches with Hilbert curve "
                            "tables (hilbert scope \"segment\", r > 1)")
        return None
    want = tuning.get("gluon_curve_lanes", GLUON_CURVE_LANES_DEFAULT)
    if not isinstance(want, bool):
        raise SpecError(f"{spec.name}: tuning gluon_curve_lanes takes true or false (asked: {want!r})")
    why = ("the queries are in curve order (hilbert scope \"sequence\")" if query_order is not None else
           "a lane branch reads its curve table in its inner loops"
           if any(b.order is not None and not b.curve_rows for b in lanes) else None)
    if want and why is not None:
        if "gluon_curve_lanes" in tuning:
            raise SpecError(f"{spec.name}: tuning gluon_curve_lanes cannot run here: {why}")
        return False
    return want


def gluon_curve_lanes(spec: Spec, branches, query_order, tuning: dict, lanes_tile) -> bool:
    """KernelConfig.gluon_curve_lanes: the Gluon lanes (lanes_tile) run curve lanes."""
    return bool(lanes_tile) and bool(_curve_lanes(spec, [b for b in branches if b.lanes], query_order, tuning))


def gluon_raster_lanes(spec: Spec, target: Target, branches, tuning: dict, lanes_tile, curve: bool,
                       dropout: bool) -> bool:
    """KernelConfig.gluon_raster_lanes: beside the curve lanes, a Gluon lane kernel built for
    raster rows takes the lane branches that read no curve table (F causal's r = 1 branch,
    else `tl`): the tuning's `gluon_raster_lanes`, untuned the target's
    gluon_raster_lanes_default; refused by name where it cannot run."""
    want = tuning.get("gluon_raster_lanes", target.gluon_raster_lanes_default)
    if not isinstance(want, bool):
        raise SpecError(f"{spec.name}: tuning gluon_raster_lanes takes true or false (asked: {want!r})")
    raster = [b for b in branches if b.lanes and not b.curve_rows and lanes_tile
              and gluon_lane_branch(b.segment_length, b.dilation, lanes_tile[0])]
    why = ("the plan's lanes do not run in the Gluon curve kernel" if not curve else
           "a dropout plan's lanes stay in one kernel" if dropout else
           None if raster else "no raster lane branch has r | w with w / r whole tiles of 128 lanes")
    if want and why is not None and "gluon_raster_lanes" in tuning:
        raise SpecError(f"{spec.name}: tuning gluon_raster_lanes cannot run here: {why}")
    return bool(want) and why is None


def gluon_pdl(spec: Spec, target: Target, tuning: dict, lanes_tile) -> bool:
    """KernelConfig.gluon_pdl: the Gluon lane launches go with programmatic dependent launch
    (a merging launch's programs compute while the launch before it drains, and wait for it
    only at the merge): the tuning's `gluon_pdl`, untuned the target's gluon_pdl_default;
    refused by name where it cannot run."""
    want = tuning.get("gluon_pdl", target.gluon_pdl_default)
    if not isinstance(want, bool):
        raise SpecError(f"{spec.name}: tuning gluon_pdl takes true or false (asked: {want!r})")
    why = "no branch runs in the Gluon lanes" if not lanes_tile else None
    if want and why is not None and "gluon_pdl" in tuning:
        raise SpecError(f"{spec.name}: tuning gluon_pdl cannot run here: {why}")
    return bool(want) and why is None


def gluon_lane_branch(w: int, r: int, keys: int) -> bool:
    """Whether the Gluon lanes take a lane branch (w, r): r | w, and a segment's w / r lanes are
    whole tiles of 128 query lanes and blocks of `keys` key lanes."""
    return w % r == 0 and (w // r) % 128 == 0 and (w // r) % keys == 0


def gluon_rows_lane_branch(w: int, r: int, keys: int) -> bool:
    """Whether the Gluon lanes over rows that start anywhere (the `_lanes_packed` kernel:
    packed rows, and a fixed-length call's branches with r not dividing w) take branch (w, r):
    gluon_lane_branch's, and r not dividing w with at least 128 lanes a segment (LongNet's
    r = 6 and 12: lane o of a segment holds ceil((w - o) / r) rows, its last tile partial)."""
    return gluon_lane_branch(w, r, keys) or (w % r != 0 and w // r >= 128)


# The Gluon lane backward's key blocks (templates/gluon_lanes_bwd.py.jinja: 128 query lanes by
# 64 key lanes a step)
LANES_BWD_KEYS = 64


def gluon_lanes_bwd_branch(w: int, r: int) -> bool:
    """Whether the Gluon lane backward (per-branch dK/dV, lane dq) takes branch (w, r); the `tl`
    per-branch kernels run the others in the same call (LongNet's r = 6 and 12 beside r = 1, 2, 4)."""
    return gluon_lane_branch(w, r, LANES_BWD_KEYS)


# A dropout plan's per-branch dK/dV holds each consumer's (P Z)^T and dS^T tiles beside its
# ring of Q/dO blocks: 3 stages leave them the room at head_dim 128
DROPOUT_LANE_DKDV_STAGES = 3


def gluon_lanes_bwd(spec: Spec, target: Target, tiles, branches, query_order, fused_dkdv: bool,
                    tuning: dict, dropout: bool = False) -> int | None:
    """The Gluon lane backward's stages (KernelConfig.gluon_lanes_bwd: the per-branch dK/dV,
    every branch, and the lane dq), or None (_backward_stages, then the branches' tiles); it
    runs where no fused dK/dV does (templates/gluon_lanes_bwd.py.jinja)."""
    extra = "the backward runs the fused dK/dV kernel here" if fused_dkdv else None
    # 3 stages where a dropout plan's tiles or gluon_dkdv_dq's TMA reduce staging (16 KB a
    # warpgroup at head_dim 128) share the shared memory with the Q/dO ring
    staged = dropout or (tuning.get("gluon_dkdv_dq") and tiles.tile_d == 128)
    default = DROPOUT_LANE_DKDV_STAGES if staged else target.gluon_lanes_bwd_stages
    stages = _backward_stages("gluon_lanes_bwd", target.gluon_lanes_bwd_default, default,
                              spec, target, tiles, branches, 1, query_order, tuning, extra, lanes=True,
                              dropout=dropout)
    if (stages is not None and all(b.dilation != 1 for b in branches) and "gluon_lanes_bwd" not in tuning
            and not lanes_bwd_without_r1(spec, target, tiles.tile_d, dropout)):
        return None     # no r = 1 branch (config D), causal or at head_dim 64: the `tl` kernels unless asked
    bad = [b for b in branches if not gluon_lanes_bwd_branch(b.segment_length, b.dilation)]
    if stages is not None and len(bad) == len(branches):
        if "gluon_lanes_bwd" in tuning:
            raise SpecError(f"{spec.name}: tuning gluon_lanes_bwd cannot run here: no branch has r | w with "
                            f"w / r a multiple of 128 (segment length {bad[0].segment_length}, r = {bad[0].dilation})")
        return None
    return stages


def gluon_rows_lanes_bwd_branch(w: int, r: int) -> bool:
    """gluon_rows_lane_branch for the Gluon lane backward over rows that start anywhere (the
    `_dkdv_lanes_packed` and `_dq_lanes_packed` kernels)."""
    return gluon_rows_lane_branch(w, r, LANES_BWD_KEYS)


def lanes_bwd_without_r1(spec: Spec, target: Target, tile_d: int, dropout: bool) -> bool:
    """Whether a plan with no r = 1 branch (config D) runs the Gluon lane backward untuned:
    non-causal, without dropout, at the target's head dims (Target.gluon_lanes_bwd_no_r1) and
    on lanes no longer than it was measured on (w / r keys, Target.gluon_lanes_bwd_no_r1_lane),
    in place of the fused dK/dV (planner._fused_dkdv asks here first)."""
    longest = max(w // r for w, r in zip(spec.segment_lengths, spec.dilation_rates))
    return (not spec.causal and not dropout and tile_d in target.gluon_lanes_bwd_no_r1
            and longest <= target.gluon_lanes_bwd_no_r1_lane)


def lanes_bwd_in_place_of_fused(spec: Spec, target: Target, tiles, branches, query_order, tuning: dict,
                                dropout: bool) -> bool:
    """Whether the fused dK/dV gives way to the Gluon lane backward untuned: a plan with no
    r = 1 branch where lanes_bwd_without_r1 holds and the lane backward would run without it
    (neither `fused_dkdv` nor `gluon_lanes_bwd` false in the tuning)."""
    if ("fused_dkdv" in tuning or tuning.get("gluon_lanes_bwd", True) is False
            or any(b.dilation == 1 for b in branches)
            or not lanes_bwd_without_r1(spec, target, tiles.tile_d, dropout)):
        return False
    untuned = {k: v for k, v in tuning.items() if k != "gluon_lanes_bwd"}
    return gluon_lanes_bwd(spec, target, tiles, branches, query_order, False, untuned, dropout) is not None


def gluon_dkdv_lanes(spec: Spec, target: Target, lanes_bwd: int | None, tuning: dict) -> bool:
    """Whether the Gluon causal backward (stages `lanes_bwd`) takes the per-branch dK/dV too
    (KernelConfig.gluon_dkdv_lanes), else only the lane dq. Asked for where the plan runs no
    Gluon causal backward, refused by name."""
    want = bool(tuning.get("gluon_dkdv_lanes", target.gluon_dkdv_lanes))
    if want and lanes_bwd is None and tuning.get("gluon_dkdv_lanes"):
        raise SpecError(f"{spec.name}: tuning gluon_dkdv_lanes needs the Gluon causal backward, which this plan "
                        f"does not run; ask for it with {{\"gluon_lanes_bwd\": true}} to see why")
    return want and lanes_bwd is not None


def gluon_dkdv_dq(spec: Spec, dkdv_lanes: bool, tuning: dict) -> bool:
    """KernelConfig.gluon_dkdv_dq: the tuning's (off by default), for a plan whose per-branch
    dK/dV is Gluon on every branch (its blocks then hold queries along rows and add dQ, and no
    dq kernel runs); asked of any other plan, refused by name."""
    want = tuning.get("gluon_dkdv_dq", False)
    if not isinstance(want, bool):
        raise SpecError(f"{spec.name}: tuning gluon_dkdv_dq takes true or false (asked: {want!r})")
    why = ("a plan whose per-branch dK/dV is not Gluon" if not dkdv_lanes else
           None if all(gluon_lanes_bwd_branch(w, r) for w, r in spec.branches()) else
           "a branch's dK/dV runs in the `tl` kernel (w / r not a multiple of 128), which adds no dQ")
    if want and why is not None:
        raise SpecError(f"{spec.name}: tuning gluon_dkdv_dq cannot run here: {why} (it is the Gluon per-branch "
                        f"dK/dV adding dQ; ask for that with {{\"gluon_lanes_bwd\": true, \"gluon_dkdv_lanes\": true}} "
                        f"to see why)")
    return want


def gluon_dkdv_prefetch(spec: Spec, tile_d: int, dkdv: int | None, tuning: dict) -> bool:
    """KernelConfig.gluon_dkdv_prefetch: the tuning's, else true at head_dim 64 and false at
    128. False loads each block's lse and Delta at its top, holding one copy in registers, not
    two: A's dK/dV at head_dim 128 spills 732 bytes with the prefetch, 44 without it
    (bench/results/gluon_dkdv_spills-2026-11-29-sm90.json), and its backward runs 6.76 -> 6.25
    ms on one H200, B 32.81 -> 30.31; at head_dim 64 there is no spill to save and the prefetch
    wins, C 4.82 -> 4.63 (bench/results/backward-2026-11-29-h200-prefetch.json). Asked of a
    plan with no Gluon dK/dV, refused by name."""
    want = tuning.get("gluon_dkdv_prefetch", dkdv is None or tile_d < 128)   # no Gluon dK/dV: moot
    if not isinstance(want, bool):
        raise SpecError(f"{spec.name}: tuning gluon_dkdv_prefetch takes true or false (asked: {want!r})")
    if "gluon_dkdv_prefetch" in tuning and dkdv is None:
        raise SpecError(f"{spec.name}: tuning gluon_dkdv_prefetch needs the Gluon dK/dV, which this plan does not "
                        f"run; ask for it with {{\"gluon_dkdv\": true}} to see why")
    return want


def gluon_exp2(spec: Spec, target: Target, tiles, gluon: dict, tuning: dict) -> int:
    """KernelConfig.gluon_exp2: the target's for the head_dim, or the tuning's `gluon_exp2`
    (0, 2, 4 or 8); a plan running neither the Gluon forward nor its lanes takes 0, and a
    tuning asking it of one is refused."""
    if not (gluon["gluon_fwd"] or gluon["gluon_lanes"]):
        if tuning.get("gluon_exp2"):
            raise SpecError(f"{spec.name}: tuning gluon_exp2 needs the Gluon forward or lanes, which this plan "
                            f"does not run; ask for them with {{\"gluon_fwd\": true}} or {{\"gluon_lanes\": true}} "
                            f"to see why")
        return 0
    return tuning.get("gluon_exp2", dict(target.gluon_exp2).get(tiles.tile_d, 0))


def _beside_lanes(name: str, target: Target, branches, tuning: dict) -> list | None:
    """The branches a Gluon backward kernel (`name`) takes while the lane branches run their
    own `tl` launches after it, adding into its gradients: the ones that are not lanes (the
    forward's lattice, L), where the tuning asks for `name` (untuned: where the target's
    gluon_bwd_beside_lanes says so) and the plan has both kinds; else None. Lane branches of
    row membership (r not dividing w, a curve table) and lattice ones that tuning `lanes`
    chose alike: the runtime's per-branch dK/dV then runs every lane branch."""
    lanes = [b for b in branches if b.lanes]
    fused = [b for b in branches if not b.lanes]
    asked = tuning[name] if name in tuning else target.gluon_bwd_beside_lanes
    return fused if lanes and fused and asked else None


def gluon_dkdv(spec: Spec, target: Target, tiles, branches, lattice: int, query_order, fused_dkdv: bool,
               tuning: dict) -> int | None:
    """The Gluon dK/dV's Q/dO stages (KernelConfig.gluon_dkdv), or None (_backward_stages);
    it replaces the fused `tl` dK/dV, so a plan without one runs none. Beside lane branches
    only where asked (_beside_lanes)."""
    extra = None if fused_dkdv else \
        "the backward runs per-branch dK/dV kernels here (the fused one's key tile does not nest)"
    part = _beside_lanes("gluon_dkdv", target, branches, tuning)
    return _backward_stages("gluon_dkdv", target.gluon_dkdv_default, target.gluon_dkdv_stages, spec, target,
                            tiles, part or branches, lattice, query_order, tuning, extra, lattice_only=bool(part))


def gluon_dq(spec: Spec, target: Target, tiles, branches, lattice: int, query_order, tuning: dict,
             default_dims: tuple[int, ...] | None = None) -> int | None:
    """The Gluon dQ's K/V stages (KernelConfig.gluon_dq), or None (_backward_stages); by default
    at the target's head dims, or at `default_dims` (the dropout plan's). Beside lane branches
    only where asked (_beside_lanes)."""
    dims = target.gluon_dq_default if default_dims is None else default_dims
    part = _beside_lanes("gluon_dq", target, branches, tuning)
    return _backward_stages("gluon_dq", dims, target.gluon_dq_stages, spec, target,
                            tiles, part or branches, lattice, query_order, tuning, lattice_only=bool(part))


def _backward_stages(name: str, default_dims, default_stages: int, spec: Spec, target: Target, tiles, branches,
                     lattice: int, query_order, tuning: dict, extra: str | None = None,
                     lanes: bool = False, dropout: bool = False, lattice_only: bool = False) -> int | None:
    """A Gluon backward kernel's stages, or None: the target's default for the head_dim, or the
    tuning's `name` (true, false, or the stages). A tuning that asks for it where it cannot run
    (the reasons shared with the forward, `extra`, its own limits) is refused with the reason."""
    want = tuning.get(name, tiles.tile_d in default_dims)
    if want is False or want is None:
        return None
    stages = default_stages if want is True else want
    tile = {d: (bn, st) for d, bn, st in target.gluon_fwd_tiles}.get(tiles.tile_d)
    why = (_refusal(spec, target, tiles, branches, query_order, tile, lanes, lattice_only=lattice_only) or extra
           or _backward_refusal(name, tiles, target, [b for b in branches if not lanes or gluon_lanes_bwd_branch(
               b.segment_length, b.dilation)], lattice, stages, dropout))
    if why is not None:
        if name in tuning:
            raise SpecError(f"{spec.name}: tuning {name} cannot run here: {why}")
        return None
    return stages


def _refusal(spec: Spec, target: Target, tiles, branches, query_order, tile, lanes: bool = False,
             lattice_only: bool = False, curve_lanes: bool = False) -> str | None:
    """Why no Gluon kernel can run this plan (one line), or None; `lanes`: for the lane kernels,
    which take the branches with r | w beside `tl` ones (gluon_lane_branch,
    gluon_lanes_bwd_branch), causal or not, and need no r = 1 branch (their first launch writes
    "no branch" into the rows its branch does not keep, CLEAR); `lattice_only`: `branches` are
    the forward's lattice branches, which read no table even when a Hilbert spec's lane branches
    do; `curve_lanes`: the forward lanes of Hilbert curve branches, which read compact copies
    (_curve_lanes)."""
    if not target.gluon_fwd_tiles:
        return f"target {target.name} has no Gluon kernels (sm90 at head_dim 64 or 128 has)"
    if tile is None:
        dims = " or ".join(str(d) for d, _, _ in target.gluon_fwd_tiles)
        return f"it takes head_dim {dims}, not {spec.head_dim}"
    if not gluon_available():
        return "this Triton has no triton.experimental.gluon with Hopper's warpgroup_mma"
    # rows permuted into a sequence curve's order around the kernels (planner._row_order) read no table
    permuted = spec.rows_in_curve_order
    checks = [
        (spec.causal and not lanes, "causal specs run their branches as lane kernels (gluon_lanes)"),
        (spec.ring_size > 1, "a ring runs its own window kernels"),
        (query_order is not None or (any(b.order is not None for b in branches) if lattice_only or permuted
                                     else spec.hilbert is not None and not curve_lanes),
         "Hilbert orders read through tables"),
        (tiles.itemsize != 2 or tiles.head_dim_pad is not None, "it takes float16 or bfloat16 "
         "with head_dim 64 or 128"),
        (not lanes and any(b.lanes for b in branches),
         "a branch runs as lanes (r does not divide w, a curve table, or tuning lanes)"),
        (any(b.head_offset is not None for b in branches), "head_offsets 'block' moves the offsets"),
        (not lanes and branches and all(b.dilation != 1 for b in branches), "it needs a branch with r = 1 (so "
         "that every query class keeps a branch)"),
    ]
    for failed, why in checks:
        if failed:
            return why
    return None


def _forward_refusal(tiles, target: Target, branches, lattice: int, tile) -> str | None:
    """The forward's and the lanes' limits (lattice 1: a lane tile is 128 lanes of a segment)."""
    keys, stages = tile
    if keys not in (64, 128) or not 2 <= stages <= 8:
        return f"keys per block must be 64 or 128 and stages 2 to 8 (asked: {list(tile)})"
    smem = (2 * stages * keys + 2 * 64) * tiles.tile_d * tiles.itemsize + 1024   # K, V ring; Q; barriers
    if smem > target.smem_bytes:
        return (f"{stages} stages of {keys} keys at head_dim {tiles.tile_d} need {smem} bytes of shared "
                f"memory, {target.name} has {target.smem_bytes}: fewer stages or keys")
    for b in branches:
        if not lattice_tiles_fit(b.segment_length, b.dilation, lattice, keys):
            return (f"segment length {b.segment_length} (r = {b.dilation}) must be a multiple of "
                    f"128 x L = {128 * lattice} with w / r a multiple of {keys} keys")
    return None


def gluon_split(spec: Spec, target: Target, tiles, lattice_ok: list) -> tuple:
    """Tuning lanes = "split" (and sm90's "auto", Target.split_wide_lattice): the lattice branches
    (`lattice_ok`), highest rate first, to run as lanes until the rest's L lets the Gluon forward
    take them (every fused segment a multiple of 128 x L rows, w / r whole blocks of keys); ()
    where no such split leaves two fused branches. The raster spec w 2K … 1M, r 1 … 32 has
    L = 32 > 2048 / 128: [5] leaves L = 16 (one H200, 512K rows: fwd+bwd 600.5 -> 384.8 ms,
    bench/results/raster_split-2026-11-30-h200.json)."""
    tile = {d: (bn, st) for d, bn, st in target.gluon_fwd_tiles}.get(tiles.tile_d)
    if tile is None or spec.ring_size > 1 or spec.causal or tiles.itemsize != 2:
        return ()
    branches = list(spec.branches())
    lattice_set = sorted((i for i, ok in enumerate(lattice_ok) if ok), key=lambda i: (-branches[i][1], -i))
    fused = [i for i in range(len(branches)) if lattice_ok[i] or branches[i][1] == 1]
    for n in range(len(lattice_set) + 1):
        chosen, rest = lattice_set[:n], [i for i in fused if i not in lattice_set[:n]]
        L = math.lcm(*[branches[i][1] for i in rest if lattice_ok[i]], 1)
        if len(rest) < 2:
            return ()
        if all(lattice_tiles_fit(*branches[i], L, tile[0]) for i in rest):
            return tuple(sorted(chosen))
    return ()


def lattice_tiles_fit(w: int, r: int, lattice: int, keys: int) -> bool:
    """Whether a lattice branch (w, r) fits the Gluon forward's tiles at lattice L: a segment is
    whole tiles of 128 x L rows, and its w / r key lanes whole blocks of `keys`."""
    return w % (128 * lattice) == 0 and (w // r) % keys == 0


def _backward_refusal(name: str, tiles, target: Target, branches, lattice: int, stages,
                      dropout: bool = False) -> str | None:
    """The dK/dV's and the dQ's own limits: two tiles of 64 rows held (K, V or Q, dO), a ring
    of stages of two 64-row blocks, 64-row blocks of every branch's lanes; a dropout plan's
    lane dK/dV also holds each consumer's (P Z)^T and dS^T (64 x 64)."""
    if not isinstance(stages, int) or isinstance(stages, bool) or not 2 <= stages <= 8:
        return f"{name} takes true, false or the stages 2 to 8 (asked: {stages!r})"
    smem = (2 * 2 + 2 * stages) * 64 * tiles.tile_d * tiles.itemsize + 1024    # held tiles; the ring; barriers
    smem += 4 * 64 * 64 * tiles.itemsize if dropout else 0
    if smem > target.smem_bytes:
        return (f"{stages} stages at head_dim {tiles.tile_d} need {smem} bytes of shared memory, "
                f"{target.name} has {target.smem_bytes}: fewer stages")
    for b in branches:
        if b.segment_length % (128 * lattice) or (b.segment_length // b.dilation) % 64:
            return (f"segment length {b.segment_length} (r = {b.dilation}) must be a multiple of "
                    f"128 x L = {128 * lattice} with w / r a multiple of 64 lanes")
    return None
