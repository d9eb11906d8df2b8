"""torch custom ops over generated kernels, so that torch.compile sees one opaque node.

    torch.ops.dilgen.attention_fwd(q, k, v, key) -> (out, lse)
    torch.ops.dilgen.attention_bwd(q, k, v, out, lse, grad_out, grad_lse, key) -> (dq, dk, dv)

The schemas hold only tensors and a string: `key` names a registered object, either a
GeneratedAttention (`register`; key "<spec name>@<target>:<spec key[:16]>:<tiles>") or a
`dilgen.Kernel` (`register_kernel`; key "kernel:..."), whose generated module is then
picked for the device of q when the op runs. The work is done by
GeneratedAttention.forward_raw and backward.backward_raw; the fake implementations give
torch.compile the output shapes without launching anything, and `register_autograd`
wires the backward op in, with the gradient of lse flowing (None or zeros when lse is
unused).

A GeneratedAttention registers itself on every eager call (`attention_op`). A graph
compiled before any eager call meets an unregistered key when it runs: `resolve` then
looks for it among the `attention` objects of imported generated modules (every module
dilgen builds, or that a program imports from `dilgen compile` output, is one).
"""
from __future__ import annotations

import hashlib
import json
import sys
import threading
from typing import Optional

import torch
from torch import Tensor

_REGISTRY: dict = {}      # key -> GeneratedAttention, or a dilgen.Kernel
_SPECS: dict = {}         # kernel key -> the spec fields that _check_inputs reads
_LOCK = threading.Lock()


def op_key(attn) -> str:
    """The key of a GeneratedAttention: instances with one key compute the same function
    (same spec, same target). Plain string work, which dynamo folds to a constant."""
    return attn.op_key


def register(attn) -> str:
    """Map op_key(attn) to attn (the latest registered instance wins); return the key."""
    key = op_key(attn)
    if _REGISTRY.get(key) is not attn:
        with _LOCK:
            _REGISTRY[key] = attn
    return key


def register_kernel(kernel) -> str:
    """Register a dilgen.Kernel (spec, fixed target or None, tuning or None) and return its
    key; the op runs `kernel.compiled_for(q.device).attention`. Call it eagerly (it hashes)."""
    spec = kernel.spec
    target = kernel.fixed_target.name if kernel.fixed_target is not None else "auto"
    key = f"kernel:{spec.name}@{target}:{spec.key()[:16]}"
    if kernel.tuning:
        blob = json.dumps(kernel.tuning, sort_keys=True).encode()
        key += ":" + hashlib.sha256(blob).hexdigest()[:8]
    with _LOCK:
        _REGISTRY[key] = kernel
        _SPECS[key] = {f: getattr(spec, f) for f in ("name", "num_heads", "num_kv_heads",
                                                     "head_dim", "dtype", "ring_size")}
    return key


def resolve(key: str):
    """The object registered under `key` (see the module docstring)."""
    obj = _REGISTRY.get(key)
    if obj is not None:
        return obj
    from . import GeneratedAttention
    for module in list(sys.modules.values()):
        cand = getattr(module, "attention", None) if module is not None else None
        if isinstance(cand, GeneratedAttention) and op_key(cand) == key:
            register(cand)
            return cand
    raise RuntimeError(
        f"dilgen: no generated kernel is registered under {key!r}; call it once outside "
        f"torch.compile, or pass it to dilgen.runtime.op.register() first")


def _attention(key: str, device: torch.device):
    obj = resolve(key)
    if hasattr(obj, "compiled_for"):      # a dilgen.Kernel: the module for this device
        return obj.compiled_for(device).attention
    return obj


def attention_op(attn, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """(out, lse) of a GeneratedAttention through torch.ops.dilgen.attention_fwd."""
    key = op_key(attn)
    if not torch.compiler.is_compiling():
        register(attn)
    return attention_fwd(q, k, v, key)


def kernel_call(kernel, q, k, v, *, return_lse: bool = False, group=None,
                chunk_order: str = "contiguous", cu_seqlens=None, max_seqlen=None):
    """`kernel(q, k, v, ...)` for a dilgen.Kernel registered with register_kernel (its key
    in `kernel._op_key`; or that key itself), without building anything at trace time:
    for torch.compile."""
    from . import InputError, _check_inputs
    key = kernel if isinstance(kernel, str) else kernel._op_key
    spec = _SPECS[key]
    if cu_seqlens is not None:
        # traced: the offsets are not read on the host (no check of their values), so the
        # grid needs max_seqlen from the caller, as FlashAttention's varlen functions take it
        if max_seqlen is None:
            raise InputError(f"{spec['name']}: under torch.compile pass max_seqlen= with cu_seqlens "
                             f"(the longest sequence; the offsets are not read on the host)")
        if spec["ring_size"] > 1:
            raise NotImplementedError(
                f"{spec['name']}: a packed row on a ring (cu_seqlens with ring_size > 1) runs "
                f"eagerly, not as a torch.ops op: call the kernel outside torch.compile")
        if group is not None:
            raise InputError(f"{spec['name']}: group= applies only to ring_size > 1 specs")
        out, lse = attention_varlen_fwd(q, k, v, cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1],
                                        int(max_seqlen), True, [], key)
        return (out, lse) if return_lse else out
    if spec["ring_size"] > 1:
        if group is not None:
            raise NotImplementedError(
                f"{spec['name']}: under torch.compile the ring runs over the default process "
                f"group; call with group=None (or call the kernel outside torch.compile)")
        out, lse = ring_attention_fwd(q, k, v, key, chunk_order)
        return (out, lse) if return_lse else out
    if chunk_order != "contiguous":
        raise InputError(f"{spec['name']}: chunk_order applies only to ring_size > 1 specs")
    if group is not None:
        raise InputError(f"{spec['name']}: group= applies only to ring_size > 1 specs")
    _check_inputs(spec, q, k, v)
    out, lse = attention_fwd(q, k, v, key)
    return (out, lse) if return_lse else out


@torch.compiler.assume_constant_result
def constant_key(make_key, obj) -> str:
    """`make_key(obj)`, a string. Under torch.compile it runs once while tracing, eagerly
    and outside the graph (hashing, building), and its result is a constant of the graph,
    guarded on the identity of `obj`: another object is traced again. dilgen.dilated_attention
    finds (or makes) the kernel of a spec with it."""
    return make_key(obj)


@torch.library.custom_op("dilgen::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, key: str) -> tuple[Tensor, Tensor]:
    """out (B, N, H, D) contiguous, of q's dtype; lse (B, H, N) float32."""
    return _attention(key, q.device).forward_raw(q, k, v)


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
    attn = _attention(key, q.device)
    if attn.backward_kernels is None:
        raise NotImplementedError(
            f"dilgen ({attn.spec['name']}): this generated module has no backward kernels; "
            f"run the forward under torch.no_grad(), or detach q, k, v")
    from .backward import backward_raw
    dq, dk, dv = backward_raw(attn, q, k, v, out, lse, grad_out, grad_lse)
    return dq, dk, dv


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


# -- the ring (ring_size > 1) over the default process group, as ops: a ring model compiles
# as one graph, the P2P steps inside the opaque op --------------------------------------------
def ring_attention_op(attn, q: Tensor, k: Tensor, v: Tensor, chunk_order: str) -> tuple[Tensor, Tensor]:
    """(out, lse) of my rows through torch.ops.dilgen.ring_attention_fwd (default group)."""
    key = op_key(attn)
    if not torch.compiler.is_compiling():
        register(attn)
    return ring_attention_fwd(q, k, v, key, chunk_order)


@torch.library.custom_op("dilgen::ring_attention_fwd", mutates_args=())
def ring_attention_fwd(q: Tensor, k: Tensor, v: Tensor, key: str, chunk_order: str) -> tuple[Tensor, Tensor]:
    """My rows of out (B, N/P, H, D) and lse (B, H, N/P): every rank of the default group calls it."""
    from .ring import RingRun, ring_forward
    attn = _attention(key, q.device)
    return ring_forward(RingRun(attn, q, k, v, None, chunk_order), q, k, v)


@ring_attention_fwd.register_fake
def _ring_attention_fwd_fake(q, k, v, key, chunk_order):
    return _attention_fwd_fake(q, k, v, key)


@torch.library.custom_op("dilgen::ring_attention_bwd", mutates_args=())
def ring_attention_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                       grad_lse: Optional[Tensor], key: str, chunk_order: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of my rows; the partial dK, dV of remote keys travel to their owners."""
    from .ring import RingRun, ring_backward
    attn = _attention(key, q.device)
    run = RingRun(attn, q, k, v, None, chunk_order)
    return ring_backward(run, q, k, v, out, lse, grad_out, grad_lse)


@ring_attention_bwd.register_fake
def _ring_attention_bwd_fake(q, k, v, out, lse, grad_out, grad_lse, key, chunk_order):
    return _attention_bwd_fake(q, k, v, out, lse, grad_out, grad_lse, key)


def _ring_setup_context(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    q, k, v, key, chunk_order = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.key, ctx.chunk_order = key, chunk_order


def _ring_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = ring_attention_bwd(q, k, v, out, lse, grad_out, grad_lse, ctx.key, ctx.chunk_order)
    return dq, dk, dv, None, None


ring_attention_fwd.register_autograd(_ring_backward, setup_context=_ring_setup_context)


# -- variable-length batches (dilgen.runtime.varlen): packed or right-padded rows ---------------
def varlen_attention_op(attn, q: Tensor, k: Tensor, v: Tensor, packing) -> tuple[Tensor, Tensor]:
    """(out (rows, H, D), lse (H, rows)) through torch.ops.dilgen.attention_varlen_fwd."""
    key = op_key(attn)
    if not torch.compiler.is_compiling():
        register(attn)
    flat = [x for b in packing.buckets for x in b]
    return attention_varlen_fwd(q, k, v, packing.starts, packing.lengths, packing.max_len,
                                packing.covers_all, flat, key)


def _packing(seq_starts, seq_lens, max_seqlen, covers_all, buckets=()):
    """The Packing of the op's arguments; `buckets` flattens its launch groups (first, end,
    longest), [] for one group."""
    from .varlen import Packing
    groups = tuple(tuple(buckets[i:i + 3]) for i in range(0, len(buckets), 3))
    return Packing(seq_starts, seq_lens, int(max_seqlen), bool(covers_all), groups)


@torch.library.custom_op("dilgen::attention_varlen_fwd", mutates_args=())
def attention_varlen_fwd(q: Tensor, k: Tensor, v: Tensor, seq_starts: Tensor, seq_lens: Tensor,
                         max_seqlen: int, covers_all: bool, buckets: list[int], key: str) -> tuple[Tensor, Tensor]:
    """Sequence b is rows seq_starts[b] + [0, seq_lens[b]) of q (rows, H, D); out (rows, H, D),
    lse (H, rows) float32; rows of no sequence get 0 and -inf."""
    from .varlen import forward_varlen_raw
    attn = _attention(key, q.device)
    return forward_varlen_raw(attn, q, k, v, _packing(seq_starts, seq_lens, max_seqlen, covers_all, buckets))


@attention_varlen_fwd.register_fake
def _attention_varlen_fwd_fake(q, k, v, seq_starts, seq_lens, max_seqlen, covers_all, buckets, key):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("dilgen::attention_varlen_bwd", mutates_args=())
def attention_varlen_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                         grad_lse: Optional[Tensor], seq_starts: Tensor, seq_lens: Tensor,
                         max_seqlen: int, covers_all: bool, buckets: list[int], key: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of a variable-length call, shaped like (q, k, v)."""
    from .varlen import backward_varlen_raw
    attn = _attention(key, q.device)
    return backward_varlen_raw(attn, q, k, v, out, lse, grad_out, grad_lse,
                               _packing(seq_starts, seq_lens, max_seqlen, covers_all, buckets))


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
