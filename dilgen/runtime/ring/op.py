"""The ring's doors: `ring_attention` and `ring_varlen_attention`, autograd-aware.

Traced, the ring runs as torch ops, so that a ring model traces under torch.compile as one
graph with the P2P steps inside the opaque op; the group travels as its name (a torch op
takes no ProcessGroup; "" is the default group), as torch's functional collectives pass it:

    torch.ops.dilgen.ring_attention_fwd(q, k, v, key, chunk_order, group_name) -> (out, lse)
    torch.ops.dilgen.ring_attention_bwd(..., key, chunk_order, group_name) -> (dq, dk, dv)

and under attention dropout (p > 0) the ops that draw the seed when they run (every rank
takes rank 0's, as eagerly) and hand it to the backward:

    torch.ops.dilgen.ring_attention_dropout_fwd(q, k, v, key, chunk_order, group_name, p)
        -> (out, lse, seed_used)
    torch.ops.dilgen.ring_attention_dropout_bwd(..., key, chunk_order, group_name, seed_used, p)

For packed rows, and for plain eager tensors (nothing traced: the op's dispatch would only
add host time), an autograd Function runs the same passes eagerly. `group=` takes a
ProcessGroup or its name (`group.group_name`), which a traced caller can hold as a string."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..op import _attention_bwd_fake, _attention_fwd_fake, _keep_nothing, _no_double_backward, plain_eager
from ..checks import InputError
from ..dropout_call import bad_p, valid_p
from ..registry import attention_for, kernel_spec, op_key, register
from .executor import ring_backward, ring_forward
from .heads import stand_in
from .run import RingRun


def resolve_group(group):
    """The ProcessGroup of `group=`: None (the default group), a ProcessGroup, or a group's
    name (`group.group_name`)."""
    if isinstance(group, str):
        if not group:
            return None
        from torch.distributed.distributed_c10d import _resolve_process_group
        return _resolve_process_group(group)
    return group


def ring_attention_op(attn, q: Tensor, k: Tensor, v: Tensor, chunk_order: str,
                      group_name: str = "") -> tuple[Tensor, Tensor]:
    """(out, lse) of my rows through torch.ops.dilgen.ring_attention_fwd."""
    key = op_key(attn)
    if not torch.compiler.is_compiling():
        register(attn)
    return ring_attention_fwd(q, k, v, key, chunk_order, group_name)


@torch.library.custom_op("dilgen::ring_attention_fwd", mutates_args=())
def ring_attention_fwd(q: Tensor, k: Tensor, v: Tensor, key: str, chunk_order: str,
                       group_name: str) -> tuple[Tensor, Tensor]:
    """My rows of out (B, N/P, H, D) and lse (B, H, N/P): every rank of the group calls it."""
    attn = attention_for(key, q.device)
    return ring_forward(RingRun(attn, q, k, v, resolve_group(group_name), chunk_order), q, k, v)


@ring_attention_fwd.register_fake
def _ring_attention_fwd_fake(q, k, v, key, chunk_order, group_name):
    return _attention_fwd_fake(q, k, v, key)


@torch.library.custom_op("dilgen::ring_attention_bwd", mutates_args=())
def ring_attention_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                       grad_lse: Optional[Tensor], key: str, chunk_order: str,
                       group_name: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of my rows; the partial dK, dV of remote keys travel to their owners."""
    attn = attention_for(key, q.device)
    run = RingRun(attn, q, k, v, resolve_group(group_name), chunk_order, kind="backward")
    return ring_backward(run, q, k, v, out, lse, grad_out, grad_lse)


@ring_attention_bwd.register_fake
def _ring_attention_bwd_fake(q, k, v, out, lse, grad_out, grad_lse, key, chunk_order, group_name):
    return _attention_bwd_fake(q, k, v, out, lse, grad_out, grad_lse, key)


def _ring_setup_context(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    q, k, v, key, chunk_order, group_name = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.key, ctx.chunk_order, ctx.group_name = key, chunk_order, group_name


def _ring_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_bwd(q, k, v, out, lse, grad_out, grad_lse, ctx.key, ctx.chunk_order,
                                    ctx.group_name)
    return dq, dk, dv, None, None, None


ring_attention_fwd.register_autograd(_ring_backward, setup_context=_ring_setup_context)
ring_attention_bwd.register_autograd(_no_double_backward, setup_context=_keep_nothing)


@torch.library.custom_op("dilgen::ring_attention_dropout_fwd", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def ring_attention_dropout_fwd(q: Tensor, k: Tensor, v: Tensor, key: str, chunk_order: str, group_name: str,
                               p: float) -> tuple[Tensor, Tensor, Tensor]:
    """My rows of out and lse under attention dropout p, and the seed the ranks agreed (rank
    0's, drawn when the op runs; CPU int64, one element) for the backward."""
    attn = attention_for(key, q.device)
    run = RingRun(attn, q, k, v, resolve_group(group_name), chunk_order, dropout_p=p)
    out, lse = ring_forward(run, q, k, v)
    return out, lse, torch.tensor([run.dropout_args[0]], dtype=torch.int64)


@ring_attention_dropout_fwd.register_fake
def _ring_dropout_fwd_fake(q, k, v, key, chunk_order, group_name, p):
    return (*_attention_fwd_fake(q, k, v, key), torch.empty(1, dtype=torch.int64))


@torch.library.custom_op("dilgen::ring_attention_dropout_bwd", mutates_args=())
def ring_attention_dropout_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                               grad_lse: Optional[Tensor], key: str, chunk_order: str, group_name: str,
                               seed: Tensor, p: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of my rows under the forward's mask (its seed_used)."""
    attn = attention_for(key, q.device)
    run = RingRun(attn, q, k, v, resolve_group(group_name), chunk_order, kind="backward", dropout_p=p,
                  dropout_seed=int(seed.item()))
    return ring_backward(run, q, k, v, out, lse, grad_out, grad_lse)


@ring_attention_dropout_bwd.register_fake
def _ring_dropout_bwd_fake(q, k, v, out, lse, grad_out, grad_lse, key, chunk_order, group_name, seed, p):
    return _attention_bwd_fake(q, k, v, out, lse, grad_out, grad_lse, key)


def _ring_dropout_setup(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    q, k, v, key, chunk_order, group_name, p = inputs
    out, lse, seed = output
    ctx.save_for_backward(q, k, v, out, lse, seed)
    ctx.key, ctx.chunk_order, ctx.group_name, ctx.p = key, chunk_order, group_name, p


def _ring_dropout_backward(ctx, grad_out, grad_lse, _grad_seed):
    q, k, v, out, lse, seed = ctx.saved_tensors
    dq, dk, dv = ring_attention_dropout_bwd(q, k, v, out, lse, grad_out, grad_lse, ctx.key, ctx.chunk_order,
                                            ctx.group_name, seed, ctx.p)
    return dq, dk, dv, None, None, None, None


ring_attention_dropout_fwd.register_autograd(_ring_dropout_backward, setup_context=_ring_dropout_setup)
ring_attention_dropout_bwd.register_autograd(_no_double_backward, setup_context=_keep_nothing)


def traced_ring_dropout(attn_or_key, q, k, v, chunk_order: str, group, p) -> tuple[Tensor, Tensor]:
    """(out, lse) of my rows through torch.ops.dilgen.ring_attention_dropout_fwd (traced)."""
    key = attn_or_key if isinstance(attn_or_key, str) else op_key(attn_or_key)
    if not valid_p(p):
        raise bad_p(kernel_spec(key)["name"], p)
    if not isinstance(attn_or_key, str) and not torch.compiler.is_compiling():
        register(attn_or_key)
    name = group if isinstance(group, str) else "" if group is None else group.group_name
    out, lse, _ = ring_attention_dropout_fwd(q, k, v, key, chunk_order, name, float(p))
    return out, lse


class _RingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, run):
        run.keep_heads = True              # "heads": the backward runs on the forward's shards
        out, lse = ring_forward(run, q, k, v)
        ctx.set_materialize_grads(False)   # an unused lse gets None (see runtime/op.py)
        ctx.run = run
        if run.kept is None:
            ctx.save_for_backward(q, k, v, out, lse)
        else:                              # the shards hold what the backward reads
            ctx.stand_ins = tuple(stand_in(t) for t in (q, k, v))
        return out, lse

    @staticmethod
    @once_differentiable      # a second derivative refuses (torch's one-line error)
    def backward(ctx, grad_out, grad_lse):
        run = ctx.run
        q, k, v, out, lse = ctx.saved_tensors if run.kept is None else (*ctx.stand_ins, None, None)
        run.agree(*(t[0] if run.packed else t for t in (q, k, v)), kind="backward")
        dq, dk, dv = ring_backward(run, q, k, v, out, lse, grad_out, grad_lse)
        return dq, dk, dv, None


def _op_takes(q, k, v, chunk_order) -> bool:
    """Arguments the ring op's schema takes and that reach its agreement: tensors on a CUDA
    or CPU device and a string. Anything else would fail (or, meta tensors, "run" on the
    fake kernel) on this rank alone, before the agreement, while the others wait for it."""
    return isinstance(chunk_order, str) and all(
        isinstance(t, torch.Tensor) and t.device.type in ("cuda", "cpu") for t in (q, k, v))


def ring_attention(attn, q, k, v, *, group=None, return_lse: bool = False,
                   chunk_order: str = "contiguous", dropout_p: float = 0.0, counter=None):
    """Every rank of `group` (P = ring_size ranks) calls this with its rows; returns its
    rows of out (and lse (B, H, N/P)), autograd-aware (SPEC §3 "Ring"). `group` is a
    ProcessGroup, its name, or None (the default group). dropout_p > 0: attention dropout,
    the mask one device draws (RingRun; eager only), or the part of a larger call's mask
    that `counter` (ring.dropout.Counter) says."""
    name = group if isinstance(group, str) else None
    group = resolve_group(group)
    if dropout_p:
        if not plain_eager(q, k, v):
            if counter is not None:
                raise InputError(f"{attn.spec['name']}: a ring call drawing part of a larger call's dropout "
                                 f"mask (torchscale's seq_parallel) runs eagerly; call the model outside "
                                 f"torch.compile while attention dropout is on")
            out, lse = traced_ring_dropout(attn, q, k, v, chunk_order, group if name is None else name, dropout_p)
            return (out, lse) if return_lse else out
        run = RingRun(attn, q, k, v, group, chunk_order, dropout_p=dropout_p, counter=counter)
        needs = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        out, lse = _RingFunction.apply(q, k, v, run) if needs else ring_forward(run, q, k, v)
        return (out, lse) if return_lse else out
    if not _op_takes(q, k, v, chunk_order):
        RingRun(attn, q, k, v, group, chunk_order)    # refused on every rank by the agreement
    if not plain_eager(q, k, v):
        # traced: the ring as torch.ops.dilgen.ring_attention_fwd/bwd, so that a ring model
        # traces under torch.compile as one graph
        if name is None:
            name = "" if group is None else group.group_name
        out, lse = ring_attention_op(attn, q, k, v, chunk_order, name)
        return (out, lse) if return_lse else out
    run = RingRun(attn, q, k, v, group, chunk_order)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad:
        out, lse = _RingFunction.apply(q, k, v, run)
    else:
        out, lse = ring_forward(run, q, k, v)
    return (out, lse) if return_lse else out


def ring_varlen_attention(attn, q, k, v, cu_seqlens, *, group=None, max_seqlen=None,
                          return_lse: bool = False, chunk_order: str = "contiguous", dropout_p: float = 0.0,
                          counter=None):
    """A packed row on the ring (SPEC §3 "Variable-length batches"): every rank of `group`
    passes its contiguous N/P rows q (N/P, H, D), k, v (N/P, H_kv, D) and the same
    cu_seqlens over the whole row of N rows (sequences may span rank borders). Returns its
    rows of out (and lse (H, N/P)), autograd-aware, equal to the single-device packed call.
    Runs eagerly (not as a torch.ops op) on `group` (or its name) or the default group.
    dropout_p > 0: attention dropout, the packed rows drawn as one sequence, as one device
    (counter: as ring_attention's)."""
    run = RingRun(attn, q, k, v, resolve_group(group), chunk_order, cu_seqlens=cu_seqlens,
                  max_seqlen=max_seqlen, dropout_p=dropout_p, counter=counter)
    q4, k4, v4 = (t.unsqueeze(0) for t in (q, k, v))
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad:
        out, lse = _RingFunction.apply(q4, k4, v4, run)
    else:
        out, lse = ring_forward(run, q4, k4, v4)
    out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
