"""A packed call's offsets and a padded call's mask are followed as they are now (issue 57
§2): a tensor rewritten behind torch's back (through the numpy array it shares, through
`.data`, or in place with its version counter set back) gives the float64 reference of its
new contents, never the result of what an earlier call read. On a GPU the comparison runs
on the device without a host read; here that path runs on CPU tensors with
readings.on_device patched (tests/test_host_path.py fakes GPU calls the same way)."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

import dilgen
from dilgen.reference import reference_attention
from dilgen.runtime import readings
from dilgen.runtime.checks import InputError

from conftest import rel_error

SPEC = dilgen.Spec(name="read_now", num_heads=2, num_kv_heads=1, head_dim=16, dtype="float32",
                   segment_lengths=[8, 16], dilation_rates=[1, 2], causal=True)
TOTAL, B, N = 40, 2, 20
OLD_CU, NEW_CU = [0, 10, 40], [0, 25, 40]
OLD_VALID, NEW_VALID = [20, 6], [9, 17]     # tokens per item (right padding)


@pytest.fixture(scope="module")
def kernel():
    return dilgen.compile(SPEC)


def _qkv(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    heads = (SPEC.num_heads, SPEC.num_kv_heads, SPEC.num_kv_heads)
    return [torch.randn(*shape, h, SPEC.head_dim, generator=gen) for h in heads]


def _packed_reference(q, k, v, cu):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for a, b in zip(cu[:-1], cu[1:]):
        if b > a:
            out[a:b] = reference_attention(q[None, a:b], k[None, a:b], v[None, a:b], SPEC)[0]
    return out


def _padded_reference(q, k, v, valid):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, n in enumerate(valid):
        out[b, :n] = reference_attention(q[b:b + 1, :n], k[b:b + 1, :n], v[b:b + 1, :n], SPEC)[0]
    return out


def _mask(valid) -> np.ndarray:
    return np.arange(N)[None, :] >= np.array(valid)[:, None]


def _set_version(t: torch.Tensor, version: int) -> None:
    setter = torch._C._autograd._unsafe_set_version_counter
    try:
        setter((t,), (version,))
    except TypeError:       # torch releases that take one tensor
        setter(t, version)


def _rewrite(how: str, t: torch.Tensor, arr: np.ndarray, new: np.ndarray) -> None:
    """Write `new` into t without torch seeing a new version."""
    if how == "numpy":
        arr[...] = new
    elif how == "data":
        t.data[...] = torch.from_numpy(new)
    else:
        if not hasattr(torch._C._autograd, "_unsafe_set_version_counter"):
            pytest.skip("this torch cannot set a version counter")
        before = t._version
        with torch.no_grad():
            t.copy_(torch.from_numpy(new))
        _set_version(t, before)
        assert t._version == before
    assert np.array_equal(t.numpy(), new)


HOW = ["numpy", "data", "copy_version_reset"]


@pytest.mark.parametrize("how", HOW)
def test_packed_offsets_rewritten_behind_torchs_back(kernel, how):
    arr = np.array(OLD_CU, dtype=np.int32)
    cu = torch.from_numpy(arr)
    q, k, v = _qkv((TOTAL,), seed=1)
    first = kernel(q, k, v, cu_seqlens=cu)
    assert rel_error(first, _packed_reference(q, k, v, OLD_CU)) < 1e-4
    _rewrite(how, cu, arr, np.array(NEW_CU, dtype=np.int32))
    want = _packed_reference(q, k, v, NEW_CU)
    assert rel_error(_packed_reference(q, k, v, OLD_CU), want) > 0.1     # the write matters
    out, lse = kernel(q, k, v, cu_seqlens=cu, return_lse=True)
    assert rel_error(out, want) < 1e-4
    assert lse.shape == (SPEC.num_heads, TOTAL) and torch.isfinite(lse).all()


@pytest.mark.parametrize("how", HOW)
def test_padding_mask_rewritten_behind_torchs_back(kernel, how):
    arr = _mask(OLD_VALID)
    mask = torch.from_numpy(arr)
    q, k, v = _qkv((B, N), seed=2)
    first = kernel.padded(q, k, v, mask)
    assert rel_error(first, _padded_reference(q, k, v, OLD_VALID)) < 1e-4
    _rewrite(how, mask, arr, _mask(NEW_VALID))
    want = _padded_reference(q, k, v, NEW_VALID)
    assert rel_error(_padded_reference(q, k, v, OLD_VALID), want) > 0.1
    out = kernel.padded(q, k, v, mask)
    assert rel_error(out, want) < 1e-4
    assert out[0, NEW_VALID[0]:].abs().max() == 0          # the new padding rows are 0


def test_gradients_follow_rewritten_offsets(kernel):
    """The backward of a call after the rewrite uses the new offsets too (its packing is the
    forward's)."""
    arr = np.array(OLD_CU, dtype=np.int32)
    cu = torch.from_numpy(arr)
    q, k, v = _qkv((TOTAL,), seed=3)
    kernel(q, k, v, cu_seqlens=cu)
    arr[1] = NEW_CU[1]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    (kernel(*leaves, cu_seqlens=cu) * g).sum().backward()
    ref_out = torch.zeros(q.shape, dtype=torch.float64)
    from dilgen.reference import differentiable_reference
    for a, b in zip(NEW_CU[:-1], NEW_CU[1:]):
        ref_out[a:b] = differentiable_reference(*(t[None, a:b] for t in ref), SPEC)[0][0]
    (ref_out * g.double()).sum().backward()
    for mine, want in zip(leaves, ref):
        assert rel_error(mine.grad, want.grad) < 2e-4


def test_a_ring_rank_checks_the_offsets_it_reads():
    """The ring's agreement reads the offsets every call: offsets rewritten into a bad
    order after a good call are refused, not sent to the other ranks unchecked."""
    from dilgen.runtime.ring.agreement import _check_packed
    spec = SPEC.replace(ring_size=2).to_json()
    arr = np.array(OLD_CU, dtype=np.int32)
    cu = torch.from_numpy(arr)
    q, k, v = _qkv((TOTAL // 2,), seed=5)
    assert _check_packed(spec, q, k, v, "contiguous", 2, cu, None) == OLD_CU
    arr[1] = 50                                     # 0, 50, 40: out of order
    with pytest.raises(InputError, match="non-decreasing"):
        _check_packed(spec, q, k, v, "contiguous", 2, cu, None)


# -- the GPU path, run on CPU tensors ------------------------------------------------------------
@pytest.fixture
def device_side(monkeypatch):
    """readings treats every tensor as a GPU one: compared on the device, never read on the
    host while its version is unchanged. Reports the host reads made from dilgen's code."""
    monkeypatch.setattr(readings, "on_device", lambda t: True)
    reads = []

    def spy(owner, name):
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("dilgen.runtime.readings") or caller.startswith("dilgen.runtime.varlen"):
                reads.append(name)
            return real(*args, **kwargs)
        monkeypatch.setattr(owner, name, wrapper)

    for owner, name in ((torch.Tensor, "tolist"), (torch.Tensor, "item"), (torch, "equal"),
                        (torch.Tensor, "__bool__")):
        spy(owner, name)
    return reads


@pytest.mark.parametrize("form", ["packed", "padded"])
def test_on_a_gpu_an_unchanged_tensor_is_compared_on_the_device(kernel, device_side, form):
    """A second call with the same offsets (or mask) reads nothing on the host; a rewrite
    torch did not see is refused by the device-side check before any kernel runs; a write
    torch saw (a new version) is read again on the host and computed exactly."""
    if form == "packed":
        t = torch.tensor(OLD_CU, dtype=torch.int32)
        q, k, v = _qkv((TOTAL,), seed=6)
        call = lambda: kernel(q, k, v, cu_seqlens=t)                      # noqa: E731
        new, want = torch.tensor(NEW_CU, dtype=torch.int32), _packed_reference(q, k, v, NEW_CU)
    else:
        t = torch.from_numpy(_mask(OLD_VALID))
        q, k, v = _qkv((B, N), seed=6)
        call = lambda: kernel.padded(q, k, v, t)                           # noqa: E731
        new, want = torch.from_numpy(_mask(NEW_VALID)), _padded_reference(q, k, v, NEW_VALID)
    first = call()
    assert device_side and "tolist" in device_side          # the first call reads on the host
    device_side.clear()
    assert torch.equal(call(), first)
    assert device_side == []                                # no host read, no sync
    t.data[...] = new
    attn = kernel.compiled_for(torch.device("cpu")).attention
    launches = attn.launches
    with pytest.raises(RuntimeError, match="rewritten since without torch seeing the write"):
        call()
    assert attn.launches == launches
    torch.autograd.graph.increment_version(t)              # the documented way to tell torch
    assert rel_error(call(), want) < 1e-4
    assert "tolist" in device_side


def test_on_a_gpu_a_tensor_without_a_version_counter_is_read_every_call(kernel, device_side):
    with torch.inference_mode():
        cu = torch.tensor(OLD_CU, dtype=torch.int32)
    q, k, v = _qkv((TOTAL,), seed=7)
    with torch.no_grad():
        kernel(q, k, v, cu_seqlens=cu)
        device_side.clear()
        with torch.inference_mode():
            cu[1] = NEW_CU[1]
        out = kernel(q, k, v, cu_seqlens=cu)
    assert "tolist" in device_side
    assert rel_error(out, _packed_reference(q, k, v, NEW_CU)) < 1e-4


def test_a_reading_holds_a_copy_not_the_tensor():
    """An entry goes with its tensor (weakly held), and keeps its own copy of the contents."""
    import gc
    import weakref
    t = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert readings.remembered(t, ("x",), lambda: 1) == 1
    assert readings.remembered(t, ("x",), lambda: 2) == 1
    entry = readings._SEEN[id(t)]
    assert entry.copy.data_ptr() != t.data_ptr()
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None and all(e.ref() is not None for e in readings._SEEN.values())
