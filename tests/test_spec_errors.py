"""SPEC.md §1's refusals: every bad spec of the table is refused by `load_spec` with a
`SpecError` whose message is ONE line naming the file, the field path, the value and the
rule, and `dilgen compile` on the same file exits 2 with exactly one stderr line
"dilgen: error: ..." naming the field, never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from dilgen.spec import Spec, SpecError, load_spec, spec_from_dict

from conftest import run_cli
from spec_helpers import BASE, DELETE, _one_line, _patched, _write


# --------------------------------------------------------------------------- bad specs
#
# (id, patch or raw text, field path, value as shown, rule fragment). For the rows with
# no field (the file is not a JSON object at all) `field` is what names the problem.

_NAN_TEXT = ('{"name": "ok_spec", "num_heads": 4, "head_dim": 64, "segment_lengths": [16], '
             '"dilation_rates": [1], "softmax_scale": NaN}')
_INF_TEXT = _NAN_TEXT.replace("NaN", "-Infinity")
_BIG_DIGITS_TEXT = ('{"name": "ok_spec", "num_heads": 4, "head_dim": 64, "segment_lengths": ['
                    + "9" * 5000 + '], "dilation_rates": [1]}')
_NEWLINE_KEY_TEXT = ('{"name": "ok_spec", "num_heads": 4, "head_dim": 64, "segment_lengths": [16], '
                     '"dilation_rates": [1], "bad\\nkey": 1}')



BAD = [
    # name
    ("name_uppercase", {"name": "Bad"}, "name", '"Bad"', "[a-z_][a-z0-9_]*"),
    ("name_path_separator", {"name": "../x"}, "name", '"../x"', "[a-z_][a-z0-9_]*"),
    ("name_leading_digit", {"name": "1abc"}, "name", '"1abc"', "[a-z_][a-z0-9_]*"),
    ("name_not_string", {"name": 5}, "name", "5", "[a-z_][a-z0-9_]*"),
    ("name_empty", {"name": ""}, "name", '""', "[a-z_][a-z0-9_]*"),
    # num_heads / num_kv_heads
    ("num_heads_zero", {"num_heads": 0}, "num_heads", "0", ">= 1"),
    ("num_heads_negative", {"num_heads": -1}, "num_heads", "-1", ">= 1"),
    ("num_heads_float", {"num_heads": 2.5}, "num_heads", "2.5", "integer"),
    ("num_heads_bool", {"num_heads": True}, "num_heads", "true", "integer"),
    ("num_heads_string", {"num_heads": "4"}, "num_heads", '"4"', "integer (write 4 without quotes)"),
    ("num_heads_integral_float", {"num_heads": 4.0}, "num_heads", "4.0", "integer (write 4, not 4.0)"),
    ("num_kv_heads_bool", {"num_kv_heads": True}, "num_kv_heads", "true", "integer, not true or false"),
    ("num_kv_heads_not_dividing", {"num_kv_heads": 3}, "num_kv_heads", "3", "divide"),
    ("num_kv_heads_zero", {"num_kv_heads": 0}, "num_kv_heads", "0", ">= 1"),
    ("num_kv_heads_null", {"num_kv_heads": None}, "num_kv_heads", "null", "integer"),
    # head_dim / dtype
    ("head_dim_12", {"head_dim": 12}, "head_dim", "12", "multiple of 8"),
    ("head_dim_264", {"head_dim": 264}, "head_dim", "264", "multiple of 8 from 8 to 256"),
    ("head_dim_0", {"head_dim": 0}, "head_dim", "0", "multiple of 8"),
    ("head_dim_string", {"head_dim": "64"}, "head_dim", '"64"', "must be an integer, a multiple of 8"),
    ("head_dim_integral_float", {"head_dim": 64.0}, "head_dim", "64.0",
     "must be an integer, a multiple of 8 from 8 to 256 (write 64, not 64.0)"),
    ("head_dim_bool", {"head_dim": True}, "head_dim", "true", "must be an integer"),
    ("dtype_fp8", {"dtype": "fp8"}, "dtype", '"fp8"', "one of"),
    # head_offsets / short_segments (issue 16: torchscale's layout)
    ("head_offsets_unknown", {"head_offsets": "blocks"}, "head_offsets", '"blocks"', '"mod" (offset h mod r) or "block"'),
    ("head_offsets_null", {"head_offsets": None}, "head_offsets", "null", '"mod"'),
    ("short_segments_unknown", {"short_segments": "pad"}, "short_segments", '"pad"', '"exact"'),
    ("short_segments_bool", {"short_segments": True}, "short_segments", "true", '"zero_pad"'),
    ("zero_pad_with_hilbert", {"short_segments": "zero_pad", "hilbert": {"scope": "segment"}},
     "short_segments", '"zero_pad"', "hilbert null"),
    # segment_lengths / dilation_rates
    ("segment_lengths_empty", {"segment_lengths": [], "dilation_rates": []},
     "segment_lengths", "[]", "empty"),
    ("segment_lengths_zero", {"segment_lengths": [0], "dilation_rates": [1]},
     "segment_lengths[0]", "0", ">= 1"),
    ("segment_lengths_string_item", {"segment_lengths": ["a"], "dilation_rates": [1]},
     "segment_lengths[0]", '"a"', "integer"),
    ("segment_lengths_not_list", {"segment_lengths": 16, "dilation_rates": [1]},
     "segment_lengths", "16", "list"),
    ("segment_lengths_float_1e30", {"segment_lengths": [1e30], "dilation_rates": [1]},
     "segment_lengths[0]", "1e+30", "integer"),
    ("segment_lengths_integral_float", {"segment_lengths": [16.0, 32]},
     "segment_lengths[0]", "16.0", "integer"),
    ("segment_lengths_huge_int", {"segment_lengths": [10**30], "dilation_rates": [1]},
     "segment_lengths[0]", str(10**30), "must be < 2**31"),
    # issue 35: the kernels compute positions in int32 (limits tested at the bound below)
    ("segment_lengths_2_31", {"segment_lengths": [16, 2**31]}, "segment_lengths[1]", "2147483648",
     "must be < 2**31 (the kernels compute positions in int32)"),
    ("segment_lengths_2_40", {"segment_lengths": [2**40, 32]}, "segment_lengths[0]", "1099511627776",
     "must be < 2**31 (the kernels compute positions in int32)"),
    ("dilation_rates_2_24", {"dilation_rates": [1, 2**24]}, "dilation_rates[1]", "16777216",
     "must be < 2**24 (the kernels compute positions in int32, and a tile of 128 lanes"),
    ("dilation_rates_integral_float", {"dilation_rates": [1, 2.0]}, "dilation_rates[1]", "2.0",
     "integer (write 2, not 2.0)"),
    ("segment_lengths_bool_item", {"segment_lengths": [True, 32]},
     "segment_lengths[0]", "true", "integer"),
    ("dilation_rates_length_mismatch", {"dilation_rates": [1]},
     "dilation_rates", "[1]", "same length"),
    ("dilation_rates_zero", {"dilation_rates": [1, 0]}, "dilation_rates[1]", "0", ">= 1"),
    ("dilation_rates_missing", {"dilation_rates": DELETE}, "dilation_rates", "", "required"),
    # causal
    ("causal_yes", {"causal": "yes"}, "causal", '"yes"', "true or false"),
    ("causal_int", {"causal": 1}, "causal", "1", "true or false"),
    # hilbert
    ("hilbert_bad_scope", {"hilbert": {"scope": "row"}}, "hilbert.scope", '"row"', "segment"),
    ("hilbert_not_object", {"hilbert": "segment"}, "hilbert", '"segment"', "object"),
    ("hilbert_segment_non_pow2_no_grids",
     {"segment_lengths": [12, 32], "hilbert": {"scope": "segment"}},
     "segment_lengths[0]", "12", "grids"),
    ("hilbert_grids_product_mismatch",
     {"hilbert": {"scope": "segment", "grids": [[4, 4], [4, 4]]}},
     "hilbert.grids[1]", "[4, 4]", "rows*cols"),
    ("hilbert_grids_wrong_count", {"hilbert": {"scope": "segment", "grids": [[4, 4]]}},
     "hilbert.grids", "[[4, 4]]", "one per branch"),
    ("hilbert_grids_not_pair",
     {"hilbert": {"scope": "segment", "grids": [[16], [4, 8]]}},
     "hilbert.grids[0]", "[16]", "[rows, cols]"),
    ("hilbert_sequence_without_grid", {"hilbert": {"scope": "sequence"}},
     "hilbert.grid", "", "required"),
    ("hilbert_sequence_with_grids",
     {"hilbert": {"scope": "sequence", "grids": [[4, 4], [4, 8]]}},
     "hilbert.grids", "[[4, 4], [4, 8]]", "segment"),
    ("hilbert_unknown_field", {"hilbert": {"scope": "segment", "order": "x"}},
     "hilbert.order", '"x"', "unknown field"),
    # ring_size / softmax_scale
    ("ring_size_zero", {"ring_size": 0}, "ring_size", "0", ">= 1"),
    ("ring_size_integral_float", {"ring_size": 2.0}, "ring_size", "2.0", "integer (write 2, not 2.0)"),
    ("ring_size_bool", {"ring_size": True}, "ring_size", "true", "integer, not true or false"),
    ("hilbert_grid_float", {"segment_lengths": [16], "dilation_rates": [1],
                            "hilbert": {"scope": "sequence", "grid": [4.0, 8]}},
     "hilbert.grid[0]", "4.0", "integer (write 4, not 4.0)"),
    ("softmax_scale_negative", {"softmax_scale": -1}, "softmax_scale", "-1", "finite number"),
    ("softmax_scale_zero", {"softmax_scale": 0}, "softmax_scale", "0", "finite number"),
    ("softmax_scale_string", {"softmax_scale": "0.1"}, "softmax_scale", '"0.1"', "number"),
    pytest.param("softmax_scale_nan", _NAN_TEXT, "softmax_scale", "NaN", ""),
    pytest.param("softmax_scale_infinity", _INF_TEXT, "softmax_scale", "Infinity", ""),
    # the file as a whole
    ("unknown_field", {"dilation_rate": [1, 2]}, "dilation_rate", "[1, 2]", "unknown field"),
    ("missing_required_field", {"head_dim": DELETE}, "head_dim", "", "required"),
    ("invalid_json", '{"name": "ok_spec",', "not valid JSON", "", "line 1"),
    ("empty_file", "", "not valid JSON", "", "line 1"),
    ("json_is_a_list", "[1, 2]", "JSON object", "", "list"),
    ("json_is_a_string", '"ok_spec"', "JSON object", "", "str"),
    pytest.param("json_too_deep", "[" * 100_000 + "]" * 100_000, "not valid JSON", "", ""),
    pytest.param("int_with_5000_digits", _BIG_DIGITS_TEXT, "segment_lengths[0]", "", ""),
    pytest.param("unknown_field_with_newline", _NEWLINE_KEY_TEXT, "unknown field", "", ""),
]


def _case_id(case) -> str:
    return case.values[0] if hasattr(case, "values") else case[0]


def _case_text(body) -> str:
    return body if isinstance(body, str) else json.dumps(_patched(body), indent=2) + "\n"


# `dilgen compile` runs in-process (dilgen.cli.main, as the console script calls it) for
# every row, and in a fresh interpreter (`python -m dilgen.cli`) for these rows too.
SUBPROCESS_IDS = {
    "name_path_separator", "num_heads_bool", "segment_lengths_huge_int",
    "hilbert_grids_product_mismatch", "unknown_field", "missing_required_field",
    "invalid_json", "json_is_a_list",
}


def _spec_file(folder: Path, body) -> Path:
    # A neutral file name, so that naming the file never passes for naming the field.
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "spec.json"
    path.write_text(_case_text(body), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cli_subprocess_results(tmp_path_factory):
    """`python -m dilgen.cli compile` on the SUBPROCESS_IDS rows, two at a time;
    {case id: (returncode, stdout, stderr, out_dir)}."""
    root = tmp_path_factory.mktemp("bad-specs")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILGEN_")}
    env["DILGEN_CACHE_DIR"] = str(root / "cache")

    def run(case):
        cid, body = (case.values if hasattr(case, "values") else case)[:2]
        path = _spec_file(root / cid, body)
        out = root / cid / "out"
        res = subprocess.run([sys.executable, "-m", "dilgen.cli", "compile", str(path),
                              "--out", str(out)], capture_output=True, text=True,
                             env=env, cwd=root, timeout=120)
        return cid, (res.returncode, res.stdout, res.stderr, out)

    cases = [c for c in BAD if _case_id(c) in SUBPROCESS_IDS]
    with ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as pool:
        return dict(pool.map(run, cases))




def _check_cli(rc: int, stdout: str, stderr: str, out: Path, field: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert rc == 2, (rc, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {stderr!r}"
    assert lines[0].startswith("dilgen: error:"), lines[0]
    assert field in lines[0], lines[0]
    assert stdout == ""
    assert not out.exists(), "a refused spec must not create the output folder"


@pytest.mark.parametrize("cid,body,field,value,rule", BAD, ids=[_case_id(c) for c in BAD])
def test_bad_spec_is_refused(tmp_path, cli_subprocess_results, cid, body, field, value, rule):
    path = _spec_file(tmp_path, body)
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    msg = str(exc.value)
    _one_line(msg)
    assert path.name in msg, f"message does not name the file: {msg}"
    assert field in msg, f"message does not name {field!r}: {msg}"
    assert value in msg, f"message does not show the value {value!r}: {msg}"
    assert rule in msg, f"message does not state the rule ({rule!r}): {msg}"

    out = tmp_path / "out"
    _check_cli(*run_cli(["compile", str(path), "--out", str(out)]), out, field)
    if cid in SUBPROCESS_IDS:
        _check_cli(*cli_subprocess_results[cid], field)


def test_later_fields_leave_earlier_keys_alone(tmp_path):
    """head_offsets and short_segments (issue 16) appear in the canonical form only when
    set, so a spec that does not set them keeps its key (and its generated files)."""
    spec = load_spec(_write(tmp_path / "a.json", BASE))
    same = load_spec(_write(tmp_path / "b.json", _patched({"head_offsets": "mod",
                                                             "short_segments": "exact"})))
    assert same == spec and same.key() == spec.key()
    assert "head_offsets" not in spec.to_json() and "short_segments" not in spec.to_json()
    ts = spec.replace(head_offsets="block", short_segments="zero_pad", head_dim=48)
    canon = ts.to_json()
    assert canon["head_offsets"] == "block" and canon["short_segments"] == "zero_pad"
    assert list(canon)[-2:] == ["head_offsets", "short_segments"]
    assert spec_from_dict(canon) == ts and spec_from_dict(canon).key() == ts.key()
    assert Spec(**canon) == ts


def test_unsupported_by_kernels_names_each_new_value():
    from dilgen.spec import KERNEL_HEAD_DIMS
    from dilgen.support import unsupported_by_kernels
    base = Spec(name="ok_spec", num_heads=4, head_dim=64, segment_lengths=[16], dilation_rates=[2])
    assert unsupported_by_kernels(base) is None
    for hd in KERNEL_HEAD_DIMS:
        assert unsupported_by_kernels(base.replace(head_dim=hd)) is None
    for change in ({"head_dim": 48}, {"head_offsets": "block"}, {"short_segments": "zero_pad"},
                   {"head_dim": 80, "head_offsets": "block", "short_segments": "zero_pad"},
                   {"ring_size": 2, "short_segments": "zero_pad", "causal": True}):
        assert unsupported_by_kernels(base.replace(**change)) is None, change
    # a ring keeps every branch in the fused kernel, which takes SPEC's layout only
    for change, words in [({"ring_size": 2, "head_offsets": "block"}, ['head_offsets = "block"']),
                          ({"ring_size": 2, "short_segments": "zero_pad"}, ['short_segments = "zero_pad"']),
                          ({"ring_size": 2, "head_offsets": "block", "short_segments": "zero_pad"},
                           ["head_offsets", "short_segments"])]:
        msg = unsupported_by_kernels(base.replace(**change))
        _one_line(msg)
        assert msg.startswith("<spec>, .replace(") and "issue 16" in msg
        assert all(w in msg for w in words), msg


def test_zero_pad_layout_slip():
    from dilgen.support import zero_pad_layout_slip
    spec = Spec(name="ok_spec", num_heads=4, head_dim=48, segment_lengths=[16, 12],
                dilation_rates=[2, 8], short_segments="zero_pad", source="ts")
    assert zero_pad_layout_slip(spec, 12) is None        # one segment of min(w, N) = 12 rows
    assert zero_pad_layout_slip(spec, 5) is None
    msg = zero_pad_layout_slip(spec, 13)                 # two segments of 12, 12 % 8 != 0
    _one_line(msg)
    assert msg.startswith("ts: N = 13 with segment_lengths[1] = 12, dilation_rates[1] = 8") and "slip" in msg
    assert zero_pad_layout_slip(spec.replace(short_segments="exact"), 13) is None


def test_replace_names_where_the_bad_value_came_from():
    spec = load_spec(Path(__file__).resolve().parent.parent / "examples" / "specs" / "longnet_base.json")
    with pytest.raises(SpecError, match=r"^longnet_base\.json, \.replace\(dilation_rates\): dilation_rates\[2\] = 0"):
        spec.replace(dilation_rates=[1, 2, 0])


def test_position_limits_at_the_bound():
    """Issue 35: the largest segment length and dilation rate are accepted, one more is
    refused (the rows above); a segment of 2**31 - 1 runs, forward and backward, against
    the float64 reference (a lattice branch and, causal with GQA, a lane branch); and a
    call whose positions would pass 2**31 (N + 128*r) is refused with the longest N."""
    import torch
    import dilgen
    from dilgen.reference import differentiable_reference
    from dilgen.runtime.checks import InputError, check_inputs, check_positions
    top = Spec(name="top", num_heads=2, head_dim=16, segment_lengths=[2**31 - 1, 16],
               dilation_rates=[2**24 - 1, 1])
    assert top.segment_lengths[0] == 2**31 - 1 and top.dilation_rates[0] == 2**24 - 1
    for fields in (dict(segment_lengths=[16, 2**31 - 1], dilation_rates=[1, 2]),
                   dict(segment_lengths=[2**31 - 1], dilation_rates=[3], causal=True, num_kv_heads=1)):
        spec = Spec(name="at_bound", num_heads=2, head_dim=16, dtype="float32", **fields)
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(1, 64, 2, 16, generator=gen, requires_grad=True)
        k, v = (torch.randn(1, 64, spec.num_kv_heads, 16, generator=gen, requires_grad=True)
                for _ in range(2))
        out = dilgen.compile(spec)(q, k, v)
        (out * out).sum().backward()
        ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, _ = differentiable_reference(*ref_in, spec)
        (ref * ref).sum().backward()
        assert (out.double() - ref).abs().max() < 1e-4, fields
        for mine, want in zip((q, k, v), ref_in):
            assert (mine.grad.double() - want.grad).abs().max() < 1e-3, fields
    # run time: positions up to N + 128*r must stay below 2**31 (no memory: expanded views)
    spec = {"name": "pos", "num_heads": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float32",
            "dilation_rates": (1, 2**20)}
    longest = 2**31 - 1 - 128 * 2**20
    for n, ok in ((longest, True), (longest + 1, False)):
        x = torch.zeros(1, 1, 1, 8).expand(1, n, 1, 8)
        if ok:
            assert check_inputs(spec, x, x, x) == (1, n)
        else:
            with pytest.raises(InputError) as exc:
                check_inputs(spec, x, x, x)
            msg = str(exc.value)
            _one_line(msg)
            assert f"N = {n} rows" in msg and "2**31" in msg and f"at most {longest} rows" in msg
    with pytest.raises(InputError, match=r"N = 2147483648 rows \(2 ranks x 1073741824\)"):
        check_positions(spec, 2**31, ranks=2)
