"""A dilgen.Kernel's call while torch.compile traces it: by its registry key, without
building anything (files, hashes) at trace time, through the same torch ops an eager
call takes (op.py, ring/op.py). Eager calls go through GeneratedAttention (attention.py)."""
from __future__ import annotations

import torch

from .checks import InputError, check_inputs, check_max_seqlen
from .decode import check_decode_inputs
from .dropout_call import attention_dropout_fwd, attention_varlen_dropout_fwd, bad_p, valid_p
from .op import attention_fwd, attention_varlen_fwd, decode_op, refused
from .registry import kernel_spec
from .ring.op import ring_attention_fwd, traced_ring_dropout


def _traced_offsets(name: str, cu, total: int, max_seqlen: int):
    """(starts, lengths) of traced cu_seqlens, checked on the device with no host sync: offsets
    that are not 0 = cu[0] <= cu[1] <= ... <= cu[-1] = total with no sequence past max_seqlen
    fail a device-side assert (torch._assert_async); and whatever they hold, the kernels only
    see sequences clamped inside the rows (starts in [0, total], ends <= total, lengths <=
    max_seqlen), so nothing is read or written out of bounds before the assert reports."""
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
        raise InputError(f"{name}: cu_seqlens must be a 1-D int32 tensor of B + 1 >= 2 offsets")
    steps = cu[1:] - cu[:-1]
    ok = (cu[0] == 0) & (cu[-1] == total) & (steps >= 0).all() & (steps <= max_seqlen).all()
    torch._assert_async(ok, f"{name}: cu_seqlens must be non-decreasing offsets from 0 to the {total} "
                            f"packed rows, no sequence longer than max_seqlen = {max_seqlen}")
    starts = cu[:-1].clamp(0, total)
    ends = cu[1:].clamp(0, total)
    return starts, (ends - starts).clamp(0, max_seqlen)


def _need_max_seqlen(name: str, max_seqlen) -> None:
    """Traced packed rows: the offsets are not read on the host (no check of their values), so
    the grid needs max_seqlen from the caller, as FlashAttention's varlen functions take it."""
    if max_seqlen is None:
        raise InputError(f"{name}: under torch.compile pass max_seqlen= with cu_seqlens "
                         f"(the longest sequence; the offsets are not read on the host)")


def _traced_packing(name: str, cu, total: int, max_seqlen):
    """(starts, lengths, longest) of traced cu_seqlens over `total` rows (_traced_offsets)."""
    _need_max_seqlen(name, max_seqlen)
    longest = check_max_seqlen(name, max_seqlen)
    return (*_traced_offsets(name, cu, total, longest), longest)


def kernel_call(kernel, q, k, v, *, return_lse: bool = False, group=None,
                chunk_order: str = "contiguous", cu_seqlens=None, max_seqlen=None, dropout_p: float = 0.0):
    """`kernel(q, k, v, ...)` for a dilgen.Kernel registered with register_kernel (its key
    in `kernel._op_key`; or that key itself), without building anything at trace time:
    for torch.compile. A call the checks refuse becomes torch.ops.dilgen.refused, which
    raises the InputError when the graph runs (so it is not wrapped in dynamo's message)."""
    try:
        if dropout_p:
            return _traced_dropout(kernel, q, k, v, dropout_p, return_lse=return_lse, group=group,
                                   chunk_order=chunk_order, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
        return _traced_call(kernel, q, k, v, return_lse=return_lse, group=group,
                            chunk_order=chunk_order, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
    except InputError as exc:
        if not isinstance(q, torch.Tensor) or q.dim() < 2:
            raise
        # exc.args[0], not str(exc): dynamo (torch 2.11) cannot trace an exception's C str()
        out, lse = refused(q, exc.args[0] if exc.args else type(exc).__name__)
        return (out, lse) if return_lse else out


def _traced_call(kernel, q, k, v, *, return_lse, group, chunk_order, cu_seqlens, max_seqlen):
    key = kernel if isinstance(kernel, str) else kernel._op_key
    spec = kernel_spec(key)
    if cu_seqlens is not None:
        _need_max_seqlen(spec["name"], max_seqlen)
        if spec["ring_size"] > 1:
            raise NotImplementedError(
                f"{spec['name']}: a packed row on a ring (cu_seqlens with ring_size > 1) runs "
                f"eagerly, not as a torch.ops op: call the kernel outside torch.compile")
        if group is not None:
            raise InputError(f"{spec['name']}: group= applies only to ring_size > 1 specs")
        starts, lens, longest = _traced_packing(spec["name"], cu_seqlens, q.shape[0], max_seqlen)
        out, lse = attention_varlen_fwd(q, k, v, starts, lens, longest, True, [], key)
        return (out, lse) if return_lse else out
    if spec["ring_size"] > 1:
        # the group travels as its name (a torch op takes no ProcessGroup); a caller that
        # holds the name as a string (group=placement.group_name) keeps the trace free of it
        name = group if isinstance(group, str) else "" if group is None else group.group_name
        out, lse = ring_attention_fwd(q, k, v, key, chunk_order, name)
        return (out, lse) if return_lse else out
    if chunk_order != "contiguous":
        raise InputError(f"{spec['name']}: chunk_order applies only to ring_size > 1 specs")
    if group is not None:
        raise InputError(f"{spec['name']}: group= applies only to ring_size > 1 specs")
    check_inputs(spec, q, k, v)
    out, lse = attention_fwd(q, k, v, key)
    return (out, lse) if return_lse else out


def _traced_dropout(kernel, q, k, v, p, *, return_lse, group, chunk_order, cu_seqlens, max_seqlen):
    """kernel(q, k, v, dropout_p=p) traced: torch.ops.dilgen.attention_dropout_fwd (a ring
    spec: ring_attention_dropout_fwd), which draws the mask's seed when the graph runs
    (dropout_call.py, ring/op.py)."""
    key = kernel if isinstance(kernel, str) else kernel._op_key
    spec = kernel_spec(key)
    name = spec["name"]
    if not valid_p(p):
        raise bad_p(name, p)
    if spec["ring_size"] > 1:
        if cu_seqlens is not None:
            raise NotImplementedError(
                f"{name}: a packed row on a ring (cu_seqlens with ring_size > 1) runs eagerly, not as a "
                f"torch.ops op: call the kernel outside torch.compile")
        out, lse = traced_ring_dropout(key, q, k, v, chunk_order, group, p)
        return (out, lse) if return_lse else out
    if chunk_order != "contiguous" or group is not None:
        raise InputError(f"{name}: group= and chunk_order apply only to ring_size > 1 specs")
    if cu_seqlens is not None:      # packed rows: drawn as one sequence of the rows, as eagerly
        starts, lens, longest = _traced_packing(name, cu_seqlens, q.shape[0], max_seqlen)
        out, lse, _ = attention_varlen_dropout_fwd(q, k, v, starts, lens, longest, float(p), -1, key)
        return (out, lse) if return_lse else out
    if max_seqlen is not None:
        raise InputError(f"{name}: max_seqlen goes with cu_seqlens (packed batches)")
    check_inputs(spec, q, k, v)
    out, lse, _ = attention_dropout_fwd(q, k, v, float(p), -1, key)
    return (out, lse) if return_lse else out


def traced_decode(spec: dict, key: str, q, k_cache, v_cache, cache_seqlens, return_lse: bool = False):
    """`decode(q, k_cache, v_cache, cache_seqlens)` while torch.compile traces it: the shapes
    checked now, the lengths on the device (T <= cache_seqlens[b] <= N_max, else a device-side
    assert when the graph runs, with no host sync), then torch.ops.dilgen.decode. A spec that
    cannot decode raises its InputError when the graph runs."""
    try:
        _, T, n_max = check_decode_inputs(spec, q, k_cache, v_cache, cache_seqlens, validate=False)
    except InputError as exc:
        if not isinstance(q, torch.Tensor) or q.dim() != 4:
            raise
        # exc.args[0], not str(exc): dynamo (torch 2.11) cannot trace an exception's C str()
        out, lse = refused(q, exc.args[0] if exc.args else type(exc).__name__)
        return (out, lse) if return_lse else out
    torch._assert_async(((cache_seqlens >= T) & (cache_seqlens <= n_max)).all(),
                        f"{spec['name']}: decode: every cache_seqlens[b] must lie in [T, N_max] = "
                        f"[{T}, {n_max}] (the cache holds the new tokens' keys and values; it has "
                        f"{n_max} rows)")
    out, lse = decode_op(q, k_cache, v_cache, cache_seqlens, key)
    return (out, lse) if return_lse else out


def kernel_decode(kernel, q, k_cache, v_cache, cache_seqlens, return_lse: bool = False):
    """`kernel.decode(...)` for a dilgen.Kernel registered with register_kernel (or its key)
    while torch.compile traces it: traced_decode by the kernel's registry key."""
    key = kernel if isinstance(kernel, str) else kernel._op_key
    return traced_decode(kernel_spec(key), key, q, k_cache, v_cache, cache_seqlens, return_lse)
