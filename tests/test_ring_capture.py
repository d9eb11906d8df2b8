"""A ring call inside a CUDA-graph capture (SPEC §3): it cannot gather the ranks'
fingerprints (a capture may not read the device back), so it runs on the agreement its eager
warm-up made, and is refused by name without one. One process: a stand-in process group
whose all_gather hands back this rank's fingerprint to every rank, and a stand-in for
"this stream is capturing". On 2 GPUs, the last test captures real NCCL rings of every transport
(tests/ring_capture_worker.py under torchrun)."""
from __future__ import annotations

import pytest
import torch

import dilgen
from dilgen.runtime.checks import InputError
from dilgen.runtime.ring import RingError
from dilgen.runtime.ring import agreement

P = 2


class FakeDist:
    """torch.distributed as _agree uses it, for P ranks that all pass what this one does."""

    def __init__(self, backend: str = "nccl"):
        self.backend, self.gathers = backend, 0

    def get_backend(self, group):
        # the warm-up's fingerprint stays on the CPU (as over gloo); the capture sees NCCL
        return self.backend if agreement._capturing(None) else "gloo"

    def all_gather(self, every, mine, group=None):
        self.gathers += 1
        for t in every:
            t.copy_(mine)


class Group:
    group_name = "capture-test"


@pytest.fixture
def capturing(monkeypatch):
    state = {"on": False}
    monkeypatch.setattr(agreement, "_capturing", lambda q: state["on"])
    monkeypatch.setattr(agreement, "_AGREED", {})
    return state


SPEC = dilgen.Spec(name="cap", num_heads=2, num_kv_heads=2, head_dim=16, segment_lengths=[32],
                   dilation_rates=[2], ring_size=P).to_json()


def _qkv(n_loc=16, heads=2):
    return [torch.randn(1, n_loc, heads, 16, dtype=torch.bfloat16) for _ in range(3)]


def _agree(dist, q, k, v, kind="forward", cu_seqlens=None):
    return agreement._agree(SPEC, q, k, v, "contiguous", Group(), P, 0, dist, kind=kind,
                            cu_seqlens=cu_seqlens)


def test_a_captured_call_runs_on_the_agreement_of_its_warm_up(capturing):
    dist, (q, k, v) = FakeDist(), _qkv()
    eager = _agree(dist, q, k, v)
    assert dist.gathers == 1
    capturing["on"] = True
    assert _agree(dist, *_qkv()) == eager       # same call, new tensors: no gather
    assert dist.gathers == 1


def test_a_capture_without_warm_up_is_refused_by_name(capturing):
    dist = FakeDist()
    _agree(dist, *_qkv())                       # the forward ran eagerly, the backward did not
    capturing["on"] = True
    with pytest.raises(RingError, match="backward is captured in a CUDA graph only after the same call"):
        _agree(dist, *_qkv(), kind="backward")
    with pytest.raises(RingError, match="warm-up"):
        _agree(dist, *_qkv(n_loc=32))           # another shape
    assert dist.gathers == 1


def test_a_captured_call_still_checks_its_inputs(capturing):
    dist = FakeDist()
    _agree(dist, *_qkv())
    capturing["on"] = True
    with pytest.raises(InputError, match="num_heads=2"):
        _agree(dist, *_qkv(heads=3))


@pytest.mark.parametrize("what", ["packed", "gloo"])
def test_what_a_capture_cannot_run_is_refused(capturing, what):
    dist = FakeDist("gloo" if what == "gloo" else "nccl")
    q, k, v = _qkv()
    capturing["on"] = True
    if what == "packed":
        q, k, v = (t[0] for t in (q, k, v))
        cu = torch.tensor([0, 32], dtype=torch.int32)
        with pytest.raises(RingError, match="packed ring call .cu_seqlens. cannot be captured"):
            _agree(dist, q, k, v, cu_seqlens=cu)
    else:
        with pytest.raises(RingError, match="only over an NCCL process group .this one is 'gloo'"):
            _agree(dist, q, k, v)
    assert dist.gathers == 0


@pytest.mark.ranks
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a captured NCCL ring needs 2 GPUs")
def test_every_transport_replays_what_it_runs_eagerly_on_two_gpus(tmp_path):
    """torchrun P = 2 over NCCL (tests/ring_capture_worker.py): each transport's forward and
    forward + backward, captured after their warm-up and replayed on new inputs, equal the
    same calls run eagerly (a replay of the captured inputs would miss by about 1.4)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from proc_tree import free_port
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{root}:{root / 'tests'}", DILGEN_RING_TRANSPORT="auto")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(root / "tests" / "ring_capture_worker.py"), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    want = {"local": "local", "ring": "ring", "allgather": "allgather", "heads": "heads", "recut": "recut",
            "hybrid": "hybrid", "recut_zigzag_causal_gqa": "recut", "hybrid_zigzag_causal_gqa": "hybrid"}
    for rank in range(2):
        res = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, transport in want.items():
            r = res[name]
            assert "error" not in r, f"rank {rank} {name}: {r['error']}"
            assert r["transport"] == transport, (rank, name, r)
            assert r["out"] < 1e-3 and max(r["dq"], r["dk"], r["dv"]) < 2e-2, (rank, name, r)
