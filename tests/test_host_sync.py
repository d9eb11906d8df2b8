"""A call after the first makes no tensor from host data and asks no value of a device tensor.

On a GPU either is a blocking copy: the host waits until the GPU has run everything
queued (the forward, when the backward starts), and the GPU then sits idle while the
host queues the next launches. With short kernels (config D: 10 launches of 0.1-0.6 ms
in a causal fwd+bwd) that idle time was a fifth of the call. The class order, Hilbert
tables and block lists are built once per module and length and kept on the device.

On the CPU the test spies on torch.tensor, torch.as_tensor, Tensor.item and
Tensor.tolist called from dilgen's own code during a second forward and backward; on a
GPU it runs the second call under torch.cuda.set_sync_debug_mode("error").
"""
from __future__ import annotations

import sys

import pytest
import torch

import dilgen
import dilgen.runtime.op as op_module

from conftest import device

SPECS = [
    ("fused_raster", dict(segment_lengths=[32, 64], dilation_rates=[1, 2])),
    ("causal_lanes_gqa", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], causal=True,
                              num_heads=4, num_kv_heads=2)),
    ("r_not_dividing_w", dict(segment_lengths=[24, 48], dilation_rates=[1, 6], num_heads=6)),
    ("hilbert_segment", dict(segment_lengths=[32, 64], dilation_rates=[1, 2],
                             hilbert={"scope": "segment"})),
    ("hilbert_causal", dict(segment_lengths=[32, 64], dilation_rates=[1, 2], causal=True,
                            hilbert={"scope": "segment"})),
]


def _kernel(fields):
    fields = dict(fields)
    fields.setdefault("num_heads", 4)
    return dilgen.compile(dilgen.Spec(name="sync", head_dim=16, dtype="float32", **fields))


def _inputs(spec, n, dev):
    gen = torch.Generator().manual_seed(7)
    make = lambda h: (torch.randn(1, n, h, spec.head_dim, generator=gen)
                      .to(dev).requires_grad_(True))
    return make(spec.num_heads), make(spec.num_kv_heads), make(spec.num_kv_heads)


def _fwd_bwd(kernel, q, k, v):
    out = kernel(q, k, v)
    out.backward(torch.ones_like(out))
    return out


@pytest.mark.parametrize("case", SPECS, ids=[c[0] for c in SPECS])
def test_second_call_reads_nothing_from_the_host(case, monkeypatch):
    kernel = _kernel(case[1])
    dev = device()
    q, k, v = _inputs(kernel.spec, 128, dev)
    _fwd_bwd(kernel, q, k, v)           # builds and keeps what the launches need
    calls = []

    def spy(owner, name):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("dilgen"):
                calls.append(f"{name} from {caller}")
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapper)

    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            _fwd_bwd(kernel, q, k, v)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    else:
        for owner, name in ((torch, "tensor"), (torch, "as_tensor"),
                            (torch.Tensor, "item"), (torch.Tensor, "tolist")):
            spy(owner, name)
        _fwd_bwd(kernel, q, k, v)
        assert not calls, f"host data read or copied in a steady-state call: {calls}"
    assert q.grad is not None and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("use_lse", [False, True])
def test_unused_lse_gets_no_gradient(use_lse, monkeypatch):
    """An lse the loss never reads reaches the backward as None (no zero tensor to read,
    no dlse pass); one it reads arrives as a tensor."""
    kernel = _kernel(SPECS[0][1])
    q, k, v = _inputs(kernel.spec, 64, device())
    seen = []
    real = op_module.backward_raw

    def spy(attn, q, k, v, out, lse, grad_out, grad_lse, packing=None):
        seen.append(grad_lse is None)
        return real(attn, q, k, v, out, lse, grad_out, grad_lse, packing)

    monkeypatch.setattr(op_module, "backward_raw", spy)  # the op's backward calls it
    out, lse = kernel(q, k, v, return_lse=True)
    loss = out.sum() + (lse.sum() if use_lse else 0)
    loss.backward()
    assert seen == [not use_lse]


def test_kept_tables_are_dropped_by_length_not_by_count():
    """A module keeps its device tables for KEPT_LENGTHS sequence lengths: any number of
    entries of one length (a causal Hilbert plan keeps up to three block lists a branch) stay
    together, a length used again is not rebuilt, a new length past the limit drops the
    entries of the length kept longest, and the class order (of no length) is never dropped."""
    spec = dilgen.Spec(name="kept_tables", head_dim=16, dtype="float32", num_heads=4, **SPECS[3][1])
    cpu = torch.device("cpu")
    attn = dilgen.compile(spec).compiled_for(cpu).attention      # a module no other test uses
    first = attn._launch_tensors(64, cpu)
    order = attn._class_order(cpu)
    for i in range(20):                               # many entries of one length
        attn._keep((64, "lists", i), torch.zeros(1))
    assert attn._launch_tensors(64, cpu) is first
    assert all((64, "lists", i) in attn._device_tensors for i in range(20))
    n_kept = attn.KEPT_LENGTHS
    for n in range(128, 64 * (n_kept + 1), 64):        # n_kept - 1 more lengths: all kept
        attn._launch_tensors(n, cpu)
    assert attn._launch_tensors(64, cpu) is first
    attn._launch_tensors(64 * (n_kept + 1), cpu)        # one more: length 64 goes, all of it
    assert not [k for k in attn._device_tensors if k[0] == 64]
    assert attn._class_order(cpu) is order
    lengths = {k[0] for k in attn._device_tensors if isinstance(k[0], int)}
    assert lengths == set(range(128, 64 * (n_kept + 2), 64))
