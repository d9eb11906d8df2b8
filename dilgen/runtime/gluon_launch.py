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


def layout(rows: int, D: int):
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
    if tile is None or attn.gluon_fn is None or q.device.type != "cuda" or not _sm90(q.device):
        return None
    if any(N % br["w"] for br in plan["branches"]):
        return None
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q, k, v, out)):
        return None
    return attn.gluon_kernel, (N // 128, B * plan["num_heads"]), gluon_args(plan, q, k, v, out, lse, B, N), OPTIONS


# 12 warps (two consumer warpgroups, a producer warp's group) at 168 registers a thread:
# one program per SM, the consumers at 240 registers, the producer at 24
OPTIONS = {"num_warps": 4, "maxnreg": 168}


def gluon_args(plan: dict, q, k, v, out, lse, B: int, N: int) -> tuple:
    """The kernel's arguments: q's and out's descriptors (64-row boxes), each branch's k and
    v descriptors (boxes of the plan's keys per block), lse, N. Tensors may be Triton's
    MockTensors (the `dilgen build` launch model): each view is written out from (B, N, heads, D)
    of contiguous tensors, never asked of the tensor."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    D, L, block = plan["head_dim"], plan["query"]["lattice"], plan["config"]["gluon_fwd"][0]
    heads = {"q": plan["num_heads"], "kv": plan["num_kv_heads"]}

    def box(t, kind: str, every: int, rows: int) -> TensorDescriptor:
        shape = [B * N // every, every * heads[kind], D]
        return TensorDescriptor(t, shape, [shape[1] * D, D, 1], [rows, 1, D], layout(rows, D))

    rates = [br["r"] for br in plan["branches"]]
    return (box(q, "q", L, 64), box(out, "q", L, 64), *(box(k, "kv", r, block) for r in rates),
            *(box(v, "kv", r, block) for r in rates), lse, N)
