"""attn_implementation="dilgen" under context parallelism (dilgen.integrations.context_parallel):
the attention layers a model was placed on a process group with run dilgen's ring over it.

Each rank of the group holds rows of every sequence (the ring's chunk order: zigzag for a
causal model, contiguous otherwise; contiguous for packed rows) and calls the layer with
them; the ring (SPEC §2.3) gives each rank its rows of the attention output over the whole
sequence, exactly, and autograd its rows of dq, dk, dv (the dK, dV of remote keys travel
back to their owners). The spec of a call is the single-device one (config.dilgen_spec,
the call's heads, dtype, causality and scale) with ring_size = the group's size.

A `RingPlacement` is kept on each attention module (attribute `_dilgen_ring`), so that
torch.compile reads it as a constant; a deepcopy (an EMA copy) shares it, a pickled model
(torch.save) drops it and loads as a one-device model.
"""
from __future__ import annotations

import torch

ATTR = "_dilgen_ring"

GENERATION = ("attn_implementation='dilgen' under context parallelism computes a whole sequence over "
               "the ranks (training, scoring); generation (fewer queries than keys, a KV cache) runs on "
               "one device: generate with a model not placed by context_parallel (or cp.remove())")


def _unplaced():
    return None


class RingPlacement:
    """Where a context-parallel attention layer runs: `group` (None: the default group) of
    `size` ranks, this rank's index `rank` in it, and the chunk order of its rows ("zigzag"
    for a causal model: chunks j and 2P-1-j, which balances causal work; else "contiguous")."""

    def __init__(self, group, size: int, rank: int, order: str, default_group: bool):
        self.group, self.size, self.rank, self.order = group, size, rank, order
        #: the group holds every rank of the default group: calls pass group=None
        self.default_group = default_group
        #: what a traced call passes: the group's name (the ring's torch op takes no
        #: ProcessGroup, and dynamo keeps a string as a constant)
        self.group_name = "" if default_group or group is None else group.group_name

    def __deepcopy__(self, memo):
        return self                       # an EMA copy trains on the same group

    def __reduce__(self):
        return (_unplaced, ())            # a saved model loads as a one-device model

    def __repr__(self) -> str:
        return f"RingPlacement(size={self.size}, rank={self.rank}, order={self.order!r})"

    def call_group(self):
        """The group= a call passes: None for the default group; a sub-group itself, or its
        name while torch.compile traces."""
        if self.default_group:
            return None
        return self.group_name if torch.compiler.is_compiling() else self.group


def placement(module) -> RingPlacement | None:
    """The RingPlacement of an attention module, or None (one device)."""
    return module.__dict__.get(ATTR)


def _packed(kwargs):
    """(cu_seqlens int32, longest or None) of a packed row (cu_seq_lens_q, over the whole
    row of N = P x local rows, the same on every rank), or None."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return None
    cu_k = kwargs.get("cu_seq_lens_k")
    if cu_k is not None and cu_k is not cu and (cu_k.shape != cu.shape or not torch.equal(cu_k, cu)):
        raise ValueError("attn_implementation='dilgen': cu_seq_lens_k differs from cu_seq_lens_q; packed "
                         "self-attention needs one set of offsets")
    longest = kwargs.get("max_length_q")
    return cu.to(torch.int32), None if longest is None else int(longest)


def attention(kernel, ring: RingPlacement, q, k, v, mask, kwargs, causal: bool, dropout: float = 0.0):
    """This rank's rows of the attention output: q (B, T, H, D) and k, v (B, T, H_kv, D)
    hold the rank's T rows of each sequence (ring.order; contiguous for a packed row);
    `kernel` is the call's spec with ring_size = ring.size. Returns out (B, T, H, D).
    dropout: attention dropout's p (every transport of the ring, packed rows included)."""
    drop = {"dropout_p": dropout} if dropout else {}
    if k.shape[1] != q.shape[1]:
        raise ValueError(GENERATION)
    if mask is not None and (torch.compiler.is_compiling() or not bool(mask.all())):
        # the model's forward pre-hook (context_parallel) refused padding on every rank
        # together; a mask that still comes is one the model built itself
        raise ValueError("attn_implementation='dilgen' under context parallelism takes no padding mask: "
                         "right-pad a causal model's rows (cp.shard drops the mask and ignores the padded "
                         "labels) or pack the rows (DataCollatorWithFlattening)")
    group = ring.call_group()
    packed = _packed(kwargs)
    if packed is not None:
        if q.shape[0] != 1:
            raise ValueError(f"attn_implementation='dilgen' under context parallelism: cu_seq_lens_q packs "
                             f"sequences into one row; got a batch of {q.shape[0]}")
        cu, longest = packed
        # the packed ring splits the row of N rows in P contiguous chunks (SPEC §3): every
        # rank passes its rows and the offsets over all N
        out = kernel(q[0], k[0], v[0], cu_seqlens=cu, max_seqlen=longest, group=group,
                     chunk_order="contiguous", **drop)
        return out.unsqueeze(0)
    if (ring.order == "zigzag") != bool(causal):
        raise ValueError(f"attn_implementation='dilgen' under context parallelism: this layer is "
                         f"{'causal' if causal else 'not causal'} but the model was placed with chunk order "
                         f"{ring.order!r} (zigzag for causal models): every attention layer of a "
                         f"context-parallel model must have the same causality")
    return kernel(q, k, v, group=group, chunk_order=ring.order, **drop)
