"""What a ring call says (issue 57): a disagreement on the chunk order or the dtype names
them, not their codes; and a ring forward in the interpreter computes nothing on
accumulator rows no window has written yet (their leftovers made numpy RuntimeWarnings)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dilgen.runtime.ring.agreement import _FIELDS, _verdict
from proc_tree import free_port, run_together

ROOT = Path(__file__).resolve().parents[1]


def _rows(label: str, values: list[int]) -> list[list[int]]:
    """Gathered fingerprints of len(values) ranks, equal but for field `label`."""
    rows = [[0] * len(_FIELDS) for _ in values]
    for row, value in zip(rows, values):
        row[_FIELDS.index(label)] = value
    return rows


def test_chunk_order_disagreement_names_the_orders():
    message = _verdict("ring_x", _rows("chunk order", [0, 1]), None, 2)
    assert "(rank 0: 'contiguous', rank 1: 'zigzag')" in message, message
    assert "chunk_order=" in message and "same shape and dtype" not in message, message


def test_measure_disagreement_names_each_ranks_value():
    """One rank measuring a spec's rate and another not would leave one rank in an all_reduce."""
    message = _verdict("ring_x", _rows("DILGEN_RING_MEASURE", [0, 2]), None, 2)
    assert "disagree on DILGEN_RING_MEASURE (rank 0: auto, rank 1: 0)" in message, message


def test_dtype_disagreement_names_the_dtypes():
    message = _verdict("ring_x", _rows("dtype", [3, 2]), None, 2)
    assert "(rank 0: float32, rank 1: bfloat16)" in message, message


# Every new float tensor of the ring executor holds inf, as a reused allocation may: the
# merge weighs an accumulator row that no window wrote by e^-inf = 0, and 0 * inf is NaN
# (a numpy RuntimeWarning, an error here). Both ranks then check their rows against the
# single-device kernel on the same full inputs.
RANK_SCRIPT = r"""
import warnings
import torch
import torch.distributed as dist
import dilgen
from dilgen.runtime.ring import executor, shard

class Leftovers:
    def __getattr__(self, name):
        return getattr(torch, name)
    def empty(self, *args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("inf")) if t.is_floating_point() else t
    def empty_like(self, *args, **kwargs):
        t = torch.empty_like(*args, **kwargs)
        return t.fill_(float("inf")) if t.is_floating_point() else t

executor.torch = Leftovers()
dist.init_process_group("gloo")
rank, P = dist.get_rank(), dist.get_world_size()
spec = dilgen.Spec(name="ring_leftovers", num_heads=2, head_dim=16, dtype="bfloat16",
                   segment_lengths=[16, 64], dilation_rates=[1, 2], ring_size=P)
torch.manual_seed(0)
full = [torch.randn(1, 64, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
warnings.simplefilter("error", RuntimeWarning)
out, lse = dilgen.compile(spec)(*(shard(t, P, rank) for t in full), return_lse=True)
alone, alone_lse = dilgen.compile(spec.replace(ring_size=1))(*full, return_lse=True)
rows = slice(rank * 32, rank * 32 + 32)
assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()
assert (out.float() - alone[:, rows].float()).abs().max() < 2e-2
assert (lse - alone_lse[:, :, rows]).abs().max() < 1e-3
dist.destroy_process_group()
"""


@pytest.mark.timeout(300)
def test_ring_forward_never_computes_on_unwritten_accumulator_rows(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILGEN_")}
    port = free_port()
    env.update(DILGEN_CACHE_DIR=str(tmp_path / "cache"), DILGEN_RING_TRANSPORT="ring",
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE="2")
    ranks = run_together([([sys.executable, "-c", RANK_SCRIPT], dict(env, RANK=str(r), LOCAL_RANK=str(r)))
                          for r in range(2)], tmp_path, 240, "two ranks", merge=True, cwd=ROOT)
    for r, (rc, out) in enumerate(ranks):
        assert rc == 0, f"rank {r}:\n{out[-4000:]}"
        assert "RuntimeWarning" not in out, f"rank {r}:\n{out[-4000:]}"
