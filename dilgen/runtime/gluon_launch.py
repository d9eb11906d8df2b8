"""The launch of the sm90 Gluon forward (templates/gluon_fwd.py.jinja, KernelConfig.gluon_fwd),
and when a call takes it. The kernel makes its TMA descriptors itself: over contiguous
(B, N, H, D) q and out seen as (B·N/L, L·H, D), whose row b·N/L + m, column c·H + h is row
u = c + L·m of head h (L the query lattice), and branch i's keys seen as (B·N/r_i, r_i·H_kv, D),
whose rows b·N/r_i + s·w_i/r_i + j are the lane s·w_i + o + r_i·j of segment s. So its
arguments are the call's tensors, and a repeated call replays it (replay.py)."""
from __future__ import annotations

import torch

_SM90: dict[int, bool] = {}      # device index -> compute capability 9.x


def _sm90(device: torch.device) -> bool:
    hit = _SM90.get(device.index)
    if hit is None:
        hit = _SM90[device.index] = torch.cuda.get_device_capability(device)[0] == 9
    return hit


def gluon_launch(attn, q, k, v, out, lse, B: int, N: int):
    """(kernel, grid, args, options) of the Gluon forward for this call, or None when the call
    takes the `tl` kernel instead: no Gluon plan, the CPU, a GPU other than sm90 (a newer GPU
    runs sm90's plan, and wgmma is Hopper's), a short last segment, or tensors that are not
    contiguous or 16-byte aligned (TMA)."""
    plan = attn.plan
    tile = plan["config"].get("gluon_fwd")
    if tile is None or attn.gluon_kernel is None or q.device.type != "cuda" or not _sm90(q.device):
        return None
    if any(N % br["w"] for br in plan["branches"]):
        return None
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v, out)):
        return None
    H, L = plan["num_heads"], plan["query"]["lattice"]
    # 12 warps (two consumer warpgroups, a producer warp's group) at 168 registers a thread:
    # one program per SM, the consumers at 240 registers, the producer at 24
    return attn.gluon_kernel, (N // L // 128, B * H, L), (q, k, v, out, lse, B, N), {"num_warps": 4, "maxnreg": 168}
