"""Float64 dense reference of the attention defined in SPEC.md section 2.

Written straight from the SPEC text and deliberately independent of the rest of
dilgen: it imports only torch and the standard library, and carries its own
private generalized-Hilbert (gilbert2d) curve, so it shares no code (and no bugs)
with the planner or the kernels.

Everything is computed in float64 on the CPU with dense (N, N) matrices, so it is
meant for tests and pictures on small inputs (N up to a few thousand).

``spec`` is duck-typed: any object with the SPEC section 1 field names as attributes
(num_heads, num_kv_heads, head_dim, segment_lengths, dilation_rates, causal,
hilbert, softmax_scale, ...). ``spec.hilbert`` is None or an object with
``scope`` ("segment" | "sequence"), ``grids`` (segment scope, optional) and
``grid`` (sequence scope). Plain dicts are accepted for ``hilbert`` as well.

Two optional fields (issue 16, torchscale's LongNet), absent = SPEC's defaults:

- ``head_offsets``: "mod" (default) — head h keeps the lanes t with t mod r == h mod r;
  "block" — the heads are cut into r contiguous blocks of ceil(H / r) heads and block g
  keeps t mod r == g, i.e. head h keeps t mod r == floor(h / ceil(H / r)).
- ``head_base`` (0 when absent): head h of the call is head head_base + h of the model
  (heads split over devices), so under "mod" it keeps t mod r == (head_base + h) mod r.
- ``short_segments``: "exact" (default) — no padding; "zero_pad" — torchscale's padding:
  branch (w, r) cuts the sequence into segments of w' = min(w, N) positions (the same
  segments as "exact") and pads every segment with zero rows to P = ceil(w' / r) * r
  positions (the last one from its real length, all of them from w' to P). A kept query
  of segment s then also sees the pad rows t in [len_s, P) with t mod r == its head's
  offset: each adds a key of score 0 and value 0, i.e. exp(0 - max) to the softmax
  denominator and nothing to the numerator. Pad rows come after every real query of
  their segment, so causal specs never see them. Pad queries are dropped. When N > w and
  w is not a multiple of r, torchscale's branch outputs land on shifted rows (its layout
  slip): refused with a ValueError rather than reproduced.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = ["reference_attention", "reference_mask_counts"]


# --------------------------------------------------------------------------- curve


def _sgn(x: int) -> int:
    return (x > 0) - (x < 0)


def _gilbert_cells(x, y, ax, ay, bx, by, out):
    """Červený's gilbert2d recursion: append (x, y) cells of the region spanned by the
    major axis (ax, ay) and the minor axis (bx, by), starting at (x, y)."""
    w = abs(ax + ay)
    h = abs(bx + by)
    dax, day = _sgn(ax), _sgn(ay)  # unit major direction
    dbx, dby = _sgn(bx), _sgn(by)  # unit orthogonal direction

    if h == 1:  # a single row/column: walk it straight
        for _ in range(w):
            out.append((x, y))
            x, y = x + dax, y + day
        return
    if w == 1:
        for _ in range(h):
            out.append((x, y))
            x, y = x + dbx, y + dby
        return

    ax2, ay2 = ax // 2, ay // 2
    bx2, by2 = bx // 2, by // 2
    w2 = abs(ax2 + ay2)
    h2 = abs(bx2 + by2)

    if 2 * w > 3 * h:
        # long case: split in two along the major axis
        if (w2 % 2) and (w > 2):
            ax2, ay2 = ax2 + dax, ay2 + day  # prefer even steps
        _gilbert_cells(x, y, ax2, ay2, bx, by, out)
        _gilbert_cells(x + ax2, y + ay2, ax - ax2, ay - ay2, bx, by, out)
    else:
        # standard case: one step up, one long horizontal, one step down
        if (h2 % 2) and (h > 2):
            bx2, by2 = bx2 + dbx, by2 + dby
        _gilbert_cells(x, y, bx2, by2, ax2, ay2, out)
        _gilbert_cells(x + bx2, y + by2, ax, ay, bx - bx2, by - by2, out)
        _gilbert_cells(
            x + (ax - dax) + (bx2 - dbx),
            y + (ay - day) + (by2 - dby),
            -bx2,
            -by2,
            -(ax - ax2),
            -(ay - ay2),
            out,
        )


@lru_cache(maxsize=None)
def _gilbert_order_cached(rows: int, cols: int) -> tuple:
    cells: list = []
    # x = col (width = cols), y = row (height = rows); start at (0, 0); first split
    # along the longer side (cols when cols >= rows).
    if cols >= rows:
        _gilbert_cells(0, 0, cols, 0, 0, rows, cells)
    else:
        _gilbert_cells(0, 0, 0, rows, cols, 0, cells)
    order = tuple(y * cols + x for (x, y) in cells)
    if len(order) != rows * cols or len(set(order)) != rows * cols:
        raise AssertionError(f"gilbert curve of {rows}x{cols} is not a permutation")
    return order


def _gilbert_raster_order(rows: int, cols: int) -> list:
    """Curve index -> raster offset (row * cols + col) of the generalized Hilbert curve
    (gilbert2d) on a rows x cols grid, as fixed by SPEC section 2."""
    rows, cols = int(rows), int(cols)
    if rows < 1 or cols < 1:
        raise ValueError(f"grid {rows}x{cols}: rows and cols must be >= 1")
    return list(_gilbert_order_cached(rows, cols))


# --------------------------------------------------------------------------- spec access


def _attr(obj, name, default=None):
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _branches(spec):
    ws = tuple(int(w) for w in spec.segment_lengths)
    rs = tuple(int(r) for r in spec.dilation_rates)
    if len(ws) != len(rs):
        raise ValueError(
            f"segment_lengths has {len(ws)} entries but dilation_rates has {len(rs)}"
        )
    if len(ws) == 0:
        raise ValueError("segment_lengths: need at least one branch")
    for i, (w, r) in enumerate(zip(ws, rs)):
        if w < 1:
            raise ValueError(f"segment_lengths[{i}] = {w}: must be >= 1")
        if r < 1:
            raise ValueError(f"dilation_rates[{i}] = {r}: must be >= 1")
    return ws, rs


def _segment_grid(w: int, branch: int, grids):
    """(rows, cols) of the per-segment grid of a branch in Hilbert segment scope."""
    if grids is not None:
        rows, cols = (int(v) for v in grids[branch])
        if rows * cols != w:
            raise ValueError(
                f"hilbert.grids[{branch}] = [{rows}, {cols}]: rows*cols must equal "
                f"segment_lengths[{branch}] = {w}"
            )
        return rows, cols
    if w & (w - 1):
        raise ValueError(
            f"segment_lengths[{branch}] = {w}: Hilbert segment scope without grids "
            f"needs a power of two"
        )
    k = w.bit_length() - 1
    return 1 << (k // 2), 1 << ((k + 1) // 2)


# --------------------------------------------------------------------------- offsets, padding


def _offset_fn(spec):
    """head -> its offset in a branch of rate r, per ``spec.head_offsets``."""
    mode = _attr(spec, "head_offsets", "mod") or "mod"
    base = int(_attr(spec, "head_base", 0) or 0)
    if mode == "mod":
        return lambda head, r: (head + base) % r
    if mode == "block":
        nh = _attr(spec, "num_heads", None)
        if nh is None:
            raise ValueError('head_offsets = "block" needs num_heads')
        nh = int(nh)
        return lambda head, r: head // -(-nh // r)
    raise ValueError(f'head_offsets = {mode!r}: must be "mod" or "block"')


def _zero_pad(spec) -> bool:
    mode = _attr(spec, "short_segments", "exact") or "exact"
    if mode not in ("exact", "zero_pad"):
        raise ValueError(f'short_segments = {mode!r}: must be "exact" or "zero_pad"')
    if mode == "zero_pad" and _attr(spec, "hilbert") is not None:
        raise ValueError('short_segments = "zero_pad" is defined for raster order only (hilbert null)')
    return mode == "zero_pad"


def _check_layout_slip(n: int, spec) -> None:
    for i, (w, r) in enumerate(zip(*_branches(spec))):
        if n > w and w % r:
            raise ValueError(
                f"N = {n} with segment_lengths[{i}] = {w}, dilation_rates[{i}] = {r}: "
                f'short_segments "zero_pad" needs w to be a multiple of r once N > w '
                f"(torchscale's layout slip is not reproduced)")


def _count_lanes(lo, hi, o: int, r: int):
    """How many t in [lo, hi) have t mod r == o (lo, hi int64 tensors; 0 <= o < r)."""
    def below(x):  # t in [0, x) with t mod r == o
        return torch.clamp(x - o + r - 1, min=0) // r
    return torch.clamp(below(hi) - below(lo), min=0)


def _pad_counts(n: int, spec, head: int) -> torch.Tensor:
    """(N,) int64: zero keys (short_segments "zero_pad") the query at each raster position
    sees in query head ``head``, summed over the branches that keep it; zeros when causal
    (pad rows follow every real query of their segment) or with "exact"."""
    counts = torch.zeros(n, dtype=torch.int64)
    if not _zero_pad(spec) or bool(_attr(spec, "causal", False)):
        return counts
    _check_layout_slip(n, spec)
    offset = _offset_fn(spec)
    pos = torch.arange(n, dtype=torch.int64)
    for w, r in zip(*_branches(spec)):
        wn = min(w, n)                      # torchscale's segment: min(w, N) positions
        padded = -(-wn // r) * r            # ... padded to a multiple of r
        seg, t = pos // wn, pos % wn
        real = torch.clamp(n - seg * wn, max=wn)   # real length of each position's segment
        o = offset(head, r)
        keep = (t % r) == o
        counts += torch.where(keep, _count_lanes(real, torch.full_like(real, padded), o, r),
                              torch.zeros_like(real))
    return counts


# --------------------------------------------------------------------------- masks


def _branch_layout(n: int, w: int, branch: int, hilbert, grids):
    """For one branch: (segment id, lane index t) of every raster position 0..n-1.

    The head-h selection keeps position p iff lane[p] % r == h % r; two positions may
    attend to each other in this branch iff they share the segment id."""
    pos = torch.arange(n, dtype=torch.int64)
    scope = _attr(hilbert, "scope")
    if hilbert is None:
        return pos // w, pos % w

    if scope == "segment":
        rows, cols = _segment_grid(w, branch, grids)
        perm = torch.tensor(_gilbert_raster_order(rows, cols), dtype=torch.int64)
        seg = pos // w
        lane = torch.empty(n, dtype=torch.int64)
        nfull = n // w
        if nfull:
            inv = torch.empty(w, dtype=torch.int64)
            inv[perm] = torch.arange(w, dtype=torch.int64)
            lane[: nfull * w] = inv.repeat(nfull)
        tail = n - nfull * w
        if tail:
            # short last segment: the curve order of the positions that exist
            kept = perm[perm < tail]
            inv_t = torch.empty(tail, dtype=torch.int64)
            inv_t[kept] = torch.arange(tail, dtype=torch.int64)
            lane[nfull * w :] = inv_t
        return seg, lane

    if scope == "sequence":
        grid = _attr(hilbert, "grid")
        if grid is None:
            raise ValueError("hilbert.grid: required for scope 'sequence'")
        rows, cols = (int(v) for v in grid)
        if rows * cols != n:
            raise ValueError(
                f"hilbert.grid = [{rows}, {cols}]: sequence scope needs N = rows*cols, "
                f"got N = {n}"
            )
        perm = torch.tensor(_gilbert_raster_order(rows, cols), dtype=torch.int64)
        curve_idx = torch.empty(n, dtype=torch.int64)
        curve_idx[perm] = torch.arange(n, dtype=torch.int64)
        return curve_idx // w, curve_idx % w

    raise ValueError(f"hilbert.scope = {scope!r}: must be 'segment' or 'sequence'")


def _layouts(n: int, spec):
    ws, rs = _branches(spec)
    hilbert = _attr(spec, "hilbert")
    grids = _attr(hilbert, "grids") if hilbert is not None else None
    if grids is not None and len(list(grids)) != len(ws):
        raise ValueError(
            f"hilbert.grids has {len(list(grids))} entries; need one per branch ({len(ws)})"
        )
    return [(r,) + _branch_layout(n, w, i, hilbert, grids) for i, (w, r) in enumerate(zip(ws, rs))]


def _counts_from_layouts(n: int, layouts, head: int, causal: bool, offset=None) -> torch.Tensor:
    counts = torch.zeros(n, n, dtype=torch.int64)
    if causal:
        pos = torch.arange(n)
        allowed = pos[None, :] <= pos[:, None]  # key raster pos <= query raster pos
    for r, seg, lane in layouts:
        keep = (lane % r) == (head % r if offset is None else offset(head, r))
        pair = keep[:, None] & keep[None, :] & (seg[:, None] == seg[None, :])
        if causal:
            pair &= allowed
        counts += pair.to(torch.int64)
    return counts


def reference_mask_counts(n, spec, head) -> torch.Tensor:
    """(N, N) int64: entry [i, j] is how many branches keep the pair (query i, key j)
    in query head ``head`` (positions in raster order)."""
    n = int(n)
    if n < 1:
        raise ValueError(f"N = {n}: must be >= 1")
    return _counts_from_layouts(n, _layouts(n, spec), int(head), bool(_attr(spec, "causal", False)),
                                _offset_fn(spec))


def reference_branch_pairs(n, spec, head) -> list[torch.Tensor]:
    """One (N, N) bool per branch: the pairs (query i, key j) branch i keeps in query head
    ``head`` (their sum is reference_mask_counts); what attention dropout draws a coin for."""
    n, head, causal = int(n), int(head), bool(_attr(spec, "causal", False))
    offset = _offset_fn(spec)
    return [_counts_from_layouts(n, [layout], head, causal, offset) > 0 for layout in _layouts(n, spec)]


def dropout_weights(spec, batch: int, heads: int, n: int, head: int, p: float, seed: int,
                    rows: tuple[int, int] | None = None) -> torch.Tensor:
    """(B, N, N) float64: sum over the branches keeping (i, j) of keep * scale, keep the coin
    of dilgen.dropout for (head, branch, query row b N + i, key j's lane in the branch; with
    Hilbert scope "sequence" the query's curve index stands for i, the rows' sequence order) and
    scale = 1 / (1 - p') (dropout.scale): the numerator's pair weights under attention dropout
    (the normalizer keeps every pair: dropout acts on the probabilities). Every batch draws
    as one sequence of its rows. rows = (row0, total): one sequence of a packed batch whose
    rows start at row0 (query rows row0 + i)."""
    from .dropout import keep, scale, stream, threshold
    pairs = reference_branch_pairs(n, spec, head)
    layouts = _layouts(n, spec)
    order = torch.arange(n)                         # the query's index in the sequence's order
    hil = _attr(spec, "hilbert")
    if hil is not None and _attr(hil, "scope") == "sequence":
        order = _branch_layout(n, n, 0, hil, None)[1]   # raster position -> curve index
    i = torch.arange(batch)[:, None, None] * n + order[:, None]   # row b N + position
    if rows is not None:
        if batch != 1:
            raise ValueError("dropout_weights: rows= takes one sequence (batch 1)")
        i = order[:, None] + rows[0]
    w = torch.zeros(batch, n, n, dtype=torch.float64)
    for branch, (pair, (r, _seg, lane)) in enumerate(zip(pairs, layouts)):
        lane_j = torch.as_tensor(lane, dtype=torch.int64)[None, :] // r   # key j's dilated lane
        coin = keep(seed, p, stream(heads, len(pairs), head, branch), i, lane_j)
        w += (coin & pair[None]).to(torch.float64)
    return w * scale(threshold(p))


# --------------------------------------------------------------------------- attention


def reference_attention(q, k, v, spec, *, return_lse=False):
    """Dense float64 reference of SPEC section 2.

    q: (B, N, H, D); k, v: (B, N, Hkv, D), any float dtype/device. Computed in float64
    on the CPU. Returns ``out`` float64 (B, N, H, D) and, with return_lse=True, also
    ``lse`` float64 (B, H, N) (natural log of the softmax denominator of the scaled
    scores; -inf for a query no branch keeps, whose output is 0)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D: (B, N, H, D) / (B, N, Hkv, D)")
    B, N, H, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k shape {tuple(k.shape)} != v shape {tuple(v.shape)}")
    Bk, Nk, Hkv, Dk = k.shape
    if (Bk, Nk, Dk) != (B, N, D):
        raise ValueError(f"q shape {tuple(q.shape)} and k shape {tuple(k.shape)} disagree")
    nh = int(_attr(spec, "num_heads", H))
    nkv = _attr(spec, "num_kv_heads", None)
    nkv = nh if nkv is None else int(nkv)
    if H != nh:
        raise ValueError(f"q has {H} heads but num_heads = {nh}")
    if Hkv != nkv:
        raise ValueError(f"k/v have {Hkv} heads but num_kv_heads = {nkv}")
    if H % Hkv:
        raise ValueError(f"num_kv_heads = {Hkv} must divide num_heads = {H}")
    hd = _attr(spec, "head_dim", None)
    if hd is not None and int(hd) != D:
        raise ValueError(f"inputs have head dim {D} but head_dim = {hd}")
    if N < 1:
        raise ValueError(f"N = {N}: must be >= 1")

    scale = _attr(spec, "softmax_scale", None)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    causal = bool(_attr(spec, "causal", False))
    group = H // Hkv

    qf = q.detach().to(device="cpu", dtype=torch.float64)
    kf = k.detach().to(device="cpu", dtype=torch.float64)
    vf = v.detach().to(device="cpu", dtype=torch.float64)

    layouts = _layouts(N, spec)
    offset = _offset_fn(spec)
    zero_pad = _zero_pad(spec)
    if zero_pad:
        _check_layout_slip(N, spec)
    out = torch.zeros(B, N, H, D, dtype=torch.float64)
    lse = torch.full((B, H, N), float("-inf"), dtype=torch.float64)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64)

    # heads with equal offsets in all branches share the same mask (and pad keys)
    mask_cache: dict = {}
    rs = tuple(r for r, _, _ in layouts)
    for h in range(H):
        key = tuple(offset(h, r) for r in rs)
        if key not in mask_cache:
            mask_cache[key] = (_counts_from_layouts(N, layouts, h, causal, offset).to(torch.float64),
                               _pad_counts(N, spec, h).to(torch.float64) if zero_pad else None)
        M, pads = mask_cache[key]  # (N, N) multiplicities; (N,) zero keys per query or None
        present = M > 0
        kh = h // group
        s = scale * torch.einsum("bid,bjd->bij", qf[:, :, h], kf[:, :, kh])  # (B, N, N)
        s = torch.where(present, s, neg_inf)
        m = s.amax(dim=-1, keepdim=True)  # -inf on rows with no key
        if pads is not None:  # zero keys score 0: the running max includes 0 where there are some
            m = torch.where(pads[None, :, None] > 0, torch.clamp(m, min=0.0), m)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = M * torch.exp(s - m)  # exp(-inf) = 0 on masked entries
        denom = p.sum(dim=-1)  # (B, N)
        if pads is not None:  # each zero key: exp(0 - m) in the denominator, 0 in the numerator
            denom = denom + pads[None, :] * torch.exp(-m.squeeze(-1))
        num = torch.einsum("bij,bjd->bid", p, vf[:, :, kh])
        safe = torch.where(denom > 0, denom, torch.ones_like(denom))
        o = num / safe[..., None]
        o = torch.where((denom > 0)[..., None], o, torch.zeros_like(o))
        out[:, :, h] = o
        lse[:, h] = m.squeeze(-1) + torch.log(denom)  # log(0) = -inf for empty rows

    if return_lse:
        return out, lse
    return out


def differentiable_reference(q, k, v, spec, *, dropout_p: float = 0.0, seed: int = 0,
                             dropout_rows: tuple[int, int] | None = None):
    """(out, lse) in float64 with autograd (for gradient references): one softmax per query over the multiset of
    keys the branches keep (weights = pair multiplicities; with short_segments "zero_pad"
    also the zero keys, score 0 and value 0). Rows no branch keeps get out = 0, lse = -inf
    and a zero (never NaN) gradient. dropout_p > 0: each branch's entry of each probability is
    kept by dilgen.dropout's coin for `seed` and scaled by 1 / (1 - dropout_p) (the lse and the
    normalizer are those without dropout). dropout_rows = (row0, total): q, k, v are one
    sequence of a packed batch (dropout_weights' rows)."""
    B, N, H, D = q.shape
    group = H // k.shape[2]
    scale = spec.softmax_scale if spec.softmax_scale is not None else 1.0 / math.sqrt(D)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64)
    offset = _offset_fn(spec)
    zero_pad = _zero_pad(spec)
    masks: dict = {}
    outs, lses = [], []
    for h in range(H):
        key = tuple(offset(h, r) for r in spec.dilation_rates)
        if key not in masks:
            masks[key] = (reference_mask_counts(N, spec, h).to(torch.float64),
                          _pad_counts(N, spec, h).to(torch.float64) if zero_pad else None)
        M, pads = masks[key]
        kh = h // group
        s = scale * torch.einsum("bid,bjd->bij", q[:, :, h], k[:, :, kh])
        s = torch.where(M > 0, s, neg_inf)
        m = s.amax(-1, keepdim=True).detach()
        if pads is not None:
            m = torch.where(pads[None, :, None] > 0, torch.clamp(m, min=0.0), m)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = M * torch.exp(s - m)
        den = p.sum(-1)
        if pads is not None:
            den = den + pads[None, :] * torch.exp(-m.squeeze(-1))
        kept = den > 0
        safe = torch.where(kept, den, torch.ones_like(den))
        if dropout_p:
            p = dropout_weights(spec, B, H, N, h, dropout_p, seed, dropout_rows) * torch.exp(s - m)
        o = torch.einsum("bij,bjd->bid", p, v[:, :, kh]) / safe[..., None]
        outs.append(torch.where(kept[..., None], o, torch.zeros_like(o)))
        lses.append(torch.where(kept, m.squeeze(-1) + torch.log(safe), neg_inf.expand_as(den)))
    return torch.stack(outs, 2), torch.stack(lses, 1)
