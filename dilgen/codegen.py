"""IR + target → Triton source text, from the Jinja templates in templates/.

The output depends only on the plan, the generator version and the template text, so
it is byte-stable: the same spec, target and version always give the same file.
"""
from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache
from pathlib import Path

import jinja2
import sympy

from . import __version__
from .ir import AffineMap, Plan, print_expr
from .plain import check_plain

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates"
if not TEMPLATE_DIR.is_dir():  # installed as a wheel: templates ship inside the package
    TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
FORWARD_TEMPLATE = "attention_fwd.py.jinja"
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
        lstrip_blocks=False,
        autoescape=False,
    )
    env.globals["expr"] = _expr
    env.globals["dm"] = _dim_mask
    return env


def template_hash() -> str:
    """sha256 over every template file (names and bytes), first 16 hex digits."""
    digest = hashlib.sha256()
    for path in sorted(TEMPLATE_DIR.glob("*.jinja")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _expr(amap: AffineMap, **names: str) -> str:
    """Print an index map with some symbols renamed (e.g. u → u_b)."""
    subs = {sympy.Symbol(k, integer=True, nonnegative=True): sympy.Symbol(v) for k, v in names.items()}
    return print_expr(amap.expr.subs(subs))


@jinja2.pass_context
def _dim_mask(ctx, row_mask: str | None, transpose: bool = False) -> str | None:
    """The mask of a (rows x head_dim) load or store: `row_mask` as given when the tiles are
    exactly head_dim wide, else also offs_d < HEAD_DIM (the tile is HEAD_DIM_PAD wide and
    the columns past head_dim exist neither in memory nor in the result). Templates that
    render without the plan's context (no pad_d) get the row mask."""
    if not ctx.get("pad_d", False):
        return row_mask
    cols = "(offs_d[:, None] < HEAD_DIM)" if transpose else "(offs_d[None, :] < HEAD_DIM)"
    return cols if row_mask is None else f"{row_mask} & {cols}"


def _py_literal(obj: object) -> str:
    """A JSON value as a Python literal, stable and readable."""
    text = json.dumps(obj, indent=4, sort_keys=True)
    # lists of plain numbers on one line: tiles, class orders, grids
    text = re.sub(r"\[\s*(-?[\d.e+-]+(?:,\s*-?[\d.e+-]+)*)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)
    return text.replace(": null", ": None").replace(": true", ": True").replace(": false", ": False")


def kernel_name(plan: Plan) -> str:
    return f"{plan.spec['name']}_fwd_kernel"


def emit(plan: Plan) -> str:
    """Render the forward module for `plan`."""
    template = _environment().get_template(FORWARD_TEMPLATE)
    plan_json = plan.to_json()
    dot_kwargs = f', input_precision="{plan.config.dot_precision}"' if plan.config.dot_precision else ""
    context = dict(
        plan=plan,
        q=plan.query,
        cfg=plan.config,
        version=__version__,
        template_hash=template_hash(),
        plan_key=plan.key(),
        spec_json=_py_literal(plan.spec),
        plan_json=_py_literal(plan_json),
        kernel_name=kernel_name(plan),
        group=plan.num_heads // plan.num_kv_heads,
        lane_branches=[b for b in plan.branches if b.lanes],
        table_index={t.name: i for i, t in enumerate(plan.tables)},
        qk_scale=repr(plan.scale * LOG2E),
        ln2=repr(LN2),
        dot_kwargs=dot_kwargs,
        ring=plan.ring.ring_size > 1,
        # head_dim not a power of two (or below 16): tiles HEAD_DIM_PAD wide, masked columns
        pad_d=plan.head_dim_pad is not None,
        dw="HEAD_DIM" if plan.head_dim_pad is None else "HEAD_DIM_PAD",
    )
    # Everything a template prints is a plain value (int, float, str, bool, None, their
    # lists, tuples and dicts, the plan's dataclasses of them) or a sympy expression, which
    # prints itself: a subclass with its own __str__ or __format__ never reaches the source.
    for name, value in context.items():
        check_plain(value, name, allow=(sympy.Basic,))
    source = template.render(**context)
    # Strip trailing spaces that conditional blocks leave behind: byte-stable and tidy.
    lines = [line.rstrip() for line in source.splitlines()]
    return "\n".join(lines).rstrip("\n") + "\n"


def check_syntax(source: str, filename: str = "<generated>") -> None:
    compile(source, filename, "exec")
