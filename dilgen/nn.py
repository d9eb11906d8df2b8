"""torch.nn layers over dilgen kernels.

- `DilatedAttention(spec)`: (q, k, v) -> out, the kernel as a module.
- `MultiheadDilatedAttention(embed_dim, num_heads, segment_lengths, dilation_rates, ...)`:
  projections + dilated attention, following nn.MultiheadAttention's conventions where
  they make sense (batch_first=True only; the spec is the attention mask; key_padding_mask
  for right-padded batches).
- `LongNetDecoderBlock`: pre-norm residual block (causal dilated attention + MLP).
"""
from __future__ import annotations

import torch
from torch import nn

from .compiler import compile as compile_spec
from .spec import Spec


class DilatedAttention(nn.Module):
    """Dilated attention of one spec; q (B, N, H, D), k and v (B, N, H_kv, D)."""

    def __init__(self, spec: Spec) -> None:
        super().__init__()
        self.spec = spec
        self.kernel = compile_spec(spec)

    def forward(self, q, k, v, return_lse: bool = False, key_padding_mask=None):
        """key_padding_mask (B, N) bool, True = padding (right padding only): each item runs
        at its own length and its padded rows come out 0."""
        if key_padding_mask is not None:
            return self.kernel.padded(q, k, v, key_padding_mask, return_lse=return_lse)
        return self.kernel(q, k, v, return_lse=return_lse)

    def extra_repr(self) -> str:
        return f"spec={self.spec.name}, w={list(self.spec.segment_lengths)}, r={list(self.spec.dilation_rates)}"


class MultiheadDilatedAttention(nn.Module):
    """Multi-head dilated attention with input and output projections.

    forward(query, key=None, value=None) takes (B, N, embed_dim) tensors and returns
    (output, None): the second slot, attention weights in nn.MultiheadAttention, is never
    materialised here. key and value default to query (self-attention)."""

    def __init__(self, embed_dim: int, num_heads: int, segment_lengths, dilation_rates, *,
                 num_kv_heads: int | None = None, causal: bool = False, bias: bool = True,
                 dropout: float = 0.0, batch_first: bool = True, hilbert=None,
                 dtype: torch.dtype | None = None, device=None, name: str = "mhda") -> None:
        super().__init__()
        if not batch_first:
            raise ValueError("MultiheadDilatedAttention supports batch_first=True only: "
                             "pass (B, N, embed_dim) tensors")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim = {embed_dim} must be divisible by num_heads = {num_heads}")
        if dropout:
            raise ValueError("attention dropout is not supported by the fused kernels; use dropout=0")
        head_dim = embed_dim // num_heads
        num_kv_heads = num_kv_heads or num_heads
        factory = {"dtype": dtype, "device": device}
        param_dtype = dtype or torch.get_default_dtype()
        dtype_name = {torch.float16: "float16", torch.bfloat16: "bfloat16",
                      torch.float32: "float32"}.get(param_dtype)
        if dtype_name is None:
            raise ValueError(f"dtype {param_dtype} is not supported: use float16, bfloat16 or float32")
        self.spec = Spec(name=name, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, dtype=dtype_name, segment_lengths=list(segment_lengths),
                         dilation_rates=list(dilation_rates), causal=causal, hilbert=hilbert)
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.batch_first = True
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **factory)
        self.attention = DilatedAttention(self.spec)

    def forward(self, query, key=None, value=None, key_padding_mask=None, need_weights: bool = False):
        """key_padding_mask (B, N) bool, True = padding, as nn.MultiheadAttention takes it, for
        right-padded batches: every item is computed at its own length (segments of the
        padding never enter), and the attention output of padded rows is 0 before out_proj
        adds its bias."""
        if need_weights:
            raise ValueError("need_weights=True is not supported: dilated attention never "
                             "materialises the (N, N) weights")
        key = query if key is None else key
        value = key if value is None else value
        B, N, _ = query.shape
        q = self.q_proj(query).view(B, N, self.num_heads, self.head_dim)
        k = self.k_proj(key).view(B, N, self.num_kv_heads, self.head_dim)
        v = self.v_proj(value).view(B, N, self.num_kv_heads, self.head_dim)
        out = self.attention(q, k, v, key_padding_mask=key_padding_mask)
        return self.out_proj(out.reshape(B, N, self.num_heads * self.head_dim)), None


class LongNetDecoderBlock(nn.Module):
    """x + attn(norm(x)); x + mlp(norm(x)), with causal dilated self-attention."""

    def __init__(self, embed_dim: int, num_heads: int, segment_lengths, dilation_rates, *,
                 mlp_ratio: int = 4, num_kv_heads: int | None = None,
                 dtype: torch.dtype | None = None, device=None, name: str = "longnet_block") -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.norm1 = nn.LayerNorm(embed_dim, **factory)
        self.attn = MultiheadDilatedAttention(embed_dim, num_heads, segment_lengths, dilation_rates,
                                              num_kv_heads=num_kv_heads, causal=True, dtype=dtype,
                                              device=device, name=name)
        self.norm2 = nn.LayerNorm(embed_dim, **factory)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, mlp_ratio * embed_dim, **factory), nn.GELU(),
                                 nn.Linear(mlp_ratio * embed_dim, embed_dim, **factory))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))[0]
        return x + self.mlp(self.norm2(x))
