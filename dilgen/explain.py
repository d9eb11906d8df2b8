"""`dilgen explain --png`: a picture of which query attends to which key.

One panel per chosen head; a cell (query i, key j) is coloured by how many branches keep
the pair (0 = white). The counts come from dilgen.reference (SPEC §2, independent of the
planner), so the picture shows the contract the kernels are tested against.
matplotlib is optional (`pip install dilgen[plot]`)."""
from __future__ import annotations

from pathlib import Path

from .spec import Spec, SpecError


MAX_CELLS = 512


def default_seq_len(spec: Spec) -> int:
    """N for the picture when --seq-len is not given: two of the longest segments (so every
    branch shows whole segments and a boundary), at most 4096 tokens."""
    return min(4096, 2 * max(spec.segment_lengths))


def _block_mean(counts, block: int, cells: int):
    import numpy as np
    pad = cells * block - counts.shape[0]
    c = np.pad(counts.astype("float64"), ((0, pad), (0, pad)))
    return c.reshape(cells, block, cells, block).mean(axis=(1, 3))


def _packed_counts(spec: Spec, cu: list[int], head: int):
    """Pair counts of a packed batch: each sequence's own pattern on the diagonal, nothing
    across sequences."""
    import torch
    from .reference import reference_mask_counts
    total = cu[-1]
    out = torch.zeros(total, total, dtype=torch.int64)
    for a, b in zip(cu, cu[1:]):
        if b > a:
            out[a:b, a:b] = reference_mask_counts(b - a, spec, head)
    return out


def write_pattern_png(spec: Spec, seq_len: int, path: str | Path, heads: list[int] | None = None,
                      cu_seqlens: list[int] | None = None) -> Path:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import BoundaryNorm, ListedColormap
    except ImportError:
        raise SpecError("--png needs matplotlib: pip install 'dilgen[plot]'") from None
    from .reference import reference_mask_counts

    if seq_len > 4096:
        raise SpecError(f"--png draws at most 4096 tokens (one pixel each), got --seq-len {seq_len}")
    if cu_seqlens is not None:
        seq_len = cu_seqlens[-1]
        if spec.hilbert is not None and spec.hilbert.scope == "sequence":
            raise SpecError("--cu-seqlens: hilbert scope 'sequence' takes one image, not a packed batch")
    elif spec.hilbert is not None and spec.hilbert.scope == "sequence":
        rows, cols = spec.hilbert.grid
        seq_len = rows * cols
    heads = heads if heads else sorted({0, min(1, spec.num_heads - 1), spec.num_heads - 1})
    bad = [h for h in heads if not 0 <= h < spec.num_heads]
    if bad:
        raise SpecError(f"--heads {bad[0]}: must be in [0, {spec.num_heads - 1}]")
    if cu_seqlens is not None:
        counts = [_packed_counts(spec, cu_seqlens, h).numpy() for h in heads]
    else:
        counts = [reference_mask_counts(seq_len, spec, h).numpy() for h in heads]
    top = max(1, max(int(c.max()) for c in counts))
    # one cell per token up to MAX_CELLS per axis; beyond, a cell is a block of tokens
    # coloured by the mean number of branches per pair (a dilated lattice shows as a
    # lighter block: r = 2 keeps a quarter of a block's pairs)
    block = -(-seq_len // MAX_CELLS)
    if block > 1:
        cells = -(-seq_len // block)
        counts = [_block_mean(c, block, cells) for c in counts]
        cmap, norm, ticks, label = plt.get_cmap("Blues"), None, None, \
            f"mean branches per pair ({block} x {block} tokens a cell)"
    else:
        palette = ["#ffffff", "#9ecae1", "#3182bd", "#08519c", "#f16913", "#d94801", "#7f2704"]
        cmap = ListedColormap(palette[: top + 1])
        norm = BoundaryNorm([x - 0.5 for x in range(top + 2)], cmap.N)
        ticks, label = list(range(top + 1)), "branches keeping the pair"

    fig, axes = plt.subplots(1, len(heads), figsize=(5.0 * len(heads) + 1.2, 5.6), squeeze=False,
                             constrained_layout=True)
    for ax, h, c in zip(axes[0], heads, counts):
        image = ax.imshow(c, cmap=cmap, norm=norm, interpolation="nearest",
                          extent=(0, seq_len, seq_len, 0), vmin=0 if norm is None else None,
                          vmax=top if norm is None else None)
        ax.set_title(f"head {h}  (offsets h mod r = {[h % r for r in spec.dilation_rates]})", fontsize=9)
        ax.set_xlabel("key position")
        ax.set_ylabel("query position")
        for edge in (cu_seqlens or [])[1:-1]:   # sequence boundaries of a packed batch
            ax.axhline(edge, color="#d94801", lw=0.6)
            ax.axvline(edge, color="#d94801", lw=0.6)
    branches = ", ".join(f"(w={w}, r={r})" for w, r in spec.branches())
    extra = " causal" if spec.causal else ""
    if spec.hilbert is not None:
        extra += f" hilbert={spec.hilbert.scope}"
    if cu_seqlens is not None:
        extra += f" packed cu_seqlens={','.join(map(str, cu_seqlens))}"
    fig.suptitle(f"{spec.name}: N={seq_len}, branches {branches}{extra}\n"
                 f"colour = number of branches that keep the (query, key) pair", fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), ticks=ticks, shrink=0.8, label=label)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
