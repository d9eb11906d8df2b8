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
