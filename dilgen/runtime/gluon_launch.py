"""The launch of the sm90 Gluon forward (templates/gluon_fwd.py.jinja, KernelConfig.gluon_fwd):
its TMA descriptors over strided views of q, k, v and out, and when a call takes it.

Views (contiguous (B, N, H, D) q and out, (B, N, H_kv, D) k and v): q and out as
(B·N/L, L·H, D), whose row b·N/L + m, column c·H + h is row u = c + L·m of head h (L the
query lattice); branch i's keys as (B·N/r_i, r_i·H_kv, D), whose rows b·N/r_i + s·w_i/r_i + j
are the lane s·w_i + o + r_i·j of segment s. A 64-row (queries) or 128-row (keys) box of such a
view is a TMA load of dilated rows. The descriptors are made on the host (made in the kernel,
by each program, they cost A 1.724 -> 1.844 ms; bench/results/gluon_dilgen_check-2026-11-27-h200.json);
a replay makes them again over the call's tensors (replay.Descriptor)."""
from __future__ import annotations

import torch

_SM90: dict[int, bool] = {}      # device index -> compute capability 9.x


def _sm90(device: torch.device) -> bool:
    hit = _SM90.get(device.index)
    if hit is None:
        hit = _SM90[device.index] = torch.cuda.get_device_capability(device)[0] == 9
    return hit


_LAYOUTS: dict[tuple[int, int], object] = {}


def _layout(rows: int, D: int):
    """The shared-memory layout of a (rows, 1, D) box of 16-bit elements (128-byte swizzle)."""
    hit = _LAYOUTS.get((rows, D))
    if hit is None:
        from triton.experimental.gluon import language as gl
        hit = _LAYOUTS[(rows, D)] = gl.NVMMASharedLayout.get_default_for([rows, 1, D], gl.bfloat16)
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
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    H, D, L = plan["num_heads"], plan["head_dim"], plan["query"]["lattice"]

    def box(t: torch.Tensor, every: int, rows: int) -> TensorDescriptor:
        view = t.view(B * N // every, every * t.shape[2], D)
        return TensorDescriptor(view, list(view.shape), list(view.stride()), [rows, 1, D], _layout(rows, D))

    rates = [br["r"] for br in plan["branches"]]
    args = (box(q, L, 64), box(out, L, 64), *(box(k, r, tile[0]) for r in rates),
            *(box(v, r, tile[0]) for r in rates), lse, N)
    # 12 warps (two consumer warpgroups, a producer warp's group) at 168 registers a thread:
    # one program per SM, the consumers at 240 registers, the producer at 24
    return attn.gluon_kernel, (N // 128, B * H), args, {"num_warps": 4, "maxnreg": 168}
