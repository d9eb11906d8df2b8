"""Input checks of a call: q, k, v against the spec (SPEC §3), one InputError that says
what to change. Packed rows (cu_seqlens) and the decode cache have their own checks in
varlen.py and decode.py; the ring's agreement (ring/agreement.py) runs these on every rank."""
from __future__ import annotations

from typing import Any

import torch

from ..spec import MAX_POSITION, TILE_LANES
from ..support import layout_slip_message

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class InputError(ValueError):
    """q, k, v (or the call) do not fit the spec; the message says what to change."""


def check_inputs(spec: dict, q: Any, k: Any, v: Any) -> tuple[int, int]:
    """(B, N) of q (B, N, H, D), k and v (B, N, H_kv, D) of the spec's dtype on one device."""
    name = spec["name"]
    check_tensors(name, (("q", q), ("k", k), ("v", v)), 4, "must have 4 dims (B, N, heads, head_dim)")
    H, Hkv, D = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    B, N = q.shape[0], q.shape[1]
    if tuple(q.shape[2:]) != (H, D):
        raise InputError(f"{name}: q has shape {tuple(q.shape)}; the spec wants (B, N, {H}, {D}) "
                         f"(num_heads={H}, head_dim={D})")
    for label, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (B, N, Hkv, D):
            raise InputError(f"{name}: {label} has shape {tuple(t.shape)}; with q of shape "
                             f"{tuple(q.shape)} it must be ({B}, {N}, {Hkv}, {D}) "
                             f"(num_kv_heads={Hkv})")
    if B < 1 or N < 1:
        raise InputError(f"{name}: empty input (B = {B}, N = {N}); dilated attention needs "
                         f"B >= 1 and N >= 1")
    check_layout(spec, (("q", q), ("k", k), ("v", v)), f"{name}: ", "all three")
    check_positions(spec, N)
    return B, N


def check_tensors(name: str, labelled, dims: int, rule: str, context: str = "") -> None:
    """Each (label, t) is a torch.Tensor of `dims` dims, else one InputError."""
    for label, t in labelled:
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise InputError(f"{name}: {label} is a nested tensor; pack its sequences into rows "
                             f"(total, heads, head_dim) and pass cu_seqlens (for a jagged one: "
                             f"{label}.values() and {label}.offsets().int())")
        if t.dim() != dims:
            raise InputError(f"{name}: {context}{label} {rule}, got shape {tuple(t.shape)}")


def check_layout(spec: dict, labelled, prefix: str, together: str) -> None:
    """The spec's dtype, the first tensor's device (CUDA or CPU), contiguous head_dim, for
    each (label, t); `prefix` starts every message, `together` names what to move."""
    want = TORCH_DTYPES[spec["dtype"]]
    first_label, first = labelled[0]
    for label, t in labelled:
        if t.dtype != want:
            raise InputError(f"{prefix}{label} has dtype {t.dtype} but the spec says "
                             f"\"{spec['dtype']}\"; pass {label}.to({want}) or change the spec")
        if t.device != first.device:
            raise InputError(f"{prefix}{first_label} is on {first.device} but {label} is on "
                             f"{t.device}; move {together} to one device")
        if t.stride(-1) != 1:
            raise InputError(f"{prefix}{label} must be contiguous in head_dim (stride(-1) == 1, "
                             f"got {t.stride(-1)}); pass {label}.contiguous()")
    if first.device.type not in ("cuda", "cpu"):
        raise InputError(f"{prefix}tensors on {first.device} are not supported; use a CUDA GPU, "
                         f"or the CPU (Triton's interpreter)")


def check_positions(spec: dict, n: int, ranks: int = 1) -> None:
    """The kernels compute positions in int32: a sequence of n rows forms positions up to
    about n + TILE_LANES * r (a tile of lanes past the last kept one; dilgen.spec), which
    must stay below 2**31. On a ring, n is the whole sequence (ranks x local rows)."""
    r = max(spec.get("dilation_rates") or (1,))
    top = n + TILE_LANES * r
    if top > MAX_POSITION:
        whole = f" ({ranks} ranks x {n // ranks})" if ranks > 1 else ""
        raise InputError(f"{spec['name']}: N = {n} rows{whole}: the kernels compute positions up "
                         f"to N + {TILE_LANES}*r = {top} (largest dilation rate r = {r}) in "
                         f"int32, which must stay below 2**31; use sequences of at most "
                         f"{MAX_POSITION - TILE_LANES * r} rows")


def check_zero_pad(spec: dict, n: int) -> None:
    """short_segments "zero_pad" (torchscale's padding): refuse its layout slip
    (dilgen.support.zero_pad_layout_slip) for a sequence of n rows (the longest of a batch)."""
    if spec.get("short_segments") != "zero_pad":
        return
    msg = layout_slip_message(spec["name"], spec["segment_lengths"], spec["dilation_rates"], n)
    if msg:
        raise InputError(msg)


def check_varlen_inputs(spec: dict, q: Any, k: Any, v: Any) -> int:
    """The rows of packed q (rows, H, D), k and v (rows, H_kv, D) (SPEC §3, cu_seqlens)."""
    check_tensors(spec["name"], (("q", q), ("k", k), ("v", v)), 3,
                  "must have 3 dims (total, heads, head_dim)", "with cu_seqlens, ")
    check_inputs(spec, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    return q.shape[0]


def check_max_seqlen(name: str, max_seqlen: Any) -> int:
    """max_seqlen of a packed call: a whole number >= 0 (an int, a numpy or torch integer)."""
    import operator
    try:
        if isinstance(max_seqlen, bool):
            raise TypeError
        value = operator.index(max_seqlen)
    except TypeError:
        raise InputError(f"{name}: max_seqlen = {max_seqlen!r}: pass an int, the number of rows of "
                         f"the longest sequence (or omit it outside torch.compile)") from None
    if value < 0:
        raise InputError(f"{name}: max_seqlen = {value}: must be >= 0 (the longest sequence's rows)")
    return value


def needs_grad(*tensors) -> bool:
    """Whether autograd records a call of these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
