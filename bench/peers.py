"""The peers dilgen is benchmarked against, each ``peer(q, k, v, spec) -> (out, lse)`` in
dilgen's layout (q (B, N, H, D), k, v (B, N, Hkv, D); out in q's dtype, lse (B, H, N) float32,
−inf and out 0 where no branch keeps the query) and exact for every spec (SPEC.md §2: r ∤ w,
short last segments, GQA, Hilbert orderings): gather_cudnn, gather_flash, flex (+ its document
mask on packed rows, document_block_mask); and two reference points, not the same math:
dense_sdpa and lane_floor. bench/README.md ("What each method computes") says what each one
computes. Off CUDA (or in fp32) the gather peers use an fp32 softmax and flex runs eagerly;
tests/test_bench_peers.py checks every peer against dilgen.reference (float64).
"""
from __future__ import annotations

import functools
import inspect
import json
import operator
import time

import torch
import torch.nn.functional as F

_TABLES, _ROWS, _BLOCK_MASKS = {}, {}, {}      # curve tables, kept rows, block masks (clear_caches())
_FLEX_COMPILED = None
FLEX_MASK_METHOD = "analytic"   # bench_forward.py sets it from --flex-mask (Hilbert specs: "create")


def virtual_tables(spec, N: int, device) -> list:
    """Per branch None (raster) or pi_i, int64 (N,) on `device`: virtual -> raster position."""
    if (hil := spec.hilbert) is None:
        return [None] * len(spec.segment_lengths)
    from dilgen.runtime.tables import table_tensors
    from dilgen.spec import default_grid
    out = []
    for i, (w, _) in enumerate(spec.branches()):
        grid = hil.grid if hil.scope == "sequence" else hil.grids[i] if hil.grids else default_grid(w)
        desc = {"scope": hil.scope, "grid": [int(x) for x in grid]}
        key = (json.dumps(desc, sort_keys=True), int(N), str(device))
        if key not in _TABLES:
            _TABLES[key] = table_tensors(desc, int(N), torch.device("cpu"))[0].to(device=device, dtype=torch.int64)
        out.append(_TABLES[key])
    return out


def _check_shapes(q, k, v, spec):
    """(B, N, H, Hkv, D) of q (B, N, H, D), k, v (B, N, Hkv, D) that agree with spec.num_heads."""
    B, N, H, D = q.shape if q.dim() == 4 else (None,) * 4
    if B is None or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != D or H % k.shape[2] \
            or H != spec.num_heads:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}, "
                         f"num_heads {spec.num_heads}")
    return B, N, H, k.shape[2], D


# --------------------------------------------------------------------------- per-segment attention
# (B', H', S, D) q, k, v -> out (B', H', S, D) in the input dtype, lse (B', H', S) float32
def _attn_math(q, k, v, causal: bool, scale: float):
    """Explicit softmax in fp32 (the CPU / fp32 fallback)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        S = q.shape[-2]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu_(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.float()).to(q.dtype), lse


def _attn_fused(cudnn: bool, dropout_p: float = 0.0):
    """cuDNN's or FlashAttention-2's attention with LSE (the fp32 math off CUDA or in fp32);
    dropout_p: FlashAttention-2's own fused dropout (the fp32 math ignores it)."""
    def attn(q, k, v, causal: bool, scale: float):
        if not (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
            return _attn_math(q, k, v, causal, scale)
        ops = torch.ops.aten
        res = (ops._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale) if cudnn
               else ops._scaled_dot_product_flash_attention(q, k, v, dropout_p, causal, False, scale=scale))
        # cuDNN's stats come as (B', H', S, 1): keep the first S entries of whatever comes
        return res[0], res[1].reshape(q.shape[0], q.shape[1], -1)[:, :, :q.shape[2]].float()
    return attn


_attn_cudnn, _attn_flash = _attn_fused(True), _attn_fused(False)


# --------------------------------------------------------------------------- gather peers
def _gather(x, rows, start: int, nseg: int, seglen: int, g: int, r: int, heads):
    """Rows start + s·seglen + g + j·r of x (B, N, Hx, D) (Hilbert: the raster rows `rows`, nseg·m of
    them), heads `heads`, as (B·nseg, Hg, m, D)."""
    B, _, Hx, D = x.shape
    y = (x[:, start:start + nseg * seglen].view(B, nseg, seglen, Hx, D)[:, :, g::r] if rows is None
         else x.index_select(1, rows).view(B, nseg, -1, Hx, D))
    y = y[:, :, :, heads] if isinstance(heads, slice) else y.index_select(3, heads)
    return y.permute(0, 1, 3, 2, 4).reshape(B * nseg, y.shape[3], y.shape[2], D)


def _kept_rows(pi, start: int, nseg: int, seglen: int, g: int, r: int):
    """(nseg, m) raster positions pi(start + s·seglen + g + r·j), sorted per segment; cached
    per table, as any gather-based implementation would keep its indices."""
    key = (pi.data_ptr(), pi.numel(), str(pi.device), start, nseg, seglen, g, r)
    hit = _ROWS.get(key)
    if hit is None or hit[0] is not pi:
        lanes = torch.arange(g, seglen, r, device=pi.device)
        virt = start + torch.arange(nseg, device=pi.device)[:, None] * seglen + lanes[None, :]
        hit = _ROWS[key] = (pi, pi[virt].sort(dim=1).values)      # pi kept: its address stays its own
    return hit[1]


def _dilated_gather(attn, q, k, v, spec):
    B, N, H, Hkv, D = _check_shapes(q, k, v, spec)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    G, causal, scale, dev, outs, lses = H // Hkv, bool(spec.causal), spec.scale, q.device, [], []
    for (w, r), pi in zip(spec.branches(), virtual_tables(spec, N, dev)):
        nfull, tail = divmod(N, w_eff := min(w, N))
        pieces = [(0, nfull, w_eff)] + ([(nfull * w_eff, 1, tail)] if tail else [])   # (start, nseg, seglen)
        o_b = torch.zeros(q.shape, dtype=q.dtype, device=dev)    # rows the branch does not keep stay 0
        l_b = torch.full((B, H, N), float("-inf"), device=dev, dtype=torch.float32)
        for g in range(min(r, H)):                               # head group: h % r == g
            qh = slice(g, H, r)
            kvh = qh if G == 1 else torch.arange(g, H, r, device=dev) // G
            for start, nseg, seglen in pieces:
                if g >= seglen:
                    continue
                rows = None if pi is None else _kept_rows(pi, start, nseg, seglen, g, r).reshape(-1)
                qs, ks, vs = (_gather(x, rows, start, nseg, seglen, g, r, h) for x, h in ((q, qh), (k, kvh), (v, kvh)))
                o, l = attn(qs, ks, vs, causal, scale)
                Hg, m = qs.shape[1], qs.shape[2]
                o, l = o.view(B, nseg, Hg, m, D).permute(0, 1, 3, 2, 4), l.view(B, nseg, Hg, m).permute(0, 2, 1, 3)
                if rows is None:
                    o_b[:, start:start + nseg * seglen].view(B, nseg, seglen, H, D)[:, :, g::r, qh].copy_(o)
                    l_b[:, qh, start:start + nseg * seglen].view(B, Hg, nseg, seglen)[:, :, :, g::r].copy_(l)
                else:                                     # Hilbert: rows pi(virtual lane positions), sorted
                    o_b[:, rows, qh] = o.reshape(B, nseg * m, Hg, D)
                    l_b[:, qh, rows] = l.reshape(B, Hg, nseg * m)
        outs.append(o_b)
        lses.append(l_b)
    return _merge(outs, lses, q.dtype)


def _merge(outs, lses, dtype):
    """LongNet Eq. 10 in fp32: out = Σ_i exp(lse_i − lse)·o_i, lse = logsumexp_i lse_i."""
    L = torch.stack(lses)
    lse = torch.logsumexp(L, dim=0)                              # −inf where no branch keeps
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    acc = None
    for i, o in enumerate(outs):
        wgt = torch.exp(L[i] - lse_safe).transpose(1, 2).unsqueeze(-1)
        acc = o.float().mul_(wgt) if acc is None else acc.addcmul_(o, wgt)
    return acc.to(dtype), lse


# gather per (branch, head group) + cuDNN / FlashAttention-2 with LSE + scatter + fp32 merge
gather_cudnn = functools.partial(_dilated_gather, _attn_cudnn)
gather_flash = functools.partial(_dilated_gather, _attn_flash)
# REFERENCE POINT: the same with FlashAttention-2's dropout at p = 0.1 (its price of dropout)
gather_flash_dropout = functools.partial(_dilated_gather, _attn_fused(False, 0.1))


def dense_sdpa(q, k, v, spec):
    """REFERENCE POINT, not the same math: dense SDPA over the whole sequence (lse None)."""
    B, N, H, Hkv, D = _check_shapes(q, k, v, spec)
    kw = {"is_causal": bool(spec.causal), "scale": spec.scale} | ({"enable_gqa": True} if Hkv != H else {})
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kw
                                          ).transpose(1, 2), None


def lane_floor(spec, B: int, N: int, device, grad: bool = False, seed: int = 0):
    """REFERENCE POINT: a callable running, per branch, one cuDNN SDPA on the gathered lane
    shapes (B·⌈N/w⌉, H, ⌈w/r⌉, D) made beforehand (+ backward of a random cotangent when grad)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    ts = [[torch.randn(B * -(-N // min(w, N)), spec.num_heads, -(-min(w, N) // r), spec.head_dim, device=device,
                       dtype=torch.bfloat16, generator=gen).requires_grad_(grad) for _ in range(4)]
          for w, r in spec.branches()]
    backend = SDPBackend.CUDNN_ATTENTION if device.type == "cuda" else SDPBackend.MATH

    def run():
        with sdpa_kernel([backend]):
            for q, k, v, g in ts:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=bool(spec.causal))
                if grad:
                    torch.autograd.grad(o, (q, k, v), g)
    return run


# --------------------------------------------------------------------------- FlexAttention
def _branch_pair(w: int, r: int, N: int, h, q_idx, kv_idx, inv=None):
    """Does branch (w, r) keep (q_idx, kv_idx) in head h? None: every pair (w >= N, r = 1).
    inv (Hilbert): the rule on virtual positions inv[raster]."""
    if inv is not None:
        q_idx, kv_idx = inv[q_idx], inv[kv_idx]
    cond = None if (w >= N and inv is None) else (q_idx // w) == (kv_idx // w)
    if r > 1:
        c = h % r
        tq, tk = (q_idx, kv_idx) if (w % r == 0 and inv is None) else (q_idx % w, kv_idx % w)
        sel = ((tq % r) == c) & ((tk % r) == c)      # (idx % w) % r == idx % r when r | w
        cond = sel if cond is None else cond & sel
    return cond


def _make_mods(branches, causal: bool, N: int, invs=None):
    """mask_mod / score_mod of the union of branches (score_mod None for one branch); invs:
    per branch None (raster) or pi⁻¹ (raster -> virtual position) on q's device."""
    branches = tuple(branches)
    invs = tuple(invs) if invs is not None else (None,) * len(branches)

    def pairs(h, q_idx, kv_idx):          # a list, not a generator: torch.compile traces it
        cs = [_branch_pair(w, r, N, h, q_idx, kv_idx, inv) for (w, r), inv in zip(branches, invs)]
        return [(q_idx >= 0) if c is None else c for c in cs]

    def mask_mod(b, h, q_idx, kv_idx):
        m = functools.reduce(operator.or_, pairs(h, q_idx, kv_idx))
        return m & (kv_idx <= q_idx) if causal else m

    def score_mod(score, b, h, q_idx, kv_idx):          # pairs no branch keeps are masked anyway
        cnt = functools.reduce(operator.add, [c.to(torch.float32) for c in pairs(h, q_idx, kv_idx)])
        return score + torch.log(torch.clamp(cnt, min=1.0))

    return mask_mod, (score_mod if len(branches) > 1 else None)


def _block_mask(nonempty, full, n: int, mask_mod, device, block: int = 128):
    """flex's BlockMask of bool block sets (…, nq, nk), full ⊆ nonempty, on `device`."""
    from torch.nn.attention.flex_attention import BlockMask

    def ordered(dense):              # (num (…, nq), indices (…, nq, nk)) int32
        d = dense.to(device=device, dtype=torch.int32)
        return (d.sum(dim=-1).to(torch.int32).contiguous(),
                torch.argsort(d, dim=-1, descending=True, stable=True).to(torch.int32).contiguous())
    return BlockMask.from_kv_blocks(*ordered(nonempty & ~full), *ordered(full), BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(n, n))


def analytic_block_sets(branches, causal: bool, H: int, N: int, block: int = 128):
    """Exact (nonempty, full) block pairs, bool (H, nb, nb), of the union mask in O(H·(N/block)² + N):
    qb < kb share a segment only through the one holding qb's last and kb's first row; full: an
    r = 1 branch holds both blocks, complete, in one segment (kb < qb when causal)."""
    nb, pos = -(-N // block), torch.arange(N)
    blk, first = pos // block, torch.arange(nb) * block
    last, complete = torch.clamp(first + block - 1, max=N - 1), (first + block - 1) < N
    nonempty, full = torch.zeros(H, nb, nb, dtype=torch.bool), torch.zeros(nb, nb, dtype=torch.bool)
    upper = torch.ones(nb, nb, dtype=torch.bool).triu(1)

    def per_block(x):
        return torch.zeros(nb, dtype=torch.int64).index_add_(0, blk, x.long()) > 0
    for w, r in branches:
        seg, off, s_first, s_last = pos // w, pos % w, first // w, last // w
        is_first, is_last = seg == s_first[blk], seg == s_last[blk]
        for c in range(min(r, H)):
            kept = (off % r) == c
            up = (s_last[:, None] == s_first[None, :]) & per_block(kept & is_last)[:, None] \
                & per_block(kept & is_first)[None, :] & upper
            nonempty[c::r] |= up | up.transpose(0, 1) | torch.diag(per_block(kept))
        if r == 1:
            one = complete & (s_first == s_last)
            full |= one[:, None] & one[None, :] & (s_first[:, None] == s_first[None, :])
    if causal:
        nonempty &= ~upper
        full &= torch.ones(nb, nb, dtype=torch.bool).tril(-1)
    return nonempty, full.unsqueeze(0).expand(H, nb, nb) & nonempty


def block_sets_of(block_mask):
    """(nonempty, full) bool (H, nq, nk) of a BlockMask (batch 0), on the CPU."""
    def dense(num, idx):
        num, idx = num[0].cpu().long(), idx[0].cpu().long()
        nk = idx.shape[2]
        d = torch.zeros(*idx.shape[:2], nk + 1, dtype=torch.bool)
        d.scatter_(2, torch.where(torch.arange(nk)[None, None, :] < num[:, :, None], idx, nk), True)
        return d[:, :, :nk]
    partial = dense(block_mask.kv_num_blocks, block_mask.kv_indices)
    fullm = (dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
             if block_mask.full_kv_num_blocks is not None else torch.zeros_like(partial))
    return partial | fullm, fullm


def _raise_recompile_limits():
    """Every config's mask is another graph for torch.compile: dynamo's limits raised to fit them all."""
    import torch._dynamo as dynamo
    for name, low in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 4096),
                      ("accumulated_cache_size_limit", 4096)):
        if hasattr(dynamo.config, name):
            setattr(dynamo.config, name, max(getattr(dynamo.config, name), low))


def flex_block_mask(spec, N: int, device, method: str = "analytic"):
    """(block_mask, mask_mod, score_mod, {"method", "build_s"}) of `spec` at length N, cached.
    "create": torch's create_block_mask (mask_mod at all H·N² points: ~2 min at N = 131072);
    "analytic": the same block sets from analytic_block_sets (checked equal by bench_forward.py).
    Hilbert specs always use "create"."""
    from torch.nn.attention.flex_attention import create_block_mask
    H, causal, branches, device, hil = int(spec.num_heads), bool(spec.causal), spec.branches(), \
        torch.device(device), None if spec.hilbert is None else spec.hilbert.to_json()
    method = "create" if hil is not None else method
    key = (tuple(branches), causal, H, int(N), str(device), method, json.dumps(hil or {}, sort_keys=True))
    if key in _BLOCK_MASKS:
        return _BLOCK_MASKS[key]
    invs = None if hil is None else [torch.empty_like(pi).scatter_(0, pi, torch.arange(N, device=device))
                                     for pi in virtual_tables(spec, N, device)]      # pi⁻¹
    mask_mod, score_mod = _make_mods(branches, causal, N, invs)
    t0 = time.perf_counter()
    if method == "create":
        _raise_recompile_limits()
        bm = create_block_mask(mask_mod, B=None, H=H, Q_LEN=N, KV_LEN=N, device=device,
                               _compile=(device.type == "cuda"))
    elif method == "analytic":
        bm = _block_mask(*(x[None] for x in analytic_block_sets(branches, causal, H, N)), N, mask_mod, device)
    else:
        raise ValueError(f"flex block mask method {method!r}: must be 'analytic' or 'create'")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    info = {"method": method, "build_s": time.perf_counter() - t0}
    return _BLOCK_MASKS.setdefault(key, (bm, mask_mod, score_mod, info))


def flex_fn(device):
    """flex_attention, torch.compile'd on CUDA (eager, unfused math, on the CPU)."""
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention
    if torch.device(device).type != "cuda":
        return flex_attention
    if _FLEX_COMPILED is None:
        _raise_recompile_limits()
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False)
    return _FLEX_COMPILED


def flex(q, k, v, spec, method: str | None = None):
    """FlexAttention: mask_mod = union of branches (+ causal), score_mod = + log(multiplicity)."""
    B, N, H, Hkv, D = _check_shapes(q, k, v, spec)
    bm, _, score_mod, _ = flex_block_mask(spec, N, q.device, method or FLEX_MASK_METHOD)
    kw = dict(score_mod=score_mod, block_mask=bm, scale=spec.scale, enable_gqa=Hkv != H)
    qkv = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    from torch.nn.attention import flex_attention as fa
    if "return_lse" in inspect.signature(fa.flex_attention).parameters:    # deprecated, still there
        out, lse = flex_fn(q.device)(*qkv, return_lse=True, **kw)
    else:
        out, aux = flex_fn(q.device)(*qkv, return_aux=fa.AuxRequest(lse=True), **kw)
        lse = aux.lse
    return out.transpose(1, 2), lse.float()


# --------------------------------------------------------------------------- FlexAttention on packed rows
def document_mods(branches, causal: bool, lengths, device):
    """mask_mod / score_mod of a packed row: same sequence AND the pattern on in-sequence positions."""
    n = torch.tensor(lengths, dtype=torch.int64)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), n)
    first = (torch.cumsum(n, 0) - n).repeat_interleave(n)
    pad = 2 * 128 - len(doc) % 128       # a kernel may read mask_mod a block past the last row
    doc = torch.cat([doc, torch.full((pad,), -1)]).to(device=device, dtype=torch.int32)
    first = torch.cat([first, torch.zeros(pad, dtype=torch.int64)]).to(device=device, dtype=torch.int32)
    inner_mask, inner_score = _make_mods(branches, causal, max(w for w, _ in branches) + 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & inner_mask(b, h, q_idx - first[q_idx], kv_idx - first[kv_idx])

    def score_mod(score, b, h, q_idx, kv_idx):
        return inner_score(score, b, h, q_idx - first[q_idx], kv_idx - first[kv_idx])
    return mask_mod, (score_mod if inner_score is not None else None)


def block_sets(branches, causal: bool, lengths, block: int = 128, device="cpu"):
    """(nonempty, full) bool (nb, nb) block pairs of a packed row, O(segments + blocks): per query
    block the interval of key blocks that may hold a kept pair (a superset for every head) and of
    those whose every pair is kept (one segment of an r = 1 branch holds both blocks)."""
    nb = -(-sum(lengths) // block)
    lo, hi = torch.full((nb,), nb + 1, dtype=torch.int64), torch.full((nb,), -1, dtype=torch.int64)
    flo, fhi, s0 = lo.clone(), hi.clone(), 0
    for n in lengths:
        for w, r in branches:
            for a in range(0, n, w):
                sa, se = s0 + a, s0 + min(a + w, n)
                ba, bb = sa // block, (se - 1) // block
                lo[ba:bb + 1].clamp_(max=ba)
                hi[ba:bb + 1].clamp_(min=bb)
                ca, cb = -(-sa // block), se // block - 1       # blocks wholly inside
                if r == 1 and ca <= cb:
                    flo[ca:cb + 1].clamp_(max=ca)
                    fhi[ca:cb + 1].clamp_(min=cb)
        s0 += n
    if causal:
        hi, fhi = torch.minimum(hi, torch.arange(nb)), torch.minimum(fhi, torch.arange(nb) - 1)
    lo, hi, flo, fhi = (x.to(device)[:, None] for x in (lo, hi, flo, fhi))
    kb = torch.arange(nb, device=device)[None, :]
    return (kb >= lo) & (kb <= hi), (kb >= flo) & (kb <= fhi) & (kb >= lo) & (kb <= hi)


def document_block_mask(spec, lengths, device, block: int = 128):
    """(BlockMask, mask_mod, score_mod, build s) of flex on a packed row of sequences of `lengths`."""
    t0, branches = time.perf_counter(), spec.branches()
    mask_mod, score_mod = document_mods(branches, bool(spec.causal), lengths, device)
    bm = _block_mask(*(x[None, None] for x in block_sets(branches, bool(spec.causal), lengths, block, device)),
                     sum(lengths), mask_mod, device, block)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return bm, mask_mod, score_mod, time.perf_counter() - t0


def clear_caches():
    """Drop the cached block masks and curve tables (their memory) between configs."""
    for cache in (_BLOCK_MASKS, _TABLES, _ROWS):
        cache.clear()


PEERS = {"gather_cudnn": gather_cudnn, "gather_flash": gather_flash, "flex": flex, "dense_sdpa": dense_sdpa,
         "gather_flash_dropout": gather_flash_dropout}
