"""torch.nn layers over dilgen kernels.

- `DilatedAttention(spec)`: (q, k, v) -> out, the kernel as a module.
- `MultiheadDilatedAttention(embed_dim, num_heads, segment_lengths, dilation_rates, ...)`:
  projections + dilated attention, following nn.MultiheadAttention's conventions where
  they make sense (batch_first=True only; the spec is the attention mask; key_padding_mask
  for padded batches).
- `LongNetDecoderBlock`: pre-norm residual block (causal dilated attention + MLP).
"""
from __future__ import annotations

import torch
from torch import nn

from .compiler import compile as compile_spec
from .spec import Spec, SpecError


def _probability(label: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(f"{label} = {value!r}: must be a probability in [0, 1)")


def _positive_int(label: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{label} = {value!r}: must be an int >= 1")


class DilatedAttention(nn.Module):
    """Dilated attention of one spec; q (B, N, H, D), k and v (B, N, H_kv, D)."""

    def __init__(self, spec: Spec, dropout: float = 0.0) -> None:
        super().__init__()
        _probability("dropout", dropout)
        self.spec = spec
        self.dropout = float(dropout)
        self.kernel = compile_spec(spec)

    def forward(self, q, k, v, return_lse: bool = False, key_padding_mask=None):
        """key_padding_mask (B, N) bool, True = padding (left or right; each item's tokens one
        run): each item runs alone and its padded rows come out 0. In training, attention
        dropout with probability `dropout` (SPEC §3, dropout_p); in eval, none."""
        p = self.dropout if self.training else 0.0
        if key_padding_mask is not None:
            return self.kernel.padded(q, k, v, key_padding_mask, return_lse=return_lse, dropout_p=p)
        return self.kernel(q, k, v, return_lse=return_lse, dropout_p=p)

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
        _positive_int("embed_dim", embed_dim)
        _positive_int("num_heads", num_heads)
        for label, seq in (("segment_lengths", segment_lengths), ("dilation_rates", dilation_rates)):
            if not isinstance(seq, (list, tuple)):
                raise ValueError(f"{label} must be a list with one entry per branch, got "
                                 f"{type(seq).__name__} {seq!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim = {embed_dim} must be divisible by num_heads = {num_heads}")
        _probability("dropout", dropout)
        head_dim = embed_dim // num_heads
        num_kv_heads = num_kv_heads or num_heads
        factory = {"dtype": dtype, "device": device}
        param_dtype = dtype or torch.get_default_dtype()
        dtype_name = {torch.float16: "float16", torch.bfloat16: "bfloat16",
                      torch.float32: "float32"}.get(param_dtype)
        if dtype_name is None:
            raise ValueError(f"dtype {param_dtype} is not supported: use float16, bfloat16 or float32")
        try:
            self.spec = Spec(name=name, num_heads=num_heads, num_kv_heads=num_kv_heads,
                             head_dim=head_dim, dtype=dtype_name, segment_lengths=list(segment_lengths),
                             dilation_rates=list(dilation_rates), causal=causal, hilbert=hilbert)
        except SpecError as exc:
            if "head_dim" not in str(exc):
                raise
            raise SpecError(f"embed_dim = {embed_dim} / num_heads = {num_heads} gives head_dim = "
                            f"{head_dim}, which the kernels do not take ({exc}); choose embed_dim "
                            f"and num_heads whose quotient is a multiple of 8 up to 256") from None
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = embed_dim, num_heads, num_kv_heads, head_dim
        self.batch_first = True
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=bias, **factory)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias, **factory)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=bias, **factory)
        self.out_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=bias, **factory)
        self.attention = DilatedAttention(self.spec, dropout)

    def forward(self, query, key=None, value=None, key_padding_mask=None, need_weights: bool = False):
        """key_padding_mask (B, N) bool, True = padding, as nn.MultiheadAttention takes it, for
        padded batches (left or right): every item is computed alone (segments start at its
        first token, padding never enters), and the attention output of padded rows is 0 before out_proj
        adds its bias."""
        if need_weights:
            raise ValueError("need_weights=True is not supported: dilated attention never "
                             "materialises the (N, N) weights")
        key = query if key is None else key
        value = key if value is None else value
        for label, x in (("query", query), ("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[-1] != self.embed_dim:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{label} must be (B, N, embed_dim = {self.embed_dim}), got {got}")
            if x.dtype != self.q_proj.weight.dtype:
                raise ValueError(f"{label} has dtype {x.dtype} but the layer's parameters are "
                                 f"{self.q_proj.weight.dtype}: pass {label}.to({self.q_proj.weight.dtype})")
        B, N, _ = query.shape
        q = self.q_proj(query).view(B, N, self.num_heads, self.head_dim)
        k = self.k_proj(key).view(B, N, self.num_kv_heads, self.head_dim)
        v = self.v_proj(value).view(B, N, self.num_kv_heads, self.head_dim)
        out = self.attention(q, k, v, key_padding_mask=key_padding_mask)
        return self.out_proj(out.reshape(B, N, self.num_heads * self.head_dim)), None

    def step(self, query, cache: "KVCache"):
        """Incremental decoding (causal layers): query (B, T, embed_dim) holds T new tokens;
        their keys and values are appended to `cache` (a KVCache of this layer) and the
        queries attend through kernel.decode. Returns the (B, T, embed_dim) output, equal to
        the last T rows of forward() over the whole sequence so far. Inference only (run it
        under torch.no_grad() or torch.inference_mode())."""
        B, T, _ = query.shape
        q = self.q_proj(query).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(query).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(query).view(B, T, self.num_kv_heads, self.head_dim)
        out = cache.attend(self.attention.kernel, q, k, v)
        return self.out_proj(out.reshape(B, T, self.num_heads * self.head_dim))


class LongNetDecoderBlock(nn.Module):
    """x + attn(norm(x)); x + mlp(norm(x)), with causal dilated self-attention."""

    def __init__(self, embed_dim: int, num_heads: int, segment_lengths, dilation_rates, *,
                 mlp_ratio: int = 4, num_kv_heads: int | None = None, dropout: float = 0.0,
                 dtype: torch.dtype | None = None, device=None, name: str = "longnet_block") -> None:
        super().__init__()
        factory = {"dtype": dtype, "device": device}
        self.norm1 = nn.LayerNorm(embed_dim, **factory)
        self.attn = MultiheadDilatedAttention(embed_dim, num_heads, segment_lengths, dilation_rates,
                                              num_kv_heads=num_kv_heads, causal=True, dropout=dropout,
                                              dtype=dtype, device=device, name=name)
        self.norm2 = nn.LayerNorm(embed_dim, **factory)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, mlp_ratio * embed_dim, **factory), nn.GELU(),
                                 nn.Linear(mlp_ratio * embed_dim, embed_dim, **factory))

    def forward(self, x, cache: "KVCache | None" = None):
        """cache: a KVCache of this block for generation; x then holds only the new tokens."""
        if cache is not None:
            x = x + self.attn.step(self.norm1(x), cache)
            return x + self.mlp(self.norm2(x))
        x = x + self.attn(self.norm1(x))[0]
        return x + self.mlp(self.norm2(x))


# --------------------------------------------------------------------------- generation

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class KVCache:
    """The keys and values of one causal dilated attention layer during generation.

    Preallocates k and v of shape (batch, max_len, num_kv_heads, head_dim) in the layer
    spec's dtype; `lengths` (host ints) and `seqlens` ((batch,) int32 on the device) count
    each item's valid rows. `attend(kernel, q, k, v)` appends the new tokens' k and v
    (B, T, H_kv, D) at each item's length and returns kernel.decode(q, ...) for them: the
    rows the causal forward over each item's whole prefix would give. A first call on an
    empty cache (the prompt, T > 1) runs the forward kernel instead (the same rows, faster).
    Per step the work does not grow with the context: a query reads at most ceil(w / r)
    kept rows per branch, in place.

        caches = [KVCache.for_layer(block, batch=B, max_len=N) for block in blocks]
        with torch.no_grad():
            for step in ...:
                x = embed(new_tokens)                  # (B, T, E), T new tokens
                for block, cache in zip(blocks, caches):
                    x = block(x, cache=cache)
    """

    def __init__(self, batch: int, max_len: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype = torch.float32, device=None) -> None:
        for label, value in (("batch", batch), ("max_len", max_len), ("num_kv_heads", num_kv_heads),
                             ("head_dim", head_dim)):
            _positive_int(f"KVCache: {label}", value)
        self.k = torch.zeros(batch, max_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=self.k.device)
        self.lengths = [0] * batch

    @classmethod
    def for_layer(cls, layer, batch: int, max_len: int, device=None) -> "KVCache":
        """A cache for a LongNetDecoderBlock, MultiheadDilatedAttention or DilatedAttention
        (heads, head_dim and dtype from its spec; device from its parameters unless given)."""
        attn = getattr(layer, "attn", layer)
        spec = attn.spec
        if device is None:
            param = next(iter(attn.parameters()), None)
            device = param.device if param is not None else torch.device("cpu")
        return cls(batch, max_len, spec.num_kv_heads, spec.head_dim, dtype=_DTYPES[spec.dtype],
                   device=device)

    @property
    def batch(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[1]

    def reset(self) -> None:
        """Forget every item's tokens (the buffers stay allocated)."""
        self.seqlens.zero_()
        self.lengths = [0] * self.batch

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (B, T, H_kv, D) at rows lengths[b] .. lengths[b] + T - 1 of each item."""
        B, T = k.shape[0], k.shape[1]
        if B != self.batch or k.shape[2:] != self.k.shape[2:] or v.shape != k.shape:
            raise ValueError(f"KVCache.append: k {tuple(k.shape)}, v {tuple(v.shape)}; this cache "
                             f"takes ({self.batch}, T, {self.k.shape[2]}, {self.k.shape[3]})")
        if max(self.lengths) + T > self.max_len:
            raise ValueError(f"KVCache.append: {T} more token(s) after {max(self.lengths)} exceed "
                             f"max_len = {self.max_len}; make a larger cache")
        if len(set(self.lengths)) == 1:       # every item at the same length: one slice
            n = self.lengths[0]
            self.k[:, n:n + T] = k.to(self.k.dtype)
            self.v[:, n:n + T] = v.to(self.v.dtype)
        else:
            rows = self.seqlens.long()[:, None] + torch.arange(T, device=self.k.device)
            items = torch.arange(B, device=self.k.device)[:, None]
            self.k[items, rows] = k.to(self.k.dtype)
            self.v[items, rows] = v.to(self.v.dtype)
        self.seqlens += T
        self.lengths = [n + T for n in self.lengths]

    def attend(self, kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append k, v of the T new tokens and return their attention output (B, T, H, D)."""
        prompt = q.shape[1] > 1 and not any(self.lengths)
        self.append(k, v)
        if prompt:        # an empty cache: the tokens are the whole sequence so far
            return kernel(q, k.to(self.k.dtype), v.to(self.v.dtype))
        return kernel.decode(q, self.k, self.v, self.seqlens, validate=False)

