"""Which kernels a plan launches, in words (`dilgen explain`'s "kernels:" line): the forward,
its lane branches, dK/dV and dQ, each `tl` or Gluon, and the branches a Gluon per-branch
kernel leaves to `tl`."""
from __future__ import annotations

from .gluon_plan import gluon_lane_branch, gluon_lanes_bwd_branch, gluon_rows_lane_branch, gluon_rows_lanes_bwd_branch


def _tl_beside(branches: list) -> str:
    """"; tl for branches 3, 4": the branches a Gluon per-branch kernel leaves to `tl`."""
    return f"; tl for branch{'es' if len(branches) > 1 else ''} {', '.join(map(str, branches))}" if branches else ""


def kernel_families(plan) -> str:
    """Which kernels a plan launches, in words: the forward, its lane branches, dK/dV and dQ,
    each `tl` or Gluon (sm90, for calls whose every segment is whole; `tl` otherwise)."""
    cfg = plan.config
    lanes = [b.index for b in plan.branches if b.lanes]
    parts = []
    exp2 = f", 1 exp2 in {cfg.gluon_exp2} on the FMA pipe" if cfg.gluon_exp2 else ""
    if cfg.gluon_fwd:
        parts.append(f"forward Gluon ({cfg.gluon_fwd[0]} keys a block, {cfg.gluon_fwd[1]} stages{exp2})")
    elif len(lanes) < len(plan.branches):
        parts.append("forward tl (fused)")
    gluon_lanes = [i for i in lanes if cfg.gluon_lanes and gluon_lane_branch(
        plan.branches[i].segment_length, plan.branches[i].dilation, cfg.gluon_lanes[0])]
    curve = [i for i in gluon_lanes if plan.branches[i].curve_rows] if cfg.gluon_curve_lanes else []
    raster = [i for i in gluon_lanes if i not in curve and (cfg.gluon_raster_lanes or not cfg.gluon_curve_lanes)]
    # r not dividing w: the lanes over rows that start anywhere (a causal plan's packed lanes,
    # runtime.gluon_packed.one_sequence_launches), but for a first launch writing the gaps
    rows_lanes = [i for i in lanes if i not in gluon_lanes and i != plan.gap_lane
                  and "gluon_lanes_packed" in plan.gluon_packed_kernels
                  and gluon_rows_lane_branch(plan.branches[i].segment_length, plan.branches[i].dilation,
                                             cfg.gluon_lanes[0])]
    for name, which in (("Gluon", raster), ("Gluon over rows", rows_lanes),
                        ("Gluon curve", curve),     # curve: Hilbert lanes' compact copies
                        ("tl", [i for i in lanes if i not in raster + curve + rows_lanes])):
        if which:
            parts.append(f"lanes {name} (branch{'es' if len(which) > 1 else ''} {', '.join(map(str, which))})")
    # the Gluon lane backward takes the branches gluon_lanes_bwd_branch admits, a causal plan's
    # over rows those with r not dividing w (gluon_rows_lanes_bwd_branch), `tl` the rest
    def rest(kernel: str) -> list:
        return [b.index for b in plan.branches if not gluon_lanes_bwd_branch(b.segment_length, b.dilation)
                and not (kernel in plan.gluon_packed_kernels and b.index != plan.gap_lane
                         and gluon_rows_lanes_bwd_branch(b.segment_length, b.dilation))]
    lane_rest = [i for i in lanes if i in rest("gluon_dq_lanes_packed")]
    rows = ", queries along rows" if plan.gluon_dkdv_rows_first else ""
    parts.append(f"dK/dV Gluon ({cfg.gluon_dkdv} stages)" if cfg.gluon_dkdv else
                 f"dK/dV Gluon (per branch, {cfg.gluon_lanes_bwd} stages{rows}{_tl_beside(rest('gluon_dkdv_lanes_packed'))})"
                 if cfg.gluon_dkdv_lanes else
                 "dK/dV tl (" + ("fused" if plan.fused_dkdv else "per branch") + ")")
    dq = [f"Gluon ({cfg.gluon_dq} stages)" if cfg.gluon_dq else
          "tl (fused)" if len(lanes) < len(plan.branches) else None,
          None if not lanes else f"Gluon lanes ({cfg.gluon_lanes_bwd} stages{_tl_beside(lane_rest)})"
          if cfg.gluon_lanes_bwd and len(lane_rest) < len(lanes) else "tl lanes"]
    parts.append("dQ in the dK/dV (TMA reduce-adds into float32)" if cfg.gluon_dkdv_dq else "dQ " + ", ".join(x for x in dq if x))
    gluon = cfg.gluon_fwd or cfg.gluon_dkdv or cfg.gluon_dq or cfg.gluon_lanes or cfg.gluon_lanes_bwd
    return (", ".join(parts) + ("; Gluon for whole segments on sm90, tl otherwise" if gluon else "")
            + ("; the Gluon lane launches overlap (programmatic dependent launch)" if cfg.gluon_pdl else ""))
