"""A drop-in for torchscale's LongNet `DilatedAttention` (Prov-GigaPath's slide encoder).

    from dilgen.compat.torchscale import patch
    model = ...                     # a torchscale LongNetEncoder, GigaPath's slide encoder, ...
    patch(model)                    # every torchscale DilatedAttention now runs on dilgen

`DilatedAttention` has torchscale's constructor `(args, embed_dim, num_heads, dropout=0.0,
self_attention=False, encoder_decoder_attention=False, subln=False)`, its forward
`(query, key, value, incremental_state=None, key_padding_mask=None, attn_mask=None,
rel_pos=None, is_first_step=False, is_causal=False) -> (attn, None)` and its parameter names
(`q_proj`, `k_proj`, `v_proj`, `out_proj`, `inner_attn_ln`), so a torchscale state_dict loads
unchanged. It reads `args.segment_length` and `args.dilated_ratio` (lists, or their string
form) and computes torchscale's function, not SPEC's default one: the spec it builds has
`"head_offsets": "block"` (head h -> offset floor(h / ceil(H / r))) and
`"short_segments": "zero_pad"` (torchscale's zero keys in padded segments), see docs/SPEC.md.
The branch weights of LongNet Eq. 10 get their exact gradient here (torchscale computes
them under no_grad: same forward, different gradients).

What is refused, with one line naming it: torchscale's xpos (`args.xpos_rel_pos`),
`incremental_state`, `attn_mask`, `rel_pos`, multiway projections (`args.multiway`),
cross-attention, and torchscale's layout slip (min(w, N) not a multiple of r with two or
more segments, where torchscale's outputs land on shifted rows). Attention dropout while
training (`dropout`) runs in the kernels (`dropout_p`: the probabilities of LongNet Eq. 10's
one softmax, docs/api.md), with `args.seq_parallel` too (each rank its rows of the
one-process call's mask).

`args.seq_parallel` (read at every forward, as torchscale does) with torch.distributed set
up and more than one rank in `module.seq_parallel_group` (None: the default group, which
torchscale's `get_data_parallel_group()` spans too): each rank passes its contiguous chunk
of the sequence (`chunk_rows(x)`) and gets its rows of the one-process result, through
dilgen's ring (dilgen/compat/torchscale_seq.py says how). A key_padding_mask with padding
is refused there; parameter gradients are each rank's share (the caller sums them).

Which code: `DilatedAttention(MultiheadAttention)` of microsoft/torchscale's
`torchscale/component/dilated_attention.py` (from commit da3d79c, "LongNet release",
2023-12-19; built by `torchscale/model/longnet.py`'s LongNetEncoderLayer), which
Prov-GigaPath vendors unchanged as `gigapath/torchscale/component/dilated_attention.py`
(built by `gigapath/torchscale/model/LongNet.py`'s `make_longnet_from_name`, which
`gigapath/slide_encoder.py`'s LongNetViT calls). Mirrored: its head blocks (head_offsets
"block"), its zero padding of min(w, N)-long segments to a multiple of r (short_segments
"zero_pad"), its (B, N, H*D) projections read as (B, N, H, D), FlashAttention's scale
1/sqrt(head_dim) per branch and the LSE-softmax mix of the branches, then `inner_attn_ln`
and `out_proj`. torchscale on PyPI (0.3.0) predates LongNet and has none of these modules:
install torchscale from git at da3d79c or later, or use GigaPath's copy (docs/torchscale.md).

`key_padding_mask` (B, N) bool, True = padding (right- or left-padded batches): torchscale
ignores it; here the batch goes to the kernel's padded call (`Kernel.padded`, autograd-aware),
which reads the rows in place and computes each item alone at its own length (its segments
start at its first token); the attention output of padded rows is 0 before `inner_attn_ln`
and `out_proj`. A mask of the wrong shape, or one whose tokens are not one run (holes), is
refused with one line. An all-False mask is the same as none.

dilgen never imports torchscale: `patch` walks `model.named_modules()` and their
`named_children()` and replaces (setattr on the parent, ModuleList entries included) every
child whose class is named `DilatedAttention`, not dilgen's, with the attributes `args`
(with `segment_length` and `dilated_ratio`), `embed_dim`, `num_heads`, `q_proj`, `k_proj`,
`v_proj` and `out_proj`, as in any vendored copy; a renamed subclass is not found (use
`DilatedAttention.from_torchscale`). tests/torchscale_model.py mirrors torchscale's encoder
and GigaPath's slide encoder for the tests.
"""
from __future__ import annotations

import ast
import math

import torch
from torch import nn
from torch.nn import LayerNorm

from ..spec import Spec
from ..support import unsupported_by_kernels, zero_pad_layout_slip
from . import torchscale_seq as seq
from .torchscale_seq import chunk_rows

__all__ = ["DilatedAttention", "chunk_rows", "patch", "is_torchscale_dilated_attention", "spec_for"]

PREFIX = seq.PREFIX
_DTYPES = seq._DTYPES


def _unsupported(feature: str, hint: str) -> NotImplementedError:
    return NotImplementedError(f"{PREFIX}: {feature} is not supported: {hint}")


def _as_list(value, field: str) -> list:
    """args.segment_length / args.dilated_ratio: a list, a tuple or their string form."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{PREFIX}: args.{field} = {value!r}: not a list of integers") from None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{PREFIX}: args.{field} = {value!r}: not a list of integers")
    return [_whole(x, value, field) for x in value]


def _whole(x, value, field: str) -> int:
    """One entry of a segment or dilation list: an int, or a float holding a whole number
    (8.0); never truncated (8.7), never a bool, a string or a nested list."""
    if isinstance(x, int) and not isinstance(x, bool):
        return x
    if isinstance(x, float) and math.isfinite(x) and x == int(x):
        return int(x)
    raise ValueError(f"{PREFIX}: args.{field} = {value!r}: entry {x!r} is not a whole number; "
                     f"give a list of integers such as [2048, 4096]")


def spec_for(args, num_heads: int, head_dim: int, *, causal: bool = False,
             dtype: str = "bfloat16") -> Spec:
    """The dilgen spec of torchscale's DilatedAttention with these args."""
    return Spec(name="torchscale_dilated_attention", num_heads=num_heads, head_dim=head_dim,
                dtype=dtype, segment_lengths=_as_list(args.segment_length, "segment_length"),
                dilation_rates=_as_list(args.dilated_ratio, "dilated_ratio"), causal=causal,
                head_offsets="block", short_segments="zero_pad", source=f"{PREFIX} args")


# --------------------------------------------------------------------------- the kernel calls
# Module-level, so that a test can swap in dilgen.reference while the kernels refuse.

def _attend(q, k, v, spec: Spec, dropout_p: float = 0.0):
    """dilgen's dilated attention of (B, N, H, D) tensors; dropout_p > 0: attention dropout
    (torchscale's `dropout` while training) in the kernels."""
    msg = unsupported_by_kernels(spec)
    if msg:
        raise NotImplementedError(f"{PREFIX}: {msg}; torchscale's layout in the kernels is pending")
    from .. import compiler
    if dropout_p:
        return compiler._kernel_for(spec)(q, k, v, dropout_p=dropout_p)
    return compiler.dilated_attention(q, k, v, spec)


def _attend_padded(q, k, v, key_padding_mask, spec: Spec, dropout_p: float = 0.0):
    """A padded batch (B, N, H, D), key_padding_mask (B, N) bool with True = padding:
    each item at its own length, padded rows 0, through the kernel's padded call (rows read
    in place, autograd-aware)."""
    msg = unsupported_by_kernels(spec)
    if msg:
        raise NotImplementedError(f"{PREFIX}: {msg}; torchscale's layout in the kernels is pending")
    from .. import compiler
    from ..runtime import InputError
    try:
        return compiler._kernel_for(spec).padded(q, k, v, key_padding_mask, dropout_p=dropout_p)
    except InputError as exc:
        text = str(exc)
        if "key_padding_mask" not in text:      # q, k, v errors read as on the unpadded path
            raise
        # the kernel's one line on the mask (holes: not left or right padding), in
        # this module's voice
        text = text.removeprefix(f"{spec.name}: ")
        raise ValueError(f"{PREFIX}: {text}") from None


# --------------------------------------------------------------------------- the module


class DilatedAttention(nn.Module):
    """torchscale's DilatedAttention (constructor, forward, parameter names) on dilgen."""

    def __init__(self, args, embed_dim, num_heads, dropout=0.0, self_attention=False,
                 encoder_decoder_attention=False, subln=False):
        super().__init__()
        if getattr(args, "multiway", False):
            raise _unsupported("args.multiway = True (MultiwayNetwork projections)",
                               "build the model with multiway off")
        if getattr(args, "xpos_rel_pos", False) and self_attention:
            raise _unsupported("args.xpos_rel_pos = True (xpos rotary positions)",
                               "dilgen's kernels take q and k as they are; build the model without xpos")
        if encoder_decoder_attention:
            raise _unsupported("encoder_decoder_attention=True (cross-attention)",
                               "dilated attention here is self-attention")
        if embed_dim % num_heads:
            raise ValueError(f"{PREFIX}: embed_dim = {embed_dim} must be divisible by num_heads = {num_heads}")
        self.args = args
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.dropout = dropout
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        # the spec, validated now (a head_dim or a segment list dilgen refuses fails here)
        self.spec = spec_for(args, num_heads, self.head_dim)
        self._specs: dict = {}
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.inner_attn_ln = (LayerNorm(embed_dim, eps=getattr(args, "layernorm_eps", 1e-5))
                              if subln and self_attention else None)
        self.dropout_module = nn.Dropout(dropout)
        self.xpos = None
        # args.seq_parallel: the ranks the sequence is split over (None: the default group,
        # the world, as torchscale's get_data_parallel_group)
        self.seq_parallel_group = None

    @classmethod
    def from_torchscale(cls, module: nn.Module) -> "DilatedAttention":
        """A dilgen DilatedAttention with the configuration, weights, device, dtype and
        train/eval mode of a torchscale one."""
        if getattr(module, "xpos", None) is not None:
            raise _unsupported("xpos (module.xpos is set)",
                               "dilgen's kernels take q and k as they are; build the model without xpos")
        new = cls(module.args, module.embed_dim, module.num_heads,
                  dropout=getattr(module, "dropout", 0.0),
                  self_attention=getattr(module, "self_attention", True),
                  encoder_decoder_attention=getattr(module, "encoder_decoder_attention", False),
                  subln=getattr(module, "inner_attn_ln", None) is not None)
        ref = next(module.parameters(), None)
        if ref is not None:
            new.to(device=ref.device, dtype=ref.dtype)
        missing, unexpected = new.load_state_dict(module.state_dict(), strict=False)
        if missing or unexpected:
            raise ValueError(f"{PREFIX}: the torchscale module's weights do not match "
                             f"(missing {sorted(missing)}, unexpected {sorted(unexpected)})")
        new.train(module.training)
        return new

    def _spec(self, dtype: torch.dtype, causal: bool) -> Spec:
        key = (dtype, bool(causal))
        spec = self._specs.get(key)
        if spec is None:
            # float64 and other dtypes: the kernels refuse them with their own one line
            spec = self._specs[key] = spec_for(self.args, self.num_heads, self.head_dim,
                                               causal=bool(causal),
                                               dtype=_DTYPES.get(dtype, "float32"))
        return spec

    def forward(self, query, key, value, incremental_state=None, key_padding_mask=None,
                attn_mask=None, rel_pos=None, is_first_step=False, is_causal=False):
        if incremental_state is not None:
            raise _unsupported("incremental_state (torchscale's incremental decoding)",
                               "call without it, on the whole sequence")
        if attn_mask is not None:
            raise _unsupported("attn_mask", "the spec is the mask; pass attn_mask=None "
                               "(and is_causal=True for causal attention)")
        if rel_pos is not None:
            raise _unsupported("rel_pos (relative position bias)", "pass rel_pos=None")
        p = float(self.dropout) if self.training else 0.0    # attention dropout, in the kernels
        if not isinstance(is_causal, bool):
            raise TypeError(f"{PREFIX}: is_causal = {is_causal!r}: pass True or False")
        key = query if key is None else key
        value = key if value is None else value
        B, N, E = query.shape
        if key.shape != query.shape or value.shape != query.shape:
            raise ValueError(f"{PREFIX}: query {tuple(query.shape)}, key {tuple(key.shape)} and "
                             f"value {tuple(value.shape)} must have one shape (self-attention)")
        if E != self.embed_dim:
            raise ValueError(f"{PREFIX}: query has {E} features but embed_dim = {self.embed_dim}")
        H, D = self.num_heads, self.head_dim
        layout = mask = None
        if getattr(self.args, "seq_parallel", False) and seq.group_size(self.seq_parallel_group) > 1:
            # this rank holds rows of the sequence: every rank agrees, or all raise
            layout = seq.agree(B, N, key_padding_mask, query.device, self.seq_parallel_group)
            longest = layout.N
        else:
            mask = _key_padding(key_padding_mask, B, N)
            longest = N if mask is None else int((~mask).sum(1).max())
        slip = zero_pad_layout_slip(self.spec, longest)
        if slip:                    # it names its source: "dilgen.compat.torchscale args: ..."
            raise ValueError(slip)
        q = self.q_proj(query).view(B, N, H, D)
        k = self.k_proj(key).view(B, N, H, D)
        v = self.v_proj(value).view(B, N, H, D)
        if layout is not None:
            out = seq.attend(q, k, v, layout, self.spec.segment_lengths, self.spec.dilation_rates,
                             causal=is_causal, group=self.seq_parallel_group, dropout_p=p)
        else:       # the seams take dropout_p only when it is on (tests and benches swap them)
            drop = (p,) if p else ()
            out = (_attend(q, k, v, self._spec(q.dtype, is_causal), *drop) if mask is None
                   else _attend_padded(q, k, v, mask, self._spec(q.dtype, is_causal), *drop))
        attn = out.reshape(B, N, E)
        if self.inner_attn_ln is not None:
            attn = self.inner_attn_ln(attn)
        return self.out_proj(attn), None

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"segment_length={list(self.spec.segment_lengths)}, "
                f"dilated_ratio={list(self.spec.dilation_rates)} (dilgen)")


def _key_padding(mask, B: int, N: int):
    """key_padding_mask as a (B, N) bool tensor with some padding, or None for none (whether
    it is left or right padding, the kernel's padded call checks)."""
    if mask is None:
        return None
    if tuple(mask.shape) != (B, N):
        raise ValueError(f"{PREFIX}: key_padding_mask has shape {tuple(mask.shape)}, expected ({B}, {N})")
    mask = mask.to(torch.bool)
    return mask if bool(mask.any()) else None


# --------------------------------------------------------------------------- patch

_ATTRS = ("args", "embed_dim", "num_heads", "q_proj", "k_proj", "v_proj", "out_proj")


def is_torchscale_dilated_attention(module) -> bool:
    """A torchscale DilatedAttention (any vendored copy): recognised by name and attributes."""
    return (type(module).__name__ == "DilatedAttention" and not isinstance(module, DilatedAttention)
            and all(hasattr(module, a) for a in _ATTRS)
            and hasattr(module.args, "segment_length") and hasattr(module.args, "dilated_ratio"))


def patch(model: nn.Module, *, verbose: bool = True, seq_parallel_group=None) -> list[str]:
    """Replace, in place, every torchscale DilatedAttention inside `model` by dilgen's,
    keeping its weights (device, dtype, train/eval mode); return the dotted names of the
    replaced modules (and print them unless verbose=False). A second call finds none.
    seq_parallel_group: the process group args.seq_parallel splits the sequence over
    (None: the default group)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{PREFIX}: patch(model) takes a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if is_torchscale_dilated_attention(model):
        raise TypeError(f"{PREFIX}: patch(model) replaces modules inside a model; for a lone "
                        f"DilatedAttention use DilatedAttention.from_torchscale(module)")
    replaced: list[str] = []
    done: dict[int, DilatedAttention] = {}      # a module shared by two parents is converted once
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not is_torchscale_dilated_attention(child):
                continue
            new = done.get(id(child))
            if new is None:
                new = done[id(child)] = DilatedAttention.from_torchscale(child)
                new.seq_parallel_group = seq_parallel_group
            setattr(parent, child_name, new)
            replaced.append(f"{parent_name}.{child_name}" if parent_name else child_name)
    if verbose:
        if replaced:
            print(f"{PREFIX}.patch: replaced {len(replaced)} torchscale DilatedAttention "
                  f"module(s) with dilgen's: {', '.join(replaced)}")
        else:
            print(f"{PREFIX}.patch: found no torchscale DilatedAttention module")
    return replaced
