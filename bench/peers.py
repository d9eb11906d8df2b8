"""The peers dilgen is benchmarked against, all with the attention of SPEC.md §2.

Every peer is a function ``peer(q, k, v, spec) -> (out, lse)`` with the dilgen layout:
q (B, N, H, D), k and v (B, N, Hkv, D); out (B, N, H, D) in the dtype of q and lse
(B, H, N) float32 (natural log of the softmax denominator; -inf, with out = 0, where no
branch keeps the query). ``spec`` is a ``dilgen.Spec`` (or anything with its field
names: num_heads, num_kv_heads, head_dim, segment_lengths, dilation_rates, causal,
softmax_scale).

The semantics, per branch (w, r): segments [s*w, min((s+1)*w, N)) (the last one may be
short, nothing is padded); in head h the branch keeps the positions whose offset t from
the segment start has t mod r == h mod r; kept queries attend to the kept keys of their
segment (key <= query when causal); branches are merged with LongNet Eq. 10,
out = sum_i exp(lse_i - lse) o_i, lse = logsumexp_i lse_i (a key kept by two branches
counts twice). Query head h reads key/value head h // (H / Hkv).

Peers:
  gather_cudnn  per branch and head group (heads with equal h mod r), gather the kept rows
                into dense (B*segments, heads, rows, D) tensors, run cuDNN attention
                (aten._scaled_dot_product_cudnn_attention, which returns the LSE), scatter
                back, merge the branches in fp32.
  gather_flash  the same with aten._scaled_dot_product_flash_attention (FlashAttention-2).
  flex          FlexAttention: mask_mod = union of the branches (and causal), score_mod =
                + log(multiplicity) where several branches keep a pair; torch.compile'd.
  dense_sdpa    plain dense SDPA over the whole sequence (causal or not). NOT the same
                math: a reference point only (what one runs without dilation). Its lse is
                None.

Hilbert ordering (spec.hilbert, SPEC §2): branch i walks its segments in a virtual
order pi_i (virtual position -> raster position; scope "segment": the gilbert curve of the
branch's own grid inside every segment, a short last segment keeping the curve order of
the positions that exist; scope "sequence": one curve over the whole rows x cols image).
The segments and the lanes t mod r == h mod r are cut along the virtual order; causal
masking compares raster positions. The gather peers gather the raster positions
pi_i(s*w + o + r*j) of each segment, sorted, so that "key <= query in raster order" is
again the lower triangle of each gathered block; flex looks the virtual positions up in
pi_i^-1 inside mask_mod / score_mod. The tables come from dilgen.runtime.tables (the
same tables as dilgen's kernels; dilgen.reference carries its own independent curve, and
tools/check_peers_cpu.py compares the two).

Without CUDA (or for float32 inputs, which the fused kernels do not take) the gather
peers run their per-segment attention with an explicit fp32 softmax, so their semantics
can be checked on a CPU against dilgen.reference (see tools/check_peers_cpu.py).
"""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

__all__ = ["gather_cudnn", "gather_flash", "flex", "dense_sdpa", "PEERS", "EXACT_PEERS",
           "flex_block_mask", "clear_caches", "branches_of", "scale_of", "hilbert_of", "virtual_tables"]


# --------------------------------------------------------------------------- spec access

def _get(spec, name, default=None):
    if isinstance(spec, dict):
        return spec.get(name, default)
    return getattr(spec, name, default)


def branches_of(spec) -> list[tuple[int, int]]:
    return [(int(w), int(r)) for w, r in zip(_get(spec, "segment_lengths"),
                                           _get(spec, "dilation_rates"))]


def scale_of(spec, head_dim: int) -> float:
    s = _get(spec, "softmax_scale", None)
    return 1.0 / math.sqrt(head_dim) if s is None else float(s)


def hilbert_of(spec) -> dict | None:
    """spec.hilbert as a plain dict ({"scope", "grids"?, "grid"?}) or None."""
    h = _get(spec, "hilbert", None)
    if h is None:
        return None
    if hasattr(h, "to_json"):
        return h.to_json()
    if isinstance(h, dict):
        return dict(h)
    return {k: getattr(h, k) for k in ("scope", "grids", "grid") if getattr(h, k, None) is not None}


def _segment_grid(w: int, i: int, hil: dict) -> tuple[int, int]:
    grids = hil.get("grids")
    if grids is not None:
        rows, cols = (int(x) for x in grids[i])
    else:
        if w & (w - 1):
            raise ValueError(f"segment_lengths[{i}] = {w}: Hilbert segment scope without grids needs a power of two")
        k = w.bit_length() - 1
        rows, cols = 1 << (k // 2), 1 << ((k + 1) // 2)
    if rows * cols != w:
        raise ValueError(f"hilbert grid [{rows}, {cols}] of branch {i}: rows*cols != w = {w}")
    return rows, cols


_TABLES: dict = {}


def virtual_tables(spec, N: int, device) -> list:
    """Per branch: None (raster order) or pi_i as an int64 tensor of length N on `device`:
    virtual position (curve order, in which segments and lanes are cut) -> raster position."""
    hil = hilbert_of(spec)
    branches = branches_of(spec)
    if hil is None:
        return [None] * len(branches)
    from dilgen.runtime.tables import table_tensors
    device = torch.device(device)
    out = []
    for i, (w, _) in enumerate(branches):
        if hil["scope"] == "sequence":
            desc = {"scope": "sequence", "grid": [int(x) for x in hil["grid"]]}
        elif hil["scope"] == "segment":
            desc = {"scope": "segment", "grid": list(_segment_grid(w, i, hil))}
        else:
            raise ValueError(f"hilbert.scope = {hil['scope']!r}")
        key = (json_key(desc), int(N), str(device))
        if key not in _TABLES:
            fwd, _ = table_tensors(desc, int(N), torch.device("cpu"))
            _TABLES[key] = fwd.to(device=device, dtype=torch.int64)
        out.append(_TABLES[key])
    return out


def json_key(d: dict) -> str:
    import json
    return json.dumps(d, sort_keys=True)


def _check_shapes(q, k, v, spec):
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be (B, N, H, D) / (B, N, Hkv, D)")
    B, N, H, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[1] != N or k.shape[3] != D:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    Hkv = k.shape[2]
    if H % Hkv:
        raise ValueError(f"k/v heads {Hkv} must divide q heads {H}")
    nh = _get(spec, "num_heads", H)
    if nh is not None and int(nh) != H:
        raise ValueError(f"q has {H} heads but spec.num_heads = {nh}")
    return B, N, H, Hkv, D


# --------------------------------------------------------------------------- per-segment attention
# Each takes dense q, k, v (B', H', S, D) (same H' for q and k/v) and returns
# out (B', H', S, D) in the input dtype and lse (B', H', S) float32.

def _attn_math(q, k, v, causal: bool, scale: float):
    """Explicit softmax in fp32 (the CPU / fp32 fallback)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    S = q.shape[-2]
    if causal:
        upper = torch.ones(S, S, dtype=torch.bool, device=q.device).triu_(1)
        s = s.masked_fill(upper, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    out = torch.matmul(p, v.float()).to(q.dtype)
    return out, lse


def _fused_ok(q) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _attn_cudnn(q, k, v, causal: bool, scale: float):
    if not _fused_ok(q):
        return _attn_math(q, k, v, causal, scale)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    Bp, Hp, S = q.shape[0], q.shape[1], q.shape[2]
    # cuDNN returns the stats as (B', H', S, 1); keep the first S entries of whatever comes
    return out, lse.reshape(Bp, Hp, -1)[:, :, :S].float()


def _attn_flash(q, k, v, causal: bool, scale: float):
    if not _fused_ok(q):
        return _attn_math(q, k, v, causal, scale)
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    Bp, Hp, S = q.shape[0], q.shape[1], q.shape[2]
    return out, lse.reshape(Bp, Hp, -1)[:, :, :S].float()


# --------------------------------------------------------------------------- gather peers

def _gather(x, start: int, nseg: int, seglen: int, g: int, r: int, heads):
    """Rows start + s*seglen + g + j*r (s < nseg, g + j*r < seglen) of x (B, N, Hx, D),
    heads `heads` (a slice or an index tensor), as a contiguous (B*nseg, Hg, m, D)."""
    B, _, Hx, D = x.shape
    y = x[:, start:start + nseg * seglen].view(B, nseg, seglen, Hx, D)[:, :, g::r]
    y = y[:, :, :, heads] if isinstance(heads, slice) else y.index_select(3, heads)
    m, Hg = y.shape[2], y.shape[3]
    return y.permute(0, 1, 3, 2, 4).reshape(B * nseg, Hg, m, D)


_ROWS: dict = {}


def _kept_rows(pi, start: int, nseg: int, seglen: int, g: int, r: int):
    """(nseg, m) int64 raster positions pi(start + s*seglen + g + r*j), sorted in each
    segment (then "key <= query in raster order" is the lower triangle of a block).
    Cached per table, like any gather-based implementation would keep its indices."""
    key = (pi.data_ptr(), pi.numel(), str(pi.device), start, nseg, seglen, g, r)
    hit = _ROWS.get(key)
    if hit is None or hit[0] is not pi:
        lanes = torch.arange(g, seglen, r, device=pi.device)
        virt = start + torch.arange(nseg, device=pi.device)[:, None] * seglen + lanes[None, :]
        hit = _ROWS[key] = (pi, pi[virt].sort(dim=1).values)      # pi kept: its address stays its own
    return hit[1]


def _dilated_gather(attn, q, k, v, spec):
    B, N, H, Hkv, D = _check_shapes(q, k, v, spec)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()   # no-ops for the usual inputs
    G = H // Hkv
    causal = bool(_get(spec, "causal", False))
    scale = scale_of(spec, D)
    dev = q.device
    outs, lses = [], []
    for (w, r), pi in zip(branches_of(spec), virtual_tables(spec, N, dev)):
        w_eff = min(w, N)
        nfull = N // w_eff
        tail = N - nfull * w_eff
        # pieces of the sequence that have the same segment length: (start, nseg, seglen)
        pieces = [(0, nfull, w_eff)] + ([(nfull * w_eff, 1, tail)] if tail else [])
        o_b = torch.zeros(q.shape, dtype=q.dtype, device=dev)   # rows the branch does not keep stay 0
        l_b = torch.full((B, H, N), float("-inf"), device=dev, dtype=torch.float32)
        for g in range(min(r, H)):                     # head group: heads h with h % r == g
            qh = slice(g, H, r)
            if G == 1:
                kvh = qh
            else:
                kvh = torch.arange(g, H, r, device=dev) // G
            for start, nseg, seglen in pieces:
                if g >= seglen:                        # this group keeps no row here
                    continue
                if pi is not None:                     # Hilbert: gather by index
                    _gather_indexed(attn, q, k, v, o_b, l_b, pi, start, nseg, seglen, g, r, qh, kvh,
                                    causal, scale)
                    continue
                qs = _gather(q, start, nseg, seglen, g, r, qh)
                ks = _gather(k, start, nseg, seglen, g, r, kvh)
                vs = _gather(v, start, nseg, seglen, g, r, kvh)
                o, l = attn(qs, ks, vs, causal, scale)
                Hg, m = qs.shape[1], qs.shape[2]
                # scatter back: o (B*nseg, Hg, m, D) -> rows of o_b; l -> l_b
                o_dst = o_b[:, start:start + nseg * seglen].view(B, nseg, seglen, H, D)[:, :, g::r, qh]
                o_dst.copy_(o.view(B, nseg, Hg, m, D).permute(0, 1, 3, 2, 4))
                l_dst = l_b[:, qh, start:start + nseg * seglen].view(B, Hg, nseg, seglen)[:, :, :, g::r]
                l_dst.copy_(l.view(B, nseg, Hg, m).permute(0, 2, 1, 3))
        outs.append(o_b)
        lses.append(l_b)
    return _merge(outs, lses, q.dtype)


def _gather_indexed(attn, q, k, v, o_b, l_b, pi, start, nseg, seglen, g, r, qh, kvh, causal, scale):
    """The Hilbert piece of _dilated_gather: rows pi(virtual lane positions), sorted."""
    B, _, H, D = q.shape
    idx = _kept_rows(pi, start, nseg, seglen, g, r)               # (nseg, m)
    m = idx.shape[1]
    flat = idx.reshape(-1)

    def take(x, heads):
        y = x.index_select(1, flat)                               # (B, nseg*m, Hx, D)
        y = y[:, :, heads] if isinstance(heads, slice) else y.index_select(2, heads)
        return y.view(B, nseg, m, y.shape[2], D).permute(0, 1, 3, 2, 4).reshape(B * nseg, y.shape[2], m, D)

    qs, ks, vs = take(q, qh), take(k, kvh), take(v, kvh)
    o, l = attn(qs, ks, vs, causal, scale)
    Hg = qs.shape[1]
    o_b[:, flat, qh] = o.view(B, nseg, Hg, m, D).permute(0, 1, 3, 2, 4).reshape(B, nseg * m, Hg, D)
    l_b[:, qh, flat] = l.view(B, nseg, Hg, m).permute(0, 2, 1, 3).reshape(B, Hg, nseg * m)


def _merge(outs, lses, dtype):
    """LongNet Eq. 10 in fp32: out = sum_i exp(lse_i - lse) o_i, lse = logsumexp_i lse_i."""
    L = torch.stack(lses)                                  # (nb, B, H, N)
    lse = torch.logsumexp(L, dim=0)                        # -inf where no branch keeps
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    acc = None
    for i, o in enumerate(outs):
        wgt = torch.exp(L[i] - lse_safe).transpose(1, 2).unsqueeze(-1)   # (B, N, H, 1); 0 where -inf
        if acc is None:
            acc = o.float().mul_(wgt)
        else:
            acc.addcmul_(o, wgt)                           # computed in fp32
    return acc.to(dtype), lse


def gather_cudnn(q, k, v, spec):
    """Gather per (branch, head group) + cuDNN attention with LSE + scatter + fp32 merge."""
    return _dilated_gather(_attn_cudnn, q, k, v, spec)


def gather_flash(q, k, v, spec):
    """Gather per (branch, head group) + FlashAttention-2 with LSE + scatter + fp32 merge."""
    return _dilated_gather(_attn_flash, q, k, v, spec)


# --------------------------------------------------------------------------- dense SDPA

def dense_sdpa(q, k, v, spec):
    """REFERENCE POINT, not the same math: dense SDPA over the whole sequence."""
    B, N, H, Hkv, D = _check_shapes(q, k, v, spec)
    kw = {"is_causal": bool(_get(spec, "causal", False)), "scale": scale_of(spec, D)}
    if Hkv != H:
        kw["enable_gqa"] = True
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw)
    return out.transpose(1, 2), None


# --------------------------------------------------------------------------- FlexAttention

def _kept(idx, w: int, r: int, c):
    """Is position idx kept (offset in its segment congruent to c mod r)?"""
    t = idx if w % r == 0 else idx % w       # (idx % w) % r == idx % r when r divides w
    return (t % r) == c


def _branch_pair(w: int, r: int, N: int, h, q_idx, kv_idx):
    if w >= N:
        cond = None                           # one segment: every pair shares it
    else:
        cond = (q_idx // w) == (kv_idx // w)
    if r > 1:
        c = h % r
        sel = _kept(q_idx, w, r, c) & _kept(kv_idx, w, r, c)
        cond = sel if cond is None else cond & sel
    return cond


def _branch_pair_virtual(w: int, r: int, inv, h, q_idx, kv_idx):
    """Hilbert: the pair rule on virtual positions inv[raster] (pi^-1 of the branch)."""
    vq, vk = inv[q_idx], inv[kv_idx]
    cond = (vq // w) == (vk // w)
    if r > 1:
        c = h % r
        cond = cond & (((vq % w) % r) == c) & (((vk % w) % r) == c)
    return cond


def _make_mods(branches, causal: bool, N: int, invs=None):
    """mask_mod / score_mod of the union of branches. invs: per branch None (raster) or
    pi^-1 (raster position -> virtual position), int64 on the device of q."""
    branches = tuple(branches)
    invs = tuple(invs) if invs is not None else (None,) * len(branches)

    def pair(i, h, q_idx, kv_idx):
        w, r = branches[i]
        if invs[i] is not None:
            return _branch_pair_virtual(w, r, invs[i], h, q_idx, kv_idx)
        return _branch_pair(w, r, N, h, q_idx, kv_idx)

    def mask_mod(b, h, q_idx, kv_idx):
        m = None
        for i in range(len(branches)):
            c = pair(i, h, q_idx, kv_idx)
            if c is None:                     # w >= N and r == 1: everything
                c = q_idx >= 0
            m = c if m is None else (m | c)
        if causal:
            m = m & (kv_idx <= q_idx)
        return m

    if len(branches) == 1:
        return mask_mod, None

    def score_mod(score, b, h, q_idx, kv_idx):
        cnt = None
        for i in range(len(branches)):
            c = pair(i, h, q_idx, kv_idx)
            c = (q_idx >= 0) if c is None else c
            c = c.to(torch.float32)
            cnt = c if cnt is None else cnt + c
        # + log(multiplicity); pairs no branch keeps are masked by mask_mod anyway
        return score + torch.log(torch.clamp(cnt, min=1.0))

    return mask_mod, score_mod


def _dense_to_ordered(dense):
    """(…, nq, nk) bool -> (num (…, nq) int32, indices (…, nq, nk) int32), as flex wants."""
    d = dense.to(torch.int32)
    num = d.sum(dim=-1).to(torch.int32).contiguous()
    idx = torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32).contiguous()
    return num, idx


def analytic_block_sets(branches, causal: bool, H: int, N: int, block: int = 128):
    """Exact non-empty block pairs and (conservatively) full block pairs of the union mask,
    computed from the segment structure in O(H·(N/block)² + N) instead of O(H·N²).

    Returns (nonempty, full): bool (H, nb, nb) on the CPU.
    A block pair (qb, kb) with qb < kb can share a segment only through the segment that
    holds both the last row of qb and the first row of kb (segments are intervals); on the
    diagonal it is non-empty iff the block keeps any row. Causal: non-empty only for
    kb <= qb (equal block sizes, Q_LEN == KV_LEN). Full: some branch with r == 1 has both
    blocks, complete (inside N), in one segment (and kb < qb when causal)."""
    nb = -(-N // block)
    pos = torch.arange(N)
    blk = pos // block
    first = torch.arange(nb) * block                      # first row of each block
    last = torch.clamp(first + block - 1, max=N - 1)      # last existing row
    complete = (first + block - 1) < N
    nonempty = torch.zeros(H, nb, nb, dtype=torch.bool)
    full = torch.zeros(nb, nb, dtype=torch.bool)
    upper = torch.ones(nb, nb, dtype=torch.bool).triu(1)  # qb < kb
    for w, r in branches:
        seg = pos // w
        off = pos % w
        s_first, s_last = first // w, last // w
        is_first = seg == s_first[blk]                    # row lies in its block's first segment
        is_last = seg == s_last[blk]
        for c in range(min(r, H)):
            kept = (off % r) == c
            any_k = torch.zeros(nb, dtype=torch.int64).index_add_(0, blk, kept.long()) > 0
            k_first = torch.zeros(nb, dtype=torch.int64).index_add_(0, blk, (kept & is_first).long()) > 0
            k_last = torch.zeros(nb, dtype=torch.int64).index_add_(0, blk, (kept & is_last).long()) > 0
            # qb < kb: shared segment = s_last(qb) == s_first(kb)
            up = (s_last[:, None] == s_first[None, :]) & k_last[:, None] & k_first[None, :] & upper
            ne = up | up.transpose(0, 1)
            ne |= torch.diag(any_k)
            nonempty[c::r] |= ne
        if r == 1:
            one = complete & (s_first == s_last)
            full |= one[:, None] & one[None, :] & (s_first[:, None] == s_first[None, :])
    if causal:
        nonempty &= ~upper                                # kb <= qb
        full &= torch.ones(nb, nb, dtype=torch.bool).tril(-1)   # kb < qb
    full = full.unsqueeze(0).expand(H, nb, nb) & nonempty
    return nonempty, full


def block_sets_of(block_mask):
    """(nonempty, full) bool (H, nq, nk) of a BlockMask (batch 0), on the CPU."""
    def dense(num, idx):
        num, idx = num[0].cpu().long(), idx[0].cpu().long()
        Hh, nq, nk = idx.shape
        valid = torch.arange(nk)[None, None, :] < num[:, :, None]
        d = torch.zeros(Hh, nq, nk + 1, dtype=torch.bool)
        d.scatter_(2, torch.where(valid, idx, nk), True)
        return d[:, :, :nk]
    partial = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    if block_mask.full_kv_num_blocks is not None:
        fullm = dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    else:
        fullm = torch.zeros_like(partial)
    return partial | fullm, fullm


_BLOCK_MASKS: dict = {}
_FLEX_COMPILED = None


def _raise_recompile_limits():
    try:
        import torch._dynamo as dynamo
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, name) and getattr(dynamo.config, name) < 64:
                setattr(dynamo.config, name, 64)
        if hasattr(dynamo.config, "accumulated_recompile_limit"):
            dynamo.config.accumulated_recompile_limit = max(dynamo.config.accumulated_recompile_limit, 4096)
        if hasattr(dynamo.config, "accumulated_cache_size_limit"):
            dynamo.config.accumulated_cache_size_limit = max(dynamo.config.accumulated_cache_size_limit, 4096)
    except Exception:  # pragma: no cover - best effort
        pass


def flex_block_mask(spec, N: int, device, method: str = "analytic"):
    """The BlockMask (and the mods) of `spec` at length N; cached. Returns
    (block_mask, mask_mod, score_mod, info) with info = {"method", "build_s"}.

    method "create": torch's create_block_mask (compiled on CUDA: _compile=True), which
    evaluates mask_mod at all H·N² points (about 2 minutes at N=131072, H=16 on an H200).
    method "analytic": the same block sets from the segment structure (analytic_block_sets;
    checked equal to create_block_mask's by tools/check_peers_cpu.py and bench_forward.py).
    Hilbert-ordered specs always use "create" (the analytic sets assume raster segments);
    info["method"] says which one was used."""
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask
    H = int(_get(spec, "num_heads"))
    causal = bool(_get(spec, "causal", False))
    branches = branches_of(spec)
    device = torch.device(device)
    hil = hilbert_of(spec)
    if hil is not None:
        method = "create"
    key = (tuple(branches), causal, H, int(N), str(device), method, json_key(hil or {}))
    hit = _BLOCK_MASKS.get(key)
    if hit is not None:
        return hit
    invs = None
    if hil is not None:
        invs = []
        for pi in virtual_tables(spec, N, device):
            inv = torch.empty_like(pi)
            inv[pi] = torch.arange(N, device=device, dtype=pi.dtype)
            invs.append(inv)
    mask_mod, score_mod = _make_mods(branches, causal, N, invs)
    t0 = time.perf_counter()
    if method == "create":
        _raise_recompile_limits()
        bm = create_block_mask(mask_mod, B=None, H=H, Q_LEN=N, KV_LEN=N, device=device,
                               _compile=(device.type == "cuda"))
    elif method == "analytic":
        nonempty, full = analytic_block_sets(branches, causal, H, N)
        partial = nonempty & ~full
        num, idx = _dense_to_ordered(partial.unsqueeze(0))
        fnum, fidx = _dense_to_ordered(full.unsqueeze(0))
        bm = BlockMask.from_kv_blocks(num.to(device), idx.to(device), fnum.to(device), fidx.to(device),
                                      BLOCK_SIZE=128, mask_mod=mask_mod, seq_lengths=(N, N))
    else:
        raise ValueError(f"flex block mask method {method!r}: must be 'analytic' or 'create'")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    info = {"method": method, "build_s": time.perf_counter() - t0}
    res = (bm, mask_mod, score_mod, info)
    _BLOCK_MASKS[key] = res
    return res


def _flex_fn(device):
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention
    if device.type != "cuda":
        return flex_attention          # eager (unfused math) on the CPU: for semantic checks
    if _FLEX_COMPILED is None:
        _raise_recompile_limits()
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


FLEX_MASK_METHOD = "analytic"   # bench_forward.py sets this from --flex-mask (Hilbert specs: "create")


def flex(q, k, v, spec, method: str | None = None):
    """FlexAttention: mask_mod = union of branches (+ causal), score_mod = + log(multiplicity)."""
    B, N, H, Hkv, D = _check_shapes(q, k, v, spec)
    bm, _, score_mod, _ = flex_block_mask(spec, N, q.device, method or FLEX_MASK_METHOD)
    fn = _flex_fn(q.device)
    kw = {"score_mod": score_mod, "block_mask": bm, "scale": scale_of(spec, D)}
    if Hkv != H:
        kw["enable_gqa"] = True
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # (B, H, N, D) views
    if _FLEX_HAS_RETURN_LSE:
        out, lse = fn(qt, kt, vt, return_lse=True, **kw)      # deprecated in favour of return_aux, still there
    else:
        from torch.nn.attention.flex_attention import AuxRequest
        out, aux = fn(qt, kt, vt, return_aux=AuxRequest(lse=True), **kw)
        lse = aux.lse
    return out.transpose(1, 2), lse.float()


def _has_return_lse() -> bool:
    try:
        import inspect
        from torch.nn.attention.flex_attention import flex_attention
        return "return_lse" in inspect.signature(flex_attention).parameters
    except Exception:  # noqa: BLE001
        return True


_FLEX_HAS_RETURN_LSE = _has_return_lse()


def clear_caches():
    """Drop the cached block masks and curve tables (their memory) between configs."""
    _BLOCK_MASKS.clear()
    _TABLES.clear()
    _ROWS.clear()


PEERS = {"gather_cudnn": gather_cudnn, "gather_flash": gather_flash, "flex": flex,
         "dense_sdpa": dense_sdpa}
EXACT_PEERS = ("gather_cudnn", "gather_flash", "flex")   # dense_sdpa is a reference point
