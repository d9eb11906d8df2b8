"""dilgen's context for Triton's interpreter (dilgen/runtime/interpreter.py): a helper call
does not patch the language again, yet every helper sees the interpreter's builtins; 32-bit
integer ops wrap as the compiled kernels' do, unless DILGEN_INTERPRET_OVERFLOW_CHECK=1; and
everything patched is put back when the launch ends."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as triton_interpreter
from triton.runtime.interpreter import InterpretedFunction

from dilgen.runtime.interpreter import interpreting


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _row_max(x):
    return tl.max(x, axis=0)          # a triton.language helper (standard.py, its own globals)


def _kernel(x_ptr, out_ptr, big, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, _twice(x) + _row_max(x))
    tl.store(out_ptr + BLOCK + offs, big * 3 + offs)      # past 2**31 - 1 for big = 2**30


def _launch(x, big):
    out = torch.full((2 * x.numel(),), -1, dtype=torch.int32)
    with interpreting():
        InterpretedFunction(_kernel)[(1,)](x, out, big, BLOCK=x.numel())
    return out


def test_helpers_run_with_the_language_patched_once_and_overflow_wraps(monkeypatch):
    monkeypatch.delenv("DILGEN_INTERPRET_OVERFLOW_CHECK", raising=False)
    calls = []
    plain = triton_interpreter._patch_lang
    monkeypatch.setattr(triton_interpreter, "_patch_lang", lambda fn: calls.append(fn) or plain(fn))
    x = torch.arange(8, dtype=torch.int32) * 5 - 7
    out = _launch(x, 2**30)
    assert torch.equal(out[:8], 2 * x + x.max())
    want = (torch.arange(8, dtype=torch.int64) + 3 * 2**30 + 2**31) % 2**32 - 2**31   # int32 wraps
    assert torch.equal(out[8:].long(), want)
    # the launch patches for the kernel, tl.max's module once: never again per helper call
    names = [getattr(fn, "__name__", "") for fn in calls]
    assert names.count("_kernel") == 1 and "_twice" not in names, names
    out = _launch(x, 2**30)                                # a second launch: the same answers
    assert torch.equal(out[:8], 2 * x + x.max())


def test_overflow_check_on_request_and_everything_put_back(monkeypatch):
    options, np_dtype = triton_interpreter.interpreter_builder.options, triton_interpreter._get_np_dtype
    device_call = InterpretedFunction.__call__
    monkeypatch.setenv("DILGEN_INTERPRET_OVERFLOW_CHECK", "1")
    with pytest.raises(Exception, match="overflow"):
        _launch(torch.arange(8, dtype=torch.int32), 2**30)
    assert triton_interpreter.interpreter_builder.options is options
    assert triton_interpreter._get_np_dtype is np_dtype and InterpretedFunction.__call__ is device_call
    assert options.sanitize_overflow                     # Triton's own default, untouched


def _fields(obj) -> dict:
    """An object's attributes with tl.tuple, constexpr and their types by value."""
    core = tl.core

    def norm(v):
        if isinstance(v, core.tuple):
            return ("tuple", [norm(x) for x in v.values], norm(v.type))
        if isinstance(v, core.tuple_type):
            return ("tuple_type", [norm(x) for x in v.types], getattr(v, "fields", None))
        if isinstance(v, (core.constexpr, core.constexpr_type)):
            return (type(v).__name__, v.value)
        return v
    return {k: norm(v) for k, v in vars(obj).items()}


@pytest.mark.parametrize("shape", [[4, 8], [16], [tl.constexpr(4), 8], "tl.tuple"])
def test_launch_constructors_make_the_same_types_and_tensors(shape):
    """Inside a launch block_type and tl.tensor are built by dilgen's constructors (a shape
    seen before reuses its checked numel and constexprs); they must make what Triton's make,
    the second time too, refuse what Triton's refuse, and be put back after the launch."""
    core = tl.core
    shape = core.tuple([2, 4]) if shape == "tl.tuple" else shape
    own = core.block_type.__init__, core.tensor.__init__
    want_type = core.block_type(tl.float32, shape)
    want = [_fields(want_type), _fields(core.tensor(None, want_type)), _fields(core.tensor(None, tl.int32))]
    with interpreting():
        assert (core.block_type.__init__, core.tensor.__init__) != own   # 3.6 and 3.9 are known
        for _ in range(2):
            got_type = core.block_type(tl.float32, shape)
            got = [_fields(got_type), _fields(core.tensor(None, got_type)), _fields(core.tensor(None, tl.int32))]
            assert got == want
        a, b = core.tensor(None, got_type), core.tensor(None, got_type)
        assert a.shape is not b.shape and a.shape.values is not b.shape.values    # fresh tuples
        for bad, error in (([3], ValueError), ([], TypeError), ((4,), AssertionError)):
            with pytest.raises(error):
                core.block_type(tl.float32, bad)
    assert (core.block_type.__init__, core.tensor.__init__) == own
    for bad, error in (([3], ValueError), ([], TypeError), ((4,), AssertionError)):
        with pytest.raises(error):
            core.block_type(tl.float32, bad)


def test_constructors_of_an_unknown_source_are_kept(monkeypatch):
    from dilgen.runtime import interpreter
    monkeypatch.setattr(interpreter, "_KNOWN_SOURCES", {"block_type": set(), "tensor": set()})
    monkeypatch.setattr(interpreter, "_CHECKED", {})
    own = tl.core.block_type.__init__, tl.core.tensor.__init__
    with interpreting():
        assert (tl.core.block_type.__init__, tl.core.tensor.__init__) == own
