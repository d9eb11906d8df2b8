"""Variable-length batches (issue 14): a packed batch of sequences of many lengths, forward
and fwd+bwd, one GPU, bf16, config A's branches (H 16, D 128, w [2048, 4096, 8192],
r [1, 2, 4]), every method in one process on the same inputs.

Packings (--packings; the first is the issue's):
  docs64  64 sequences, lengths log-uniform in [2048, 65536] (random.Random(5): the first
          seed whose total is within 5% of the issue's "about 1.3M"; 1,305,357 tokens,
          longest 61,662)
  docs    LM packing: 29 documents of 256 .. 16K tokens in 131,072 rows (earlier benches)
  slides  8 whole-slide tile sequences of 2K .. 32K tiles (earlier benches)
each non-causal and causal (causal is per sequence).

Methods (one row each per packing, causal flag and pass):
  dilgen_varlen        kernel(q, k, v, cu_seqlens=cu): the packed call
  dilgen_one_sequence  the same kernel on ONE sequence of the same total length (B 1,
                       N = total): the rate the packed call should come near
  dilgen_padded        peer (a): every sequence right-padded to the longest, (B, N_max, H, D),
                       kernel.padded(q, k, v, key_padding_mask); when the padded batch does
                       not fit in memory it runs in chunks of whole items (padded_chunks in the
                       row; ms is the sum), or is skipped with the reason in `error`
  dilgen_loop          peer (b): one dilgen call per sequence
  flex_document        peer (c): FlexAttention on the packed row, mask_mod = same sequence AND
                       the dilated pattern on positions local to the sequence (+ causal),
                       score_mod = + log(multiplicity) (bench/peers.py's mods); the BlockMask
                       from the segment structure (document_block_sets); torch.compile'd;
                       skipped once --flex-budget-s is spent
  gather_cudnn         extra peer, per sequence: gather per (branch, head group) + cuDNN + merge

Timing: CUDA events, median of --reps (10) calls after --warmup (3) calls, the checked first
call counted as a warm-up. fwd_bwd = forward + torch.autograd.grad on the method's own leaf
inputs (the per-sequence methods: one leaf per sequence), gradients discarded, so no method
pays for accumulating into .grad.

Checks, on each method's first call (before timing, on the same inputs): fwd, the output;
fwd_bwd, dq, dk and dv; each against dilgen_varlen's (dilgen_loop runs the same kernels one
sequence at a time, so its rel_err, copied into the dilgen_varlen row, is the packed call's
check; dilgen_one_sequence computes another function and is not checked). rel_err =
‖a − ref‖ / ‖ref‖ over all rows (max over dq, dk, dv); bounds (bf16) 2e-2 for out and 4e-2
for gradients as in bench_forward/backward (fp32 dry run: 100x tighter). The dry run also
checks document_block_sets against create_block_mask's block sets (flex_block_mask_check).

Useful FLOPs of a sequence of length n: Σ_i Σ_segments 4·H·(len/r_i)²·D over its segments
(the last one may be short), halved when causal, x3.5 for fwd_bwd; a packed batch sums its
sequences and every method of a packing gets the same figure (dilgen_one_sequence: the count
of its one sequence). dilgen.stats.forward_flops is this count when n is a multiple of every
w; it counts a short last segment as a fraction of a full one (+2.3% on docs64, which would
flatter the packed call), so the exact count is used; the header keeps the ratio per packing.

Memory (docs64, one H200): packed q/k/v/do 5.3 GB each; the padded batch is 64 x 61,662 rows,
16 GB per tensor, so dilgen_padded drops the packed inputs once its own exist and runs
fwd_bwd in chunks (about 4); it is skipped, with the reason, if even its inputs do not fit.

Output: <out>/varlen-<date>.json: header (device, versions, spec, packings with their
lengths, targets, args); `rows`, one per (packing, causal, method, pass): `method`, `pass`
("fwd" | "fwd_bwd"), `ms` (median; ms_min, ms_max, reps), `useful_tflops`, useful_flops,
first_call_s, rel_err / check_against / check_bound / check_passed, `error` when skipped or
failed, padded_chunks / padded_rows, flex_mask_build_s; `summary`, one per (packing, causal,
pass): every method's useful_tflops, rate_vs_one_sequence, best_peer, speedup_vs_best_peer
(best of dilgen_padded, dilgen_loop, flex_document; peers_missing names any that did not
run), speedup_vs_gather_cudnn, rate_target_met, speedup_target_met, targets_met. Plus
varlen-<date>.png: useful TFLOP/s per method, per (packing, pass, mask). The file is
rewritten after every row; --append keeps the rows of today's file that a run does not redo.
Target (issue 14): varlen's useful TFLOP/s >= 0.9x one sequence of the same total length and
>= 2x the best of (a)-(c), forward and fwd+bwd. Exit status 1 if a dilgen_varlen check (or
the dry run's block-set check) fails.

GPU (each command well inside 10 minutes, by estimate; flex's compiles dominate; docs64 is
the issue's, the others are extras):

    python bench/bench_varlen.py --packings docs64 --no-causal
    python bench/bench_varlen.py --packings docs64 --causal-only --append
    python bench/bench_varlen.py --packings docs --append
    python bench/bench_varlen.py --packings slides --append

CPU (Triton's interpreter, tiny shapes: H 2, D 16, w [8, 16], r [1, 2]; packings docs64
(4 sequences) and slides; the checked first call is the one timed call; ~30 s on 2 cores):

    python bench/bench_varlen.py --dry-run-cpu --out /tmp/x
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import toolkit as tk  # noqa: E402

tk.setup_paths()

SPEC = dict(H=16, D=128, ws=[2048, 4096, 8192], rs=[1, 2, 4])          # config A's branches
DRY = dict(H=2, D=16, ws=[8, 16], rs=[1, 2])
DOCS64 = dict(count=64, lo=2048, hi=65536, seed=5)                    # issue 14's packing
DRY_DOCS64 = dict(count=4, lo=8, hi=32, seed=5)

# run order: dilgen_varlen first (the reference of every check), dilgen_padded last (it
# drops the packed inputs to make room for the padded batch)
METHODS = ("dilgen_varlen", "dilgen_one_sequence", "dilgen_loop", "gather_cudnn", "flex_document",
           "dilgen_padded")
SHOW = ("dilgen_varlen", "dilgen_one_sequence", "dilgen_padded", "dilgen_loop", "flex_document",
        "gather_cudnn")                                               # table / plot order
BLOCK_CHECK_LENGTHS = [37, 5, 64, 19, 100, 3, 0, 41]   # dry-run block-set check: odd starts, an empty one
TARGET_PEERS = ("dilgen_padded", "dilgen_loop", "flex_document")      # issue 14's (a)-(c)
TARGET_RATE, TARGET_SPEEDUP = 0.9, 2.0
PASSES = ("fwd", "fwd_bwd")
BOUND = {"fwd": 2e-2, "fwd_bwd": 4e-2}             # bf16; fp32 (dry run): BOUND / 100
COLORS = {"dilgen_varlen": "#d62728", "dilgen_one_sequence": "#ff9896", "dilgen_padded": "#9467bd",
          "dilgen_loop": "#8c564b", "flex_document": "#2ca02c", "gather_cudnn": "#1f77b4"}
NAMES = {"dilgen_varlen": "dilgen varlen", "dilgen_one_sequence": "dilgen, one sequence of the total",
         "dilgen_padded": "(a) dilgen padded", "dilgen_loop": "(b) dilgen per sequence",
         "flex_document": "(c) FlexAttention document mask", "gather_cudnn": "gather+cuDNN per sequence"}


# --------------------------------------------------------------------------- packings, FLOPs

def log_uniform_lengths(count: int, lo: int, hi: int, seed: int) -> list[int]:
    """`count` lengths log-uniform in [lo, hi] (random.Random(seed))."""
    rng = random.Random(seed)
    return [int(round(2 ** rng.uniform(math.log2(lo), math.log2(hi)))) for _ in range(count)]


def packings(dry: bool) -> dict[str, list[int]]:
    """Named lists of sequence lengths (deterministic); the first is the default one."""
    if dry:
        return {"docs64": log_uniform_lengths(**DRY_DOCS64), "docs": [5, 17, 9, 24], "slides": [30, 11]}
    rng = random.Random(0)                 # "docs" and "slides" as in the earlier benches
    docs, total = [], 0
    while total < 131072:                  # LM packing: documents of 256 .. 16K tokens
        n = min(int(2 ** rng.uniform(8, 14)), 131072 - total)
        docs.append(n)
        total += n
    slides = [rng.randint(2000, 32000) for _ in range(8)]    # whole-slide tiles, 2K .. 32K
    return {"docs64": log_uniform_lengths(**DOCS64), "docs": docs, "slides": slides}


def seq_flops(n: int, cfg: dict, causal: bool) -> float:
    """Useful forward FLOPs of one sequence of length n: its segments, the last one short."""
    f = 0.0
    for w, r in zip(cfg["ws"], cfg["rs"]):
        for a in range(0, n, w):
            f += 4 * cfg["H"] * (min(w, n - a) / r) ** 2 * cfg["D"]
    return f / 2 if causal else f


def packing_flops(lengths, cfg: dict, causal: bool, fwd_bwd: bool) -> float:
    return sum(seq_flops(n, cfg, causal) for n in lengths) * (3.5 if fwd_bwd else 1.0)


# --------------------------------------------------------------------------- FlexAttention, document mask

def document_mods(branches, causal: bool, lengths, device):
    """mask_mod / score_mod of the packed row: same sequence AND peers' dilated pattern on
    positions local to the sequence (q_idx - start of its sequence); score_mod None when
    there is one branch."""
    import torch
    import peers
    n = torch.tensor(lengths, dtype=torch.int64)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), n)
    first = (torch.cumsum(n, 0) - n).repeat_interleave(n)
    # the tables run a block past the last row: a kernel may evaluate mask_mod on the padded
    # indices of the last (partial) block before masking them, and must not read past the end
    pad = 2 * 128 - len(doc) % 128
    doc = torch.cat([doc, torch.full((pad,), -1)]).to(device=device, dtype=torch.int32)
    first = torch.cat([first, torch.zeros(pad, dtype=torch.int64)]).to(device=device, dtype=torch.int32)
    # N past every w: every branch compares segment indices (each sequence has its own)
    inner_mask, inner_score = peers._make_mods(branches, causal, max(w for w, _ in branches) + 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & inner_mask(b, h, q_idx - first[q_idx], kv_idx - first[kv_idx])

    if inner_score is None:
        return mask_mod, None

    def score_mod(score, b, h, q_idx, kv_idx):
        return inner_score(score, b, h, q_idx - first[q_idx], kv_idx - first[kv_idx])

    return mask_mod, score_mod


def document_block_sets(branches, causal: bool, lengths, block: int = 128):
    """Per query block, the key blocks that may hold a kept pair and those whose every pair
    is kept, as intervals: (lo, hi, full_lo, full_hi) int64 (nb,) on the CPU (full_lo >
    full_hi: none). Kept pairs share a segment of some branch inside one sequence; the key
    blocks of the segments that hold a query block form one interval (each contains the
    query block). A superset for every head (lanes are left to mask_mod). Full: both blocks
    complete inside one segment of an r = 1 branch (and key block < query block when causal).
    O(segments + blocks), so 1.3M rows are cheap."""
    import torch
    T = sum(lengths)
    nb = -(-T // block)
    big = nb + 1
    lo, hi = torch.full((nb,), big, dtype=torch.int64), torch.full((nb,), -1, dtype=torch.int64)
    flo, fhi = lo.clone(), hi.clone()
    s0 = 0
    for n in lengths:
        for w, r in branches:
            for a in range(0, n, w):
                sa, se = s0 + a, s0 + min(a + w, n)            # rows [sa, se)
                ba, bb = sa // block, (se - 1) // block
                lo[ba:bb + 1].clamp_(max=ba)
                hi[ba:bb + 1].clamp_(min=bb)
                ca, cb = -(-sa // block), se // block - 1       # blocks wholly inside
                if r == 1 and ca <= cb:
                    flo[ca:cb + 1].clamp_(max=ca)
                    fhi[ca:cb + 1].clamp_(min=cb)
        s0 += n
    if causal:
        qb = torch.arange(nb)
        hi = torch.minimum(hi, qb)
        fhi = torch.minimum(fhi, qb - 1)
    return lo, hi, flo, fhi


def document_block_mask(spec, lengths, device, block: int = 128):
    """(BlockMask, score_mod, info) of FlexAttention on the packed row."""
    import torch
    import peers
    from torch.nn.attention.flex_attention import BlockMask
    t0 = time.perf_counter()
    branches = peers.branches_of(spec)
    causal = bool(spec.causal)
    T = sum(lengths)
    mask_mod, score_mod = document_mods(branches, causal, lengths, device)
    lo, hi, flo, fhi = (x.to(device) for x in document_block_sets(branches, causal, lengths, block))
    kb = torch.arange(lo.numel(), device=device)[None, :]
    nonempty = (kb >= lo[:, None]) & (kb <= hi[:, None])
    full = (kb >= flo[:, None]) & (kb <= fhi[:, None]) & nonempty
    partial = nonempty & ~full
    del nonempty
    num, idx = peers._dense_to_ordered(partial[None, None])
    fnum, fidx = peers._dense_to_ordered(full[None, None])
    del partial, full
    bm = BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=(T, T))
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return bm, mask_mod, score_mod, {"build_s": time.perf_counter() - t0}


def check_document_block_sets(spec, lengths, device, block: int = 16) -> dict:
    """document_block_sets against create_block_mask (every head): ours must hold every
    non-empty block pair, and only block pairs that are full for every head may be full."""
    import torch
    import peers
    from torch.nn.attention.flex_attention import create_block_mask
    branches = peers.branches_of(spec)
    causal = bool(spec.causal)
    T = sum(lengths)
    mask_mod, _ = document_mods(branches, causal, lengths, device)
    ref = create_block_mask(mask_mod, B=None, H=int(spec.num_heads), Q_LEN=T, KV_LEN=T, device=device,
                            BLOCK_SIZE=block, _compile=False)
    ne_ref, full_ref = peers.block_sets_of(ref)                 # (H, nb, nb)
    lo, hi, flo, fhi = document_block_sets(branches, causal, lengths, block)
    kb = torch.arange(lo.numel())[None, :]
    ne = (kb >= lo[:, None]) & (kb <= hi[:, None])
    full = (kb >= flo[:, None]) & (kb <= fhi[:, None]) & ne
    missing = int((ne_ref & ~ne).sum())
    wrong_full = int((full & ~full_ref).sum())
    return {"packing_lengths": list(lengths), "causal": causal, "block": block, "blocks": lo.numel(),
            "nonempty_pairs": int(ne.sum()), "nonempty_pairs_needed_max_head": int(ne_ref.sum((1, 2)).max()),
            "missing_pairs": missing, "wrongly_full_pairs": wrong_full,
            "passed": missing == 0 and wrong_full == 0}


def flex_head_group(H: int, rs, T: int, D: int, forced: int = 0):
    """Heads per FlexAttention call: the most (a divisor of H, a multiple of every r so that
    the lanes h mod r stay those of the global heads, or H) whose (1, heads, T, D) tensor has
    fewer than 2^31 elements with T rounded up a block past; None if not even one head fits."""
    if forced:
        if H % forced or (forced != H and forced % math.lcm(*rs)):
            raise ValueError(f"--flex-head-group {forced}: must divide H = {H} and be a multiple of {list(rs)}")
        return forced
    t = (-(-T // 128) + 1) * 128
    for g in range(H, 0, -1):
        if H % g == 0 and (g == H or g % math.lcm(*rs) == 0) and g * t * D < 2 ** 31:
            return g
    return None


# --------------------------------------------------------------------------- checks

class RelErr:
    """‖a − ref‖ / ‖ref‖ accumulated over pieces (rows), in float64, in row chunks."""

    def __init__(self):
        self.num = self.den = 0.0

    def add(self, a, ref, rows: int = 1 << 15):
        a = a.detach()
        for s in range(0, ref.shape[0], rows):
            x, y = a[s:s + rows].double(), ref[s:s + rows].detach().double()
            self.num += (x - y).pow(2).sum().item()
            self.den += y.pow(2).sum().item()

    def value(self) -> float:
        return math.sqrt(self.num / self.den) if self.den > 0 else (0.0 if self.num == 0 else math.inf)


# --------------------------------------------------------------------------- the bench

class Case:
    """One (packing, causal, pass): inputs, the methods' callables, their rows."""

    def __init__(self, b: "Bench", pack: str, causal: bool, pas: str):
        import torch
        import dilgen
        self.b, self.pack, self.causal, self.pas = b, pack, causal, pas
        self.grad = pas == "fwd_bwd"
        cfg, dev = b.cfg, b.dev
        self.lengths = b.packs[pack]
        self.T, self.L = sum(self.lengths), max(self.lengths)
        self.spec = dilgen.Spec(name=f"bench_varlen_{'causal' if causal else 'full'}", num_heads=cfg["H"],
                                head_dim=cfg["D"], dtype="float32" if b.dry else "bfloat16",
                                segment_lengths=cfg["ws"], dilation_rates=cfg["rs"], causal=causal)
        self.kernel = dilgen.compile(self.spec)
        offs = [0]
        for n in self.lengths:
            offs.append(offs[-1] + n)
        self.bounds = list(zip(offs[:-1], offs[1:]))
        self.cu = torch.tensor(offs, dtype=torch.int32, device=dev)
        g = torch.Generator(device=dev).manual_seed(1)
        shape = (self.T, cfg["H"], cfg["D"])
        self.q, self.k, self.v = (torch.randn(shape, generator=g, device=dev, dtype=b.dtype) for _ in range(3))
        self.do = torch.randn(shape, generator=g, device=dev, dtype=b.dtype) if self.grad else None
        self.ref = None                # dilgen_varlen's out (fwd) or (dq, dk, dv) (fwd_bwd)
        self.flops = packing_flops(self.lengths, cfg, causal, self.grad)
        self.one_flops = packing_flops([self.T], cfg, causal, self.grad)

    # -- helpers
    def leaves(self, *ts):
        return [t.detach().requires_grad_(self.grad) for t in ts]

    def finish(self, out, ins, do, sink, a, e, take=lambda t: t, heads=None):
        """Backward when fwd_bwd (its gradients discarded: nothing accumulates); the piece
        (rows a:e of the packed row, heads `heads` or all) to `sink` for the check."""
        import torch
        if self.grad:
            res = torch.autograd.grad(out, ins, do)
        else:
            res = (out,)
        if sink is not None:
            sink(a, e, [take(t) for t in res], heads)

    # -- the methods: build() -> run(sink=None) running the method once
    def dilgen_varlen(self):
        q, k, v = self.leaves(self.q, self.k, self.v)
        do = self.do

        def run(sink=None):
            out = self.kernel(q, k, v, cu_seqlens=self.cu, max_seqlen=self.L)
            self.finish(out, (q, k, v), do, sink, 0, self.T)
        return run

    def dilgen_one_sequence(self):
        q, k, v = self.leaves(*(t.unsqueeze(0) for t in (self.q, self.k, self.v)))
        do = self.do.unsqueeze(0) if self.grad else None

        def run(sink=None):                  # another function: not checked against varlen
            out = self.kernel(q, k, v)
            self.finish(out, (q, k, v), do, None, 0, self.T)
        return run

    def _per_sequence(self, fn):
        seqs = [(a, e, *self.leaves(*(t[a:e].unsqueeze(0) for t in (self.q, self.k, self.v))),
                 self.do[a:e].unsqueeze(0) if self.grad else None) for a, e in self.bounds if e > a]

        def run(sink=None):
            for a, e, q, k, v, do in seqs:
                self.finish(fn(q, k, v), (q, k, v), do, sink, a, e, take=lambda t: t[0])
        return run

    def dilgen_loop(self):
        return self._per_sequence(lambda q, k, v: self.kernel(q, k, v))

    def gather_cudnn(self):
        import peers
        return self._per_sequence(lambda q, k, v: peers.gather_cudnn(q, k, v, self.spec)[0])

    def flex_document(self):
        import peers
        b = self.b
        if b.dev.type != "cuda" and self.grad:
            raise Skip("skipped: FlexAttention's backward needs torch.compile (GPU); the dry run "
                       "checks and times its forward only")
        if b.dev.type == "cuda" and b.elapsed() > b.args.flex_budget_s:
            raise Skip(f"skipped: time budget --flex-budget-s={b.args.flex_budget_s:.0f} spent "
                       f"({b.elapsed():.0f} s)")
        H, D = b.cfg["H"], b.cfg["D"]
        hg = flex_head_group(H, b.cfg["rs"], self.T, D, b.args.flex_head_group)
        if hg is None:
            raise Skip(f"skipped: one head of the packed row ({self.T} x {D}) is past int32 offsets")
        bm, _, score_mod, info = document_block_mask(self.spec, self.lengths, b.dev)
        self.extra.update(flex_mask_build_s=round(info["build_s"], 3), flex_head_groups=H // hg)
        fn = peers._flex_fn(b.dev)
        scale = peers.scale_of(self.spec, D)
        # flex's own layout, (1, heads, T, D) contiguous, one tensor per head group (made
        # before timing); fewer than 2^31 elements each: its Triton kernels index in int32
        # (pytorch/pytorch#190857: illegal memory access past INT32_MAX in the backward)
        def group(t, h0):
            return t[:, h0:h0 + hg].permute(1, 0, 2).unsqueeze(0).contiguous()
        groups = [(slice(h0, h0 + hg), *self.leaves(group(self.q, h0), group(self.k, h0), group(self.v, h0)),
                   group(self.do, h0) if self.grad else None) for h0 in range(0, H, hg)]
        take = lambda t: t[0].transpose(0, 1)                      # (1, hg, T, D) -> (T, hg, D)

        def run(sink=None):
            for heads, q, k, v, do in groups:
                out = fn(q, k, v, score_mod=score_mod, block_mask=bm, scale=scale)
                self.finish(out, (q, k, v), do, sink, 0, self.T, take=take, heads=heads)
        return run

    def dilgen_padded(self):
        """Right-padded to the longest: (B, N_max, H, D) chunks of whole items (separate
        leaves), each kernel.padded(q, k, v, key_padding_mask). Drops the packed inputs."""
        import torch
        b, cfg = self.b, self.b.cfg
        B, L = len(self.lengths), self.L
        item = L * cfg["H"] * cfg["D"] * self.q.element_size()      # bytes of one padded item
        n_in = 4 if self.grad else 3                                # q, k, v (, do)
        per_item = (10 if self.grad else 1) * item                 # out (+ fp32 and bf16 grads)
        chunks = b.args.padded_chunks or 1
        if b.dev.type == "cuda":
            free = (torch.cuda.mem_get_info(b.dev)[0] + torch.cuda.memory_reserved(b.dev)
                    - torch.cuda.memory_allocated(b.dev))
            if n_in * B * item > 0.9 * free:
                raise Skip(f"skipped: out of memory: the padded inputs ({B} x {L} rows) need "
                           f"{n_in * B * item / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")
            free += self._packed_bytes()                            # dropped once the padded inputs exist
            budget = 0.85 * free - n_in * B * item
            if not b.args.padded_chunks:
                chunks = next((c for c in (1, 2, 4, 8, 16, 32, 64) if per_item * -(-B // c) <= budget), None)
            if chunks is None:
                raise Skip(f"skipped: out of memory: the padded batch ({B} x {L} rows) needs "
                           f"{(n_in * B * item + per_item) / 2**30:.1f} GiB at least, "
                           f"{free / 2**30:.1f} GiB free")
        per = -(-B // chunks)
        groups = [list(range(i, min(i + per, B))) for i in range(0, B, per)]
        pieces = []
        for items in groups:
            def pad(t, items=items):
                x = t.new_zeros((len(items), L) + tuple(t.shape[1:]))
                for j, i in enumerate(items):
                    a, e = self.bounds[i]
                    x[j, :e - a] = t[a:e]
                return x
            mask = torch.ones((len(items), L), dtype=torch.bool, device=b.dev)
            for j, i in enumerate(items):
                mask[j, :self.lengths[i]] = False                    # True = padding
            q, k, v = self.leaves(pad(self.q), pad(self.k), pad(self.v))
            pieces.append((items, q, k, v, mask, pad(self.do) if self.grad else None))
        self.q = self.k = self.v = self.do = None                   # the packed inputs go
        tk.cleanup(b.dev)
        self.extra.update(padded_chunks=len(groups), padded_rows=B * L)

        def run(sink=None):
            for items, q, k, v, mask, do in pieces:
                out = self.kernel.padded(q, k, v, mask)
                if self.grad:
                    res = torch.autograd.grad(out, (q, k, v), do)
                else:
                    res = (out,)
                if sink is not None:
                    for j, i in enumerate(items):
                        a, e = self.bounds[i]
                        sink(a, e, [t[j, :e - a] for t in res], None)
                del out, res
        return run

    def _packed_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.k, self.v, self.do) if t is not None)

    # -- one method: build, check on the first call, time
    def measure(self, m: str) -> dict:
        b = self.b
        row = {"packing": self.pack, "causal": self.causal, "method": m, "pass": self.pas, "ms": None,
               "useful_tflops": None, "sequences": len(self.lengths), "tokens": self.T, "longest": self.L}
        self.extra = {}
        flops = self.one_flops if m == "dilgen_one_sequence" else self.flops
        row["useful_flops"] = flops
        run = None
        try:
            run = getattr(self, m)()
            against = None if m == "dilgen_one_sequence" else "dilgen_varlen"
            if m == "dilgen_varlen":
                pieces = []
                t0 = time.perf_counter()
                run(lambda a, e, ts, heads: pieces.append([t.detach() for t in ts]))
                tk._sync(b.dev)
                self.ref = pieces[0]
                against = None                     # filled in by dilgen_loop's check
            elif against is not None and self.ref is not None:
                errs = None

                def sink(a, e, ts, heads):
                    nonlocal errs
                    errs = errs or [RelErr() for _ in ts]
                    for err, t, r in zip(errs, ts, self.ref):
                        err.add(t, r[a:e] if heads is None else r[a:e, heads])
                t0 = time.perf_counter()
                run(sink)
                tk._sync(b.dev)
                row["rel_err"] = max(e.value() for e in errs) if errs else None
                bound = BOUND[self.pas] / (100 if b.dry else 1)
                row["check_against"], row["check_bound"] = against, bound
                row["check_passed"] = row["rel_err"] is not None and row["rel_err"] < bound
            else:
                t0 = time.perf_counter()
                run()
                tk._sync(b.dev)
            first = time.perf_counter() - t0
            row["first_call_s"] = round(first, 3)
            if b.warmup == 0:              # the checked first call is the one timed call (dry run)
                t = {"median": first * 1e3, "min": first * 1e3, "max": first * 1e3, "n": 1}
            else:
                t = tk.time_ms(run, warmup=b.warmup - 1, reps=b.reps, device=b.dev)
            row.update(ms=round(t["median"], 4), useful_tflops=round(flops / t["median"] / 1e9, 9 if b.dry else 1),
                       ms_min=round(t["min"], 4), ms_max=round(t["max"], 4), reps=t["n"])
        except Skip as e:
            row["error"] = str(e)
        except Exception as e:  # noqa: BLE001 - recorded in the row; the next method runs
            oom = "out of memory" in str(e).lower()
            row["error"] = ("out of memory: " if oom else "") + tk.short_err(e)
        row.update(self.extra)
        del run
        tk.cleanup(b.dev)
        return row


class Skip(Exception):
    pass


class Bench:
    def __init__(self, args):
        import torch
        self.args, self.dry = args, args.dry_run_cpu
        self.dev = torch.device("cpu" if self.dry else "cuda")
        self.cfg = DRY if self.dry else SPEC
        self.dtype = torch.float32 if self.dry else torch.bfloat16
        self.reps = 1 if self.dry and args.reps is None else (args.reps or 10)
        self.warmup = 0 if self.dry and args.warmup is None else (3 if args.warmup is None else args.warmup)
        self.packs = packings(self.dry)
        default = "docs64,slides" if self.dry else ",".join(self.packs)      # the dry run: quick
        names = [p.strip() for p in (args.packings or default).split(",") if p.strip()]
        bad = [p for p in names if p not in self.packs]
        if bad:
            raise SystemExit(f"unknown packing(s) {bad}; choose from {','.join(self.packs)}")
        self.names = names
        methods = [m.strip() for m in (args.methods or ",".join(METHODS)).split(",") if m.strip()]
        bad = [m for m in methods if m not in METHODS]
        if bad:
            raise SystemExit(f"unknown method(s) {bad}; choose from {','.join(METHODS)}")
        self.methods = [m for m in METHODS if m in methods or m == "dilgen_varlen"]   # varlen: the reference
        self.causals = tk.causal_flags(args.no_causal, args.causal_only)
        self.passes = ("fwd",) if args.no_bwd else PASSES
        self.t0 = time.time()
        from dilgen.stats import forward_flops
        pk = {}
        for name, lengths in self.packs.items():
            c = self.cfg
            formula = sum(forward_flops(c["ws"], c["rs"], c["H"], c["D"], False, n) for n in lengths)
            pk[name] = {"sequences": len(lengths), "total": sum(lengths), "longest": max(lengths),
                        "shortest": min(lengths), "lengths": lengths,
                        "stats_formula_over_exact_flops": round(formula / packing_flops(lengths, c, False, False), 4)}
        pk["docs64"]["drawn"] = dict(DRY_DOCS64 if self.dry else DOCS64, rng="random.Random(seed), "
                                     "round(2 ** uniform(log2 lo, log2 hi))")
        head = tk.header(self.dev, self.dry, {
            "spec": self.cfg, "dtype": str(self.dtype).replace("torch.", ""), "packings": pk,
            "targets": {"rate_vs_one_sequence": TARGET_RATE, "speedup_vs_best_peer": TARGET_SPEEDUP,
                        "peers": list(TARGET_PEERS)},
            "useful_flops": "exact: sum over sequences and segments of 4*H*(len/r)^2*D, /2 causal, x3.5 fwd_bwd",
            "args": {k: v for k, v in vars(args).items()}, "summary": []})
        self.res = tk.Results(tk.result_path(args.out, "varlen", self.dry), head,
                              key=("packing", "causal", "method", "pass"), append=args.append, lists=())
        self.res.data["summary"] = summarize(self.res.all_rows())
        self.block_checks = []
        self.failed = False

    def elapsed(self) -> float:
        return time.time() - self.t0

    def run(self):
        todo = [(p, c, s) for p in self.names for c in self.causals for s in self.passes]
        prog = tk.Progress(len(todo) * len(self.methods), "varlen")
        if self.dry and "flex_document" in self.methods:        # the document BlockMask's block sets
            import dilgen
            sets = {p: self.packs[p] for p in self.names}
            sets["mixed"] = BLOCK_CHECK_LENGTHS
            for c in self.causals:
                s = dilgen.Spec(name="bench_varlen_blocks", num_heads=self.cfg["H"], head_dim=self.cfg["D"],
                                dtype="float32", segment_lengths=self.cfg["ws"], dilation_rates=self.cfg["rs"],
                                causal=c)
                for p, lengths in sets.items():
                    for block in (4, 8, 16):
                        rec = dict(packing=p, **check_document_block_sets(s, lengths, self.dev, block))
                        self.block_checks.append(rec)
                        if not rec["passed"]:
                            prog.write(f"!! flex document block sets {p} causal={c} block {block}: "
                                       f"{rec['missing_pairs']} missing, {rec['wrongly_full_pairs']} wrongly full")
            ok = sum(r["passed"] for r in self.block_checks)
            prog.write(f"flex document block sets against create_block_mask: {ok}/{len(self.block_checks)} ok")
            self.res.data["flex_block_mask_check"] = self.block_checks
        for pack, causal, pas in todo:
            case = Case(self, pack, causal, pas)
            rows = {}
            for m in self.methods:
                row = case.measure(m)
                rows[m] = row
                if m == "dilgen_loop" and "rel_err" in row:         # the packed call's check
                    v = rows["dilgen_varlen"]
                    v.update(rel_err=row["rel_err"], check_against="dilgen_loop", check_bound=row["check_bound"],
                             check_passed=row["check_passed"])
                    self.failed |= not row["check_passed"]
                self.res.add(row)
                self.res.data["summary"] = summarize(self.res.all_rows())
                self.res.save()
                note = f"  [{row['error']}]" if row.get("error") else ""
                chk = f", err {row['rel_err']:.1e}" if row.get("rel_err") is not None else ""
                prog.step(f"{pack} {'causal' if causal else 'full'} {pas} {m}: "
                          f"{tk.fmt(row['ms'], '.3f')} ms{chk}{note}")
            if rows["dilgen_varlen"].get("error"):
                self.failed = True
            del case
            tk.cleanup(self.dev)
        prog.close()
        if any(not r["passed"] for r in self.block_checks):
            self.failed = True

    def report(self):
        rows = [r for r in self.res.all_rows() if r.get("method")]
        order = {m: i for i, m in enumerate(SHOW)}
        packs = {p: i for i, p in enumerate(self.packs)}
        rows.sort(key=lambda r: (packs.get(r["packing"], 99), r["causal"], r["pass"], order.get(r["method"], 99)))
        spec = ".3g" if self.dry else ".1f"
        print(tk.markdown_table(
            ["packing", "mask", "pass", "method", "ms", "useful TFLOP/s", "rel err", "check", "note"],
            [[r["packing"], "causal" if r["causal"] else "full", r["pass"], r["method"], tk.fmt(r.get("ms"), ".3f"),
              tk.fmt(r.get("useful_tflops"), spec),
              tk.fmt(r.get("rel_err"), ".1e"),
              {True: "ok", False: "FAIL", None: None}[r.get("check_passed")],
              (r.get("error") or "")[:60] or None] for r in rows]))
        summ = self.res.data["summary"]
        print()
        print(tk.markdown_table(
            ["packing", "mask", "pass", "varlen TFLOP/s", "one-sequence TFLOP/s", f"rate (>= {TARGET_RATE})",
             "best peer", f"speedup (>= {TARGET_SPEEDUP})", "vs gather+cuDNN", "targets met"],
            [[s["packing"], "causal" if s["causal"] else "full", s["pass"], tk.fmt(s["dilgen_varlen_tflops"], spec),
              tk.fmt(s["dilgen_one_sequence_tflops"], spec), tk.fmt(s["rate_vs_one_sequence"]),
              s["best_peer"], tk.fmt(s["speedup_vs_best_peer"]), tk.fmt(s["speedup_vs_gather_cudnn"]),
              {True: "yes", False: "no", None: "—"}[s["targets_met"]]
              + ("" if s["peers_complete"] else " (peers missing)")] for s in summ]))
        bad = [r for r in rows if r.get("check_passed") is False]
        bad += [r for r in self.block_checks if not r["passed"]]
        for r in bad:
            tk.log(f"!! check failed: {r}")
        d = self.res.data
        plot_rows = [dict({"config": f"{s['packing']} {s['pass']}", "causal": s["causal"]},
                          **{f"{m}_tflops": s.get(f"{m}_tflops") for m in SHOW}) for s in summ]
        title = (f"packed batches, config A's branches — {d['device']}\ntorch {d['torch']}, {d['date']}; "
                 f"target: varlen >= {TARGET_RATE}x one sequence, >= {TARGET_SPEEDUP}x the best of (a)-(c)")
        for m, color in COLORS.items():                 # labels and colours of this bench's methods
            tk.NAMES.setdefault(m, NAMES[m])
            tk.COLORS.setdefault(m, color)
        tk.plot_bars(plot_rows, list(SHOW), tk.result_path(self.args.out, "varlen", self.dry, ext="png"),
                     "useful TFLOP/s (higher is better)", title, field="{m}_tflops", log_scale=False)


def summarize(rows) -> list:
    """One entry per (packing, causal, pass): the rates and whether issue 14's targets are met."""
    groups: dict = {}
    for r in rows:
        if r.get("method"):
            groups.setdefault((r["packing"], r["causal"], r["pass"]), {})[r["method"]] = r
    out = []
    for (pack, causal, pas), by in groups.items():
        tf = {m: (by.get(m) or {}).get("useful_tflops") for m in SHOW}
        s = {"packing": pack, "causal": causal, "pass": pas, **{f"{m}_tflops": tf[m] for m in SHOW}}
        v, one = tf["dilgen_varlen"], tf["dilgen_one_sequence"]
        s["rate_vs_one_sequence"] = round(v / one, 3) if v and one else None
        peers = {m: tf[m] for m in TARGET_PEERS if tf[m]}
        s["peers_missing"] = {m: (by.get(m) or {}).get("error") or "not run" for m in TARGET_PEERS if not tf[m]}
        s["peers_complete"] = not s["peers_missing"]
        best = max(peers, key=peers.get) if peers else None
        s["best_peer"] = best
        s["speedup_vs_best_peer"] = round(v / peers[best], 3) if v and best else None
        s["speedup_vs_gather_cudnn"] = round(v / tf["gather_cudnn"], 3) if v and tf["gather_cudnn"] else None
        s["rate_target_met"] = None if s["rate_vs_one_sequence"] is None else s["rate_vs_one_sequence"] >= TARGET_RATE
        s["speedup_target_met"] = (None if s["speedup_vs_best_peer"] is None
                                   else s["speedup_vs_best_peer"] >= TARGET_SPEEDUP)
        s["targets_met"] = (None if None in (s["rate_target_met"], s["speedup_target_met"])
                            else s["rate_target_met"] and s["speedup_target_met"])
        s["checks_passed"] = all(r.get("check_passed") is not False for r in by.values())
        out.append(s)
    order = {p: i for i, p in enumerate(("docs64", "docs", "slides"))}
    out.sort(key=lambda s: (order.get(s["packing"], 99), s["packing"], s["causal"], PASSES.index(s["pass"])))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(tk.RESULTS))
    ap.add_argument("--packings", default=None, help="comma list of docs64,docs,slides (default: all)")
    ap.add_argument("--methods", default=None, help=f"comma list of {','.join(METHODS)} "
                    "(default: all; dilgen_varlen always runs)")
    ap.add_argument("--no-causal", action="store_true", help="only the non-causal variants")
    ap.add_argument("--causal-only", action="store_true", help="only the causal variants")
    ap.add_argument("--no-bwd", action="store_true", help="forward only")
    ap.add_argument("--reps", type=int, default=None, help="timed calls, median taken (default 10; dry 1)")
    ap.add_argument("--warmup", type=int, default=None, help="calls before timing, the checked first "
                    "call included (default 3); 0: the checked first call is the only timed one (dry default)")
    ap.add_argument("--flex-budget-s", type=float, default=480.0,
                    help="skip flex_document rows once the run has taken this many seconds")
    ap.add_argument("--flex-head-group", type=int, default=0,
                    help="heads per FlexAttention call (0: as many as int32 offsets allow)")
    ap.add_argument("--padded-chunks", type=int, default=0,
                    help="run dilgen_padded in this many chunks of whole items (0: as few as fit)")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows of today's file that this run does not redo")
    ap.add_argument("--dry-run-cpu", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    import torch
    if not args.dry_run_cpu and not torch.cuda.is_available():
        tk.log("no GPU: use --dry-run-cpu")
        return 2
    b = Bench(args)
    d = b.res.data
    tk.log(f"device {d['device']}  torch {d['torch']}  triton {d['triton']}  packings {b.names}  "
           f"methods {b.methods}  json {b.res.path}")
    for p in b.names:
        i = d["packings"][p]
        tk.log(f"  {p}: {i['sequences']} sequences, {i['total']} rows, {i['shortest']} .. {i['longest']}")
    b.run()
    b.res.save()
    b.report()
    tk.log(f"wrote {b.res.save()}  ({b.elapsed():.0f} s)")
    return 1 if b.failed else 0


if __name__ == "__main__":
    sys.exit(main())
