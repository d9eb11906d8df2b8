"""The spec fuzzers' oracle and strategies (tests/test_fuzz.py): an independent reading of
SPEC.md §1 and the limits documented in dilgen/spec.py that says which specs are valid and
what they load to, and hypothesis strategies for valid, mutated and hostile specs."""
from __future__ import annotations

import functools
import keyword
import math
import re

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from dilgen import spec as spec_mod

FIELDS = spec_mod._ALLOWED
REQUIRED = spec_mod._REQUIRED
MAX_INT = spec_mod.MAX_INT
MAX_BRANCHES = spec_mod.MAX_BRANCHES
MAX_CELLS = spec_mod.MAX_CURVE_CELLS
HEAD_DIMS = spec_mod.HEAD_DIMS                # valid: any multiple of 8 from 8 to 256
KERNEL_HEAD_DIMS = spec_mod.KERNEL_HEAD_DIMS  # what valid_specs draws: the kernels plan them
DTYPES = spec_mod.DTYPES
MAX_HEADS, MAX_RING, MAX_SCALE, MAX_NAME = 4096, 65536, 1e4, 100


def fuzz_settings(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much,
                                           HealthCheck.function_scoped_fixture])


# --------------------------------------------------------------------------- the oracle

MISSING = object()


class Deep:
    """A list nested `depth` levels deep, written into the JSON text as brackets (json.dumps
    itself cannot write it near the recursion limit). Never valid anywhere in a spec."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __repr__(self) -> str:
        return f"Deep({self.depth})"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_ok(x, hi: int = MAX_INT) -> bool:
    return _is_int(x) and 1 <= x <= hi


def _pair_ok(x) -> bool:
    return isinstance(x, list) and len(x) == 2 and all(_int_ok(v) for v in x)


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def valid_module_name(name) -> bool:
    """SPEC §1/§5: `name` names a module imported as `from generated.<name> import attention`."""
    return (isinstance(name, str) and re.fullmatch(r"[a-z_][a-z0-9_]*", name) is not None
            and len(name) <= MAX_NAME and not keyword.iskeyword(name) and name != "__init__")


def oracle(data) -> tuple[list[str], dict | None]:
    """(problems, canonical): the fragments one of which the error message must contain
    (empty when the spec is valid), and the canonical JSON of a valid spec."""
    if not isinstance(data, dict):
        return ["JSON object"], None
    problems: list[str] = []
    if any(k not in FIELDS for k in data):
        problems.append("unknown field")
    if any(k not in data for k in REQUIRED):
        problems.append("is missing")
    get = data.get

    name = get("name", MISSING)
    if name is not MISSING and not valid_module_name(name):
        problems.append("name")
    nh = get("num_heads", MISSING)
    nh_ok = _int_ok(nh, MAX_HEADS)
    if nh is not MISSING and not nh_ok:
        problems.append("num_heads")
    kv = get("num_kv_heads", nh)
    if kv is not MISSING:
        if not _int_ok(kv, MAX_HEADS):
            problems.append("num_kv_heads")
        elif nh_ok and nh % kv:
            problems.append("num_kv_heads")
    hd = get("head_dim", MISSING)
    if hd is not MISSING and not (_is_int(hd) and hd in HEAD_DIMS):
        problems.append("head_dim")
    dtype = get("dtype", "bfloat16")
    if not (isinstance(dtype, str) and dtype in DTYPES):
        problems.append("dtype")
    lists = {}
    limits = {"segment_lengths": spec_mod.MAX_SEGMENT, "dilation_rates": spec_mod.MAX_DILATION}
    for key in ("segment_lengths", "dilation_rates"):
        v = get(key, MISSING)
        if v is MISSING:
            continue
        if isinstance(v, list) and 1 <= len(v) <= MAX_BRANCHES and all(_int_ok(x, limits[key]) for x in v):
            lists[key] = v
        else:
            problems.append(key)
    segs, rates = lists.get("segment_lengths"), lists.get("dilation_rates")
    if segs is not None and rates is not None and len(segs) != len(rates):
        problems.append("dilation_rates")
    causal = get("causal", False)
    if not isinstance(causal, bool):
        problems.append("causal")
    ring = get("ring_size", 1)
    if not _int_ok(ring, MAX_RING):
        problems.append("ring_size")
    scale = get("softmax_scale", None)
    if scale is not None and not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
                                  and math.isfinite(scale) and 0 < scale <= MAX_SCALE):
        problems.append("softmax_scale")

    head_offsets = get("head_offsets", "mod")
    if not (isinstance(head_offsets, str) and head_offsets in ("mod", "block")):
        problems.append("head_offsets")
    short_segments = get("short_segments", "exact")
    if not (isinstance(short_segments, str) and short_segments in ("exact", "zero_pad")):
        problems.append("short_segments")
    elif short_segments == "zero_pad" and get("hilbert", None) is not None:
        problems.append("short_segments")        # torchscale's padding: raster segments only
    head_base = get("head_base", 0)
    if not (_is_int(head_base) and 0 <= head_base <= 1 << 20):
        problems.append("head_base")
    elif nh_ok and _int_ok(kv, MAX_HEADS) and nh % kv == 0 and head_base % (nh // kv):
        problems.append("head_base")             # a kv head keeps its whole group
    elif head_base and head_offsets != "mod":
        problems.append("head_base")

    hil = get("hilbert", None)
    hil_canon = None
    if hil is not None:
        if not isinstance(hil, dict):
            problems.append("hilbert")
        elif set(hil) - {"scope", "grids", "grid"}:
            problems.append("hilbert.")
        elif hil.get("scope") == "segment" and isinstance(hil.get("scope"), str):
            grids = hil.get("grids")
            if "grid" in hil:
                problems.append("hilbert.grid")
            elif segs is None:
                pass                     # the segment lengths are refused already
            elif grids is None:
                if not all(_is_pow2(w) and w <= MAX_CELLS for w in segs):
                    problems.append("segment_lengths")
                hil_canon = {"scope": "segment"}
            elif (isinstance(grids, list) and len(grids) == len(segs)
                  and all(_pair_ok(g) and g[0] * g[1] <= MAX_CELLS for g in grids)
                  and all(g[0] * g[1] == w for g, w in zip(grids, segs))):
                hil_canon = {"scope": "segment", "grids": [list(g) for g in grids]}
            else:
                problems.append("hilbert.grids")
        elif hil.get("scope") == "sequence" and isinstance(hil.get("scope"), str):
            grid = hil.get("grid", MISSING)
            if "grids" in hil:
                problems.append("hilbert.grids")
            elif grid is MISSING or not _pair_ok(grid) or grid[0] * grid[1] > MAX_CELLS:
                problems.append("hilbert.grid")
            else:
                hil_canon = {"scope": "sequence", "grid": list(grid)}
                if _int_ok(ring, MAX_RING) and ring > 1:    # a rank's chunk is no run of the curve
                    problems.append("ring_size")
        else:
            problems.append("hilbert.scope")
    if problems:
        return problems, None
    return [], {
        "name": name, "num_heads": nh, "num_kv_heads": kv, "head_dim": hd, "dtype": dtype,
        "segment_lengths": list(segs), "dilation_rates": list(rates), "causal": causal,
        "hilbert": hil_canon, "ring_size": ring,
        "softmax_scale": None if scale is None else float(scale),
        # fields added later (issue 16) are in the canonical form only when not default
        **({} if head_offsets == "mod" else {"head_offsets": head_offsets}),
        **({} if short_segments == "exact" else {"short_segments": short_segments}),
        **({"head_base": head_base} if head_base else {}),
    }


# --------------------------------------------------------------------------- strategies

HOSTILE_NAMES = [
    "..", ".", "../evil", "../../evil", "/tmp/evil", "evil/x", "a/../b", "sub\\evil",
    "C:\\evil", "evil.py", "~", "~/evil", "evil\x00", "a\x00b", "", " ", "a b", "Evil",
    "évil", "ok\n", "\nok", "ok_\t", "1abc", "-x", "class", "import", "lambda", "None",
    "__init__", "a" * (MAX_NAME + 1), "a" * 4000, "con", "nul", "_", "__main__", "a" * MAX_NAME,
]
HUGE_INTS = [MAX_INT, MAX_INT + 1, 2**53 + 1, 2**63, 2**64 + 1, 10**30, -(10**30),
             10**63, 10**64, 10**70, -(10**70), int("9" * 200)]
FLOATS = [1e30, -1e30, 1e300, 0.0, -0.0, 0.5, 1.0, 16.0, 64.0, 2.5, 1e-300, 5e-324,
          1e4, 10000.000001, float("nan"), float("inf"), float("-inf")]
STRINGS = ["", "16", "64", "1e30", "bfloat16", "float64", "segment", "sequence", "true",
           "null", "NaN", "../x", "a\nb", "\u2028", "\ud800"]

ints = st.one_of(st.integers(-4, 70), st.integers(-2**70, 2**70), st.sampled_from(HUGE_INTS))
scalars = st.one_of(st.none(), st.booleans(), ints,
                    st.sampled_from(FLOATS), st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(STRINGS), st.text(max_size=8))
junk_keys = st.one_of(st.sampled_from(FIELDS + ("scope", "grid", "grids")), st.text(max_size=6))
junk = st.one_of(
    scalars,
    st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                  st.dictionaries(junk_keys, inner, max_size=3)),
                 max_leaves=8),
    st.integers(1, 1600).map(Deep),
)
names = st.one_of(st.from_regex(r"[a-z_][a-z0-9_]{0,24}", fullmatch=True),
                  st.sampled_from(HOSTILE_NAMES),
                  st.sampled_from([k for k in keyword.kwlist if k.islower()]),
                  st.text(max_size=12))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# valid_specs' strategies, made once (a strategy built inside a draw is built and validated
# again on every example: half the fuzz tests' time); the same strategies, so the same examples
_BRANCHES = st.one_of(st.integers(1, 4), st.integers(1, MAX_BRANCHES))
_KINDS = st.sampled_from([None, None, "segment", "segment_grids", "sequence"])
_SEG_EXP, _SIDE, _ROWS = st.integers(0, 24), st.integers(1, 4096), st.integers(1, 4096)
_SEG = st.one_of(st.integers(1, 64), st.integers(1, 1 << 17), st.integers(1, spec_mod.MAX_SEGMENT),
                 st.just(spec_mod.MAX_SEGMENT))
_RATE = st.one_of(st.integers(1, 16), st.sampled_from([6, 12, 24]), st.integers(1, spec_mod.MAX_DILATION))
_HEADS = st.one_of(st.integers(1, 64), st.integers(1, MAX_HEADS))
_NAME = st.from_regex(r"[a-z_][a-z0-9_]{0,30}", fullmatch=True).filter(valid_module_name)
_HEAD_DIM, _DTYPE, _BOOL = st.sampled_from(KERNEL_HEAD_DIMS), st.sampled_from(DTYPES), st.booleans()
_RING = st.one_of(st.just(1), st.integers(1, 8), st.integers(1, MAX_RING))
_SCALE = st.one_of(st.none(), st.integers(1, 10_000),
                   st.floats(min_value=0, max_value=MAX_SCALE, exclude_min=True))
_SEGMENT_SCOPE = st.sampled_from([{"scope": "segment"}, {"scope": "segment", "grids": None}])


@functools.lru_cache(maxsize=None)
def _n_of(strategy, n: int):
    return st.lists(strategy, min_size=n, max_size=n)


@functools.lru_cache(maxsize=None)
def _kv_heads(num_heads: int):
    return st.sampled_from(_divisors(num_heads))


@functools.lru_cache(maxsize=None)
def _cols(rows: int):
    return st.integers(1, MAX_CELLS // rows)


@functools.lru_cache(maxsize=None)
def _orders(n: int):
    return st.permutations(list(range(n)))


@st.composite
def valid_specs(draw) -> dict:
    """A spec that SPEC §1 accepts, with the optional fields sometimes left out."""
    n = draw(_BRANCHES)
    kind = draw(_KINDS)
    grids = None
    if kind == "segment":
        segs = [1 << draw(_SEG_EXP) for _ in range(n)]
    elif kind == "segment_grids":
        grids = [[draw(_SIDE), draw(_SIDE)] for _ in range(n)]
        segs = [r * c for r, c in grids]
    else:
        segs = draw(_n_of(_SEG, n))
    rates = draw(_n_of(_RATE, n))
    num_heads = draw(_HEADS)
    data = {"name": draw(_NAME), "num_heads": num_heads, "head_dim": draw(_HEAD_DIM),
            "segment_lengths": segs, "dilation_rates": rates}
    optional = {
        "num_kv_heads": draw(_kv_heads(num_heads)),
        "dtype": draw(_DTYPE),
        "causal": draw(_BOOL),
        "ring_size": draw(_RING),
        "softmax_scale": draw(_SCALE),
        "hilbert": None,
    }
    if kind == "segment":
        optional["hilbert"] = draw(_SEGMENT_SCOPE)
    elif kind == "segment_grids":
        optional["hilbert"] = {"scope": "segment", "grids": grids}
    elif kind == "sequence":
        rows = draw(_ROWS)
        optional["hilbert"] = {"scope": "sequence", "grid": [rows, draw(_cols(rows))]}
        optional["ring_size"] = 1          # a ring needs raster chunks: refused with "sequence"
    for key, value in optional.items():
        if draw(_BOOL) or value is not None and key == "hilbert":
            data[key] = value
    # JSON key order must never matter
    keys = list(data)
    return {keys[i]: data[keys[i]] for i in draw(_orders(len(keys)))}


@st.composite
def bad_hilbert(draw, segs) -> object:
    n = len(segs) if isinstance(segs, list) else 1
    pair = st.lists(st.integers(1, 64), min_size=2, max_size=2)
    return draw(st.one_of(
        junk,
        st.sampled_from(["segment", "sequence", [], {}, 1, True, [{"scope": "segment"}]]),
        st.builds(lambda s: {"scope": s}, junk),
        st.just({"scope": "segment", "grid": [4, 4]}),
        st.just({"scope": "sequence"}),
        st.just({"scope": "sequence", "grid": None}),
        st.just({"scope": "sequence", "grid": [4096, 4097]}),
        st.just({"scope": "segment", "grids": [[1 << 13, 1 << 12]] * n}),
        st.builds(lambda g: {"scope": "sequence", "grids": g}, st.lists(pair, max_size=3)),
        st.builds(lambda g: {"scope": "sequence", "grid": g}, junk),
        st.builds(lambda g: {"scope": "segment", "grids": g}, junk),
        st.builds(lambda g: {"scope": "segment", "grids": g},
                  st.lists(pair, min_size=max(0, n - 1), max_size=n + 1)),
        st.builds(lambda g: {"scope": "segment", "grids": g},
                  st.lists(st.lists(junk, max_size=3), min_size=n, max_size=n)),
        st.builds(lambda k, v: {"scope": "segment", k: v},
                  st.text(max_size=6).filter(lambda k: k not in ("scope", "grid", "grids")), junk),
        st.builds(lambda d: {"scope": "segment", "grids": [[1, 3]] * n, "Grid": d}, junk),
    ))


@st.composite
def mutated_specs(draw) -> object:
    """A valid spec with 1-3 hostile changes (which may, by chance, leave it valid)."""
    data = draw(valid_specs())
    for _ in range(draw(st.sampled_from([1, 1, 1, 2, 3]))):   # mostly one change: its error shows
        op = draw(st.sampled_from(["set", "set", "item", "delete", "unknown", "mismatch",
                                   "empty", "hilbert", "name", "intfloat"]))
        if op == "set":
            data[draw(st.sampled_from(FIELDS))] = draw(junk)
        elif op == "item":
            key = draw(st.sampled_from(["segment_lengths", "dilation_rates"]))
            if isinstance(data.get(key), list) and data[key]:
                i = draw(st.integers(0, len(data[key]) - 1))
                data[key][i] = draw(st.one_of(ints, scalars, junk))
        elif op == "delete":
            data.pop(draw(st.sampled_from(FIELDS)), None)
        elif op == "unknown":
            key = draw(st.one_of(st.sampled_from(["dilation_rate", "segment_length", "Name",
                                                  "source", "num_heads ", "hilbert.scope", "",
                                                  "causal\n", "__proto__", "../x"]),
                                 st.text(max_size=12)))
            if key not in FIELDS:
                data[key] = draw(junk)
        elif op == "mismatch":
            key = draw(st.sampled_from(["segment_lengths", "dilation_rates"]))
            if isinstance(data.get(key), list):
                if data[key] and draw(st.booleans()):
                    data[key].pop()
                else:
                    data[key].append(draw(st.integers(1, 64)))
        elif op == "empty":
            for key in draw(st.sampled_from([["segment_lengths"], ["dilation_rates"],
                                             ["segment_lengths", "dilation_rates"]])):
                data[key] = []
        elif op == "hilbert":
            data["hilbert"] = draw(bad_hilbert(data.get("segment_lengths")))
        elif op == "name":
            data["name"] = draw(names)
        elif op == "intfloat":       # an int field written as a float (16.0, 1e30, ...)
            key = draw(st.sampled_from(["num_heads", "num_kv_heads", "head_dim", "ring_size"]))
            value = data.get(key, 1)
            data[key] = float(value) if _is_int(value) and abs(value) < 1e300 else 1e30
    return data


not_objects = st.one_of(scalars, st.lists(junk, max_size=3), st.integers(1, 1600).map(Deep))
any_specs = st.one_of(valid_specs(), mutated_specs(), mutated_specs(), not_objects)


