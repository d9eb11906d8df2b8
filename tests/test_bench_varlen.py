"""bench/bench_varlen.py's CPU dry run (issue 14's bench): the rows follow the issue's schema
(method, pass, ms, useful_tflops), every method is checked against the packed call, and the
summary carries the two targets. Numbers from the interpreter mean nothing; the shape does."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_varlen_bench_dry_run_writes_the_issue_schema(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_varlen
        assert bench_varlen.main(["--dry-run-cpu", "--packings", "slides", "--no-bwd",
                                  "--out", str(tmp_path)]) == 0
    finally:
        sys.path.remove(str(ROOT / "bench"))
    data = json.loads(next(tmp_path.glob("varlen-*.json")).read_text())
    methods = {r["method"] for r in data["rows"]}
    assert {"dilgen_varlen", "dilgen_one_sequence", "dilgen_padded", "dilgen_loop"} <= methods
    for row in data["rows"]:
        assert row["pass"] == "fwd"
        if row.get("error"):
            continue
        assert row["ms"] > 0 and row["useful_tflops"] > 0
        if row["method"] != "dilgen_one_sequence":      # the twin runs other inputs: not compared
            assert row["check_passed"] and row["check_against"], row
    for summary in data["summary"]:
        assert summary["packing"] == "slides" and "rate_vs_one_sequence" in summary
        assert "speedup_vs_best_peer" in summary and summary["checks_passed"]
    assert list(tmp_path.glob("varlen-*.png")), "the plot"
