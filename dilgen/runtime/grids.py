"""Launch grids of the generated kernels, as pure functions of a plan (dict) and sizes.

The runtime launches with them, and the ahead-of-time build (dilgen.aot.launch_model)
predicts the same launches without tensors, so both read one definition."""
from __future__ import annotations

import math


def lane_order(plan: dict) -> list[int]:
    """The lane branches in launch order, as the planner scheduled them (Plan.lane_order:
    an r = 1 branch first, then the others as the spec lists them)."""
    return list(plan.get("lane_order", ()))


def lane_grid(branch: dict, n: int, block_m: int) -> tuple[int, int]:
    """(segments, lane tiles per segment) of a lane kernel launch for one branch."""
    w, r = branch["w"], branch["r"]
    return math.ceil(n / w), math.ceil(math.ceil(min(w, n) / r) / block_m)


def dkdv_per_branch(plan: dict, fused: bool, gluon: bool) -> list[dict]:
    """The branches whose dK/dV runs the per-branch kernel (one launch each, adding into the
    fused launch's dK, dV): every branch without a fused launch; after the Gluon dK/dV (which
    takes the branches that are not lanes) the lane branches; after the `tl` fused one the
    branches it does not take (BranchIR.fused_dkdv, the planner's choice)."""
    if not fused:
        return list(plan["branches"])
    if gluon:
        return [br for br in plan["branches"] if br["lanes"]]
    return [br for br in plan["branches"] if not br.get("fused_dkdv", False)]


def lattice_group_tiles(plan: dict, n_tiles: int, block: int, row_bytes: int) -> int:
    """Tiles per group of a lattice launch (common.lattice_program; grid classes x n_tiles),
    whose tiles span L*block positions and read row_bytes per position (keys and values of
    a kv head; queries and dO of a kv group for dK/dV). A head whose rows fit in half of L2
    (KernelConfig.l2_bytes) keeps one group, class-major (longest class first over the whole
    sequence); a larger one takes groups of a quarter of L2, so every class of a group finds
    the group's rows in L2 (H200, bf16, B: 16 classes of 2048 positions a tile, 64 MB of keys
    and values per head). KernelConfig.lattice_group > 0 fixes it (tuning)."""
    config = plan["config"]
    if config.get("lattice_group"):
        return max(1, min(int(config["lattice_group"]), n_tiles))
    l2 = config.get("l2_bytes", 0)
    tile_bytes = plan["query"]["lattice"] * block * row_bytes
    if not l2 or n_tiles * tile_bytes <= l2 // 2:
        return n_tiles
    return max(1, min(n_tiles, (l2 // 4) // tile_bytes))


def lane_launch_grid(plan: dict, batch_heads: int, n_seg: int, n_tiles: int, varlen: bool) -> tuple:
    """The launch grid of a lane kernel (forward or dq), as common.lane_program reads it:
    packed batches with KernelConfig.lane_tiles_fastest on (B*H * tiles, segments), else
    (B*H, tiles, segments)."""
    if varlen and plan["config"].get("lane_tiles_fastest"):
        return batch_heads * n_tiles, n_seg
    return batch_heads, n_tiles, n_seg
