"""The packed batch's lines of `dilgen explain --cu-seqlens`: its sequences, segments and tiles
per branch, the runtime's launch groups, and which kernels a packed call runs on sm90
(runtime.gluon_packed)."""
from __future__ import annotations


def packed_summary(plan, cu: list[int]) -> list[str]:
    """The tiles of a packed batch (kernel(q, k, v, cu_seqlens=cu)), in words: each
    sequence restarts the segments of every branch; one lane-kernel launch per branch
    covers every sequence."""
    lengths = [b - a for a, b in zip(cu, cu[1:])]
    longest = max(lengths)
    bm = plan.config.lane_fwd[0]
    lines = [f"  packed batch: {len(lengths)} sequence(s), {cu[-1]} rows, longest {longest} "
             f"(cu_seqlens {','.join(map(str, cu))})"]
    for s, (a, n) in enumerate(zip(cu, lengths)):
        lines.append(f"    sequence {s}: rows [{a}, {a + n}), N = {n}" + ("  (empty)" if n == 0 else ""))
        if n == 0:
            continue
        for b in plan.branches:
            w, r = b.segment_length, b.dilation
            full, tail = divmod(n, w)
            segs = f"{full} x {w}" + (f" + {tail}" if tail else "") if full else f"1 short segment of {tail}"
            tiles = full * -(-(-(-w // r)) // bm) + (-(-(-(-tail // r)) // bm) if tail else 0)
            lines.append(f"      [{b.index}] w = {w}, r = {r}: {segs}; {tiles} query tile(s) of "
                         f"{bm} lanes per head")
    from .runtime.varlen import bucket_order    # the runtime's launch groups
    order, groups = bucket_order(lengths)
    lines.append(f"  launches: {len(groups)} group(s) of sequences of similar length, longest first; "
                 f"each group runs the plan's launches once, its grid sized by its longest sequence")
    for a, e, n in groups:
        lines.append(f"    sequences {sorted(order[a:e])} (longest {n}): {e - a} x {plan.num_heads} "
                     f"(sequence, head) programs per tile")
    return lines + packed_kernels(plan, cu[-1])


def packed_kernels(plan, rows: int) -> list[str]:
    """Which of the plan's Gluon kernels a packed call of `rows` rows runs on sm90
    (runtime.gluon_packed): those over the lattice branches, where the rows are a multiple of
    the lattice L, and a causal plan's lanes, dK/dV and lane dq per branch, where the rows are a
    multiple of its r; dropout and other row counts run `tl`."""
    cfg, L = plan.config, plan.query.lattice
    gluon = [name for name, on in (("forward", cfg.gluon_fwd), ("dK/dV", cfg.gluon_dkdv), ("dQ", cfg.gluon_dq)) if on]
    lines = _packed_lanes(plan, rows)
    if not gluon:
        return lines
    if rows % L:
        return [f"  on sm90: tl kernels, as the rows ({rows}) are not a multiple of L = {L} (the Gluon "
                f"{', '.join(gluon)} read each branch's rows through (rows / r, r * H, D) views): append "
                f"{L - rows % L} row(s) as one more sequence (its output unused) to run them"] + lines
    return [f"  on sm90: {', '.join(gluon)} in Gluon (the rows, {rows}, a multiple of L = {L}); with "
            f"dropout, tl"] + lines


def _packed_lanes(plan, rows: int) -> list[str]:
    """packed_kernels' lines for a causal plan's lane branches and per-branch dK/dV (every
    branch without a fused dK/dV; runtime.grids.dkdv_per_branch): runtime.gluon_packed
    gluon_lanes_packed_launch, gluon_dkdv_lanes_packed_launch, gluon_dq_lanes_packed_launch."""
    from .gluon_plan import gluon_rows_lane_branch, gluon_rows_lanes_bwd_branch
    cfg, lanes = plan.config, [b for b in plan.branches if b.lanes]
    per_branch = lanes if plan.fused_dkdv else list(plan.branches)
    if not plan.causal:
        return [f"  on sm90, lane branch{'es' if len(lanes) > 1 else ''} {', '.join(f'[{b.index}]' for b in lanes)}: "
                f"tl (the Gluon lanes over packed rows are a causal plan's)"] if lanes else []
    fwd, dkdv, dq = (f"gluon_{name}_packed" in plan.gluon_packed_kernels for name in ("lanes", "dkdv_lanes", "dq_lanes"))
    group = plan.num_heads // plan.num_kv_heads
    lines = []
    for b in plan.branches:
        if b not in lanes and b not in per_branch:
            continue
        w, r = b.segment_length, b.dilation
        first_lane = bool(lanes) and b is lanes[0]
        clears = first_lane and plan.gap_lane is not None      # a first lane launch writing the gaps
        bwd = gluon_rows_lanes_bwd_branch(w, r) and rows >= r
        names = [name for name, on in (
            ("lanes", b in lanes and fwd and not clears and rows >= r and gluon_rows_lane_branch(w, r, cfg.gluon_lanes[0])),
            ("dK/dV", b in per_branch and dkdv and bwd
                      and not (plan.dkdv_first_writes and b is per_branch[0] and r > group)),
            ("dq", b in lanes and dq and bwd and not clears)) if on]
        what = "lane branch" if b in lanes else "branch"
        lines.append(f"  on sm90, {what} [{b.index}]: " + (f"{', '.join(names)} in Gluon; with dropout, tl" if names
                                                           else "tl"))
    return lines
