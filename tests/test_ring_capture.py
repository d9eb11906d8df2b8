"""A ring call inside a CUDA-graph capture (SPEC §3): it cannot gather the ranks'
fingerprints (a capture may not read the device back), so it runs on the agreement its eager
warm-up made, and is refused by name without one. One process: a stand-in process group
whose all_gather hands back this rank's fingerprint to every rank, and a stand-in for
"this stream is capturing" (the GPU check, bench/results/ring_gpu_check-*.json, captures
real NCCL rings)."""
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
