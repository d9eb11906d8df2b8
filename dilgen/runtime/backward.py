"""Backward launches (dq, dk, dv) for a generated module's BACKWARD_KERNELS."""
from __future__ import annotations


def backward_raw(attn, q, k, v, out, lse, grad_out, grad_lse):
    """Return (dq, dk, dv) for one forward call; grad_lse may be None."""
    raise NotImplementedError("dilgen: backward kernels are not generated yet")
