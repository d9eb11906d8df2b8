"""Hostile arguments get one clear error, never a truncated value, a raw traceback or a
silent wrong answer (issue 44, items 7 and 8): torchscale's args, packed and padded calls,
nested tensors, double backward, and the errors of a call traced by torch.compile."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import dilgen
from dilgen.compat import torchscale as compat
from dilgen.runtime.checks import InputError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torchscale_model as tm  # noqa: E402

SPEC = dilgen.Spec(name="hostile", num_heads=2, head_dim=16, dtype="float32",
                   segment_lengths=[8, 16], dilation_rates=[1, 2])


def _one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


@pytest.fixture(scope="module")
def kernel():
    return dilgen.compile(SPEC)


# --------------------------------------------------------------------------- torchscale args
@pytest.mark.parametrize("segments", [[8.7], "[2.5]", [True], "[1e400]", [[8]], "[8, 'a']", ["8"]])
def test_torchscale_segment_lists_are_never_truncated(segments):
    args = tm.make_args(segments, [1], embed_dim=32, heads=2)
    with pytest.raises(ValueError) as exc:
        compat.DilatedAttention(args, 32, 2, self_attention=True)
    line = _one_line(exc)
    assert "args.segment_length" in line and ("not a whole number" in line or "not a list" in line), line


def test_torchscale_whole_floats_are_the_integers_they_hold():
    args = tm.make_args([8.0, 16], "[1, 2.0]", embed_dim=32, heads=2)
    layer = compat.DilatedAttention(args, 32, 2, self_attention=True)
    assert layer.spec.segment_lengths == (8, 16) and layer.spec.dilation_rates == (1, 2)


@pytest.mark.parametrize("flag", ["no", 1, None, torch.tensor(True)])
def test_torchscale_is_causal_must_be_a_bool(flag):
    layer = compat.DilatedAttention(tm.make_args([8], [2], embed_dim=32, heads=2), 32, 2,
                                    self_attention=True)
    x = torch.randn(1, 8, 32)
    with pytest.raises(TypeError) as exc:
        layer(x, x, x, is_causal=flag)
    assert "is_causal" in _one_line(exc)


def test_torchscale_patch_of_a_non_module():
    with pytest.raises(TypeError) as exc:
        compat.patch(42)
    assert "torch.nn.Module" in _one_line(exc) and "int" in str(exc.value)


# --------------------------------------------------------------------------- call arguments
@pytest.mark.parametrize("max_seqlen", ["abc", 8.5, True, -1, [16]])
def test_max_seqlen_that_is_not_a_row_count(kernel, max_seqlen):
    q = torch.randn(20, 2, 16)
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    with pytest.raises(InputError) as exc:
        kernel(q, q, q, cu_seqlens=cu, max_seqlen=max_seqlen)
    assert "max_seqlen" in _one_line(exc)


def test_padding_mask_on_the_meta_device(kernel):
    q = torch.randn(1, 16, 2, 16)
    with pytest.raises(InputError) as exc:
        kernel.padded(q, q, q, torch.zeros(1, 16, dtype=torch.bool, device="meta"))
    assert "meta device" in _one_line(exc)


def test_nested_tensors_are_told_to_pack(kernel):
    nested = torch.nested.nested_tensor([torch.randn(8, 2, 16), torch.randn(12, 2, 16)],
                                        layout=torch.jagged)
    with pytest.raises(InputError) as exc:
        kernel(nested, nested, nested)
    assert "nested tensor" in _one_line(exc) and "cu_seqlens" in str(exc.value)


@pytest.mark.parametrize("packed", [False, True], ids=["fixed", "packed"])
def test_double_backward_is_refused_not_dropped(kernel, packed):
    """A second derivative through a dilgen call raises (a loss with a gradient term would
    otherwise treat that term as a constant)."""
    gen = torch.Generator().manual_seed(44)
    shape = (16, 2, 16) if packed else (1, 16, 2, 16)
    q = torch.randn(shape, generator=gen).requires_grad_()
    extra = {"cu_seqlens": torch.tensor([0, 6, 16], dtype=torch.int32)} if packed else {}
    out = kernel(q, q, q, **extra)
    grad, = torch.autograd.grad(out.square().sum(), q, create_graph=True)
    assert torch.isfinite(grad).all()                     # the first derivative still works
    with pytest.raises(NotImplementedError) as exc:
        grad.square().sum().backward()
    assert "double backward" in _one_line(exc)


# --------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_call_raises_the_input_error_itself(kernel, backend):
    """Under torch.compile(fullgraph=True) a refused call raises its InputError when the
    graph runs (dynamo would wrap an error raised while tracing in ~20 lines); the same
    function then compiles for good inputs and equals the eager call."""
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend=backend)
    def attend(q):
        return kernel(q, q, q)

    bad = torch.randn(1, 16, 3, 16, requires_grad=True)
    with pytest.raises(InputError) as exc:
        attend(bad).sum().backward()
    assert _one_line(exc).startswith("hostile: q has shape (1, 16, 3, 16)")
    good = torch.randn(1, 16, 2, 16, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(attend(good), kernel(good, good, good), rtol=0, atol=0)


def test_package_hands_on_its_errors_and_runtime():
    """`import dilgen` is enough for dilgen.runtime, dilgen.nn and the error classes."""
    import subprocess
    code = ("import dilgen; assert dilgen.InputError is dilgen.runtime.checks.InputError; "
            "assert callable(dilgen.runtime.ring.shard) and dilgen.nn.KVCache and dilgen.RingAborted; "
            "assert issubclass(dilgen.CacheError, Exception)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
