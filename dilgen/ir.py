"""IR values: index maps, branches, query classes, tiles, ring schedule.

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
    """
    index: int
    segment_length: int
    dilation: int
    key_map: AffineMap
    keep_map: AffineMap | None
    order: TableMap | None
    single_segment: bool
    keys_per_query: int

    def to_json(self) -> dict:
        return {
            "index": self.index, "w": self.segment_length, "r": self.dilation,
            "key_map": self.key_map.to_json(),
            "membership": "class" if self.keep_map is None else "row",
            "keep_map": None if self.keep_map is None else self.keep_map.to_json(),
            "order": None if self.order is None else self.order.to_json(),
            "single_segment": self.single_segment,
            "keys_per_query": self.keys_per_query,
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

    def to_json(self) -> dict:
        return {"block_m": self.block_m, "block_n": self.block_n, "num_warps": self.num_warps,
                "num_stages": self.num_stages, "dot_precision": self.dot_precision}


@dataclass(frozen=True)
class RingIR:
    """The ring schedule (ring_size P). P = 1 is purely local."""
    ring_size: int

    def to_json(self) -> dict:
        return {"ring_size": self.ring_size, "steps": [] if self.ring_size == 1 else None}


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

    def to_json(self) -> dict:
        return {
            "spec": self.spec, "spec_key": self.spec_key, "target": self.target,
            "num_heads": self.num_heads, "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "dtype": self.dtype, "causal": self.causal,
            "scale": self.scale, "query": self.query.to_json(),
            "branches": [b.to_json() for b in self.branches],
            "config": self.config.to_json(), "ring": self.ring.to_json(),
            "tables": [t.to_json() for t in self.tables],
        }

    def key(self) -> str:
        return _sha(self.to_json())

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2, sort_keys=False)
