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
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import event, given, note
from hypothesis import strategies as st

from dilgen import support as support_mod
from dilgen.spec import Hilbert, Spec, SpecError, load_spec, spec_from_dict

from conftest import run_cli
from spec_oracle import (FIELDS, Deep, any_specs, fuzz_settings, junk, mutated_specs, not_objects,
                         oracle, valid_specs)


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
