"""Fuzzing the spec loader (SPEC.md §1, §4) with hypothesis.

Thousands of spec files, valid and invalid mixed, hostile values included (1e30, floats
where ints belong, booleans, negatives, empty lists, huge ints, strings, nested junk,
unknown keys, names with path separators or "..", mismatched list lengths, bad Hilbert
objects, JSON nested close to the interpreter's recursion limit). An independent oracle,
written from SPEC.md §1 and the limits documented in dilgen/spec.py, says which specs
are valid; the loader must agree with it:

- an invalid spec raises SpecError with ONE line that starts with the file name and
  names the problem; through `dilgen compile` it exits 2 with one line on stderr, writes
  nothing and creates no output folder;
- a valid spec loads to the canonical form the oracle predicts, its key does not depend
  on key order, whitespace, the way it was built or the process, and it plans for the
  interpreter and sm90; `dilgen compile` writes exactly `<out>/<name>.py` (and the
  package's `__init__.py`), never anything outside --out.

Every @given test runs with derandomize=True and no example database, so CI sees the
same examples every run.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import keyword
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from dilgen import spec as spec_mod
from dilgen import support as support_mod
from dilgen.spec import Hilbert, Spec, SpecError, load_spec, spec_from_dict

from conftest import run_cli

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


@st.composite
def valid_specs(draw) -> dict:
    """A spec that SPEC §1 accepts, with the optional fields sometimes left out."""
    n = draw(st.one_of(st.integers(1, 4), st.integers(1, MAX_BRANCHES)))
    kind = draw(st.sampled_from([None, None, "segment", "segment_grids", "sequence"]))
    grids = None
    if kind == "segment":
        segs = [1 << draw(st.integers(0, 24)) for _ in range(n)]
    elif kind == "segment_grids":
        grids = [[draw(st.integers(1, 4096)), draw(st.integers(1, 4096))] for _ in range(n)]
        segs = [r * c for r, c in grids]
    else:
        segs = draw(st.lists(st.one_of(st.integers(1, 64), st.integers(1, 1 << 17),
                                       st.integers(1, spec_mod.MAX_SEGMENT), st.just(spec_mod.MAX_SEGMENT)),
                             min_size=n, max_size=n))
    rates = draw(st.lists(st.one_of(st.integers(1, 16), st.sampled_from([6, 12, 24]),
                                    st.integers(1, spec_mod.MAX_DILATION)), min_size=n, max_size=n))
    num_heads = draw(st.one_of(st.integers(1, 64), st.integers(1, MAX_HEADS)))
    data = {"name": draw(st.from_regex(r"[a-z_][a-z0-9_]{0,30}", fullmatch=True)
                         .filter(valid_module_name)),
            "num_heads": num_heads, "head_dim": draw(st.sampled_from(KERNEL_HEAD_DIMS)),
            "segment_lengths": segs, "dilation_rates": rates}
    optional = {
        "num_kv_heads": draw(st.sampled_from(_divisors(num_heads))),
        "dtype": draw(st.sampled_from(DTYPES)),
        "causal": draw(st.booleans()),
        "ring_size": draw(st.one_of(st.just(1), st.integers(1, 8), st.integers(1, MAX_RING))),
        "softmax_scale": draw(st.one_of(
            st.none(), st.integers(1, 10_000),
            st.floats(min_value=0, max_value=MAX_SCALE, exclude_min=True))),
        "hilbert": None,
    }
    if kind == "segment":
        optional["hilbert"] = draw(st.sampled_from([{"scope": "segment"},
                                                    {"scope": "segment", "grids": None}]))
    elif kind == "segment_grids":
        optional["hilbert"] = {"scope": "segment", "grids": grids}
    elif kind == "sequence":
        rows = draw(st.integers(1, 4096))
        optional["hilbert"] = {"scope": "sequence",
                               "grid": [rows, draw(st.integers(1, MAX_CELLS // rows))]}
        optional["ring_size"] = 1          # a ring needs raster chunks: refused with "sequence"
    for key, value in optional.items():
        if draw(st.booleans()) or value is not None and key == "hilbert":
            data[key] = value
    # JSON key order must never matter
    keys = draw(st.permutations(list(data)))
    return {k: data[k] for k in keys}


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


# --------------------------------------------------------------------------- helpers


def encode(data, *, indent=None, sort_keys=False) -> tuple[str, bool]:
    """JSON text of `data` (Deep values written as brackets); and whether it has any."""
    deep: dict[str, int] = {}

    def swap(x):
        if isinstance(x, Deep):
            token = f"@@deep{len(deep)}@@"
            deep[token] = x.depth
            return token
        if isinstance(x, list):
            return [swap(v) for v in x]
        if isinstance(x, dict):
            return {k: swap(v) for k, v in x.items()}
        return x

    text = json.dumps(swap(data), indent=indent, sort_keys=sort_keys)
    for token, depth in deep.items():
        text = text.replace(json.dumps(token), "[" * depth + "]" * depth, 1)
    return text, bool(deep)


def write_fresh(path: Path, text: str) -> Path:
    """Write a new file (unlink first: truncating an existing file in place makes ext4
    flush it on close, ~5 ms a write, which would dominate these tests)."""
    path.unlink(missing_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def assert_one_line(msg: str) -> None:
    assert msg, "empty error message"
    assert "\n" not in msg and "\r" not in msg, f"not one line: {msg!r}"
    assert msg == msg.strip(), f"stray whitespace: {msg!r}"


def check_refused(msg: str, src: str, problems: list[str], has_deep: bool) -> None:
    assert_one_line(msg)
    assert msg.startswith(f"{src}: "), f"does not name the file: {msg!r}"
    assert any(p in msg for p in problems) or has_deep and "nested too deeply" in msg, \
        f"names none of {problems}: {msg!r}"


def check_valid(spec: Spec, data: dict, canonical: dict, folder: Path) -> None:
    from dilgen.planner import plan
    from dilgen.targets import INTERPRETER, SM90

    assert spec.to_json() == canonical
    key = spec.key()
    blob = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    assert key == hashlib.sha256(blob.encode()).hexdigest()
    # the same spec: other key order and whitespace, canonical form, built by hand
    other = folder / "other.json"
    write_fresh(other, encode(data, indent=3, sort_keys=True)[0])
    assert load_spec(other).key() == key
    assert spec_from_dict(spec.to_json()).key() == key
    kwargs = {k: v for k, v in canonical.items() if k != "hilbert"}
    hil = canonical["hilbert"]
    by_hand = Spec(**kwargs, hilbert=None if hil is None else Hilbert(
        hil["scope"], grids=tuple(map(tuple, hil["grids"])) if "grids" in hil else None,
        grid=tuple(hil["grid"]) if "grid" in hil else None))
    assert by_hand == spec and by_hand.key() == key
    # the name stays inside any output folder
    out = (folder / "out").resolve()
    assert (out / f"{spec.name}.py").resolve().parent == out
    assert spec.name.isidentifier() and not keyword.iskeyword(spec.name)
    refusal = support_mod.unsupported_by_kernels(spec)
    if refusal is not None:
        # valid, but not in the kernels yet (issue 16): the planner refuses it with this line
        assert_one_line(refusal)
        with pytest.raises(SpecError) as exc:
            plan(spec, INTERPRETER)
        assert str(exc.value) == refusal
        return
    for target in (INTERPRETER, SM90):
        p = plan(spec, target)
        assert p.spec_key == key and p.target == target.name
        assert p.spec == canonical
        assert len(p.branches) == spec.num_branches
        assert [(b.segment_length, b.dilation) for b in p.branches] == spec.branches()


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")




def _tree(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


# --------------------------------------------------------------------------- load_spec


@fuzz_settings(1000)
@given(data=any_specs)
def test_fuzz_load_spec(scratch, data):
    """1000 spec files: the loader agrees with the oracle; errors are one line naming
    the problem; valid specs have a stable key and plan for the interpreter and sm90."""
    problems, canonical = oracle(data)
    text, has_deep = encode(data)
    path = scratch / "spec.json"
    write_fresh(path, text)
    note(f"oracle: {problems or 'valid'}")
    event("valid" if not problems else "invalid")
    try:
        spec = load_spec(path)
    except SpecError as exc:
        assert problems, f"a valid spec was refused: {exc}"
        check_refused(str(exc), "spec.json", problems, has_deep)
        return
    assert not problems, f"accepted a spec the oracle refuses for {problems}: {spec!r}"
    check_valid(spec, data, canonical, scratch)


@fuzz_settings(200)
@given(data=valid_specs())
def test_fuzz_valid_specs_plan(scratch, data):
    """Valid specs only (the mixed run above spends half its examples on invalid ones)."""
    problems, canonical = oracle(data)
    assert not problems, problems
    path = scratch / "valid.json"
    write_fresh(path, encode(data)[0])
    check_valid(load_spec(path), data, canonical, scratch)


# Python-only values a JSON file cannot hold, for the dict/keyword API.
class _MultiLineRepr:
    def __repr__(self) -> str:
        return "line one\nline two"


py_junk = st.one_of(
    junk, st.sampled_from([10**5000, -(10**5000), 10**400, (16, 32), (), {1, 2}, b"16",
                           bytearray(b"x"), 1j, _MultiLineRepr(), object(), [10**5000],
                           {"scope": "segment", 1: 2}, {1: 2}, {(1, 2): 3}]))


@fuzz_settings(200)
@given(data=mutated_specs(), key=st.one_of(st.sampled_from(FIELDS), st.integers(), st.none(),
                                           st.text(max_size=4)),
       value=py_junk)
def test_fuzz_spec_from_dict_python_values(data, key, value):
    """spec_from_dict with Python values (huge ints, tuples, sets, bytes, non-string keys,
    objects whose repr spans lines): a Spec or a one-line SpecError, nothing else."""
    data[key] = value
    try:
        spec = spec_from_dict(data, source="api")
    except SpecError as exc:
        assert_one_line(str(exc))
        assert str(exc).startswith("api: ")
        return
    assert spec_from_dict(spec.to_json()) == spec
    assert spec_from_dict(spec.to_json()).key() == spec.key()


CONTENTS = {"valid": {"name": "ok", "num_heads": 2, "head_dim": 16, "segment_lengths": [8],
                      "dilation_rates": [1]},
            "invalid": {"name": "ok", "num_heads": 2, "head_dim": 12, "segment_lengths": [8],
                        "dilation_rates": [1]}}


@fuzz_settings(150)
@given(filename=st.text(st.characters(codec="utf-8", exclude_characters="/\x00"),
                        min_size=1, max_size=40).filter(lambda s: s not in (".", "..")),
       content=st.sampled_from(["valid", "invalid", "missing", "not json", "bad utf-8"]))
def test_fuzz_file_names(scratch, filename, content):
    """Any file name (newlines, tabs, control characters, unicode): still one line."""
    folder = scratch / "names"
    folder.mkdir(exist_ok=True)
    path = folder / filename
    path.unlink(missing_ok=True)
    if content in CONTENTS:
        path.write_text(json.dumps(CONTENTS[content]))
    elif content == "not json":
        path.write_text("{nope")
    elif content == "bad utf-8":
        path.write_bytes(b'{"name": "\xff"}')
    try:
        spec = load_spec(path)
    except SpecError as exc:
        assert content != "valid", exc
        assert_one_line(str(exc))
        return
    assert content == "valid" and spec.name == "ok"


# --------------------------------------------------------------------------- JSON depth


def test_nesting_sweep_up_to_recursion_limit(scratch):
    """Every nesting depth up to past the recursion limit, in three places (an unknown
    field, the name, a Hilbert grid): a one-line SpecError, never a RecursionError. The
    interesting depths (parsed, but too deep to print back) depend on the stack depth of
    the caller, so every depth is tried rather than sampled."""
    path = scratch / "deep.json"
    base = '"name": "ok", "num_heads": 2, "head_dim": 16, "segment_lengths": [4], "dilation_rates": [1]'
    templates = {
        "unknown field": "{" + base + ', "extra": %s}',
        "name": '{"name": %s, "num_heads": 2, "head_dim": 16, "segment_lengths": [4], "dilation_rates": [1]}',
        "hilbert.grids": "{" + base + ', "hilbert": {"scope": "segment", "grids": [%s]}}',
    }
    for field, template in templates.items():
        for depth in range(1, sys.getrecursionlimit() + 60):
            write_fresh(path, template % ("[" * depth + "]" * depth))
            try:
                load_spec(path)
            except SpecError as exc:
                msg = str(exc)
                assert_one_line(msg)
                assert field in msg or "nested too deeply" in msg, (depth, msg)
            else:
                pytest.fail(f"depth {depth} in {field} was accepted")


def test_nesting_sweep_through_cli(scratch):
    """The same sweep through `dilgen compile` (a deeper stack): exit 2, one line."""
    path = scratch / "deep_cli.json"
    out = scratch / "deep_out"
    for depth in range(1, sys.getrecursionlimit() + 60, 3):
        write_fresh(path, '{"extra": %s}' % ("[" * depth + "]" * depth))
        rc, stdout, stderr = run_cli(["compile", str(path), "--out", str(out)])
        assert rc == 2 and stdout == "", (depth, rc, stderr[-500:])
        assert len(stderr.splitlines()) == 1 and stderr.startswith("dilgen: error:"), (depth, stderr[-500:])
    assert not out.exists()


# --------------------------------------------------------------------------- the CLI


@fuzz_settings(50)
@given(data=st.one_of(valid_specs(), mutated_specs(), not_objects))
def test_fuzz_cli_compile(scratch, monkeypatch, data):
    """`dilgen compile` (in-process, as the console script runs it) on 50 specs: exit 2
    and one stderr line for a bad one, with nothing written; exit 0 for a good one, with
    exactly <out>/<name>.py and <out>/__init__.py written and nothing else anywhere."""
    monkeypatch.delenv("DILGEN_DUMP_DIR", raising=False)
    problems, canonical = oracle(data)
    root = scratch / f"cli-{len(list(scratch.glob('cli-*')))}"
    root.mkdir()
    path = root / "spec.json"
    text, has_deep = encode(data)
    path.write_text(text)
    out = root / "work" / "out"
    name = data.get("name") if isinstance(data, dict) else None
    outside = []
    if isinstance(name, str) and "\x00" not in name:
        candidate = Path(out, f"{name}.py")
        with contextlib.suppress(OSError, ValueError):
            if not candidate.resolve().is_relative_to(out.resolve()) and not candidate.exists():
                outside.append(candidate)
    refusal = None if problems else support_mod.unsupported_by_kernels(spec_from_dict(data, source="spec.json"))
    rc, stdout, stderr = run_cli(["compile", str(path), "--arch", "interpreter",
                                          "--out", str(out)])
    for candidate in outside:
        assert not candidate.exists(), f"wrote {candidate} outside --out"
    if refusal is not None:
        # valid, but not in the kernels (issue 16): the planner refuses it, exit 2, one line
        assert "Traceback" not in stderr, stderr
        assert rc == 2, (rc, stderr)
        assert stderr.splitlines() == [f"dilgen: error: {refusal}"], stderr
        assert stdout == ""
        assert _tree(root) == {"spec.json"}, "a refused spec wrote something"
    elif problems:
        assert "Traceback" not in stderr, stderr
        assert rc == 2, (rc, stderr)
        lines = stderr.splitlines()
        assert len(lines) == 1, f"expected one stderr line, got {stderr!r}"
        assert lines[0].startswith("dilgen: error: ")
        check_refused(lines[0].removeprefix("dilgen: error: "), str(path), problems, has_deep)   # the path as given
        assert stdout == ""
        assert _tree(root) == {"spec.json"}, "a refused spec wrote something"
    else:
        assert rc == 0, stderr
        assert _tree(root) == {"spec.json", "work", "work/out", "work/out/__init__.py",
                               f"work/out/{canonical['name']}.py"}
        assert f"wrote {out / canonical['name']}.py" in stdout
        source = (out / f"{canonical['name']}.py").read_text()
        assert load_spec(path).key() in source


# --------------------------------------------------------------------------- keys


def test_keys_stable_across_processes(tmp_path):
    """25 fuzzed valid specs: a fresh interpreter with another hash seed computes the
    same keys."""
    collected: list[dict] = []

    @fuzz_settings(25)
    @given(data=valid_specs())
    def collect(data):
        collected.append(data)

    collect()
    paths, keys = [], []
    for i, data in enumerate(collected):
        path = tmp_path / f"s{i}.json"
        path.write_text(encode(data)[0])
        paths.append(str(path))
        keys.append(load_spec(path).key())
    code = ("import sys; from dilgen.spec import load_spec\n"
            "for p in sys.argv[1:]: print(load_spec(p).key())")
    env = dict(os.environ, PYTHONHASHSEED="4242")
    res = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == keys


# --------------------------------------------------------------------------- found by fuzzing
# Each of these crashed or misled before dilgen/spec.py was fixed; kept as plain examples.


@pytest.mark.parametrize("name", ["class", "import", "lambda", "and", "__init__"])
def test_reserved_module_names_are_refused(name):
    """`from generated.class import attention` is a SyntaxError; `__init__` would
    overwrite the output package's own __init__.py."""
    with pytest.raises(SpecError, match=r"name = .*reserved"):
        spec_from_dict(dict(CONTENTS["valid"], name=name))


def test_integer_literal_too_long_to_read_is_named_as_too_large(scratch):
    digits = "9" * 80
    path = write_fresh(scratch / "long.json", '{"name": "ok", "num_heads": 2, "head_dim": 16, '
                       f'"segment_lengths": [{digits}], "dilation_rates": [1]}}')
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    msg = str(exc.value)
    assert f"segment_lengths[0] = {digits[:20]}..." in msg, msg      # shown as a number
    assert "must be < 2**31" in msg and "must be an integer" not in msg, msg


@pytest.mark.parametrize("value", [10**5000, [10**5000], _MultiLineRepr()],
                         ids=["int_5001_digits", "list_of_it", "multi_line_repr"])
def test_unprintable_python_values_still_give_one_line(value):
    with pytest.raises(SpecError) as exc:
        spec_from_dict(dict(CONTENTS["valid"], num_heads=value))
    assert_one_line(str(exc.value))


def test_huge_python_int_scale_and_non_string_keys():
    with pytest.raises(SpecError, match="softmax_scale"):
        spec_from_dict(dict(CONTENTS["valid"], softmax_scale=10**400))
    with pytest.raises(SpecError, match="unknown field"):
        spec_from_dict({**CONTENTS["valid"], 1: 2})
    with pytest.raises(SpecError, match=r"hilbert\.1 = 2: unknown field"):
        spec_from_dict({**CONTENTS["valid"], "hilbert": {"scope": "segment", 1: 2}})


def test_file_name_with_a_newline_gives_one_line(scratch):
    path = write_fresh(scratch / "a\nb.json", "{}")
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    assert_one_line(str(exc.value))
    assert str(exc.value).startswith("a\\nb.json: ")
