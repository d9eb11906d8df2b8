"""Attention dropout's door (`attention(q, k, v, dropout_p=p)`, SPEC §3): the call runs the
spec's dropout plan (dropout_plan.DROPOUT_TUNING: the fused `tl` kernels with Plan.dropout), whose
forward drops each branch's entry of each probability by the coin of dilgen.dropout and
scales the kept ones by 1 / (1 - p), and whose backward draws the same coins again from the
seed the forward kept (nothing of size N x N is stored).

Every batch draws as one sequence of its rows (item b of a fixed-length batch: rows b N +
position; a packed or padded batch: its rows), so a batch gets one mask in every layout.
The seed is drawn from torch's default generator on the host (torch.manual_seed reproduces a
run; successive calls differ; no device read, no sync) and handed to the kernels as one int64
on the device, which they read when they run: inside a CUDA-graph capture it is drawn there
by the device's generator instead, so every replay draws a new mask (seed_tensor)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..dropout import scale, stream, threshold
from .backward import backward_raw
from .checks import InputError
from .forward import forward_raw
from .op import _keep_nothing, _no_double_backward, plain_eager
from .registry import attention_for, op_key, register, twin
from .varlen import Packing

#: seeds are drawn in [0, 2^62): the kernels take them as a signed 64-bit argument
SEED_BOUND = 1 << 62


def refuse(name: str, what: str, fix: str) -> None:
    raise InputError(f"{name}: dropout_p > 0 {what}; {fix}")


def valid_p(p) -> bool:
    return not isinstance(p, bool) and isinstance(p, (int, float)) and 0.0 <= float(p) < 1.0


def bad_p(name: str, p) -> InputError:
    return InputError(f"{name}: dropout_p = {p!r} must be a number in [0, 1) (the probability of "
                      f"dropping an attention probability)")


def draw_seed() -> int:
    """A seed from torch's default generator (a CPU tensor: no device sync)."""
    return int(torch.randint(0, SEED_BOUND, (1,)).item())


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def seed_tensor(seed, device: torch.device) -> Tensor:
    """The mask's seed as the kernels read it: one int64 on `device`. seed: a tensor of one
    (the forward's, for a backward), an int, or None: drawn by torch's generator on the host,
    or, inside a CUDA-graph capture, by the device's generator in the graph, whose replays
    each draw a new one (PyTorch's graph-safe Philox offsets)."""
    if isinstance(seed, Tensor):
        return seed
    if seed is None and _capturing(device):
        return torch.randint(0, SEED_BOUND, (1,), dtype=torch.int64, device=device)
    return torch.full((1,), draw_seed() if seed is None else seed, dtype=torch.int64, device=device)


_STREAMS: dict = {}


def model_streams(heads: int, n_branches: int, device: torch.device) -> Tensor:
    """(heads, n_branches) int64 on `device`: the counter's stream h n_branches + i of head h
    and branch i (dilgen.dropout.stream), which the kernels read (common.dropout_rows); kept
    per shape and device, but made anew inside a CUDA-graph capture (its kernels run at replay)."""
    key = (heads, n_branches, device)
    table = _STREAMS.get(key)
    if table is None:
        table = stream(heads, n_branches, torch.arange(heads, device=device)[:, None],
                       torch.arange(n_branches, device=device)[None, :])
        if not _capturing(device):
            _STREAMS[key] = table
    return table


def cut_and_scale(p: float) -> tuple[int, float]:
    """The kernels' (drop_cut, drop_scale) of probability p (common.dropout_keep)."""
    cut = threshold(float(p))
    return cut, scale(cut)


def _seed_and_cut(name: str, p, seed, device) -> tuple[Tensor, int, float]:
    """(seed tensor, drop_cut, drop_scale) of a call with drop probability p, or one InputError."""
    if not valid_p(p):
        raise bad_p(name, p)
    if seed is not None and not isinstance(seed, Tensor):
        if not 0 <= int(seed) < SEED_BOUND:
            raise InputError(f"{name}: dropout seed {seed} must be in [0, 2^62)")
        seed = int(seed)
    return (seed_tensor(seed, device), *cut_and_scale(p))


class _DropoutFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn, args, packing):
        out, lse = forward_raw(attn, q, k, v, packing, dropout=args)
        ctx.set_materialize_grads(False)
        ctx.attn, ctx.args, ctx.packing = attn, args, packing
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None, None
        dq, dk, dv = backward_raw(ctx.attn, q, k, v, out, lse, grad_out, grad_lse, ctx.packing, dropout=ctx.args)
        return dq, dk, dv, None, None, None


def dropout_twin(attn, device):
    """The dropout plan's module of attn's spec (dropout_plan.DROPOUT_TUNING), or one refusal. A
    module built with the planner's tuning {"dropout": True, ...} (a tile sweep's variant) is
    its own."""
    if attn.plan.get("dropout"):
        return attn
    drop = twin(attn, device, tuning={"dropout": True})
    if drop is None:
        refuse(attn.spec["name"], "needs dilgen's compiler to build the spec's dropout kernels",
               "call it through dilgen.compile(spec), not an imported generated module")
    return drop


def dropout_args(attn, q, p, seed, packing=None) -> tuple:
    """The kernels' dropout arguments (seed tensor, drop_cut, drop_scale, the counter's N,
    position of row 0, the streams of the heads and branches: common.dropout_rows) of a call
    on q, or one refusal. seed: an int, the forward's seed tensor, or None (drawn: seed_tensor)."""
    name = attn.spec["name"]
    if attn.spec.get("head_base", 0):
        refuse(name, "draws the coins of a model's heads, which a head_base spec called alone does not know",
               "call the model's spec (head_base 0); a ring's heads transport passes them")
    B, n = (1, q.shape[0]) if packing is not None else (q.shape[0], q.shape[1])
    H, nb = attn.spec["num_heads"], len(attn.plan["branches"])
    if H * nb >= 1 << 32 or B * n >= 1 << 32:
        refuse(name, f"counts (head, branch) and rows in 32-bit words: heads {H} x branches {nb} and "
               f"batch {B} x N = {n} must stay below 2^32", "split the batch")
    return (*_seed_and_cut(name, p, seed, q.device), n, 0, model_streams(H, nb, q.device))


def dropout_attention(attn, q, k, v, p, *, return_lse: bool = False, seed: int | None = None, packing=None):
    """attention(q, k, v, dropout_p=p) for p > 0 on one device (autograd-aware), inputs
    already checked by the caller. packing (runtime.varlen.Packing): q, k, v are packed rows
    (total, heads, D). `seed`: the mask's seed (tests and reproductions; default drawn from
    torch's generator). Traced by torch.compile (or a tensor subclass): the custom op below,
    which draws the seed when it runs."""
    name = attn.spec["name"]
    if attn.plan["ring"]["ring_size"] > 1:
        refuse(name, "runs here on one device", "call a ring spec through kernel(...) on every rank")
    if not plain_eager(q, k, v):
        if packing is not None:
            refuse(name, "on packed or padded rows is not traced by torch.compile yet",
                   "call the model eagerly while dropout is on, or pass fixed-length rows")
        if not valid_p(p):
            raise bad_p(name, p)
        if not torch.compiler.is_compiling():
            register(attn)
        out, lse, _ = attention_dropout_fwd(q, k, v, float(p), -1 if seed is None else int(seed), op_key(attn))
        return (out, lse) if return_lse else out
    drop = dropout_twin(attn, q.device)
    args = dropout_args(drop, q, p, seed, packing)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        out, lse = _DropoutFunction.apply(q, k, v, drop, args, packing)
    else:
        out, lse = forward_raw(drop, q, k, v, packing, dropout=args)
    return (out, lse) if return_lse else out


# Under torch.compile (or for a tensor subclass) the call is one opaque node of each pass:
#   torch.ops.dilgen.attention_dropout_fwd(q, k, v, p, seed, key) -> (out, lse, seed_used)
#   torch.ops.dilgen.attention_dropout_bwd(q, k, v, out, lse, grad_out, grad_lse, seed_used, p, key)
# The forward draws the seed when it runs (seed < 0: one draw of torch's generator, as an
# eager call draws it, so torch.manual_seed gives a compiled call the eager call's mask) and
# returns it (int64, one element on q's device) for the backward. Tagged nondeterministic_seeded: the
# compiler keeps one run per call and never recomputes it for the backward.


@torch.library.custom_op("dilgen::attention_dropout_fwd", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def attention_dropout_fwd(q: Tensor, k: Tensor, v: Tensor, p: float, seed: int,
                          key: str) -> tuple[Tensor, Tensor, Tensor]:
    """out (B, N, H, D), lse (B, H, N) float32, and the seed drawn (int64, one element on q's device)."""
    drop = dropout_twin(attention_for(key, q.device), q.device)
    args = dropout_args(drop, q, p, None if seed < 0 else seed)
    out, lse = forward_raw(drop, q, k, v, None, dropout=args)
    return out, lse, args[0]


@attention_dropout_fwd.register_fake
def _op_fwd_fake(q, k, v, p, seed, key):
    B, N, H, _ = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty((B, H, N), dtype=torch.float32), q.new_empty(1, dtype=torch.int64))


@torch.library.custom_op("dilgen::attention_dropout_bwd", mutates_args=())
def attention_dropout_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Optional[Tensor],
                          grad_lse: Optional[Tensor], seed: Tensor, p: float,
                          key: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) under the forward's mask (its seed_used)."""
    drop = dropout_twin(attention_for(key, q.device), q.device)
    return backward_raw(drop, q, k, v, out, lse, grad_out, grad_lse, None,
                        dropout=dropout_args(drop, q, p, seed))


@attention_dropout_bwd.register_fake
def _op_bwd_fake(q, k, v, out, lse, grad_out, grad_lse, seed, p, key):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _op_setup(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    q, k, v, p, _seed, key = inputs
    out, lse, seed_used = output
    ctx.save_for_backward(q, k, v, out, lse, seed_used)
    ctx.p, ctx.key = p, key


def _op_backward(ctx, grad_out, grad_lse, _grad_seed):
    q, k, v, out, lse, seed_used = ctx.saved_tensors
    if grad_out is None and grad_lse is None:
        return None, None, None, None, None, None
    dq, dk, dv = attention_dropout_bwd(q, k, v, out, lse, grad_out, grad_lse, seed_used, ctx.p, ctx.key)
    return dq, dk, dv, None, None, None


attention_dropout_fwd.register_autograd(_op_backward, setup_context=_op_setup)
attention_dropout_bwd.register_autograd(_no_double_backward, setup_context=_keep_nothing)


@torch.library.custom_op("dilgen::attention_varlen_dropout_fwd", mutates_args=(),
                         tags=(torch.Tag.nondeterministic_seeded,))
def attention_varlen_dropout_fwd(q: Tensor, k: Tensor, v: Tensor, seq_starts: Tensor, seq_lens: Tensor,
                                 max_seqlen: int, p: float, seed: int, key: str) -> tuple[Tensor, Tensor, Tensor]:
    """The packed rows' call (sequence b is rows seq_starts[b] + [0, seq_lens[b]) of q (rows,
    H, D), covering every row): out, lse (H, rows) and the seed drawn."""
    drop = dropout_twin(attention_for(key, q.device), q.device)
    packing = _op_packing(seq_starts, seq_lens, max_seqlen)
    args = dropout_args(drop, q, p, None if seed < 0 else seed, packing)
    out, lse = forward_raw(drop, q, k, v, packing, dropout=args)
    return out, lse, args[0]


@attention_varlen_dropout_fwd.register_fake
def _op_varlen_fwd_fake(q, k, v, seq_starts, seq_lens, max_seqlen, p, seed, key):
    return (q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32),
            q.new_empty(1, dtype=torch.int64))


@torch.library.custom_op("dilgen::attention_varlen_dropout_bwd", mutates_args=())
def attention_varlen_dropout_bwd(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                                 grad_out: Optional[Tensor], grad_lse: Optional[Tensor], seq_starts: Tensor,
                                 seq_lens: Tensor, max_seqlen: int, seed: Tensor, p: float,
                                 key: str) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the packed rows under the forward's mask."""
    drop = dropout_twin(attention_for(key, q.device), q.device)
    packing = _op_packing(seq_starts, seq_lens, max_seqlen)
    return backward_raw(drop, q, k, v, out, lse, grad_out, grad_lse, packing,
                        dropout=dropout_args(drop, q, p, seed, packing))


@attention_varlen_dropout_bwd.register_fake
def _op_varlen_bwd_fake(q, k, v, out, lse, grad_out, grad_lse, seq_starts, seq_lens, max_seqlen, seed, p, key):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _op_packing(seq_starts, seq_lens, max_seqlen: int):
    return Packing(seq_starts, seq_lens, int(max_seqlen), True)


def _op_varlen_setup(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    q, k, v, seq_starts, seq_lens, max_seqlen, p, _seed, key = inputs
    out, lse, seed_used = output
    ctx.save_for_backward(q, k, v, out, lse, seq_starts, seq_lens, seed_used)
    ctx.max_seqlen, ctx.p, ctx.key = max_seqlen, p, key


def _op_varlen_backward(ctx, grad_out, grad_lse, _grad_seed):
    q, k, v, out, lse, seq_starts, seq_lens, seed_used = ctx.saved_tensors
    if grad_out is None and grad_lse is None:
        return (None,) * 9
    dq, dk, dv = attention_varlen_dropout_bwd(q, k, v, out, lse, grad_out, grad_lse, seq_starts, seq_lens,
                                              ctx.max_seqlen, seed_used, ctx.p, ctx.key)
    return (dq, dk, dv) + (None,) * 6


attention_varlen_dropout_fwd.register_autograd(_op_varlen_backward, setup_context=_op_varlen_setup)
attention_varlen_dropout_bwd.register_autograd(_no_double_backward, setup_context=_keep_nothing)
