"""Attention dropout's plan (Plan.dropout): which kernels a call with dropout_p > 0 runs, as
the tuning the planner lowers a spec's dropout module with (planner.plan with {"dropout":
true}; a causal spec's Gluon lanes are planner._dropout_lanes_plan's)."""
from __future__ import annotations

from .gluon_plan import DROPOUT_LANE_DKDV_STAGES
from .spec import Spec

# Attention dropout's plan (Plan.dropout): every branch in the fused `tl` kernels, which see
# each entry's raster query and key positions (the mask's counter, dilgen.dropout; a sequence
# curve's rows permuted around the kernels count in curve order), with one chain; no curve-row
# kernel, and of the fused Gluon kernels only the forward and dQ (sm90, non-causal, one
# device: their key blocks are whole spans of a branch's lanes, so their threads draw their
# coins in the accumulator's registers). One device reads keys and queries
# through descriptors where the target does (the forward's at head_dim 128 only); a ring's
# windows, whose dropout blocks start before the window (on a span of 32 lanes), read them
# through masked pointers
DROPOUT_TUNING = {"lanes": "none", "dual_chain": False, "fused_ws": False,
                  "fused_dkdv": False, "curve_rows": False, "gluon_dkdv": False,
                  "gluon_lanes": False}
# ... and the Gluon dQ at head_dim 64 as well as 128 (its coins drawn as the Gluon forward's,
# common.gluon_coins): fwd+bwd at p = 0.1 on one H200, A 11.17 -> 11.05 ms, C (head_dim 64)
# 9.84 -> 9.30 (bench/results/backward_dropout-2026-11-29-h200-gluondq.json)
DROPOUT_GLUON_DQ_DIMS = (64, 128)
# ... and the per-branch dK/dV in Gluon wherever it runs (gluon_plan.gluon_lanes_bwd; off with
# {"gluon_dkdv_lanes": false}), causal or not: its blocks hold queries along rows, so its coins
# are drawn in registers as the forward's (templates/gluon_lanes_bwd.py.jinja). fwd+bwd at p =
# 0.1 on one H200: A 10.99 -> 10.47 ms, A causal 7.44 -> 7.05, C 9.38 -> 8.16, C causal 7.12
# -> 5.52 (bench/results/backward_dropout-2026-11-29-h200-lanes.json). A causal spec's branches
# run as lanes where its plain plan's do and each lane kernel is Gluon (forward, dq, dK/dV, the
# same coins) wherever all of them run: A causal 7.05 -> 6.66 ms. {"dropout": true, "lanes":
# "auto"} asks for the lanes in the `tl` kernels; {"gluon_lanes": false} declines them
DROPOUT_RING_TUNING = {"fused_tma": False, "bwd_tma": False}


def dropout_refusal(spec: Spec) -> str | None:
    """Why the dropout plan cannot run `spec` (the end of a sentence), or None."""
    return None


def dropout_tuning(spec: Spec, tuning: dict) -> dict:
    """The dropout plan's tuning: the caller's under DROPOUT_TUNING, with the lanes and the
    per-branch Gluon dK/dV it asked for (or declined), and a ring's or head_dim's rules."""
    lanes, lane_fwd, lane_dkdv = (tuning.get(x) for x in ("lanes", "gluon_lanes", "gluon_dkdv_lanes"))
    tuning = {**tuning, **DROPOUT_TUNING}
    if lanes or lane_fwd:       # asked: the branches as lanes where the plan would run them so
        tuning["lanes"] = lanes or "auto"
    if lane_fwd:                # ... and each lane kernel in Gluon
        tuning["gluon_lanes"] = lane_fwd
        lane_dkdv = True if lane_dkdv is None else lane_dkdv
    if lane_dkdv is not None:   # asked (or declined): the per-branch dK/dV in Gluon
        tuning.update(gluon_lanes_bwd=(DROPOUT_LANE_DKDV_STAGES if lane_dkdv is True else lane_dkdv),
                      gluon_dkdv_lanes=bool(lane_dkdv))
    if spec.ring_size > 1:
        tuning.update(DROPOUT_RING_TUNING)
    elif spec.head_dim != 128:
        # the forward's descriptors pay at head_dim 128 only (H200, fwd+bwd at p = 0.1,
        # bench/results/backward_dropout-2026-11-29-h200-descriptors.json: A 12.04 -> 11.44
        # ms, C at head_dim 64 9.43 -> 10.04); the backward's stay (C causal 7.17 -> 7.11)
        tuning.setdefault("fused_tma", False)
    return tuning
