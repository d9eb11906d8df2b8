"""Context parallelism as people train: transformers.Trainer through
dilgen.integrations.cp_trainer.ContextParallelTrainer at P = 2 (gloo, DDP as accelerate sets
it up), and examples/train_context_parallel.py run by torchrun with --cpu --check."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import cp_worker  # noqa: E402

pytestmark = pytest.mark.slow     # several processes each

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_context_parallel.py"


@pytest.mark.ranks
def test_trainer_step_equals_one_process(tmp_path):
    """One SGD step of ContextParallelTrainer on two sequences of 64 tokens split over 2
    ranks: the logged loss is the mean over every token, and the step is one process's
    gradient (Trainer's token count over all ranks and DDP's average, context_parallel's
    docstring), on both ranks."""
    pytest.importorskip("accelerate")
    case = {"name": "trainer", "kind": "trainer"}
    got = cp_worker.spawn(2, [case], tmp_path, timeout_s=420)["trainer"]
    want = cp_worker.reference(case)
    for rank, result in enumerate(got):
        assert abs(result["loss"] - want["loss"]) <= 1e-5 * want["loss"], (rank, result["loss"], want["loss"])
        errors = cp_worker.grad_errors(result["grads"], want["grads"])
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-5, (rank, worst, errors[worst])


@pytest.mark.ranks
def test_trainer_evaluates_the_loss_of_one_process_and_refuses_split_logits(tmp_path):
    """Trainer.evaluate under context parallelism: eval_loss is the mean over every token of
    the batch (one process's), not a rank's share; compute_metrics and predict(), which
    would see each rank's rows of the logits as if they were whole sequences, are refused in
    one line on every rank."""
    pytest.importorskip("accelerate")
    case = {"name": "trainer_eval", "kind": "trainer_eval"}
    got = cp_worker.spawn(2, [case], tmp_path, timeout_s=420)["trainer_eval"]
    want = cp_worker.reference(case)["loss"]
    for rank, result in enumerate(got):
        assert abs(result["eval_loss"] - want) <= 1e-5 * want, (rank, result["eval_loss"], want)
        assert result["compute_metrics"].startswith("NotImplementedError: ContextParallelTrainer: compute_metrics"), \
            result["compute_metrics"]
        assert result["predict"].startswith("NotImplementedError: ContextParallelTrainer.predict"), result["predict"]


def test_trainer_refuses_what_it_cannot_keep_exact(tmp_path):
    """Settings under which each rank's loss would be a mean over its own tokens are refused
    in one line before training (checked without a process group: the refusal comes first)."""
    pytest.importorskip("accelerate")
    from dilgen.integrations.cp_trainer import ContextParallelTrainer
    model = cp_worker.build("causal")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), average_tokens_across_devices=False, report_to=[],
                                          use_cpu=True)
    with pytest.raises(ValueError, match="average_tokens_across_devices=False") as info:
        ContextParallelTrainer(model=model, args=args, train_dataset=[], context_parallel=None)
    assert "\n" not in str(info.value)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=0.1, report_to=[], use_cpu=True)
    with pytest.raises(ValueError, match="label smoothing"):
        ContextParallelTrainer(model=model, args=args, train_dataset=[], context_parallel=None)


@pytest.mark.ranks
def test_example_check_under_torchrun():
    """`torchrun --nproc-per-node 2 examples/train_context_parallel.py --cpu --check`: three
    AdamW steps of a tiny model over 2 gloo ranks against one process, loss and every
    gradient at every step within 1e-5; exit 0."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), "--cpu", "--check"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("check passed") == 2, proc.stdout
    assert "step 2: loss" in proc.stdout


def test_example_model_is_the_benchs():
    """The example trains bench/bench_transformers.py's model and pattern."""
    spec = importlib.util.spec_from_file_location("train_context_parallel", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_transformers
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert example.MODEL == bench_transformers.MODEL and example.PATTERN == bench_transformers.PATTERN
    a = example.parse(["--cpu", "--check"])
    assert a.cpu and a.check and a.context is None
    help_text = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                               timeout=120).stdout
    assert "--context" in help_text and "--check" in help_text and "--json" in help_text
