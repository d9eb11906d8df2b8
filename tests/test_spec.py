"""SPEC.md §1: the spec file, its defaults and its canonical key (its refusals:
tests/test_spec_errors.py)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import pytest

from dilgen.spec import Hilbert, Spec, SpecError, default_grid, load_spec, spec_from_dict

from spec_helpers import BASE, _one_line, _patched, _write

# The SPEC §1 example, verbatim.
SPEC_EXAMPLE = {
    "name": "longnet_base", "num_heads": 16, "num_kv_heads": 16, "head_dim": 128,
    "dtype": "bfloat16", "segment_lengths": [2048, 4096, 8192], "dilation_rates": [1, 2, 4],
    "causal": False, "hilbert": None, "ring_size": 1,
}
# sha256 of the canonical JSON of SPEC_EXAMPLE. The key names generated files and cache
# entries, so it must be stable across runs, machines and releases: if this changes,
# every cache entry and every generated header changes with it.
SPEC_EXAMPLE_KEY = "95e9f8aba21f707f2218825cf3bacd92a18af098dec78f5d084e7f1c3ba95b32"


# --------------------------------------------------------------------------- good specs


def test_minimal_spec_fills_defaults(tmp_path):
    spec = load_spec(_write(tmp_path / "min.json", BASE))
    assert spec.name == "ok_spec"
    assert spec.num_heads == 4 and spec.num_kv_heads == 4
    assert spec.head_dim == 64
    assert spec.dtype == "bfloat16"
    assert spec.segment_lengths == (16, 32) and spec.dilation_rates == (1, 2)
    assert spec.causal is False
    assert spec.hilbert is None
    assert spec.ring_size == 1
    assert spec.softmax_scale is None
    assert spec.scale == pytest.approx(1 / math.sqrt(64))
    assert spec.num_branches == 2 and spec.group_size == 1
    assert spec.branches() == [(16, 1), (32, 2)]
    canon = spec.to_json()
    assert list(canon) == ["name", "num_heads", "num_kv_heads", "head_dim", "dtype",
                           "segment_lengths", "dilation_rates", "causal", "hilbert",
                           "ring_size", "softmax_scale"]
    assert canon["num_kv_heads"] == 4 and canon["dtype"] == "bfloat16"
    # the canonical form is itself a valid spec that loads back to the same value
    assert load_spec(_write(tmp_path / "canon.json", canon)) == spec


def test_spec_example_loads_and_key_is_pinned(tmp_path):
    spec = load_spec(_write(tmp_path / "longnet_base.json", SPEC_EXAMPLE))
    assert spec.key() == SPEC_EXAMPLE_KEY
    blob = json.dumps(spec.to_json(), sort_keys=True, separators=(",", ":"))
    assert spec.key() == hashlib.sha256(blob.encode()).hexdigest()


def test_key_is_stable_across_processes(tmp_path):
    path = _write(tmp_path / "longnet_base.json", SPEC_EXAMPLE)
    code = "import sys; from dilgen.spec import load_spec; print(load_spec(sys.argv[1]).key())"
    env = dict(os.environ, PYTHONHASHSEED="12345")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == load_spec(path).key() == SPEC_EXAMPLE_KEY


def test_equal_specs_have_equal_keys(tmp_path):
    a = load_spec(_write(tmp_path / "a.json", BASE))
    # same spec: other file name, other key order, other whitespace, defaults spelled out
    explicit = {"softmax_scale": None, "ring_size": 1, "hilbert": None, "causal": False,
                "dilation_rates": [1, 2], "segment_lengths": [16, 32], "dtype": "bfloat16",
                "head_dim": 64, "num_kv_heads": 4, "num_heads": 4, "name": "ok_spec"}
    (tmp_path / "b.json").write_text(json.dumps(explicit, separators=(",", ":")))
    b = load_spec(tmp_path / "b.json")
    assert a == b and a.key() == b.key() and hash(a) == hash(b)
    assert len(a.key()) == 64 and int(a.key(), 16) >= 0
    # an integer scale and the same float scale are the same spec
    c = load_spec(_write(tmp_path / "c.json", _patched({"softmax_scale": 1})))
    d = load_spec(_write(tmp_path / "d.json", _patched({"softmax_scale": 1.0})))
    assert c == d and c.key() == d.key()


CHANGES = [
    ("name", "other_spec"),
    ("num_heads", 8),
    ("num_kv_heads", 2),
    ("head_dim", 128),
    ("dtype", "float16"),
    ("segment_lengths", [16, 64]),
    ("dilation_rates", [1, 4]),
    ("causal", True),
    ("hilbert", {"scope": "segment"}),
    ("ring_size", 2),
    ("softmax_scale", 0.5),
    ("head_offsets", "block"),
    ("short_segments", "zero_pad"),
]


@pytest.mark.parametrize("field,value", CHANGES, ids=[c[0] for c in CHANGES])
def test_key_changes_when_any_field_changes(tmp_path, field, value):
    base = load_spec(_write(tmp_path / "base.json", BASE))
    changed = load_spec(_write(tmp_path / "changed.json", _patched({field: value})))
    assert changed != base
    assert changed.key() != base.key()


def test_all_single_field_changes_give_distinct_keys(tmp_path):
    keys = {load_spec(_write(tmp_path / "base.json", BASE)).key()}
    for i, (field, value) in enumerate(CHANGES):
        keys.add(load_spec(_write(tmp_path / f"c{i}.json", _patched({field: value}))).key())
    assert len(keys) == len(CHANGES) + 1


def test_hand_built_spec_equals_loaded_spec(tmp_path):
    loaded = load_spec(_write(tmp_path / "ok_spec.json", BASE))
    by_hand = Spec(name="ok_spec", num_heads=4, head_dim=64,
                   segment_lengths=[16, 32], dilation_rates=[1, 2])
    as_tuples = Spec(name="ok_spec", num_heads=4, head_dim=64,
                     segment_lengths=(16, 32), dilation_rates=(1, 2), num_kv_heads=4)
    for spec in (by_hand, as_tuples):
        assert spec == loaded
        assert spec.key() == loaded.key()
        assert hash(spec) == hash(loaded)
        assert spec.to_json() == loaded.to_json()
        assert isinstance(spec.segment_lengths, tuple) and spec.num_kv_heads == 4


def test_hand_built_hilbert_spec_equals_loaded_spec(tmp_path):
    data = _patched({"segment_lengths": [12, 15], "dilation_rates": [1, 3], "causal": True,
                     "hilbert": {"scope": "segment", "grids": [[3, 4], [3, 5]]},
                     "softmax_scale": 0.25, "num_kv_heads": 2, "dtype": "float32"})
    loaded = load_spec(_write(tmp_path / "h.json", data))
    by_hand = Spec(name="ok_spec", num_heads=4, num_kv_heads=2, head_dim=64, dtype="float32",
                   segment_lengths=[12, 15], dilation_rates=[1, 3], causal=True,
                   hilbert=Hilbert("segment", grids=((3, 4), (3, 5))), softmax_scale=0.25)
    from_dict = Spec(name="ok_spec", num_heads=4, num_kv_heads=2, head_dim=64, dtype="float32",
                     segment_lengths=[12, 15], dilation_rates=[1, 3], causal=True,
                     hilbert={"scope": "segment", "grids": [[3, 4], [3, 5]]},
                     softmax_scale=0.25)
    assert by_hand == loaded == from_dict
    assert by_hand.key() == loaded.key() == from_dict.key()
    assert loaded.hilbert == Hilbert("segment", grids=((3, 4), (3, 5)))


def test_hand_built_spec_is_validated():
    with pytest.raises(SpecError) as exc:
        Spec(name="ok_spec", num_heads=4, head_dim=12, segment_lengths=[16], dilation_rates=[1])
    _one_line(str(exc.value))
    assert "head_dim" in str(exc.value) and "12" in str(exc.value)
    with pytest.raises(SpecError):
        Spec(name="../evil", num_heads=4, head_dim=64, segment_lengths=[16], dilation_rates=[1])
    with pytest.raises(SpecError):
        Spec(name="ok", num_heads=4, head_dim=64, segment_lengths=[16, 32], dilation_rates=[1])


def test_python_and_json_name_unknown_and_missing_fields_alike():
    """Issue 31: Spec(**fields) and spec_from_dict(fields) refuse an unknown or a missing
    field with the same SpecError, word for word; Spec stays a frozen dataclass."""
    import dataclasses
    import inspect
    for fields, words in (({**BASE, "foo": 1}, "foo = 1: unknown field (allowed: name, "),
                          ({**BASE, "dilation_rate": [1, 2]}, "dilation_rate = [1, 2]: unknown field"),
                          ({k: v for k, v in BASE.items() if k != "head_dim"},
                           "head_dim is missing: it is a required field")):
        with pytest.raises(SpecError) as from_python:
            Spec(**fields)
        with pytest.raises(SpecError) as from_json:
            spec_from_dict(fields)
        assert str(from_python.value) == str(from_json.value), str(from_python.value)
        assert str(from_python.value).startswith(f"<spec>: {words}"), str(from_python.value)
    with pytest.raises(SpecError, match=r"^here: foo = 1: unknown field \(allowed: name, num_heads, "):
        Spec(**BASE, foo=1, source="here")
    spec = Spec(**BASE)
    assert dataclasses.is_dataclass(spec) and Spec(**spec.to_json()) == spec
    assert dataclasses.replace(spec, causal=True) == spec.replace(causal=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.causal = True
    with pytest.raises(SpecError, match="foo = 1: unknown field"):
        dataclasses.replace(spec, foo=1)
    assert list(inspect.signature(Spec).parameters)[:3] == ["name", "num_heads", "head_dim"]
    import copy
    import pickle
    assert copy.deepcopy(spec) == spec == pickle.loads(pickle.dumps(spec))


def test_replace_revalidates(tmp_path):
    spec = load_spec(_write(tmp_path / "a.json", BASE))
    other = spec.replace(causal=True)
    assert other.causal is True and other != spec and other.key() != spec.key()
    assert other.replace(causal=False) == spec
    with pytest.raises(SpecError):
        spec.replace(num_heads=0)
    with pytest.raises(SpecError):
        spec.replace(dilation_rate=[1, 2])      # unknown field


@pytest.mark.parametrize("patch", [
    {"head_dim": 16}, {"head_dim": 32}, {"head_dim": 128}, {"head_dim": 256},
    {"dtype": "float16"}, {"dtype": "float32"},
    {"num_kv_heads": 1}, {"num_kv_heads": 2},
    {"segment_lengths": [2048, 4096, 8192, 16384], "dilation_rates": [1, 2, 6, 12]},  # LongNet
    {"segment_lengths": [16, 16], "dilation_rates": [1, 1]},       # a repeated branch counts twice
    {"segment_lengths": [7], "dilation_rates": [3]},
    {"hilbert": {"scope": "segment"}},
    {"hilbert": {"scope": "segment", "grids": [[2, 8], [8, 4]]}},
    {"hilbert": {"scope": "sequence", "grid": [8, 8]}},
    {"ring_size": 4}, {"softmax_scale": 0.125}, {"softmax_scale": 2},
    {"causal": True},
    {"head_dim": 8}, {"head_dim": 48}, {"head_dim": 80}, {"head_dim": 96}, {"head_dim": 248},
    {"head_offsets": "block"}, {"head_offsets": "mod"},
    {"short_segments": "zero_pad"}, {"short_segments": "exact"},
    {"head_offsets": "block", "short_segments": "zero_pad", "head_dim": 48, "num_heads": 16,
     "segment_lengths": [1024, 5792, 32768, 185363, 1048576], "dilation_rates": [1, 2, 4, 8, 16]},
], ids=lambda p: json.dumps(p))
def test_valid_variants_load(tmp_path, patch):
    spec = load_spec(_write(tmp_path / "v.json", _patched(patch)))
    for key, value in patch.items():
        got = spec.to_json().get(key, getattr(spec, key))   # later fields: absent when default
        if key == "softmax_scale":
            assert got == float(value)
        elif key == "hilbert":
            assert got["scope"] == value["scope"]
        else:
            assert got == value


def test_default_grid():
    assert default_grid(16) == (4, 4)
    assert default_grid(32) == (4, 8)
    assert default_grid(2) == (1, 2)
    assert default_grid(1) == (1, 1)
    assert default_grid(12) is None


def test_spec_from_dict_and_path_types(tmp_path):
    path = _write(tmp_path / "a.json", BASE)
    assert load_spec(str(path)) == load_spec(path) == spec_from_dict(dict(BASE))
    with pytest.raises(SpecError):
        spec_from_dict([BASE])


def test_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError) as exc:
        load_spec(tmp_path / "nope.json")
    _one_line(str(exc.value))
    assert "nope.json" in str(exc.value)
