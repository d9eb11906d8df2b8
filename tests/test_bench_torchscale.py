"""bench/bench_torchscale.py --smoke: the GigaPath-sized benchmark's whole flow on a tiny
model on the CPU (numbers meaningless; speed is the GPU bench's job)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchscale_model as tm  # noqa: E402

from dilgen.compat import torchscale as compat  # noqa: E402

pytestmark = pytest.mark.slow     # long runs (several processes, whole flows): -m "not slow" skips them


def test_bench_torchscale_smoke(tmp_path, monkeypatch, capsys):
    """bench/bench_torchscale.py --smoke: the whole flow on a tiny model on the CPU (the
    patched model's attention through the float64 reference while the kernels refuse)."""
    import importlib.util
    import json
    monkeypatch.setattr(compat, "_attend", compat._attend)     # the smoke run swaps them:
    monkeypatch.setattr(tm, "ATTENTION", tm.ATTENTION)        # restored after the test
    path = Path(__file__).resolve().parent.parent / "bench" / "bench_torchscale.py"
    spec = importlib.util.spec_from_file_location("bench_torchscale_smoke", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    (result,) = tmp_path.glob("torchscale-*-cpu-smoke.json")
    data = json.loads(result.read_text())
    rows = {(r["tiles"], r["pass"], r["method"]): r for r in data["rows"]}
    assert set(rows) == {(n, p, m) for n in (40, 72) for p in ("fwd", "fwd+bwd")
                         for m in ("torchscale", "dilgen", "no_attention")}
    assert all(r["ms"] is not None and "error" not in r for r in rows.values()), data["rows"]
    assert all(c["rel_err_dilgen_vs_torchscale"] < 3e-2 for c in data["check"])   # bf16 both
    # every method timed (no wall-clock comparison here: on a shared CPU, as in CI where two
    # suites run side by side, the smoke sizes' times are noise; speed is the GPU bench's job),
    # and the table bounds by the no-attention floor: torchscale ms / no-attention ms
    assert all(r["ms"] > 0 for r in rows.values())
    out = capsys.readouterr().out
    assert "| tiles | pass |" in out and "bound (torchscale / no-attention)" in out
    for n in (40, 72):
        bound = rows[(n, "fwd", "torchscale")]["ms"] / rows[(n, "fwd", "no_attention")]["ms"]
        assert f"| {n} | fwd |" in out and f"{bound:.2f}x" in out
    assert compat._attend is not None and compat._attend.__name__ != "identity_attend"   # restored
