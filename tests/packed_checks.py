"""What the Gluon packed-row tests share: bf16 rows on the GPU, the offsets of a packing, and
each sequence's output and lse against the float64 reference run on that sequence alone."""
from __future__ import annotations

import torch

from dilgen.reference import differentiable_reference

from conftest import rel_error


def packed_inputs(spec, total: int, seed: int, device: str = "cuda"):
    """q, k, v of `total` packed rows, (rows, heads, head_dim), bf16, from a fresh seed."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(total, spec.num_heads, spec.head_dim, generator=g)
    k, v = (torch.randn(total, spec.num_kv_heads, spec.head_dim, generator=g) for _ in range(2))
    return [t.to(torch.bfloat16).to(device) for t in (q, k, v)]


def offsets(lengths, multiple: int = 4) -> list[int]:
    """cu_seqlens of sequences of these lengths; the rows in all a multiple of `multiple` (the
    cases' own choice: the Gluon packed kernels take rows that their rates divide)."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    assert cu[-1] % multiple == 0, (cu[-1], multiple)
    return cu


def check_sequences(spec, q, k, v, out, lse, cu, skip=()):
    """Each sequence's rows of out (finite: an unwritten row is poisoned) and lse equal the
    float64 reference of that sequence alone (bf16 tolerances); `skip`: sequences not checked."""
    for b in range(len(cu) - 1):
        a, e = cu[b], cu[b + 1]
        if e == a or b in skip:
            continue
        ro, rl = differentiable_reference(*(t[a:e].double().cpu().unsqueeze(0) for t in (q, k, v)), spec)
        assert torch.isfinite(out[a:e]).all(), f"sequence {b}: non-finite or unwritten rows"
        assert rel_error(out[a:e].cpu(), ro[0]) < 2e-2, f"sequence {b}"
        assert (lse[:, a:e].cpu().double() - rl[0]).abs().max() < 0.4, f"sequence {b}: lse"
