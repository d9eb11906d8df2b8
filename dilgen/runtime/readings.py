"""What a call reads on the host from a small tensor it is given (a packed batch's
cu_seqlens, a padding mask; the transformers doorway's masks and position_ids), remembered
while the tensor still holds what was read. A model's layers pass one tensor to every call,
so they share one read instead of one device sync each.

Whether the tensor still holds what was read is decided from its contents, not from torch's
bookkeeping: a numpy array behind torch.from_numpy, a write through `t.data`, another
library's kernel, a collective into a kept buffer or a reset version counter change a
tensor without torch seeing it. So every call follows what the tensor holds now:

- On the CPU the tensor is compared with a copy of what was read (torch.equal, no device
  involved); different contents are read again.
- On a GPU that comparison runs on the device: a call whose tensor differs from what was
  read fails a device-side assert (torch._assert_async) queued ahead of its kernels, so they
  never run with tables made from the old contents; no host read, no sync. The assert is
  fatal to the process's CUDA context, as any device-side assert is, so a program that
  rewrites such a tensor without torch seeing it calls
  torch.autograd.graph.increment_version(t) after the write (or passes a new tensor): a
  write torch sees (a new in-place version), like a tensor of another shape, dtype or
  device, is read again on the host (one sync), as on the first call.
- A GPU tensor with no version counter (made under torch.inference_mode) is read on every
  call (a sync each); tensor subclasses and traced calls are never remembered.

An entry goes with its tensor and holds a copy of the contents, never the tensor itself.
"""
from __future__ import annotations

import weakref

import torch

MAX_VALUES = 16      # readings kept per tensor (one per call form: rows, device, max_seqlen)


def on_device(t: torch.Tensor) -> bool:
    """Whether `t` is compared on its device rather than on the host (tests/test_read_now.py
    sets this for CPU tensors, to run the GPU path on a machine without one)."""
    return t.device.type != "cpu"


class _Entry:
    __slots__ = ("ref", "layout", "version", "copy", "values")

    def __init__(self, ref, layout, version, copy) -> None:
        self.ref, self.layout, self.version, self.copy = ref, layout, version, copy
        self.values: dict = {}


_SEEN: dict[int, _Entry] = {}


def _drop(key: int, ref) -> None:
    entry = _SEEN.get(key)
    if entry is not None and entry.ref is ref:
        del _SEEN[key]


def unchanged_on_device(t: torch.Tensor, copy: torch.Tensor, what: str = "a tensor") -> None:
    """Queue a device-side check that `t` holds `copy`'s contents (no host read)."""
    torch._assert_async((t == copy).all(), f"dilgen: {what} was read by an earlier call and has "
                                           f"been rewritten since without torch seeing the write; "
                                           f"call torch.autograd.graph.increment_version on it "
                                           f"after such a write, or pass a new tensor")


def remembered(t, extra: tuple, make, what: str = "a tensor"):
    """make() (which reads t on the host), or what it gave before for this tensor and
    `extra` while t holds the contents it read then (module docstring). `what` names t in
    the device-side check's message."""
    if type(t) is not torch.Tensor or torch.compiler.is_compiling():
        return make()
    device_side = on_device(t)
    version = None if t.is_inference() else t._version
    if device_side and version is None:
        return make()
    layout = (t.shape, t.dtype, t.device)
    entry = _SEEN.get(id(t))
    if entry is not None and (entry.ref() is not t or entry.layout != layout):
        entry = None
    if entry is not None:
        if device_side and entry.version == version and extra in entry.values:
            unchanged_on_device(t, entry.copy, what)
            return entry.values[extra]
        # the CPU; or a write torch saw, or a reading not made yet, where make() reads t on
        # the host anyway: compared on the host
        if not torch.equal(t, entry.copy):
            entry = None
    if entry is None:
        ref = weakref.ref(t, lambda r, key=id(t): _drop(key, r))
        entry = _Entry(ref, layout, version, t.clone())    # the copy is queued before make()'s read
        value = make()
        _SEEN[id(t)] = entry
    else:
        entry.version = version
        if extra in entry.values:
            return entry.values[extra]
        value = make()
    if len(entry.values) >= MAX_VALUES:
        entry.values.clear()
    entry.values[extra] = value
    return value
