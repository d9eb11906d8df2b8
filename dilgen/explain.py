"""`dilgen explain --png`: a picture of which query attends to which key.

One column per chosen head. Up to MAX_CELLS tokens the panel has one cell per token pair
(query i, key j), coloured by how many branches keep the pair (0 = white). Above, any N up
to MAX_TOKENS: the top panel is the whole input in at most MAX_CELLS x MAX_CELLS cells,
each a block of tokens coloured by the mean number of branches keeping a pair of the block
(white: no pair of the block attends; a branch of rate r alone gives 1/r^2 per head), so
segments and each branch's share show; the bottom panel is the first `zoom` tokens, one
cell per token, where every branch is in its first segment, so each branch's dilated
lattice and the head's offsets show (the top-left corner of the top panel).

The pairs come from dilgen.reference's segment and lane layout of SPEC §2 (independent of
the planner; `tests/test_cli.py` checks the cells against reference_mask_counts), so the
picture shows the contract the kernels are tested against. Counting works on one vector
per branch, never on the N x N mask: cell (I, J) sums, over the segments, kept rows of I
in the segment times kept rows of J in it (causal: J < I whole, the diagonal cell
k (k + 1) / 2 per segment). matplotlib is optional (`pip install dilgen[plot]`)."""
from __future__ import annotations

import io
import textwrap
from dataclasses import dataclass
from pathlib import Path

from . import fsafe
from .spec import Spec, SpecError

MAX_CELLS = 512            # cells per side of a panel; above, a cell is a block of tokens
MAX_TOKENS = 1 << 24       # N of a picture: a few int64 vectors of N per branch
MAX_DEFAULT = 1 << 21      # the default N stays quick to count (2M tokens)
ZOOM_MIN, ZOOM_MAX = 32, MAX_CELLS


def default_seq_len(spec: Spec) -> int:
    """N for the picture when --seq-len is not given: two of the longest segments (every
    branch shows whole segments and a boundary), at most MAX_DEFAULT tokens."""
    return min(MAX_DEFAULT, 2 * max(spec.segment_lengths))


def zoom_len(spec: Spec, n: int) -> int:
    """Tokens of the one-cell-per-token panel: 8 periods of the largest rate (32 to 512)."""
    return min(n, max(ZOOM_MIN, min(ZOOM_MAX, 8 * max(spec.dilation_rates))))


# --------------------------------------------------------------------------- counting


def branch_rows(spec: Spec, n: int, head: int, cu_seqlens: list[int] | None = None):
    """Per branch, lazily (one branch's vectors in memory at a time), (keep, seg) over the
    N tokens (raster order) for query head `head`: keep (N,) bool, the token is a lane of
    the head's offset; seg (N,) int64, its segment (unique across the sequences of a packed
    row). A pair attends in the branch iff both are kept and share seg (and, causal, key <=
    query)."""
    import torch
    from .reference import _branch_layout, _offset_fn
    offset = _offset_fn(spec)
    pieces = [(0, n)] if cu_seqlens is None else [(a, b) for a, b in zip(cu_seqlens, cu_seqlens[1:]) if b > a]
    grids = spec.hilbert.grids if spec.hilbert is not None else None
    for i, (w, r) in enumerate(spec.branches()):
        keeps, segs, base = [], [], 0
        for a, b in pieces:
            seg, lane = _branch_layout(b - a, w, i, spec.hilbert, grids)
            keeps.append(lane % r == offset(head, r))
            segs.append(seg + base)
            base += int(seg.max()) + 1
        yield torch.cat(keeps), torch.cat(segs)


def cell_counts(rows, n: int, block: int, causal: bool):
    """(cells, cells) float64 numpy: cell (I, J) = pairs (query in block I, key in block J)
    summed over the branches that keep them (blocks of `block` tokens)."""
    import torch
    cells = -(-n // block)
    total = torch.zeros(cells * cells, dtype=torch.float64)
    cell_of = torch.arange(n, dtype=torch.int64) // block
    for keep, seg in rows:
        c, s = cell_of[keep], seg[keep]
        if c.numel() == 0:
            continue
        # (segment, cell) -> kept tokens, sorted by segment: k[e] tokens of segment s[e] in cell c[e]
        key, k = torch.unique(s * cells + c, return_counts=True)
        s, c, k = key // cells, key % cells, k.to(torch.float64)
        # every two entries of one segment: k[e] * k[f] pairs in cell (c[e], c[f])
        first = torch.ones_like(s, dtype=torch.bool)
        first[1:] = s[1:] != s[:-1]
        starts = torch.nonzero(first).flatten()
        sizes = torch.diff(torch.cat([starts, torch.tensor([s.numel()])]))
        group_start = torch.repeat_interleave(starts, sizes)          # per entry
        group_size = torch.repeat_interleave(sizes, sizes)
        left = torch.repeat_interleave(torch.arange(s.numel()), group_size)
        step = torch.arange(left.numel()) - torch.repeat_interleave(
            torch.cumsum(group_size, 0) - group_size, group_size)
        right = group_start[left] + step
        cl, cr, w = c[left], c[right], k[left] * k[right]
        if causal:    # J < I: every pair has key < query; the diagonal cell: k (k + 1) / 2
            w = torch.where(cl == cr, k[left] * (k[left] + 1) / 2, torch.where(cr < cl, w, 0.0))
        total.index_add_(0, cl * cells + cr, w)
    return total.reshape(cells, cells).numpy()


def window_counts(rows, z: int, causal: bool):
    """(z, z) float64 numpy: branches keeping each pair of the first z tokens."""
    import torch
    out = torch.zeros(z, z, dtype=torch.float64)
    for keep, seg in rows:
        k, s = keep[:z], seg[:z]
        pair = k[:, None] & k[None, :] & (s[:, None] == s[None, :])
        if causal:
            pair = pair.tril()
        out += pair.to(torch.float64)
    return out.numpy()


# --------------------------------------------------------------------------- the picture


@dataclass
class Pattern:
    """A validated picture: N tokens (a packed row with cu_seqlens), the heads, the block
    size of the top panel and the tokens of the zoom (0: the top panel is one cell per
    token already)."""
    spec: Spec
    n: int
    heads: list[int]
    cu_seqlens: list[int] | None
    block: int
    zoom: int

    @property
    def cells(self) -> int:
        return -(-self.n // self.block)

    def panels(self, head: int):
        """(overview, zoom counts) of one head, in one pass over its branches: overview
        (cells, cells), the mean number of branches keeping a pair of each block of tokens
        (block 1: the count of each pair); zoom counts (zoom, zoom), the branches keeping
        each pair of the first `zoom` tokens (None without a zoom)."""
        import numpy as np
        sums = window = None
        for keep, seg in branch_rows(self.spec, self.n, head, self.cu_seqlens):
            part = cell_counts([(keep, seg)], self.n, self.block, self.spec.causal)
            sums = part if sums is None else sums + part
            if self.zoom:
                part = window_counts([(keep, seg)], self.zoom, self.spec.causal)
                window = part if window is None else window + part
        if self.block > 1:
            size = np.minimum(self.block, self.n - self.block * np.arange(self.cells)).astype("float64")
            sums = sums / (size[:, None] * size[None, :])
        return sums, window

    def overview(self, head: int):
        return self.panels(head)[0]

    def zoom_counts(self, head: int):
        return self.panels(head)[1]

    def offsets(self, head: int) -> list[int]:
        from .reference import _offset_fn
        offset = _offset_fn(self.spec)
        return [offset(head, r) for r in self.spec.dilation_rates]


def _require_matplotlib():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecError("--png needs matplotlib: pip install 'dilgen[plot]'") from None
    return plt


def prepare_pattern(spec: Spec, seq_len: int, heads: list[int] | None = None,
                    cu_seqlens: list[int] | None = None) -> Pattern:
    """Check everything the picture needs (matplotlib, N, heads) without drawing; the
    SpecError names the flag the user gave (--seq-len, --cu-seqlens, --heads)."""
    _require_matplotlib()
    if cu_seqlens is not None:
        flag = f"--cu-seqlens {','.join(map(str, cu_seqlens))}"
        seq_len = cu_seqlens[-1]
        if spec.hilbert is not None and spec.hilbert.scope == "sequence":
            raise SpecError(f"{flag}: hilbert scope 'sequence' takes one image, not a packed batch")
        if seq_len < 1:
            raise SpecError(f"{flag}: the packed row has no tokens to draw")
        what = f"the packed row has {seq_len} tokens"
    elif spec.hilbert is not None and spec.hilbert.scope == "sequence":
        rows, cols = spec.hilbert.grid      # one image (spec.py keeps it to MAX_TOKENS)
        seq_len = rows * cols
        flag, what = f"hilbert.grid {rows} x {cols}", f"{seq_len} tokens"
    else:
        flag, what = f"--seq-len {seq_len}", f"{seq_len} tokens"
    if seq_len > MAX_TOKENS:
        raise SpecError(f"{flag}: {what}; --png draws at most {MAX_TOKENS} tokens "
                        f"(in blocks of tokens, at most {MAX_CELLS} x {MAX_CELLS} cells)")
    last = spec.num_heads - 1
    heads = list(dict.fromkeys(heads)) if heads else sorted({0, min(1, last), last})
    bad = [h for h in heads if not 0 <= h < spec.num_heads]
    if bad:
        raise SpecError(f"--heads {bad[0]}: must be in [0, {spec.num_heads - 1}]")
    block = -(-seq_len // MAX_CELLS)
    return Pattern(spec, seq_len, heads, cu_seqlens, block,
                   zoom_len(spec, seq_len) if block > 1 else 0)


def draw_pattern(pattern: Pattern, path: str | Path) -> Path:
    import numpy as np
    plt = _require_matplotlib()
    from matplotlib.colors import BoundaryNorm, ListedColormap, PowerNorm

    spec, n, heads, cu = pattern.spec, pattern.n, pattern.heads, pattern.cu_seqlens
    top_panels, zoom_panels = zip(*(pattern.panels(h) for h in heads))
    token_panels = zoom_panels if pattern.zoom else top_panels
    top = max(1, max(int(c.max()) for c in token_panels))
    palette = ["#ffffff", "#9ecae1", "#3182bd", "#08519c", "#f16913", "#d94801", "#7f2704"]
    palette += ["#54278f"] * max(0, top + 1 - len(palette))
    count_cmap = ListedColormap(palette[: top + 1])
    count_norm = BoundaryNorm([x - 0.5 for x in range(top + 2)], count_cmap.N)

    rows = 2 if pattern.zoom else 1
    fig, axes = plt.subplots(rows, len(heads), figsize=(4.6 * len(heads) + 1.6, 4.9 * rows + 0.9),
                             squeeze=False, constrained_layout=True)

    def boundaries(ax, limit):
        for edge in (cu or [])[1:-1]:       # sequence boundaries of a packed batch
            if 0 < edge < limit:
                ax.axhline(edge, color="#d94801", lw=0.6)
                ax.axvline(edge, color="#d94801", lw=0.6)

    def label(ax, title):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")

    if pattern.zoom:
        mean_top = max(float(c.max()) for c in top_panels) or 1.0
        shades = plt.get_cmap("Blues")(np.linspace(0.2, 1.0, 256))
        mean_cmap = ListedColormap(shades).with_extremes(bad="#ffffff")   # no pair attends
        mean_norm = PowerNorm(0.5, vmin=0.0, vmax=mean_top)
        b = pattern.block
        for ax, h, c in zip(axes[0], heads, top_panels):
            image = ax.imshow(np.ma.masked_equal(c, 0.0), cmap=mean_cmap, norm=mean_norm,
                              interpolation="nearest", extent=(0, pattern.cells * b, pattern.cells * b, 0))
            ax.set_xlim(0, n)
            ax.set_ylim(n, 0)
            boundaries(ax, n)
            label(ax, f"head {h}: all {n} tokens, a cell = {b} x {b} tokens")
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.85,
                     label="mean branches keeping a pair of the cell\n(sqrt scale; white: none attends)")
        token_axes = axes[1]
    else:
        token_axes = axes[0]
    for ax, h, c in zip(token_axes, heads, token_panels):
        size = c.shape[0]
        image = ax.imshow(c, cmap=count_cmap, norm=count_norm, interpolation="nearest",
                          extent=(0, size, size, 0))
        boundaries(ax, size)
        where = f"tokens 0-{size - 1}, one cell per token" if pattern.zoom else f"N = {n}"
        label(ax, f"head {h} ({where})\noffsets per branch: {pattern.offsets(h)}")
    fig.colorbar(image, ax=token_axes.tolist(), ticks=list(range(top + 1)), shrink=0.85,
                 label="branches keeping the pair")

    branches = ", ".join(f"(w={w}, r={r})" for w, r in spec.branches())
    extra = " causal" if spec.causal else ""
    if spec.hilbert is not None:
        extra += f" hilbert={spec.hilbert.scope}"
    if spec.head_offsets != "mod":
        extra += f" head_offsets={spec.head_offsets}"
    if spec.short_segments != "exact":
        extra += f" short_segments={spec.short_segments} (its zero keys not drawn)"
    if cu is not None:
        shown = ",".join(map(str, cu)) if len(cu) <= 12 else f"{len(cu) - 1} sequences"
        extra += f" packed cu_seqlens={shown}"
    how = ("top: all tokens, a cell = a block of tokens shaded by the mean number of branches "
           "keeping a (query, key) pair of it (a branch of rate r alone: 1/r^2 of the pairs)\n"
           f"bottom: the first {pattern.zoom} tokens (top-left corner), one cell per token, every "
           "branch in its first segment: each branch's dilated lattice at the head's offsets"
           if pattern.zoom else "colour = number of branches that keep the (query, key) pair")
    # wrapped to the figure's width (about 12 characters an inch at 10 pt), so that a
    # picture of one or two heads does not cut its title at both edges
    width = max(40, int(fig.get_figwidth() * 12))
    title = "\n".join(textwrap.fill(line, width) for line in
                      f"{spec.name}: N={n}, branches {branches}{extra}\n{how}".split("\n"))
    fig.suptitle(title, fontsize=10)
    out = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    try:       # a temporary file in the folder, moved onto the name: never a half picture
        fsafe.write_atomic(out, buf.getvalue(), mode=0o644)
    except fsafe.UnsafePath as exc:
        raise SpecError(f"--png {path}: {exc}") from None
    except OSError as exc:
        raise SpecError(f"--png {path}: could not write the picture ({exc.strerror or exc})") from None
    return out


def check_png_path(path: str | Path) -> None:
    """A --png target dilgen can write: a name ending in .png, in a folder that exists, not
    a symlink (dangling or not) or anything but a regular file (never followed)."""
    out = Path(path)
    if out.is_symlink():
        raise SpecError(f"--png {path}: is a symlink; dilgen writes only regular files and "
                        f"does not follow links: remove it or give another name")
    if out.is_dir():
        raise SpecError(f"--png {path}: is a folder; give the PNG file to write")
    if out.suffix.lower() != ".png":
        raise SpecError(f"--png {path}: the picture is a PNG; give a file name ending in .png")
    if not out.parent.is_dir():
        raise SpecError(f"--png {path}: folder {str(out.parent)!r} does not exist; create it first")
    try:
        fsafe.refuse_non_regular(out)
    except fsafe.UnsafePath as exc:
        raise SpecError(f"--png {path}: {exc}") from None


def write_pattern_png(spec: Spec, seq_len: int, path: str | Path, heads: list[int] | None = None,
                      cu_seqlens: list[int] | None = None) -> Path:
    """prepare_pattern + draw_pattern: the picture of `spec` at N = seq_len into `path`."""
    return draw_pattern(prepare_pattern(spec, seq_len, heads, cu_seqlens), path)
