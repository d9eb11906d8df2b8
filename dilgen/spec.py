"""The Spec value (SPEC.md §1): load JSON, validate every rule, canonical key.

Imports only the standard library (and dilgen.plain, dilgen.spec_json). Every rule
violation raises `SpecError` with one line naming the source, the field, the value and
the rule, e.g. ``spec.json: dilation_rates[2] = 0: must be >= 1``.

A Spec holds plain values only (exactly int, float, str, bool, None, tuples of them and a
Hilbert of them; dilgen.plain says why), however it is made: Spec(...),
dataclasses.replace, Spec.replace, spec_from_dict, load_spec, copy and pickle all run
the constructor's validation on values copied to those exact types.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import keyword
import math
import re
import stat
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .plain import plain
from .spec_json import MAX_SPEC_BYTES, DuplicateKey, LongInt as _LongInt, decode, unknown_field

NAME_RE = re.compile(r"[a-z_][a-z0-9_]*\Z")
HEAD_DIMS = tuple(range(8, 257, 8))   # SPEC §1: any multiple of 8 from 8 to 256
KERNEL_HEAD_DIMS = HEAD_DIMS   # the kernels pad tiles to a power of two and mask the rest
HEAD_OFFSETS = ("mod", "block")           # head h -> offset h mod r | floor(h / ceil(H / r))
SHORT_SEGMENTS = ("exact", "zero_pad")    # SPEC's short last segment | torchscale's zero padding
DTYPES = ("float16", "bfloat16", "float32")
HILBERT_SCOPES = ("segment", "sequence")
MAX_INT = 1 << 40          # larger than any sequence a GPU can hold; guards against 1e300-sized ints
# The kernels compute positions (rows of one sequence) in int32; the row offsets they
# address memory with are int64 (tests/test_row_offsets.py). A segment length is a
# constant of that arithmetic (s*w, u // w), and a tile of up to TILE_LANES lanes of a
# branch spans TILE_LANES*r positions past its first, so every position formed, up to
# about N + TILE_LANES*r, must stay below 2**31 (runtime.checks.check_positions).
MAX_POSITION = (1 << 31) - 1
TILE_LANES = 128           # the most lanes a tile of the block tables holds (targets.py)
MAX_SEGMENT = MAX_POSITION
MAX_DILATION = (1 << 31) // TILE_LANES - 1     # 2**24 - 1
MAX_BRANCHES = 16
MAX_CURVE_CELLS = 1 << 24  # Hilbert tables are built in Python: keep them to 16M cells


class SpecError(ValueError):
    """A spec breaks a rule of SPEC.md §1. The message is one line, fit for stderr."""


def _short(value: Any, limit: int = 60) -> str:
    """A value as one short line of JSON (never raises, never spans lines)."""
    if type(value) is _LongInt:
        shown = str.__str__(value)               # an integer literal, shown unquoted
    else:
        try:
            shown = json.dumps(value)
        except (TypeError, ValueError, RecursionError):
            # not JSON (Python API), an int too long to print, or nested too deeply
            try:
                shown = repr(value).encode("unicode_escape").decode("ascii")
            except Exception:  # noqa: BLE001 - repr of a hostile value
                shown = f"<{type(value).__name__}>"
    return shown if len(shown) <= limit else shown[:limit - 3] + "..."


def _fail(src: str, path: str, value: Any, rule: str) -> SpecError:
    return SpecError(f"{src}: {path} = {_short(value)}: {rule}")


def _key_name(key: str) -> str:
    """A JSON key as written in a message: plain when it is a simple name, else quoted."""
    if isinstance(key, str) and re.fullmatch(r"[A-Za-z0-9_]{1,40}", key):
        return key
    return _short(key, 40)


def _sorted_keys(keys: Any) -> list:
    """Keys in a stable order, even when a Python dict mixes str and non-str keys."""
    return sorted(keys, key=lambda k: (not isinstance(k, str), str(k)))


def _printable(text: Any) -> str:
    """Text fit for a one-line message: control characters (a newline in a file name)
    and unpaired surrogates escaped."""
    text = str(text)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _int(src: str, path: str, value: Any, lo: int = 1, hi: int = MAX_INT,
         too_big: str | None = None) -> int:
    """An int field in [lo, hi]; too_big: the rule a larger value breaks (default <= hi)."""
    too_big = too_big or f"must be <= {hi}"
    if type(value) is _LongInt:
        raise _fail(src, path, value, f"must be >= {lo}" if value.startswith("-") else too_big)
    if type(value) is not int:      # exact: bool, and anything but a plain() int, is refused
        raise _fail(src, path, value, _not_an_integer(value))
    if value < lo:
        raise _fail(src, path, value, f"must be >= {lo}")
    if value > hi:
        raise _fail(src, path, value, too_big)
    return value


def _not_an_integer(value: Any, what: str = "an integer") -> str:
    """The rule an int field's non-int value breaks, with the fix when it is plain."""
    if isinstance(value, bool):
        return f"must be {what}, not true or false"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return f"must be {what} (write {int(value)}, not {value!r})"
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,18}", value):
        return f"must be {what} (write {int(value)} without quotes)"
    return f"must be {what}"


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def default_grid(w: int) -> tuple[int, int] | None:
    """SPEC §2: w = 2^k → rows = 2^floor(k/2), cols = 2^ceil(k/2); None for other w."""
    if not _is_pow2(w):
        return None
    k = w.bit_length() - 1
    return (1 << (k // 2), 1 << ((k + 1) // 2))


@dataclass(frozen=True)
class Hilbert:
    """Hilbert ordering: scope "segment" (per-branch grids) or "sequence" (one image)."""
    scope: str
    grids: tuple[tuple[int, int], ...] | None = None   # segment scope, one per branch
    grid: tuple[int, int] | None = None                 # sequence scope

    def to_json(self) -> dict:
        out: dict[str, Any] = {"scope": self.scope}
        if self.grids is not None:
            out["grids"] = [list(g) for g in self.grids]
        if self.grid is not None:
            out["grid"] = list(self.grid)
        return out


@dataclass(frozen=True)
class Spec:
    """A validated dilated-attention spec. Construct with `Spec(...)` or `load_spec(path)`."""
    name: str
    num_heads: int
    head_dim: int
    segment_lengths: tuple[int, ...]
    dilation_rates: tuple[int, ...]
    num_kv_heads: int | None = None
    dtype: str = "bfloat16"
    causal: bool = False
    hilbert: Hilbert | None = None
    ring_size: int = 1
    softmax_scale: float | None = None
    head_offsets: str = "mod"
    short_segments: str = "exact"
    head_base: int = 0
    source: str = field(default="<spec>", compare=False, repr=False)

    def __new__(cls, *args: Any, **kwargs: Any) -> "Spec":
        # Spec(...) refuses an unknown or a missing field with spec_from_dict's SpecError,
        # word for word, before the dataclass __init__ (whose TypeError would say less).
        # A pickle made by hand may call Spec.__new__(Spec) with no fields: __setstate__
        # then validates its state.
        if args or kwargs:
            given = {**dict(zip((f.name for f in fields(cls)), args)), **kwargs}
            _check_field_names(given, _source(given.get("source", "<spec>")), extra=("source",))
        return super().__new__(cls)

    def __post_init__(self) -> None:
        # Copy every value to plain types, and normalise containers so that Spec(...)
        # built by hand behaves like a loaded one; then validate what was copied.
        src = _source(self.source)
        object.__setattr__(self, "source", src)
        raw = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "source"}
        if isinstance(raw["hilbert"], Hilbert):
            raw["hilbert"] = Hilbert.to_json(raw["hilbert"])
        raw = plain(raw, keep=(_LongInt,))
        if raw["num_kv_heads"] is None:
            raw["num_kv_heads"] = raw["num_heads"]
        for key in ("segment_lengths", "dilation_rates"):
            if type(raw[key]) is tuple:
                raw[key] = list(raw[key])
        for key, value in _validate(raw, src).items():
            object.__setattr__(self, key, value)

    def __reduce__(self) -> tuple:
        # copy and pickle rebuild a Spec through the constructor, so it is validated again
        return (Spec, tuple(getattr(self, f.name) for f in fields(self)))

    def __setstate__(self, state: Any) -> None:
        # a pickle that sets a bare Spec's __dict__ (the default protocol) is validated too
        state = plain(state, keep=(_LongInt,))
        if type(state) is not dict:
            raise SpecError(f"<pickle>: a Spec's state must be a dict of its fields, "
                            f"got {type(state).__name__}")
        _check_field_names(state, _source(state.get("source", "<spec>")), extra=("source",))
        checked = Spec(**state)
        for f in fields(self):
            object.__setattr__(self, f.name, getattr(checked, f.name))

    # ---- derived values -------------------------------------------------------------
    @property
    def num_branches(self) -> int:
        return len(self.segment_lengths)

    @property
    def rows_in_curve_order(self) -> bool:   # one device permutes whole rows around raster kernels
        return self.hilbert is not None and self.hilbert.scope == "sequence" and not self.causal and self.ring_size == 1

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def branches(self) -> list[tuple[int, int]]:
        return list(zip(self.segment_lengths, self.dilation_rates))

    def to_json(self) -> dict:
        """Canonical JSON form: every field, defaults filled in, fixed order."""
        return {
            "name": self.name,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "segment_lengths": list(self.segment_lengths),
            "dilation_rates": list(self.dilation_rates),
            "causal": self.causal,
            "hilbert": None if self.hilbert is None else self.hilbert.to_json(),
            "ring_size": self.ring_size,
            "softmax_scale": self.softmax_scale,
            # fields added later appear only when set, so that the keys (and generated
            # files) of every spec written before them stay the same
            **({} if self.head_offsets == "mod" else {"head_offsets": self.head_offsets}),
            **({} if self.short_segments == "exact" else {"short_segments": self.short_segments}),
            **({"head_base": self.head_base} if self.head_base else {}),
        }

    def key(self) -> str:
        """sha256 of the canonical JSON (stable across runs and machines)."""
        blob = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    def replace(self, **changes: Any) -> "Spec":
        """A copy with `changes`; a bad value is reported as coming from this call, with
        the file the spec was loaded from named as its origin."""
        data = self.to_json()
        data.update(changes)
        origin = f"{self.source}, .replace({', '.join(sorted(changes))})" if changes else self.source
        return spec_from_dict(data, source=origin)


# help() and inspect show the dataclass fields, not __new__'s (*args, **kwargs)
Spec.__signature__ = inspect.signature(Spec.__init__).replace(
    parameters=list(inspect.signature(Spec.__init__).parameters.values())[1:])

_REQUIRED = ("name", "num_heads", "head_dim", "segment_lengths", "dilation_rates")
_ALLOWED = ("name", "num_heads", "num_kv_heads", "head_dim", "dtype", "segment_lengths",
            "dilation_rates", "causal", "hilbert", "ring_size", "softmax_scale", "head_offsets",
            "short_segments", "head_base")


def _source(value: Any) -> str:
    """The `source` a Spec names in its messages: a plain string on one line."""
    value = plain(value)
    if type(value) is not str:
        raise SpecError(f"<spec>: source = {_short(value)}: must be a string (where the spec "
                        f"came from, named in messages)")
    return _printable(value)


def _check_field_names(data: dict, source: str, extra: tuple = ()) -> None:
    """The first unknown field, else the first missing required one, as a SpecError: one
    message for a JSON object (spec_from_dict) and for Spec(**fields) (`extra`: the names
    the Python call takes besides the JSON fields, i.e. source)."""
    unknown = _sorted_keys(set(data) - set(_ALLOWED) - set(extra))
    if unknown:
        raise _fail(source, _key_name(unknown[0]), data[unknown[0]], unknown_field(unknown[0], _ALLOWED))
    for key in _REQUIRED:
        if key not in data:
            raise SpecError(f"{source}: {key} is missing: it is a required field")


LIMITS = {   # field: (largest value, the rule a larger one breaks)
    "segment_lengths": (MAX_SEGMENT, "must be < 2**31 (the kernels compute positions in int32)"),
    "dilation_rates": (MAX_DILATION, f"must be < 2**24 (the kernels compute positions in int32, "
                                     f"and a tile of {TILE_LANES} lanes spans {TILE_LANES}*r of them)"),
}


def _validate(raw: dict, src: str) -> dict:
    """Check every rule of SPEC §1 on plain() values; return normalised ones (tuples,
    Hilbert objects). Types are compared exactly: an object that claims another
    __class__ is refused."""
    name = raw["name"]
    if type(name) is not str or not NAME_RE.match(name):
        raise _fail(src, "name", name, "must match [a-z_][a-z0-9_]* (it names a Python module)")
    if len(name) > 100:
        raise _fail(src, "name", name, "must be at most 100 characters")
    if keyword.iskeyword(name) or name == "__init__":
        raise _fail(src, "name", name, "is reserved in Python: `from generated.<name> import "
                    "attention` must work (pick another module name)")
    num_heads = _int(src, "num_heads", raw["num_heads"], hi=4096)
    num_kv = _int(src, "num_kv_heads", raw["num_kv_heads"], hi=4096)
    if num_heads % num_kv:
        raise _fail(src, "num_kv_heads", num_kv, f"must divide num_heads = {num_heads}")
    head_dim = raw["head_dim"]
    if type(head_dim) is not int:
        raise _fail(src, "head_dim", head_dim,
                    _not_an_integer(head_dim, "an integer, a multiple of 8 from 8 to 256"))
    if head_dim not in HEAD_DIMS:
        raise _fail(src, "head_dim", head_dim, "must be a multiple of 8 from 8 to 256 (one of 8, 16, 24, ..., 256)")
    dtype = raw["dtype"]
    if type(dtype) is not str or dtype not in DTYPES:
        raise _fail(src, "dtype", dtype, 'must be one of "float16", "bfloat16", "float32"')

    lists = {}
    for key in ("segment_lengths", "dilation_rates"):
        value = raw[key]
        if type(value) is not list:
            raise _fail(src, key, value, "must be a list of integers")
        if not value:
            raise _fail(src, key, value, "must not be empty")
        if len(value) > MAX_BRANCHES:
            raise _fail(src, key, value, f"must have at most {MAX_BRANCHES} branches")
        hi, why = LIMITS[key]
        lists[key] = tuple(_int(src, f"{key}[{i}]", x, hi=hi, too_big=why) for i, x in enumerate(value))
    segs, rates = lists["segment_lengths"], lists["dilation_rates"]
    if len(segs) != len(rates):
        raise _fail(src, "dilation_rates", list(rates),
                    f"must have the same length as segment_lengths ({len(segs)})")
    causal = raw["causal"]
    if type(causal) is not bool:
        raise _fail(src, "causal", causal, "must be true or false")
    ring = _int(src, "ring_size", raw["ring_size"], hi=65536)
    scale = raw["softmax_scale"]
    if scale is not None:
        if type(scale) is _LongInt:
            raise _fail(src, "softmax_scale", scale, "must be a finite number in (0, 1e4]")
        if type(scale) not in (int, float):
            raise _fail(src, "softmax_scale", scale, "must be a number or null")
        if type(scale) is int and abs(scale) > 1e4:   # math.isfinite(10**400) overflows
            raise _fail(src, "softmax_scale", scale, "must be a finite number in (0, 1e4]")
        if not math.isfinite(scale) or scale <= 0 or scale > 1e4:
            raise _fail(src, "softmax_scale", scale, "must be a finite number in (0, 1e4]")
        scale = float(scale)

    head_offsets = raw["head_offsets"]
    if type(head_offsets) is not str or head_offsets not in HEAD_OFFSETS:
        raise _fail(src, "head_offsets", head_offsets,
                    'must be "mod" (offset h mod r) or "block" (torchscale: offset floor(h / ceil(H / r)))')
    short_segments = raw["short_segments"]
    if type(short_segments) is not str or short_segments not in SHORT_SEGMENTS:
        raise _fail(src, "short_segments", short_segments,
                    'must be "exact" (no padding) or "zero_pad" (torchscale: zero keys pad each segment)')

    # head_base (tensor parallelism over heads, dilgen's head-parallel ring transport): head
    # h of this call is head head_base + h of the model, and keeps that head's offsets
    head_base = _int(src, "head_base", raw["head_base"], lo=0, hi=1 << 20)
    if head_base % (num_heads // num_kv):
        raise _fail(src, "head_base", head_base,
                    f"must be a multiple of the GQA group size num_heads / num_kv_heads = "
                    f"{num_heads // num_kv}, so that every kv head keeps its whole group")
    if head_base and head_offsets != "mod":
        raise _fail(src, "head_base", head_base,
                    f'cannot be > 0 with head_offsets "{head_offsets}" (its blocks follow '
                    f'num_heads); use head_offsets "mod"')
    hilbert = _validate_hilbert(raw["hilbert"], segs, src)
    if short_segments == "zero_pad" and hilbert is not None:
        raise _fail(src, "short_segments", short_segments,
                    "is torchscale's padding of raster segments: use hilbert null, or short_segments "
                    '"exact" with a Hilbert order')
    if ring > 1 and hilbert is not None and hilbert.scope == "sequence" and causal:
        raise _fail(src, "ring_size", ring,
                    'cannot be > 1 with hilbert scope "sequence" and causal true (a rank holds a '
                    'run of the curve, whose raster positions are not in order); use causal '
                    'false, scope "segment", or ring_size 1')
    return dict(name=name, num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim,
                dtype=dtype, segment_lengths=segs, dilation_rates=rates, causal=causal,
                hilbert=hilbert, ring_size=ring, softmax_scale=scale, head_offsets=head_offsets,
                short_segments=short_segments, head_base=head_base)


def _grid(src: str, path: str, value: Any) -> tuple[int, int]:
    if type(value) is not list or len(value) != 2:
        raise _fail(src, path, value, "must be a [rows, cols] pair")
    return (_int(src, f"{path}[0]", value[0]), _int(src, f"{path}[1]", value[1]))


def _validate_hilbert(value: Any, segs: tuple[int, ...], src: str) -> Hilbert | None:
    if value is None:
        return None
    if type(value) is not dict:
        raise _fail(src, "hilbert", value, 'must be null or an object like {"scope": "segment"}')
    unknown = _sorted_keys(set(value) - {"scope", "grids", "grid"})
    if unknown:
        raise _fail(src, f"hilbert.{_key_name(unknown[0])}", value[unknown[0]],
                    unknown_field(unknown[0], ("scope", "grids", "grid")))
    scope = value.get("scope")
    if type(scope) is not str or scope not in HILBERT_SCOPES:
        raise _fail(src, "hilbert.scope", scope, 'must be "segment" or "sequence"')
    if scope == "segment":
        if "grid" in value:
            raise _fail(src, "hilbert.grid", value["grid"],
                        'belongs to scope "sequence"; use "grids" (one per branch) for "segment"')
        grids_raw = value.get("grids")
        if grids_raw is None:
            for i, w in enumerate(segs):
                if w > MAX_CURVE_CELLS:
                    raise _fail(src, f"segment_lengths[{i}]", w,
                                f"Hilbert segments hold at most {MAX_CURVE_CELLS} positions")
                if default_grid(w) is None:
                    raise _fail(src, f"segment_lengths[{i}]", w,
                                'is not a power of two: Hilbert scope "segment" needs '
                                '"grids": [[rows, cols], ...] with rows*cols = w')
            return Hilbert("segment")
        if type(grids_raw) is not list or len(grids_raw) != len(segs):
            raise _fail(src, "hilbert.grids", grids_raw,
                        f"must be a list of {len(segs)} [rows, cols] pairs, one per branch")
        grids = tuple(_grid(src, f"hilbert.grids[{i}]", g) for i, g in enumerate(grids_raw))
        for i, g in enumerate(grids):
            if g[0] * g[1] > MAX_CURVE_CELLS:
                raise _fail(src, f"hilbert.grids[{i}]", list(g),
                            f"at most {MAX_CURVE_CELLS} cells per Hilbert grid")
        for i, ((rows, cols), w) in enumerate(zip(grids, segs)):
            if rows * cols != w:
                raise _fail(src, f"hilbert.grids[{i}]", [rows, cols],
                            f"rows*cols = {rows * cols} must equal segment_lengths[{i}] = {w}")
        return Hilbert("segment", grids=grids)
    if "grids" in value:
        raise _fail(src, "hilbert.grids", value["grids"],
                    'belongs to scope "segment"; use "grid": [rows, cols] for "sequence"')
    if "grid" not in value:
        raise _fail(src, "hilbert.grid", None,
                    'is required for scope "sequence": the image as [rows, cols]')
    grid = _grid(src, "hilbert.grid", value["grid"])
    if grid[0] * grid[1] > MAX_CURVE_CELLS:
        raise _fail(src, "hilbert.grid", list(grid), f"at most {MAX_CURVE_CELLS} cells")
    return Hilbert("sequence", grid=grid)


def spec_from_dict(data: Any, source: str = "<spec>") -> Spec:
    """Validate a decoded JSON object and build a Spec. Raises SpecError."""
    source = _source(source)
    raw = plain(data, keep=(_LongInt,))    # exact types (a dict subclass's own items)
    if type(raw) is not dict:
        raise SpecError(f"{source}: the spec must be a JSON object, got {type(data).__name__}")
    _check_field_names(raw, source)
    if "num_kv_heads" not in raw:      # defaults to num_heads, whose own check names it
        raw["num_kv_heads"] = raw["num_heads"]
    elif raw["num_kv_heads"] is None:
        raise _fail(source, "num_kv_heads", None, "must be an integer (or left out)")
    # Spec.__post_init__ validates every rule on these JSON values (errors name them).
    spec = Spec(**raw, source=source)
    return spec


def load_spec(path: str | Path, *, source: str | None = None) -> Spec:
    """Read and validate a spec file. Raises SpecError with a one-line message naming the
    file as `source` (default: its file name; the command line passes the path as the user
    gave it, e.g. `baddir/neg.json` for `dilgen build baddir`)."""
    path = Path(path)
    src = _printable(path.name if source is None else source)
    try:
        # a FIFO would block the open, a device (/dev/zero, also through a link) never ends
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):
            raise SpecError(f"{_printable(path)}: not a regular file (a spec is a JSON file of at "
                            f"most {MAX_SPEC_BYTES // 2**20} MiB)")
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
        if len(raw) > MAX_SPEC_BYTES:
            raise SpecError(f"{_printable(path)}: larger than {MAX_SPEC_BYTES // 2**20} MiB: not a spec")
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise SpecError(f"{_printable(path)}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{_printable(path)}: cannot read the spec: {_printable(exc)}") from None
    text = text.removeprefix("\ufeff")
    try:
        data = decode(text)
    except json.JSONDecodeError as exc:
        raise SpecError(f"{src}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise SpecError(f"{src}: not valid JSON: nested too deeply") from None
    except DuplicateKey as exc:
        raise SpecError(f"{src}: {_key_name(exc.args[0])} is written twice in one object (the last "
                        f"would win silently): keep one") from None
    except ValueError as exc:
        raise SpecError(f"{src}: not valid JSON: {_short(str(exc), 80)}") from None
    return spec_from_dict(data, source=src)
