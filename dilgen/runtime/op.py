"""torch custom ops over the single-device launches, so that torch.compile sees one
opaque node and autograd one function.

    torch.ops.dilgen.attention_fwd(q, k, v, key) -> (out, lse)
    torch.ops.dilgen.attention_bwd(q, k, v, out, lse, grad_out, grad_lse, key) -> (dq, dk, dv)
    torch.ops.dilgen.attention_varlen_fwd / _bwd: the same over a packing (varlen.Packing)
    torch.ops.dilgen.decode(q, k_cache, v_cache, cache_seqlens, key) -> (out, lse)
    torch.ops.dilgen.refused(q, message) -> (out, lse): raises InputError(message) when run

`key` names a registered GeneratedAttention or dilgen.Kernel (registry.py). The work is
done by forward.forward_raw and backward.backward_raw; the fake implementations give
torch.compile the output shapes without launching anything, and `register_autograd`
wires the backward op in, with the gradient of lse flowing (None or zeros when lse is
unused). The ring's ops are in ring/op.py.

An eager call of plain tensors skips the op's dispatch (its Python-side autograd and
redispatch cost more host time than the launches they wrap): `_DilgenAttention` and
`_DilgenVarlenAttention` are the same forward and backward as autograd.Functions. Under
torch.compile, for a tensor subclass or under a dispatch mode (fake tensors), the op runs.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .backward import backward_raw
from .checks import needs_grad
from .decode import decode
from .forward import forward_raw
from .registry import attention_for, op_key, register
from .varlen import Packing, check_packed_plan


def attention_op(attn, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of a GeneratedAttention: torch.ops.dilgen.attention_fwd, or eagerly its
    work without the op's dispatch (module docstring)."""
    if not torch.compiler.is_compiling():
        register(attn)
        if plain_eager(q, k, v):
            if needs_grad(q, k, v):
                return _DilgenAttention.apply(q, k, v, attn)
            return forward_raw(attn, q, k, v)
    return attention_fwd(q, k, v, op_key(attn))


def plain_eager(*tensors) -> bool:
    """Eager tensors the op's dispatch would add nothing to: not traced, no subclass, no
    dispatch mode."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and all(type(t) is Tensor for t in tensors))


class _Refused(torch.autograd.Function):
    """The identity on gradients computed with create_graph=True, joined to the graph of
    `anchors` (the call's inputs and grad_out), whose own gradient (a double backward)
    refuses in one line."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *anchors):
        return dq, dk, dv

    @staticmethod
    def backward(ctx, *grads):
        _no_double_backward(ctx)


def _eager_grads(grads: tuple, *anchors) -> tuple:
    """Gradients for autograd; under create_graph=True marked so that differentiating them
    again refuses (the ops' register_autograd of the backward op does the same)."""
    return _Refused.apply(*grads, *anchors) if torch.is_grad_enabled() else grads


class _DilgenAttention(torch.autograd.Function):
    """attention_fwd and attention_bwd, eagerly (attention_op)."""

    @staticmethod
    def forward(ctx, q, k, v, attn):
        out, lse = forward_raw(attn, q, k, v)
        ctx.set_materialize_grads(False)      # as _setup_context
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attn = attn
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad():
            grads = backward_raw(_backward_kernels(ctx.attn), q, k, v, out, lse, grad_out, grad_lse)
        return (*_eager_grads(grads, q, k, v, grad_out), None)


def _backward_kernels(attn):
    if attn.backward_kernels is None:
        raise NotImplementedError(
            f"dilgen ({attn.spec['name']}): this generated module has no backward kernels; "
            f"run the forward under torch.no_grad(), or detach q, k, v")
    return attn


@torch.library.custom_op("dilgen::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, key: str) -> tuple[Tensor, Tensor]:
    """out (B, N, H, D) contiguous, of q's dtype; lse (B, H, N) float32."""
    return forward_raw(attention_for(key, q.device), q, k, v)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, key):
    B, N, H, _ = q.shape
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = q.new_empty((B, H, N), dtype=torch.float32)
    return out, lse


@torch.library.custom_op("dilgen::attention_bwd", mutates_args=())
def attention_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                  grad_lse: Optional[Tensor], key: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), contiguous, shaped like (q, k, v); grad_lse may be None."""
    attn = _backward_kernels(attention_for(key, q.device))
    return backward_raw(attn, q, k, v, out, lse, grad_out, grad_lse)


@attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, out, lse, grad_out, grad_lse, key):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    # an output the caller did not use (lse, mostly) gets a None gradient, not a zero
    # tensor: the backward then skips the dlse pass instead of reading zeros
    ctx.set_materialize_grads(False)
    q, k, v, key = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.key = key


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd(q, k, v, out, lse, grad_out, grad_lse, ctx.key)
    return dq, dk, dv, None


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx, *grads):
    raise NotImplementedError(
        "dilgen: the gradient of dilated attention's backward (double backward: "
        "torch.autograd.grad(..., create_graph=True) through a dilgen call, then backward "
        "again) is not implemented; compute second derivatives through dilgen.reference")


def _keep_nothing(ctx, inputs, output) -> None:
    pass


# the backward ops are differentiable only in name: their gradient refuses in one line
attention_bwd.register_autograd(_no_double_backward, setup_context=_keep_nothing)


# -- variable-length batches (varlen.py): packed or padded rows ---------------------------------
def varlen_attention_op(attn, q: Tensor, k: Tensor, v: Tensor, packing) -> tuple[Tensor, Tensor]:
    """(out (rows, H, D), lse (H, rows)) through torch.ops.dilgen.attention_varlen_fwd, or
    eagerly its work without the op's dispatch."""
    if not torch.compiler.is_compiling():
        register(attn)
        if plain_eager(q, k, v):
            check_packed_plan(attn)
            if needs_grad(q, k, v):
                return _DilgenVarlenAttention.apply(q, k, v, attn, packing)
            return forward_raw(attn, q, k, v, packing=packing)
    flat = [x for b in packing.buckets for x in b]
    return attention_varlen_fwd(q, k, v, packing.starts, packing.lengths, packing.max_len,
                                packing.covers_all, flat, op_key(attn))


def _packing(seq_starts, seq_lens, max_seqlen, covers_all, buckets=()):
    """The Packing of the op's arguments; `buckets` flattens its launch groups (first, end,
    longest), [] for one group."""
    groups = tuple(tuple(buckets[i:i + 3]) for i in range(0, len(buckets), 3))
    return Packing(seq_starts, seq_lens, int(max_seqlen), bool(covers_all), groups)


@torch.library.custom_op("dilgen::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, seq_starts: Tensor, seq_lens: Tensor,
                         max_seqlen: int, covers_all: bool, buckets: list[int], key: str) -> tuple[Tensor, Tensor]:
    """Sequence b is rows seq_starts[b] + [0, seq_lens[b]) of q (rows, H, D); out (rows, H, D),
    lse (H, rows) float32; rows of no sequence get 0 and -inf."""
    attn = attention_for(key, q.device)
    check_packed_plan(attn)
    return forward_raw(attn, q, k, v, packing=_packing(seq_starts, seq_lens, max_seqlen, covers_all, buckets))


@attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, seq_starts, seq_lens, max_seqlen, covers_all, buckets, key):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dilgen::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                         grad_lse: Optional[Tensor], seq_starts: Tensor, seq_lens: Tensor,
                         max_seqlen: int, covers_all: bool, buckets: list[int], key: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of a variable-length call, shaped like (q, k, v)."""
    attn = attention_for(key, q.device)
    check_packed_plan(attn)
    return backward_raw(_backward_kernels(attn), q, k, v, out, lse, grad_out, grad_lse,
                        packing=_packing(seq_starts, seq_lens, max_seqlen, covers_all, buckets))


@attention_varlen_bwd.register_fake
def _attention_varlen_bwd_fake(q, k, v, out, lse, grad_out, grad_lse, seq_starts, seq_lens,
                               max_seqlen, covers_all, buckets, key):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _varlen_setup_context(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    q, k, v, seq_starts, seq_lens, max_seqlen, covers_all, buckets, key = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, seq_starts, seq_lens)
    ctx.max_seqlen, ctx.covers_all, ctx.buckets, ctx.key = max_seqlen, covers_all, buckets, key


def _varlen_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, seq_starts, seq_lens = ctx.saved_tensors
    dq, dk, dv = attention_varlen_bwd(q, k, v, out, lse, grad_out, grad_lse, seq_starts, seq_lens,
                                      ctx.max_seqlen, ctx.covers_all, ctx.buckets, ctx.key)
    return dq, dk, dv, None, None, None, None, None, None


attention_varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)
attention_varlen_bwd.register_autograd(_no_double_backward, setup_context=_keep_nothing)


class _DilgenVarlenAttention(torch.autograd.Function):
    """attention_varlen_fwd and attention_varlen_bwd, eagerly (varlen_attention_op)."""

    @staticmethod
    def forward(ctx, q, k, v, attn, packing):
        out, lse = forward_raw(attn, q, k, v, packing=packing)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attn, ctx.packing = attn, packing
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.no_grad():
            grads = backward_raw(_backward_kernels(ctx.attn), q, k, v, out, lse, grad_out, grad_lse,
                                 packing=ctx.packing)
        return (*_eager_grads(grads, q, k, v, grad_out), None, None)


# -- incremental decoding (decode.py) -------------------------------------------------------
@torch.library.custom_op("dilgen::decode", mutates_args=())
def decode_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, key: str) -> tuple[Tensor, Tensor]:
    """out (B, T, H, D), lse (B, H, T) float32 of GeneratedAttention.decode, unvalidated (the
    traced caller checks the lengths on the device: dispatch.traced_decode)."""
    return decode(attention_for(key, q.device), q, k_cache, v_cache, cache_seqlens, return_lse=True,
                  validate=False, keep_scratch=False)


@decode_op.register_fake
def _decode_fake(q, k_cache, v_cache, cache_seqlens, key):
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)


# -- a call refused while torch.compile traced it -----------------------------------------------
@torch.library.custom_op("dilgen::refused", mutates_args=())
def refused(q: Tensor, message: str) -> tuple[Tensor, Tensor]:
    """Raise the InputError that checking the traced call found. Raised while tracing, it
    would reach the user wrapped in dynamo's many-line "Observed exception"; raised from the
    compiled graph, it arrives as itself, its one line last in the traceback."""
    from .checks import InputError
    raise InputError(message)


@refused.register_fake
def _refused_fake(q, message):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if q.dim() == 4 else tuple(q.shape[:-1])[::-1]
    return torch.empty_like(q), q.new_empty(lse_shape, dtype=torch.float32)


refused.register_autograd(lambda ctx, grad_out, grad_lse: (None, None),
                          setup_context=_keep_nothing)
