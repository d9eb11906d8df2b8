"""examples/train_tiny_lm.py: a few training steps on the CPU, through dilgen's kernels
(forward and backward in Triton's interpreter), and its command line."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow     # long runs (several processes, whole flows): -m "not slow" skips them

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_tiny_lm.py"

# seq-len 64, dim 32, 2 heads of head_dim 16, one block; w = [16, 16, 64], r = [2, 4, 8].
# Six steps on one fixed batch: the loss fell from about 3 to about 0.8 for each of seeds 0-9.
TINY = dict(device="cpu", dtype="fp32", steps=6, seq_len=64, batch=2, dim=32, heads=2,
            layers=1, lr=1e-2, fixed_batch=True, log_every=3, quiet=True)


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_tiny_lm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_tiny_lm_loss_falls_and_writes_json(example, tmp_path):
    out = tmp_path / "run" / "train.json"
    result = example.train(dict(TINY, seed=0, json=str(out)))
    losses = result["losses"]
    assert len(losses) == TINY["steps"]
    assert all(math.isfinite(x) for x in losses + result["copy_losses"])
    assert losses[-1] < 0.6 * losses[0], losses
    # every attention call went through dilgen: one forward and one backward per layer and step
    assert result["dilgen_kernel_launches"] == 2 * TINY["layers"] * TINY["steps"]
    data = json.loads(out.read_text())
    assert data["steps"] == TINY["steps"] and data["losses"] == losses
    assert data["first_loss"] == losses[0] and data["last_loss"] == losses[-1]
    assert data["tokens_per_s"] > 0 and data["device"].startswith("cpu")
    assert {"python", "torch", "triton", "dilgen"} <= set(data["versions"])
    assert data["settings"]["segments"] == [16, 32, 64] and data["settings"]["rates"] == [2, 4, 8]


def test_train_tiny_lm_is_deterministic(example):
    params = dict(TINY, steps=2, seed=3, fixed_batch=False)   # fresh batches, as in real runs
    assert example.train(params)["losses"] == example.train(params)["losses"]


def test_train_tiny_lm_cpu_preset(example):
    # The default CPU run (README: loss 2.22 -> 0.73 in 100 steps, about a minute on 2 cores):
    # N = 32, two segment lengths (no repeat), a copy offset every rate divides, and enough
    # heads that the r = 2 branch covers every query.
    a = example.resolve(dict(device="cpu"))
    assert (a.steps, a.seq_len, a.batch, a.dim, a.heads, a.layers) == (100, 32, 4, 32, 2, 1)
    assert (a.block, a.vocab, a.segments, a.rates) == (5, 8, [16, 32], [2, 4])
    assert all((a.block - 1) % r == 0 for r in a.rates) and a.heads >= min(a.rates)
    assert example._is_cpu_preset(a) and not example._is_cpu_preset(example.resolve(TINY))
    # longer N keeps three distinct lengths; the GPU preset is unchanged
    assert example.resolve(dict(device="cpu", seq_len=128)).segments == [16, 32, 128]
    g = example.resolve(dict(device="cuda"))
    assert (g.seq_len, g.block, g.vocab, g.segments, g.rates) == (8192, 65, 128, [128, 1024, 8192], [2, 4, 8])


def test_train_tiny_lm_refuses_bad_settings(example):
    with pytest.raises(ValueError, match="divisible"):
        example.resolve(dict(TINY, heads=3))
    with pytest.raises(ValueError, match="vocab"):
        example.resolve(dict(TINY, vocab=8, block=9))


def test_train_tiny_lm_help():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--seq-len" in proc.stdout and "--json" in proc.stdout


# --------------------------------------------------------------------------- generate_tiny_lm

GENERATE = ROOT / "examples" / "generate_tiny_lm.py"


@pytest.fixture(scope="module")
def generate_example():
    spec = importlib.util.spec_from_file_location("generate_tiny_lm_example", GENERATE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generate_copy_accuracy_judges_each_copy_step(generate_example):
    """A perfect copy of the repeated block scores 1 (it scored 0: compared with the token
    block - 1 back); each step is judged on its own previous token."""
    import torch
    acc = generate_example.copy_accuracy
    block, prompt, new = 5, 20, 8
    seq = torch.tensor([[3, 1, 4, 0, 2] * 6, [7, 5, 6, 2, 1] * 6])[:, :prompt + new]
    assert acc(seq, prompt, block) == 1.0
    slipped = torch.cat([seq[:, :prompt], seq[:, prompt + 1:prompt + new + 1]], dim=1)
    assert acc(slipped, prompt, block) == pytest.approx(6 / 7)         # one skipped token
    stuck = torch.cat([seq[:, :prompt], seq[:, prompt - 1:prompt].expand(-1, new)], dim=1)
    assert acc(stuck, prompt, block) == 0.0
    outside = seq.clone()
    outside[0, prompt + 2] = 9                                        # not in the block
    assert acc(outside, prompt, block) == pytest.approx(14 / 16)
    assert math.isnan(acc(seq[:, :7], 4, block))                     # prompt < block


def test_generate_says_when_the_weights_are_random(generate_example, capsys, monkeypatch):
    """Issue 31: without --train-steps the weights are random; the run says so (copy
    accuracy about 0 is expected) and how to train, instead of a bare `copy accuracy 0.00`."""
    small = {"device": "cpu", "prompt": 20, "new": 2, "batch": 1, "seq_len": 64}
    res = generate_example.generate(small)
    out = capsys.readouterr().out
    assert res["weights"] == "random"
    assert "random (untrained) weights" in out and "copy accuracy" in out, out
    assert "--train-steps" in out and "expected" in out, out
    monkeypatch.setattr(generate_example, "_train", lambda *a, **kw: None)   # trained: no note
    res = generate_example.generate(dict(small, train_steps=1))
    out = capsys.readouterr().out
    assert res["weights"] == "trained 1 step(s)" and "untrained" not in out, out
