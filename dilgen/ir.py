"""IR values: index maps, branches, query classes, tiles, the ring IR, the plan.

Everything here is frozen data with a stable `.key()`. Affine index maps are sympy
expressions, simplified once by the planner and printed as Triton arithmetic by
`print_expr`; non-affine maps (the Hilbert curve) are permutation tables.

Symbols used by the maps (they are also the names in the generated kernel):
  h  query head                     d  query class delta, c = (h + d) mod L
  c  query residue class mod L       m  query row inside the class lattice
  s  segment index of a branch       j  key lane inside a segment (0, 1, 2, ...)
  o  per-head offset h mod r         u  virtual position (raster, or curve order)
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

import sympy
from sympy.printing.str import StrPrinter

SYM = {name: sympy.Symbol(name, integer=True, nonnegative=True)
       for name in ("h", "d", "c", "m", "s", "j", "o", "u", "N")}


class TritonPrinter(StrPrinter):
    """Prints integer sympy expressions as Triton/Python arithmetic (// and %)."""

    def _print_floor(self, expr: sympy.Expr) -> str:
        num, den = sympy.fraction(sympy.together(expr.args[0]))
        if den == 1:
            return self._print(num)
        return f"(({self._print(num)}) // {self._print(den)})"

    def _print_Mod(self, expr: sympy.Mod) -> str:
        a, b = expr.args
        return f"(({self._print(a)}) % {self._print(b)})"

    def _print_Min(self, expr: sympy.Min) -> str:
        a, *rest = expr.args
        out = self._print(a)
        for b in rest:
            out = f"tl.minimum({out}, {self._print(b)})"
        return out

    def _print_Max(self, expr: sympy.Max) -> str:
        a, *rest = expr.args
        out = self._print(a)
        for b in rest:
            out = f"tl.maximum({out}, {self._print(b)})"
        return out


def print_expr(expr: sympy.Expr) -> str:
    return TritonPrinter().doprint(expr)


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _sha(obj: Any) -> str:
    return hashlib.sha256(_canonical(obj).encode()).hexdigest()


@dataclass(frozen=True)
class AffineMap:
    """An integer index map given by a simplified sympy expression."""
    expr: sympy.Expr

    @property
    def text(self) -> str:
        return print_expr(self.expr)

    def to_json(self) -> dict:
        return {"kind": "affine", "expr": self.text}


@dataclass(frozen=True)
class TableMap:
    """A permutation table: virtual position (curve order) → raster position.

    scope "segment": every segment of length `period` is laid out on a rows x cols grid
    and walked along the gilbert curve; a short last segment keeps the curve order of
    the positions that exist. scope "sequence": the whole sequence is one rows x cols
    image (period = rows * cols = N). The values are materialised for a given N by the
    runtime (dilgen.runtime.tables) from this description."""
    name: str
    scope: str
    rows: int
    cols: int

    @property
    def period(self) -> int:
        return self.rows * self.cols

    def to_json(self) -> dict:
        return {"kind": "table", "name": self.name, "scope": self.scope,
                "grid": [self.rows, self.cols], "curve": "gilbert2d"}


@dataclass(frozen=True)
class BranchIR:
    """One branch (w, r) of LongNet Eq. 10, lowered to index maps.

    key_map:     u_k = s*w + o + r*j, the virtual position of key lane j of segment s
    keep_map:    the lane offset of a query, compared with o (row membership), or None
                 when membership is decided per query class (d mod r == 0)
    order:       None when the branch reads positions in the query order, else the
                 table that maps its virtual positions to raster positions
    single_segment: every query tile lies inside one segment of this branch
    lanes:       the branch runs in its own launch whose query tiles walk its kept lanes
                 u = s*w + o + r*m of one segment (full tiles, no row membership), merging
                 into the running (out, lse) of the launches before it (LongNet Eq. 10)
    head_offset: the offset o of head h as a map of h (head_offsets "block": floor(h / ceil(H/r)),
                 printed into the lane and per-branch dkdv kernels), or None for o = h mod r
    zero_pad:    short_segments "zero_pad" (non-causal): the kernels that finish a query's
                 softmax for this branch add its segment's zero keys (score 0, value 0)
    curve_rows:  a lane branch with a curve table whose inner loops read compact copies of
                 the rows it keeps, in curve order (<name>_curve_rows makes them once per
                 call): kept lane j of segment s is row s*LW + j, LW = ceil(min(w, N) / r),
                 so the loops walk contiguous tiles and touch the table only for causal masks
    fused_dkdv:  the plan's `tl` fused dK/dV launch takes this branch (membership by query
                 class and r | L: its key class c keeps the keys of head h iff r | c - h);
                 the per-branch dK/dV runs the others after it (runtime.grids.dkdv_per_branch)
    """
    index: int
    segment_length: int
    dilation: int
    key_map: AffineMap
    keep_map: AffineMap | None
    order: TableMap | None
    single_segment: bool
    keys_per_query: int
    lanes: bool = False
    head_offset: AffineMap | None = None
    zero_pad: bool = False
    curve_rows: bool = False
    fused_dkdv: bool = False

    def __post_init__(self) -> None:
        if self.fused_dkdv and self.keep_map is not None:
            raise ValueError(f"branch {self.index}: the fused dK/dV takes branches of class membership only")

    def to_json(self) -> dict:
        return {
            "index": self.index, "w": self.segment_length, "r": self.dilation,
            "key_map": self.key_map.to_json(),
            "membership": "class" if self.keep_map is None else "row",
            "keep_map": None if self.keep_map is None else self.keep_map.to_json(),
            "order": None if self.order is None else self.order.to_json(),
            "single_segment": self.single_segment,
            "keys_per_query": self.keys_per_query,
            "lanes": self.lanes,
            # only when set: plans of SPEC's default layout are unchanged
            **({} if self.head_offset is None else {"head_offset": self.head_offset.to_json()}),
            **({"zero_pad": True} if self.zero_pad else {}),
            **({"curve_rows": True} if self.curve_rows else {}),
            **({"fused_dkdv": True} if self.fused_dkdv else {}),
        }


@dataclass(frozen=True)
class QueryTiling:
    """Queries are tiled along residue lattices u = c + L*m of the query order.

    With L > 1 every query of class c = (h + d) mod L is kept by exactly the branches
    whose r divides d (LongNet Eq. 13-15 with offset h mod r), so a tile needs no row
    mask; class_order lists the d values longest work first (the launch order)."""
    lattice: int
    class_order: tuple[int, ...]
    class_work: tuple[int, ...]
    block_m: int
    query_map: AffineMap
    order: TableMap | None

    def to_json(self) -> dict:
        return {"lattice": self.lattice, "class_order": list(self.class_order),
                "class_work": list(self.class_work), "block_m": self.block_m,
                "query_map": self.query_map.to_json(),
                "order": None if self.order is None else self.order.to_json()}


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters the planner picked for one target."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dot_precision: str | None      # "ieee" for exact fp32 dots, None for the dtype's default
    # backward tiles: dkdv (keys per program, queries per step, warps, stages) and
    # dq (query rows, keys per step, warps, stages); dq rows divide block_m
    bwd_kv: tuple[int, int, int, int] = (16, 16, 1, 1)
    bwd_dq: tuple[int, int, int, int] = (16, 16, 1, 1)
    # lane kernels (branch-major launches): forward (rows, keys, warps, stages) and dq
    lane_fwd: tuple[int, int, int, int] = (16, 16, 1, 1)
    lane_dq: tuple[int, int, int, int] = (16, 16, 1, 1)
    # lane kernels of raster branches read k, v through tensor descriptors (TMA on sm90:
    # the kept lanes of a segment are a 2-D box with row stride r*H_kv*D), with the key
    # loop warp-specialized (producer / consumer warps) when lane_ws is set
    lane_tma: bool = False
    lane_ws: bool = False
    # the dq lane kernel reads k, v through tensor descriptors too (warp-specialized with
    # lane_ws)
    lane_dq_tma: bool = False
    # packed batches (VARLEN) launch the lane kernels, forward and dq, on (B*H * lane tiles,
    # segments), tiles fastest, instead of (B*H, lane tiles, segments): the programs in flight
    # then share one segment's keys in L2 however many sequences there are
    # (templates/common.jinja lane_program); targets.Target.lane_tiles_fastest
    lane_tiles_fastest: bool = False
    # the fused forward kernel reads each raster branch's kept key lanes of a segment
    # through tensor descriptors (the same 2-D box as the lane kernels), its full-block key
    # loops warp-specialized when fused_ws is set; fold_scale: scores stay unscaled and
    # the softmax scale enters the exp2 argument as one fused multiply-add
    fused_tma: bool = False
    fused_ws: bool = False
    fold_scale: bool = False
    # the fused forward runs its tile as two chains of block_m / 2 rows against the same key
    # blocks, so that one chain's dots overlap the other's softmax (single device, non-causal,
    # raster class branches whose tiles nest in segments; planner.plan decides)
    dual_chain: bool = False
    # the backward's raster branches read through tensor descriptors too: the dq kernel its
    # key lanes, the dK/dV kernels (fused and per branch) their query and dO lanes
    bwd_tma: bool = False
    # the lattice kernels (fused forward, dq, fused dK/dV) take their tiles in groups, class by
    # class within a group (common.lattice_program): runtime.lattice_group_tiles sizes a group
    # to l2_bytes (0: one group, class-major); lattice_group > 0 fixes the tiles per group
    l2_bytes: int = 0
    lattice_group: int = 0
    # incremental decoding (templates/decode.py.jinja): keys per step of the split kernel,
    # the largest split (kept keys per program; the runtime may halve it down to the block
    # to fill the GPU at small batch), warps, stages
    decode: tuple[int, int, int, int] = (16, 32, 1, 1)
    # sm90: the forward's lattice branches run as the Gluon kernel of templates/gluon_fwd.py.jinja
    # (a producer warp, two consumer warpgroups of 64 rows), keys per block and K/V stages
    gluon_fwd: tuple[int, int] | None = None
    # sm90: the fused dK/dV as the Gluon kernel of templates/gluon_bwd.py.jinja (a producer
    # warp, two consumer warpgroups of 64 keys), its Q/dO stages
    gluon_dkdv: int | None = None
    # sm90: the dq kernel's lattice branches as the Gluon kernel of templates/gluon_dq.py.jinja
    # (the Gluon forward's shape), its K/V stages
    gluon_dq: int | None = None
    # sm90: the causal lane branches as the Gluon kernel of templates/gluon_lanes.py.jinja
    # (the Gluon forward's shape, one branch a launch), keys per block and K/V stages
    gluon_lanes: tuple[int, int] | None = None
    # with gluon_lanes: the Gluon lanes run a Hilbert plan's curve lanes, whose keys they read
    # from the compact curve copies (BranchIR.curve_rows), whose query rows they gather and
    # scatter through the curve table, and whose causal key blocks follow the curve's lists
    gluon_curve_lanes: bool = False
    # with gluon_curve_lanes: a second Gluon lane kernel, built for raster rows, runs the plan's
    # lane branches that read no curve table (an r = 1 branch: a permutation inside a segment
    # leaves its keys alone), which the curve kernel cannot take
    gluon_raster_lanes: bool = False
    # with gluon_lanes: its launches go with programmatic dependent launch (common.gdc), so a
    # launch's programs start while the one before it drains its last wave
    gluon_pdl: bool = False
    # sm90: a causal spec's per-branch dK/dV and lane dq as the Gluon kernels of
    # templates/gluon_lanes_bwd.py.jinja (the Gluon dK/dV's and dQ's shapes), their stages
    gluon_lanes_bwd: int | None = None
    # with gluon_lanes_bwd: the per-branch dK/dV in Gluon too (else only the lane dq)
    gluon_dkdv_lanes: bool = False
    # the Gluon per-branch dK/dV adds each block's dQ share into a float32 buffer by
    # reductions, so the backward runs no dq kernel (and a dropout plan draws its coins once)
    gluon_dkdv_dq: bool = False
    # the Gluon forward's and lanes' softmax: one exponential in every gluon_exp2 as a cubic
    # on the FMA pipe instead of the MUFU unit (0: every one on the MUFU unit)
    gluon_exp2: int = 0
    # attention dropout's `tl` dK/dV and the Gluon per-branch dK/dV: each step's block with
    # queries along rows (P = Q K^T, the coins in the MMA's column order as in the forward;
    # P^T and dS^T go through shared memory into the dV and dK products) instead of keys along
    # rows (whose coins are shuffled); the Gluon dropout plan's and gluon_dkdv_dq's always are
    dkdv_rows_first: bool = False
    # the Gluon dK/dV loads the next block's lse and Delta while this block's products run
    # (two copies in registers); False: each block's at its top
    gluon_dkdv_prefetch: bool = True

    def __post_init__(self) -> None:
        for name in ("bwd_kv", "bwd_dq", "lane_fwd", "lane_dq", "decode"):
            value = getattr(self, name)
            if len(value) != 4 or not all(isinstance(x, int) and x > 0 for x in value):
                raise ValueError(f"KernelConfig.{name} = {value!r}: four positive ints")
        block, split = self.decode[:2]
        if block < 16 or block & (block - 1) or split % block:
            raise ValueError(f"KernelConfig.decode = {self.decode!r}: the block must be a power "
                             f"of two >= 16 and divide the split")
        for name in ("gluon_fwd", "gluon_lanes"):
            value = getattr(self, name)
            if value is not None and (len(value) != 2 or value[0] not in (64, 128) or not 2 <= value[1] <= 8):
                raise ValueError(f"KernelConfig.{name} = {value!r}: (keys per block 64 or 128, stages 2 to 8)")
        if self.gluon_dkdv is not None and not (isinstance(self.gluon_dkdv, int) and 2 <= self.gluon_dkdv <= 8):
            raise ValueError(f"KernelConfig.gluon_dkdv = {self.gluon_dkdv!r}: stages 2 to 8")
        for name in ("gluon_dq", "gluon_lanes_bwd"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 2 <= value <= 8):
                raise ValueError(f"KernelConfig.{name} = {value!r}: stages 2 to 8")
        if self.gluon_curve_lanes and not self.gluon_lanes:
            raise ValueError("KernelConfig.gluon_curve_lanes needs gluon_lanes (its curve lanes are that kernel's)")
        if self.gluon_raster_lanes and not self.gluon_curve_lanes:
            raise ValueError("KernelConfig.gluon_raster_lanes needs gluon_curve_lanes (it runs beside that kernel)")
        if self.gluon_pdl and not self.gluon_lanes:
            raise ValueError("KernelConfig.gluon_pdl needs gluon_lanes (it is how their launches go)")
        if self.gluon_dkdv_dq and not self.gluon_dkdv_lanes:
            raise ValueError("KernelConfig.gluon_dkdv_dq needs gluon_dkdv_lanes (its dQ is that kernel's)")
        if self.gluon_exp2 not in (0, 2, 4, 8):
            raise ValueError(f"KernelConfig.gluon_exp2 = {self.gluon_exp2!r}: 0, 2, 4 or 8")
        if self.block_m % self.bwd_dq[0]:
            raise ValueError(f"KernelConfig: dq rows {self.bwd_dq[0]} must divide block_m "
                             f"{self.block_m} (a dq tile must nest in the forward's tiles)")

    def to_json(self) -> dict:
        return {"block_m": self.block_m, "block_n": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "dot_precision": self.dot_precision,
                "bwd_kv": list(self.bwd_kv), "bwd_dq": list(self.bwd_dq),
                "lane_fwd": list(self.lane_fwd), "lane_dq": list(self.lane_dq),
                "lane_tma": self.lane_tma, "lane_ws": self.lane_ws,
                **({"lane_dq_tma": True} if self.lane_dq_tma else {}),
                **({"lane_tiles_fastest": True} if self.lane_tiles_fastest else {}),
                **({"fused_tma": True} if self.fused_tma else {}),
                **({"fused_ws": True} if self.fused_ws else {}),
                **({"fold_scale": True} if self.fold_scale else {}),
                **({"dual_chain": True} if self.dual_chain else {}),
                **({"bwd_tma": True} if self.bwd_tma else {}),
                **({"l2_bytes": self.l2_bytes} if self.l2_bytes else {}),
                **({"lattice_group": self.lattice_group} if self.lattice_group else {}),
                **({"gluon_fwd": list(self.gluon_fwd)} if self.gluon_fwd else {}),
                **({"gluon_dkdv": self.gluon_dkdv} if self.gluon_dkdv else {}),
                **({"gluon_dq": self.gluon_dq} if self.gluon_dq else {}),
                **({"gluon_lanes": list(self.gluon_lanes)} if self.gluon_lanes else {}),
                **({"gluon_curve_lanes": True} if self.gluon_curve_lanes else {}),
                **({"gluon_raster_lanes": True} if self.gluon_raster_lanes else {}),
                **({"gluon_pdl": True} if self.gluon_pdl else {}),
                **({"gluon_lanes_bwd": self.gluon_lanes_bwd} if self.gluon_lanes_bwd else {}),
                **({"gluon_dkdv_lanes": True} if self.gluon_dkdv_lanes else {}),
                **({"gluon_dkdv_dq": True} if self.gluon_dkdv_dq else {}),
                **({"gluon_exp2": self.gluon_exp2} if self.gluon_exp2 else {}),
                **({"dkdv_rows_first": True} if self.dkdv_rows_first else {}),
                **({} if self.gluon_dkdv_prefetch else {"gluon_dkdv_prefetch": False}),
                "decode": list(self.decode)}


@dataclass(frozen=True)
class RingBranch:
    """What the ring schedule needs of one branch: its segments and whether its kept
    rows are a residue class (raster order, r | w), which lets a sender compact them."""
    index: int
    segment_length: int
    dilation: int
    raster: bool

    def to_json(self) -> dict:
        return {"index": self.index, "w": self.segment_length, "r": self.dilation,
                "raster": self.raster}


@dataclass(frozen=True)
class RingIR:
    """The ring (SPEC §2 "Ring"): P ranks, rank j holding the rows of its chunk(s).

    The schedule depends on N, known at call time, so the IR holds the rule and
    `ring_schedule(ring_json, n, ...)` below instantiates it: the same pure function
    runs in `dilgen explain` and in the runtime, on every rank, with the same answer.
    The transport cost model's rates are the machine's (dilgen.calibration), not the IR's."""
    ring_size: int
    causal: bool = False
    branches: tuple[RingBranch, ...] = ()
    one_kv_head_per_query_head: bool = True
    # Hilbert scope "sequence": the rows the ranks hold are runs of the curve over a
    # rows x cols image (dilgen.runtime.ring.shard orders them), and the schedule works
    # on curve positions
    curve: tuple[int, int] | None = None

    def to_json(self) -> dict:
        if self.ring_size == 1:
            return {"ring_size": 1, "steps": []}
        return {"ring_size": self.ring_size, "causal": self.causal,
                "branches": [b.to_json() for b in self.branches],
                "one_kv_head_per_query_head": self.one_kv_head_per_query_head,
                "curve": None if self.curve is None else list(self.curve)}


@dataclass(frozen=True)
class Plan:
    """The whole lowered spec for one target: what codegen and the runtime read."""
    spec: dict
    spec_key: str
    target: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    scale: float
    query: QueryTiling
    branches: tuple[BranchIR, ...]
    config: KernelConfig
    ring: RingIR
    tables: tuple[TableMap, ...] = field(default=())
    # dK, dV of every branch in one launch over key lattice tiles (see the planner)
    fused_dkdv: bool = False
    # tile width when head_dim is not a power of two >= 16 (the next one; the kernels mask
    # the columns past head_dim on every load and store), else None
    head_dim_pad: int | None = None
    # Hilbert scope "sequence", non-causal, one device: the runtime permutes q, k, v into
    # curve order once per call (and out, lse, the gradients back), and the kernels run on
    # the permuted rows as in raster order, with no table (virtual positions are the rows)
    row_order: TableMap | None = None
    # Launch schedule (runtime, AOT launch model and templates read it, the planner decides):
    # the lane branches in launch order; the lane branch whose first launch also writes "no
    # branch" into the rows it does not keep (CLEAR_GAPS), when no fused kernel writes first
    # and it is not r = 1; whether the first per-branch dK, dV launch writes (not adds)
    lane_order: tuple[int, ...] = ()
    gap_lane: int | None = None
    dkdv_first_writes: bool = False
    # the model's index of this call's head 0 (Spec.head_base): head h keeps the offsets
    # (h + head_base) mod r; pointers still index heads 0 .. num_heads - 1 of the tensors
    head_base: int = 0
    # attention dropout (dilgen.dropout): the kernels take a seed and drop each branch's
    # entry of each probability by its coin (dropout_plan.DROPOUT_TUNING says which kernels run)
    dropout: bool = False

    def __post_init__(self) -> None:
        taken = [b.index for b in self.branches if b.fused_dkdv]
        if bool(taken) != self.fused_dkdv:
            raise ValueError(f"Plan.fused_dkdv is {self.fused_dkdv} but the fused dK/dV takes branches {taken}")
        for i in taken:
            if self.query.lattice % self.branches[i].dilation:
                raise ValueError(f"branch {i}: the fused dK/dV's key classes need r | L "
                                 f"(r = {self.branches[i].dilation}, L = {self.query.lattice})")

    @property
    def gluon_dkdv_rows_first(self) -> bool:
        """Whether the Gluon per-branch dK/dV's blocks hold queries along rows (FlashAttention-3's
        backward): the coins must be the forward's (dropout), dS must reach a dQ product from
        shared memory (gluon_dkdv_dq), or the config asks (dkdv_rows_first); keys otherwise."""
        return self.dropout or self.config.gluon_dkdv_dq or self.config.dkdv_rows_first

    @property
    def gluon_packed_kernels(self) -> frozenset[str]:
        """The Gluon kernels over packed rows (runtime.gluon_packed) the plan's module carries, by
        GeneratedAttention's argument names: none under dropout (a packed dropout call runs `tl`);
        the lattice kernels' beside their fixed-length ones; the lane kernels' for a causal plan
        only, the lane forward's not over curve rows, the per-branch dK/dV's not where its blocks
        add into a whole-sequence dQ (gluon_dkdv_dq)."""
        cfg, causal = self.config, self.causal
        if self.dropout:
            return frozenset()
        carried = {"gluon_packed": cfg.gluon_fwd, "gluon_dkdv_packed": cfg.gluon_dkdv, "gluon_dq_packed": cfg.gluon_dq,
                   "gluon_lanes_packed": causal and cfg.gluon_lanes and not cfg.gluon_curve_lanes,
                   "gluon_dkdv_lanes_packed": causal and cfg.gluon_dkdv_lanes and not cfg.gluon_dkdv_dq,
                   "gluon_dq_lanes_packed": causal and cfg.gluon_lanes_bwd}
        return frozenset(name for name, on in carried.items() if on)

    @property
    def delta_step(self) -> int:
        """The backward's preprocess computes Delta only at rows p = (h + head_base) mod m + k*m of
        head h, m = this (1: every row). With every branch a lane branch of r_i > 1 (gap_lane),
        raster rows, head offsets "mod" (t mod r_i == (h + head_base) mod r_i, LongNet Eq. 13-15)
        and m = gcd(r_i) dividing every w_i, a row kept by branch i satisfies n mod m ==
        (h + head_base) mod m, since its segment starts at a multiple of w_i; no kernel reads
        Delta of the other rows (config D: 3/4 of them). One device, fixed-length calls only (a
        packed sequence or a ring chunk starts anywhere: the runtime passes 1 there)."""
        if (self.gap_lane is None or self.tables or self.row_order is not None or self.ring.ring_size != 1
                or any(b.head_offset is not None or b.keep_map is not None for b in self.branches)):
            return 1
        m = math.gcd(*(b.dilation for b in self.branches))
        return m if m > 1 and all(b.segment_length % m == 0 for b in self.branches) else 1

    def to_json(self) -> dict:
        return {
            "fused_dkdv": self.fused_dkdv,
            "spec": self.spec, "spec_key": self.spec_key, "target": self.target,
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "dtype": self.dtype, "causal": self.causal,
            "scale": self.scale, "query": self.query.to_json(),
            "branches": [b.to_json() for b in self.branches],
            "config": self.config.to_json(), "ring": self.ring.to_json(),
            "tables": [t.to_json() for t in self.tables],
            # only when set: plans (and their keys) of power-of-two head dims are unchanged
            **({} if self.head_dim_pad is None else {"head_dim_pad": self.head_dim_pad}),
            **({} if self.row_order is None else {"row_order": self.row_order.to_json()}),
            **({"lane_order": list(self.lane_order)} if self.lane_order else {}),
            **({} if self.gap_lane is None else {"gap_lane": self.gap_lane}),
            **({"dkdv_first_writes": True} if self.dkdv_first_writes else {}),
            **({"head_base": self.head_base} if self.head_base else {}),
            **({"dropout": True} if self.dropout else {}),
        }

    def key(self) -> str:
        return _sha(self.to_json())

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False)
