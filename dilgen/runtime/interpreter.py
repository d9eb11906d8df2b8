"""Triton's interpreter inside a process that may also compile for the GPU.

Generated kernels run on CPU tensors in Triton's interpreter (the same source the GPU
compiles). `interpreting()` wraps one launch; see its docstring for what it patches and
puts back."""
from __future__ import annotations

import inspect
import threading
from typing import Any

_INTERPRET_LOCK = threading.RLock()


def scalar_index(self):
    """A scalar of the interpreter as a Python int (range bounds, indices): its data is an
    array of one element, whatever its rank."""
    data = self.handle.data
    if data.size != 1:
        raise TypeError(f"only a scalar can be an index, got a block of shape {data.shape}")
    return int(data.reshape(-1)[0])


class interpreting:
    """Run Triton's interpreter in a process where triton was imported without
    TRITON_INTERPRET=1: triton.language's own @jit helpers (tl.max, tl.sum, tl.zeros, ...)
    are then JITFunctions, which the interpreter cannot call; route them through
    InterpretedFunction for the duration of one launch.

    Also: Triton 3.6's interpreter turns a scalar into an index with int() of its
    one-element array, which NumPy 2.4 and later refuse for arrays of rank 1 ("only
    0-dimensional arrays can be converted to Python scalars"); its tensor patch gets an
    __index__ that takes the one element, for the duration of the launch.

    And: the interpreter patches triton.language's builtins for interpreted helpers (tl.max,
    tl.sum, ...) and does not undo the patches of triton.language.core, so a GPU compile later
    in the process failed ("'ir.value' object has no attribute 'dtype'"): the attributes of
    the language modules and classes are saved here and put back on exit."""

    def __enter__(self):
        from triton.runtime import interpreter
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
        _INTERPRET_LOCK.acquire()
        self._cls = JITFunction
        self._saved = JITFunction.__call__
        self._interp = interpreter
        self._saved_patch = getattr(interpreter, "_patch_lang_tensor", None)
        if self._saved_patch is not None:
            original = self._saved_patch

            def patch_lang_tensor(tensor, scope):
                original(tensor, scope)
                scope.set_attr(tensor, "__index__", scalar_index)

            interpreter._patch_lang_tensor = patch_lang_tensor
        cache: dict[int, Any] = {}

        def call(fn_self, *args, **kwargs):
            wrapped = cache.get(id(fn_self))
            if wrapped is None:
                wrapped = cache[id(fn_self)] = InterpretedFunction(fn_self.fn)
            return wrapped(*args, **kwargs)

        JITFunction.__call__ = call
        self._language = [(obj, dict(vars(obj))) for obj in language_namespaces()]
        return self

    def __exit__(self, *exc):
        self._cls.__call__ = self._saved
        if self._saved_patch is not None:
            self._interp._patch_lang_tensor = self._saved_patch
        for obj, saved in self._language:
            restore_namespace(obj, saved)
        _INTERPRET_LOCK.release()
        return False


def language_namespaces() -> list:
    """The modules and classes of triton.language whose builtins the interpreter patches."""
    import triton.language as tl
    found = [tl, tl.core, tl.math, tl.core.tensor]
    base = getattr(tl.core, "tensor_descriptor_base", None)
    return found + ([base] if base is not None else [])


def restore_namespace(obj, saved: dict) -> None:
    """Put the attributes of a module or class back as `saved` (its vars() before)."""
    now = vars(obj)
    for name in [n for n in now if n not in saved and not inspect.ismodule(now[n])]:
        delattr(obj, name)      # (a submodule imported meanwhile stays)
    for name, value in saved.items():
        if now.get(name, _MISSING_ATTR) is not value:
            setattr(obj, name, value)


_MISSING_ATTR = object()
