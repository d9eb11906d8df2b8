"""torchscale's LongNet, re-expressed for tests: what dilgen.compat.torchscale must reproduce.

Written from the facts in issue 16 (not from torchscale's code): torchscale's
`DilatedAttention` (its main branch, and Prov-GigaPath's vendored copy) computes, per
branch (w, r) of its `segment_length` / `dilated_ratio` lists, on q, k, v (B, N, H, D):

1. pad: the segment length is w' = min(w, N); the sequence is zero-padded to a multiple
   of w' and cut into segments of w' rows; every segment is zero-padded to a multiple of r;
2. select: the heads are cut into r contiguous blocks of ceil(H / r) heads; block g keeps
   the rows g, g + r, g + 2r, ... of every padded segment (so the zero rows of the padding
   it keeps are keys of score 0 and value 0 in its softmax);
3. attention of the kept rows of each segment (causal per segment when asked), returning
   (out, lse);
4. scatter the rows back (a row a head block does not keep gets out 0 and a very negative
   lse), drop the padding;
then mixes the branches by the softmax of their LSEs, with the weights computed under
`torch.no_grad()` (the forward is LongNet Eq. 10; the gradients are not). A segment of
min(w, N) rows that is not a multiple of r, with two or more segments, makes torchscale's
branch outputs land on shifted rows (its "layout slip"): `LayoutSlip` here, refused by
dilgen. Its `key_padding_mask` is ignored; `inner_attn_ln` (sub-LN) runs before `out_proj`.

`dilated_attention(...)` takes any per-segment attention `attn(q, k, v, causal, scale) ->
(out, lse)` on (B', H', S, D) tensors: the default is an explicit softmax in the inputs'
dtype (float64 in the tests); bench/bench_torchscale.py sets `ATTENTION` (what the modules
use) to cuDNN's SDPA with its LSE, in bf16, as torchscale's users run it with FlashAttention.

The modules below mirror torchscale's constructor and forward signatures and parameter
names (`q_proj`, `k_proj`, `v_proj`, `out_proj`, `inner_attn_ln`), so that a state_dict of
one loads into dilgen.compat.torchscale.DilatedAttention and `patch()` finds them by class
name, as it finds the real ones in a user's vendored copy. `make_slide_encoder` mirrors the
module structure of Prov-GigaPath's slide encoder (LongNetViT -> make_longnet_from_name ->
LongNetEncoder), tiny and with random weights (docs/torchscale.md).
"""
from __future__ import annotations

import ast
import contextlib
import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import LayerNorm

UNKEPT_LSE = -1e8      # the lse of a row a head block does not keep (finite: no NaN in the mix)


class LayoutSlip(ValueError):
    """min(w, N) is not a multiple of r and there are two or more segments."""


def attention_with_lse(q, k, v, causal: bool, scale: float):
    """Softmax attention of (B', H', S, D) tensors, explicit, in their dtype: (out, lse)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        S = q.shape[-2]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v), lse


def branch(q, k, v, w: int, r: int, *, causal: bool, scale: float, attn=attention_with_lse):
    """One branch: (out (B, N, H, D), lse (B, N, H)) with zeros / UNKEPT_LSE where unkept."""
    B, N, H, D = q.shape
    sl = min(w, N)
    nseg = -(-N // sl)
    if nseg >= 2 and sl % r:
        raise LayoutSlip(f"segment of {sl} rows is not a multiple of r = {r} and there are "
                         f"{nseg} segments: torchscale's outputs land on shifted rows")
    padded = -(-sl // r) * r

    def segments(x):                                   # (B, N, H, D) -> (B * nseg, padded, H, D)
        x = F.pad(x, (0, 0, 0, 0, 0, nseg * sl - N))   # the sequence to a multiple of sl
        x = x.reshape(B * nseg, sl, H, D)
        return F.pad(x, (0, 0, 0, 0, 0, padded - sl))  # each segment to a multiple of r

    qs, ks, vs = segments(q), segments(k), segments(v)
    out = qs.new_zeros(B * nseg, padded, H, D)
    lse = None
    block = -(-H // r)                                 # heads per block: ceil(H / r)
    for g in range(r):
        heads = slice(g * block, min((g + 1) * block, H))
        if heads.start >= H:
            break
        pick = lambda x: x[:, g::r, heads].transpose(1, 2).contiguous()   # (B*nseg, hg, padded/r, D)
        o, l = attn(pick(qs), pick(ks), pick(vs), causal, scale)
        if lse is None:
            lse = torch.full((B * nseg, padded, H), UNKEPT_LSE, dtype=l.dtype, device=q.device)
        out[:, g::r, heads] = o.transpose(1, 2).to(out.dtype)
        lse[:, g::r, heads] = l.transpose(1, 2)
    out = out[:, :sl].reshape(B, nseg * sl, H, D)[:, :N]
    lse = lse[:, :sl].reshape(B, nseg * sl, H)[:, :N]
    return out, lse


def dilated_attention(q, k, v, segment_lengths, dilated_ratios, *, causal: bool = False,
                      scale: float | None = None, attn=attention_with_lse,
                      detach_weights: bool = True, return_lse: bool = False):
    """torchscale's dilated attention of q, k, v (B, N, H, D): out (B, N, H, D) and, with
    return_lse, lse (B, H, N) = log Σ_i exp(lse_i). detach_weights=False gives the exact
    gradients of the same forward (the weights keep their graph)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    outs, lses = [], []
    for w, r in zip(segment_lengths, dilated_ratios):
        o, l = branch(q, k, v, int(w), int(r), causal=causal, scale=scale, attn=attn)
        outs.append(o)
        lses.append(l)
    stacked = torch.stack(lses)                        # (branches, B, N, H)
    with torch.no_grad() if detach_weights else contextlib.nullcontext():
        weights = torch.softmax(stacked, dim=0)
    out = sum(o * wt.unsqueeze(-1).to(o.dtype) for o, wt in zip(outs, weights))
    if return_lse:
        return out, torch.logsumexp(stacked, dim=0).transpose(1, 2)
    return out


# --------------------------------------------------------------------------- modules

#: the per-segment attention the modules below use (bench_torchscale.py sets cuDNN's SDPA)
ATTENTION = attention_with_lse


def _as_list(x):
    return list(ast.literal_eval(x)) if isinstance(x, str) else list(x)


def make_args(segment_length, dilated_ratio, *, embed_dim=96, heads=2, ffn_dim=None, layers=2,
              subln=True, **extra) -> SimpleNamespace:
    """An args object with the fields torchscale's encoder config gives these modules."""
    args = SimpleNamespace(
        segment_length=segment_length, dilated_ratio=dilated_ratio, flash_attention=True,
        seq_parallel=False, xpos_rel_pos=False, xpos_scale_base=512, multiway=False,
        layernorm_eps=1e-5, subln=subln, encoder_embed_dim=embed_dim,
        encoder_attention_heads=heads, encoder_ffn_embed_dim=ffn_dim or 2 * embed_dim,
        encoder_layers=layers, encoder_normalize_before=True, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0)
    for key, value in extra.items():
        setattr(args, key, value)
    return args


class MultiheadAttention(nn.Module):
    """torchscale's constructor signature and parameter names."""

    def __init__(self, args, embed_dim, num_heads, dropout=0.0, self_attention=False,
                 encoder_decoder_attention=False, subln=False):
        super().__init__()
        self.args = args
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim ** -0.5
        self.dropout = dropout
        self.self_attention = self_attention
        self.encoder_decoder_attention = encoder_decoder_attention
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.inner_attn_ln = (LayerNorm(embed_dim, eps=args.layernorm_eps)
                              if subln and self_attention else None)
        self.dropout_module = nn.Dropout(dropout)
        # the real module builds an XPOS rotary embedding here; a stand-in marks it
        self.xpos = nn.Identity() if args.xpos_rel_pos and self_attention else None


class DilatedAttention(MultiheadAttention):
    """torchscale's forward signature over the re-expression above (float64 in the tests)."""

    def forward(self, query, key, value, incremental_state=None, key_padding_mask=None,
                attn_mask=None, rel_pos=None, is_first_step=False, is_causal=False):
        B, N, E = query.shape
        H, D = self.num_heads, self.head_dim
        q = self.q_proj(query).view(B, N, H, D)
        k = self.k_proj(key).view(B, N, H, D)
        v = self.v_proj(value).view(B, N, H, D)
        out = dilated_attention(q, k, v, _as_list(self.args.segment_length),
                                _as_list(self.args.dilated_ratio), causal=is_causal, attn=ATTENTION)
        attn = out.reshape(B, N, E)                # key_padding_mask: ignored, as in torchscale
        if self.inner_attn_ln is not None:
            attn = self.inner_attn_ln(attn)
        return self.out_proj(attn), None


class FeedForwardNetwork(nn.Module):
    def __init__(self, embed_dim, ffn_dim, layernorm_eps=1e-5, subln=False):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.ffn_layernorm = LayerNorm(ffn_dim, eps=layernorm_eps) if subln else None

    def forward(self, x):
        x = F.gelu(self.fc1(x))
        if self.ffn_layernorm is not None:
            x = self.ffn_layernorm(x)
        return self.fc2(x)


class LongNetEncoderLayer(nn.Module):
    """Pre-norm encoder layer built the torchscale way: self_attn is a DilatedAttention."""

    def __init__(self, args):
        super().__init__()
        E = args.encoder_embed_dim
        self.self_attn = DilatedAttention(args, E, args.encoder_attention_heads,
                                          dropout=args.attention_dropout, self_attention=True,
                                          encoder_decoder_attention=False, subln=args.subln)
        self.self_attn_layer_norm = LayerNorm(E, eps=args.layernorm_eps)
        self.ffn = FeedForwardNetwork(E, args.encoder_ffn_embed_dim, args.layernorm_eps, args.subln)
        self.final_layer_norm = LayerNorm(E, eps=args.layernorm_eps)

    def forward(self, x, encoder_padding_mask=None, attn_mask=None, is_causal=False):
        residual = x
        x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(query=x, key=x, value=x, key_padding_mask=encoder_padding_mask,
                              attn_mask=attn_mask, is_causal=is_causal)
        x = residual + x
        residual = x
        return residual + self.ffn(self.final_layer_norm(x))


class LongNetEncoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(LongNetEncoderLayer(args) for _ in range(args.encoder_layers))
        self.layer_norm = LayerNorm(args.encoder_embed_dim, eps=args.layernorm_eps)

    def forward(self, src_tokens=None, encoder_padding_mask=None, token_embeddings=None,
                is_causal=False):
        x = token_embeddings
        for layer in self.layers:
            x = layer(x, encoder_padding_mask=encoder_padding_mask, is_causal=is_causal)
        return {"encoder_out": self.layer_norm(x), "encoder_padding_mask": encoder_padding_mask}


def make_encoder(args, *, seed: int = 0, dtype=torch.float64) -> LongNetEncoder:
    """The encoder with random weights (every parameter, LayerNorms included, random)."""
    torch.manual_seed(seed)
    model = LongNetEncoder(args).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                nn.init.xavier_uniform_(p)
            elif "norm" in name or "ln" in name:
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


# --------------------------------------------------------------------------- GigaPath's slide encoder
# Prov-GigaPath (github.com/prov-gigapath/prov-gigapath) builds its slide encoder so:
# gigapath/slide_encoder.py's LongNetViT embeds the tile features (PatchEmbed: a Linear), adds
# a fixed position embedding looked up from the tile coordinates (2-D sin-cos there, fixed
# random here), prepends a cls token and runs the encoder of `make_longnet_from_name` from its
# vendored torchscale (gigapath/torchscale/model/LongNet.py): EncoderConfig(**LongNetConfig.<name>,
# segment and ratio lists as strings, which EncoderConfig evaluates) -> LongNetEncoder, whose
# LongNetEncoderLayer builds self_attn = DilatedAttention(args, E, heads,
# dropout=args.attention_dropout, self_attention=True, encoder_decoder_attention=False,
# subln=args.subln). torchscale's Encoder.forward makes an all-False encoder_padding_mask when
# given none and hands it to every layer. Mirrored below at a tiny size (no weights downloaded).

GIGAPATH_CONFIGS = {     # gigapath/torchscale/model/LongNetConfig.py's format, tiny
    "LongNet_2_layers_128_dim": {
        "encoder_layers": 2, "encoder_embed_dim": 128, "encoder_ffn_embed_dim": 256,
        "encoder_attention_heads": 16, "dilated_ratio": "[1, 2, 4, 8, 16]",
        "segment_length": "[1024, 2048, 4096, 8192, 16384]", "block_shift": True,
        "flash_attention": True, "use_xmoe": False, "moe_freq": 0},
    # GigaPath's own (its slide encoder on 2 GPUs: bench/bench_context_parallel.py@0f0ec80)
    "LongNet_12_layers_768_dim": {
        "encoder_layers": 12, "encoder_embed_dim": 768, "encoder_ffn_embed_dim": 3072,
        "encoder_attention_heads": 16, "dilated_ratio": "[1, 2, 4, 8, 16]",
        "segment_length": "[1024, 2048, 4096, 8192, 16384]", "block_shift": True,
        "flash_attention": True, "use_xmoe": False, "moe_freq": 0},
    # smaller still, for the 2-rank seq_parallel tests (tests/test_torchscale_seq_parallel.py)
    "LongNet_1_layers_64_dim": {
        "encoder_layers": 1, "encoder_embed_dim": 64, "encoder_ffn_embed_dim": 128,
        "encoder_attention_heads": 4, "dilated_ratio": "[1, 2, 4, 8, 16]",
        "segment_length": "[1024, 2048, 4096, 8192, 16384]", "block_shift": True,
        "flash_attention": True, "use_xmoe": False, "moe_freq": 0},
}


def get_optimal_segment_length(max_wsi_size: int = 262144, tile_size: int = 256) -> str:
    """LongNetViT's segment lengths: 5 powers of two from 1024 to the largest slide, as a
    string ('[1024, 5792, 32768, 185363, 1048576]' for GigaPath's defaults)."""
    top = int(math.log2((max_wsi_size // tile_size) ** 2))
    return str([int(2 ** float(x)) for x in torch.linspace(10.0, top, 5, dtype=torch.float64)])


def make_longnet_from_name(config_name: str, dilated_ratio: str = "[1, 2, 4, 8, 16]",
                           segment_length: str = "[1024, 2048, 4096, 8192, 16384]",
                           drop_path_rate: float = 0.1, dropout: float = 0.1) -> "GigaPathEncoder":
    """gigapath/torchscale/model/LongNet.py's make_longnet_from_name."""
    cfg = dict(GIGAPATH_CONFIGS[config_name], dropout=dropout, drop_path_rate=drop_path_rate,
               dilated_ratio=dilated_ratio, segment_length=segment_length)
    args = make_args(ast.literal_eval(cfg.pop("segment_length")), ast.literal_eval(cfg.pop("dilated_ratio")),
                     embed_dim=cfg.pop("encoder_embed_dim"), heads=cfg.pop("encoder_attention_heads"),
                     ffn_dim=cfg.pop("encoder_ffn_embed_dim"), layers=cfg.pop("encoder_layers"), **cfg)
    return GigaPathEncoder(args)


class GigaPathEncoder(LongNetEncoder):
    """LongNetEncoder with torchscale's Encoder.forward as GigaPath calls it."""

    def __init__(self, args):
        super().__init__(args)
        self.dropout_module = nn.Dropout(args.dropout)

    def forward(self, src_tokens=None, encoder_padding_mask=None, token_embeddings=None,
                return_all_hiddens=False, is_causal=False):
        x = token_embeddings
        if encoder_padding_mask is None:                  # torchscale: an all-False mask
            encoder_padding_mask = torch.zeros(x.shape[:2], dtype=torch.bool, device=x.device)
        x = self.dropout_module(x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x)))
        states = [x] if return_all_hiddens else []
        for layer in self.layers:
            x = layer(x, encoder_padding_mask=encoder_padding_mask, is_causal=is_causal)
            states += [x] if return_all_hiddens else []
        return {"encoder_out": self.layer_norm(x), "encoder_padding_mask": encoder_padding_mask,
                "encoder_states": states}


class PatchEmbed(nn.Module):
    """gigapath/slide_encoder.py's PatchEmbed: tile features -> embed_dim."""

    def __init__(self, in_chans, embed_dim):
        super().__init__()
        self.proj = nn.Linear(in_chans, embed_dim)
        self.norm = nn.Identity()

    def forward(self, x):
        return self.norm(self.proj(x))


class LongNetViT(nn.Module):
    """gigapath/slide_encoder.py's LongNetViT (global_pool=False: the cls token's embedding)."""

    def __init__(self, in_chans=32, embed_dim=128, depth=2, slide_ngrids=8, tile_size=256,
                 max_wsi_size=262144, dropout=0.25, drop_path_rate=0.1, segment_length=None):
        super().__init__()
        self.patch_embed = PatchEmbed(in_chans, embed_dim)
        self.tile_size = tile_size
        self.slide_ngrids = slide_ngrids
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.register_buffer("pos_embed", torch.randn(1, slide_ngrids ** 2 + 1, embed_dim), persistent=False)
        segment_length = segment_length or get_optimal_segment_length(max_wsi_size, tile_size)
        self.encoder = make_longnet_from_name(f"LongNet_{depth}_layers_{embed_dim}_dim",
                                              segment_length=segment_length, dropout=dropout,
                                              drop_path_rate=drop_path_rate)
        self.norm = LayerNorm(embed_dim, eps=1e-6)

    def coords_to_pos(self, coords, tile_size: int = 256):
        """Tile coordinates (pixels) -> position indices into pos_embed (+ 1: the cls token)."""
        cells = torch.floor(coords / tile_size)
        return (cells[..., 0] * self.slide_ngrids + cells[..., 1]).long() + 1

    def forward(self, x, coords):
        x = self.patch_embed(x)
        x = x + self.pos_embed[:, self.coords_to_pos(coords, self.tile_size), :].squeeze(0)
        cls = (self.cls_token + self.pos_embed[:, :1, :]).expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1)
        x = self.encoder(src_tokens=None, token_embeddings=x)["encoder_out"]
        return [self.norm(x)[:, 0]]


def make_slide_encoder(*, seed: int = 0, dtype=torch.float64, **kwargs) -> LongNetViT:
    """A tiny LongNetViT with random weights (every parameter random), in eval mode (its
    dropout 0.25 and drop-path as GigaPath runs inference), and a slide for it:
    (tiles (B, L, in_chans), coords (B, L, 2) in pixels)."""
    torch.manual_seed(seed)
    model = LongNetViT(**kwargs).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.2 * torch.randn_like(p) + (1.0 if name.endswith("norm.weight") else 0.0))
    return model


def make_slide(model: LongNetViT, batch: int, tiles: int, *, seed: int = 0):
    """Tile features and distinct tile coordinates (pixels, 256 a tile) for `model`."""
    g = torch.Generator().manual_seed(seed)
    n = model.slide_ngrids
    cells = torch.randperm(n * n, generator=g)[:tiles]
    coords = torch.stack([cells // n, cells % n], dim=-1).double().mul(256.0).expand(batch, -1, -1)
    dtype = model.cls_token.dtype
    return torch.randn(batch, tiles, model.patch_embed.proj.in_features, generator=g, dtype=dtype), coords


# --------------------------------------------------------------------------- tests' helpers
# (tests/test_compat_torchscale.py)

ENCODER_ARGS = dict(segment_length=[8, 16, 64], dilated_ratio=[1, 2, 4], embed_dim=5 * 48, heads=5)


def small_encoder(subln=True, seed=0, **extra):
    """(a 2-layer LongNetEncoder of ENCODER_ARGS with random float64 weights, its args)."""
    a = ENCODER_ARGS
    args = make_args(a["segment_length"], a["dilated_ratio"], embed_dim=a["embed_dim"],
                     heads=a["heads"], subln=subln, **extra)
    return make_encoder(args, seed=seed), args


def qkv(B, N, H, D, seed, dtype=torch.float64, requires_grad=False):
    """Three random (B, N, H, D) tensors (drawn in float64, then cast)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, N, H, D, generator=g, dtype=torch.float64).to(dtype)
            .requires_grad_(requires_grad) for _ in range(3)]


def each_item_alone(attend, q, k, v, mask):
    """A right-padded batch (mask True = padding): each item alone at its own length through
    attend(q, k, v) on (1, n, H, D), padded rows 0 (what Kernel.padded computes)."""
    out = torch.zeros_like(q)
    for i, n in enumerate((~mask).sum(1).tolist()):
        out[i, :n] = attend(q[i:i + 1, :n], k[i:i + 1, :n], v[i:i + 1, :n])[0]
    return out


def rel_error(a, b) -> float:
    """||a - b|| / ||b|| in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()
