"""examples/: the tiny LongNet LM trains a few steps on CPU (Triton's interpreter) with
dilgen's forward and backward kernels, and its loss falls."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import train_tiny_lm  # noqa: E402


@pytest.mark.timeout(300)
def test_tiny_lm_loss_falls_on_cpu(tmp_path):
    out = tmp_path / "train.json"
    args = train_tiny_lm.parse_args([
        "--device", "cpu", "--dtype", "fp32", "--steps", "6", "--seq-len", "64", "--block", "16",
        "--dim", "32", "--heads", "2", "--layers", "1", "--batch", "2", "--vocab", "32",
        "--lr", "1e-2", "--fixed-batch", "--json", str(out)])
    result = train_tiny_lm.train(args)
    losses = result["losses"]
    assert all(l == l and l < 10 for l in losses)           # finite
    assert losses[-1] < 0.75 * losses[0], losses             # it learns (same batch, 6 steps)
    saved = json.loads(out.read_text())
    assert saved["last_loss"] == losses[-1] and saved["spec"]["causal"] is True


def test_tiny_lm_help():
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "train_tiny_lm.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--seq-len" in res.stdout
