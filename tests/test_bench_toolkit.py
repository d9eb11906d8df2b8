"""bench/toolkit.py on the CPU: atomic JSON, result files, tables, timing, FLOP counts, configs."""
from __future__ import annotations

import json
import math
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_backward  # noqa: E402
import bench_forward  # noqa: E402
import toolkit as tk  # noqa: E402


def test_write_json_atomic_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "r.json"
    tk.write_json_atomic(path, {"a": 1.5, "bad": float("nan"), "inf": [float("inf")], "t": (1, 2)})
    assert json.loads(path.read_text()) == {"a": 1.5, "bad": None, "inf": [None], "t": [1, 2]}
    tk.write_json_atomic(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]


def test_write_json_atomic_keeps_old_file_when_serialising_fails(tmp_path):
    path = tmp_path / "r.json"
    tk.write_json_atomic(path, {"rows": [1]})
    with pytest.raises(TypeError):
        tk.write_json_atomic(path, {"rows": [object()]})
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_results_written_after_every_row_and_append_merges(tmp_path):
    path = tk.result_path(tmp_path, "forward", dry=True, date="2026-01-02")
    assert path.name == "forward-2026-01-02-cpu-dryrun.json"
    res = tk.Results(path, {"device": "x"})
    assert json.loads(path.read_text())["rows"] == []
    row = res.add({"config": "A", "causal": False, "ms": 1.0})
    assert json.loads(path.read_text())["rows"] == [row]
    res.add({"config": "A", "causal": True, "ms": 2.0})
    again = tk.Results(path, {"device": "y"}, append=True)        # a second run redoes causal A
    again.add({"config": "A", "causal": True, "ms": 3.0})
    again.add({"config": "B", "causal": False, "ms": 4.0})
    data = json.loads(path.read_text())
    assert [(r["config"], r["causal"], r["ms"]) for r in data["rows"]] == \
        [("A", False, 1.0), ("A", True, 3.0), ("B", False, 4.0)]
    assert data["device"] == "y" and len(data["earlier_runs"]) == 1
    fresh = tk.Results(path, {"device": "z"})                      # without append: a new file
    assert json.loads(path.read_text())["rows"] == [] and fresh.rows == []


def test_results_append_from_another_file_merges_rows_and_checks(tmp_path):
    earlier = tmp_path / "carried" / "forward-2026-01-01.json"
    tk.write_json_atomic(earlier, {"device": "gpu", "matmul_ceiling": {"tflops": 700.0}, "check_passed": True,
                                   "rows": [{"config": "A", "causal": False, "ms": 1.0},
                                            {"config": "B", "causal": False, "ms": 2.0}],
                                   "check": [{"config": "A", "causal": False, "passed": True},
                                             {"config": "B", "causal": False, "passed": True}]})
    out = tmp_path / "out" / "forward-2026-01-02.json"
    res = tk.Results(out, {"device": "gpu", "check": []}, append=str(earlier))
    res.data["check"].append({"config": "B", "causal": False, "passed": False})
    res.add({"config": "B", "causal": False, "ms": 3.0})
    data = json.loads(out.read_text())
    assert [(r["config"], r["ms"]) for r in data["rows"]] == [("A", 1.0), ("B", 3.0)]
    assert [(c["config"], c["passed"]) for c in data["check"]] == [("A", True), ("B", False)]
    assert data["matmul_ceiling"] == {"tflops": 700.0} and data["earlier_runs"][0]["check_passed"] is True
    with pytest.raises(FileNotFoundError):
        tk.Results(tmp_path / "x.json", {}, append=str(tmp_path / "missing.json"))


def test_commit_is_git_head_or_the_env_fallback(tmp_path, monkeypatch):
    """header()'s "commit": the checkout's short HEAD (+dirty); without git, $DILGEN_COMMIT, else None."""
    got = tk.commit()
    assert got is None or re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", got), got
    monkeypatch.setenv("DILGEN_COMMIT", "abc1234")
    monkeypatch.setattr(tk.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("git")))
    assert tk.commit() == "abc1234"                     # git missing
    monkeypatch.setattr(tk, "REPO", tmp_path)          # a copied tree without .git
    assert tk.commit() == "abc1234"
    monkeypatch.delenv("DILGEN_COMMIT")
    assert tk.commit() is None


def test_markdown_table():
    text = tk.markdown_table(["config", "ms"], [["A", "**1.00**"], ["B|x", None]])
    assert text.splitlines() == ["| config | ms |", "|---|---|", "| A | **1.00** |", "| B\\|x | — |"]
    assert tk.fmt(None) == "—" and tk.fmt(1.234, ".1f") == "1.2"


def test_time_ms_on_cpu_counts_calls_and_takes_the_median():
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.002)
    t = tk.time_ms(fn, warmup=2, reps=5, device="cpu")
    assert len(calls) == 7 and t["n"] == 5 and len(t["times"]) == 5
    assert t["min"] <= t["median"] <= t["max"] and t["median"] >= 1.9
    first, res = tk.first_call_s(lambda: 42, "cpu")
    assert res == 42 and first >= 0
    assert tk.peak_extra_gib(lambda: None, "cpu") is None


def test_useful_flops_match_dilgen_stats_for_every_config():
    from dilgen.stats import forward_flops
    for cfg in list(tk.CONFIGS.values()) + list(tk.DRY_CONFIGS.values()):
        for causal in (False, True):
            want = forward_flops(cfg["ws"], cfg["rs"], cfg["H"], cfg["D"], causal, cfg["N"], cfg["B"])
            assert tk.useful_flops(cfg, causal) == pytest.approx(want)
            assert tk.useful_flops(cfg, causal, fwd_bwd=True) == pytest.approx(3.5 * want)
    a = tk.CONFIGS["A"]
    assert tk.useful_flops(a, False) == pytest.approx(
        sum(4 * 16 * (32768 / w) * (w / r) ** 2 * 128 for w, r in zip(a["ws"], a["rs"])))


def test_configs_e_and_f_and_their_specs():
    e, f, b, a = (tk.CONFIGS[c] for c in "EFBA")
    assert e["ws"] == b["ws"] and e["rs"] == [1, 2, 4, 6, 12] and any(w % r for w, r in zip(e["ws"], e["rs"]))
    assert {k: v for k, v in f.items() if k != "hilbert"} == a and f["hilbert"] == {"scope": "segment"}
    for table in (tk.CONFIGS, tk.DRY_CONFIGS):
        assert list(table) == list("ABCDEF")
        for name, cfg in table.items():
            spec = tk.make_spec(name, cfg, causal=True)
            assert spec.causal and list(spec.dilation_rates) == cfg["rs"]
            assert (spec.hilbert is not None) == (name == "F")
    assert tk.parse_configs("a, f") == ["A", "F"]
    with pytest.raises(ValueError, match="unknown"):
        tk.parse_configs("A,G")
    assert tk.causal_flags() == [False, True] and tk.causal_flags(no_causal=True) == [False]


def test_progress_plain_lines(capsys):
    p = tk.Progress(2)
    p.step("first")
    tk.log("note")
    p.step("second")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[1/2] first") and out[1] == "note" and out[2].startswith("[2/2] second")


def test_roofline_and_bar_plots(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"config": "A", "causal": c, "dilgen_ms": 2.0, "gather_cudnn_ms": 3.0,
             "useful_tflops_by_method": {"dilgen": 400.0, "gather_cudnn": 300.0}} for c in (False, True)]
    roof = bench_forward.Bench.draw({"matmul_ceiling": {"tflops": 700.0}}, rows, tmp_path / "forward-x.json")
    bars = tk.plot_bars(rows, ["dilgen", "gather_cudnn"], tmp_path / "bars.png", "ms", "t")
    for p in (roof, bars):
        assert p is not None and p.read_bytes()[:4] == b"\x89PNG"


def test_sanitize_and_short_err():
    assert tk.sanitize({1: [math.nan, Path("/x")]}) == {"1": [None, "/x"]}
    msg = tk.short_err(ValueError("a\nb" * 300), limit=50)
    assert len(msg) == 50 and "\n" not in msg and msg.startswith("ValueError: a b")


def test_merge_rerun_replaces_only_the_rerun_methods(tmp_path):
    """bench_backward.merge_rerun (bench_forward/backward --merge-into): dilgen's fields and the speed-ups move,
    the peers' stay."""
    old = {"device": "GPU X", "check": [{"config": "A", "causal": False, "passed": True},
                                         {"config": "B", "causal": False, "passed": True}],
           "rows": [{"config": "A", "causal": False, "dilgen_ms": 2.0, "peer_ms": 4.0, "useful_tflops": 100.0,
                     "speedup_vs_peer": 2.0, "timing_ms": {"dilgen": {"median": 2.0}, "peer": {"median": 4.0}},
                     "errors": {"dense": "skipped: too long", "dilgen": "old failure"},
                     "useful_tflops_by_method": {"dilgen": 100.0, "peer": 50.0}},
                    {"config": "B", "causal": False, "dilgen_ms": 3.0, "peer_ms": 3.0, "speedup_vs_peer": 1.0}]}
    new = {"device": "GPU X", "time": "t1", "check_passed": True,
           "check": [{"config": "A", "causal": False, "passed": True, "new": 1}],
           "rows": [{"config": "A", "causal": False, "dilgen_ms": 1.0, "useful_tflops": 200.0,
                     "errors": {"peer": "not selected (--methods)"},
                     "timing_ms": {"dilgen": {"median": 1.0}}, "useful_tflops_by_method": {"dilgen": 200.0}}]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert bench_backward.merge_rerun(tmp_path / "old.json", tmp_path / "new.json") == [("A", False)]
    got = json.loads((tmp_path / "old.json").read_text())
    a, b = got["rows"]
    assert (a["dilgen_ms"], a["peer_ms"], a["speedup_vs_peer"], a["useful_tflops"]) == (1.0, 4.0, 4.0, 200.0)
    assert a["timing_ms"] == {"dilgen": {"median": 1.0}, "peer": {"median": 4.0}}
    assert a["useful_tflops_by_method"] == {"dilgen": 200.0, "peer": 50.0}
    assert a["errors"] == {"dense": "skipped: too long"}     # the peers' reasons stay, dilgen's go
    assert a["merged_from"]["time"] == "t1" and b == old["rows"][1]
    assert sorted(c["config"] for c in got["check"]) == ["A", "B"] and any(c.get("new") for c in got["check"])
    assert got["earlier_runs"][-1]["merged_rows"] == [["A", False]]
    new["device"] = "GPU Y"                      # numbers from another GPU are refused
    (tmp_path / "new.json").write_text(json.dumps(new))
    with pytest.raises(ValueError, match="device differs"):
        bench_backward.merge_rerun(tmp_path / "old.json", new)


def test_merge_rerun_redraws_the_plots_beside_a_bench_file(tmp_path):
    """After a merge the forward file's bar and roofline plots are redrawn from its rows."""
    pytest.importorskip("matplotlib")
    head = {"device": "GPU X", "torch": "t", "triton": "3.6", "date": "2000-01-01",
            "matmul_ceiling": {"tflops": 700.0}}
    row = {"config": "A", "causal": False, "dilgen_ms": 2.0, "gather_cudnn_ms": 3.0, "useful_tflops": 400.0,
           "useful_gflop": 800.0, "useful_tflops_by_method": {"dilgen": 400.0, "gather_cudnn": 266.7}}
    old = dict(head, rows=[row])
    new = dict(head, time="t1", rows=[dict(row, dilgen_ms=1.5, useful_tflops=533.0)])
    committed = tmp_path / "forward-2000-01-01.json"
    committed.write_text(json.dumps(old))
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert bench_backward.merge_rerun(committed, tmp_path / "new.json", draw=bench_forward.Bench.draw) == [("A", False)]
    for name in ("forward-2000-01-01.png", "roofline-2000-01-01.png"):
        png = tmp_path / name
        assert png.exists() and png.read_bytes()[:4] == b"\x89PNG", name
