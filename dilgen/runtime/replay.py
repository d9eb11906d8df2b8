"""Launch replay: the host path of a repeated call. A call's launches are recorded once per
argument signature and launched again by the compiled kernels' own launchers, without
Triton's binder and without rebuilding argument lists (GPU only; the interpreter never
replays).

Why a replay launches what a fresh call would: Triton specializes a kernel on its
arguments' dtypes, their 16-byte alignment, integers equal to 1 or divisible by 16, and
constexpr values. Two calls of one module whose tensors agree in shape, stride, dtype,
device and alignment (`signature`) pass the same integers, the same device tables and
fresh buffers (CUDA's caching allocator aligns every block to 512 bytes) to the same
kernels, so the second call can launch the kernels the first one compiled, its tensors in
the slots where the first call's were. Tensors a call allocates for its own launches (the
compact copies of curve-ordered rows, `Recorder.temporary`) are allocated afresh by each
replay. A host-made TMA descriptor over a slot (the Gluon forward's, runtime/gluon_launch.py)
is made again over the call's tensor (or temporary): its shape and strides follow from the
signature, its base is the slot's pointer. A recording in which a launch reads any other tensor, neither a
slot nor one of the module's kept device tables, is not kept: such calls take the full path
every time.
"""
from __future__ import annotations

import contextlib
import inspect
import threading

import torch

from .launch import direct, ensure_descriptor_allocator, hooked, launch_compiled
from ..knobs import flag

ENABLED = flag("DILGEN_REPLAY", True)   # off: every call records nothing
_SLOT = object()
_MAX_RECIPES = 64      # distinct signatures kept per module (a call of a new shape records again)


# The GPU calls, one function each (tests/test_host_path.py replaces them on a CPU machine).

def _device() -> int:
    return torch._C._cuda_getDevice()     # torch.cuda.current_device() without its lazy-init check


def _stream(device: int):
    return torch._C._cuda_getCurrentRawStream(device)     # what Triton's driver returns


def enabled() -> bool:
    """Whether calls replay (DILGEN_REPLAY=0, or replay.ENABLED = False, turns it off)."""
    return ENABLED


def signature(tag: str, tensors, extra=()) -> tuple:
    """The key of a call: what Triton's specialization and dilgen's launch arithmetic read
    from its tensors (shape, stride, dtype, device, alignment), with the current CUDA device
    (where Triton launches), and which tensors start at the same address: a recording of
    kernel(x, x, x) fills every slot from one tensor, so only such calls may replay it."""
    ptrs = [t.data_ptr() for t in tensors]
    return (tag, _device(), extra, tuple(ptrs.index(p) for p in ptrs),
            *[(t.shape, t.stride(), t.dtype, t.get_device(), p & 15) for t, p in zip(tensors, ptrs)])


def split_dropout(dropout: tuple) -> tuple[tuple, tuple]:
    """A dropout plan's kernel arguments (runtime.dropout_call.dropout_args) as a recipe takes
    them: the call's tensors (the seed, read by the kernels when they run, and the streams
    table), which are slots, and its numbers (drop_cut, drop_scale, the counter's rows, the
    first row's position), which a recipe keeps as recorded and so belong to the signature."""
    return (tuple(x for x in dropout if isinstance(x, torch.Tensor)),
            tuple(x for x in dropout if not isinstance(x, torch.Tensor)))


def kept_tensors(attn) -> set[int]:
    """ids of the device tables a module keeps between calls (GeneratedAttention
    ._device_tensors: class order, Hilbert tables, block lists, decode's curves)."""
    ids: set[int] = set()
    stack = list(attn._device_tensors.values())
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            ids.add(id(x))
        elif isinstance(x, (tuple, list)):
            stack.extend(x)
    return ids


class Recorder:
    """Launches `kernel[grid](*args, **options)` and notes what ran, for a Recipe. Tensors the
    call allocates for its own launches to write and read (`temporary`: the compact
    curve-ordered rows of a Hilbert branch) are allocated afresh by each replay."""

    def __init__(self) -> None:
        self.ran: list[tuple] = []
        self.temporaries: dict[int, torch.Tensor] = {}

    def launch(self, kernel, grid, args: tuple, options: dict) -> None:
        compiled = kernel[grid](*args, **options)
        self.ran.append((kernel, compiled, tuple(grid) + (1,) * (3 - len(grid)), args))

    def temporary(self, *tensors: torch.Tensor) -> None:
        """Fresh tensors (torch.empty) that a recorded launch writes in full before a later
        recorded launch reads them, and nothing else reads."""
        for t in tensors:
            self.temporaries[id(t)] = t

    def recipe(self, slots: tuple, attn, allocator: bool = False) -> "Recipe | None":
        """The Recipe of the recorded launches with `slots` (the call's tensors) as holes;
        None when a launch read a tensor that is neither a slot, a temporary nor a kept
        table, or a kernel gave no compiled kernel to launch again."""
        where = {id(t): i for i, t in enumerate(slots)}
        temps: list[tuple] = []
        for t in self.temporaries.values():       # holes after the slots
            where[id(t)] = len(slots) + len(temps)
            temps.append((tuple(t.shape), t.dtype))
        kept = kept_tensors(attn)
        launches = []
        for kernel, compiled, grid, args in self.ran:
            if compiled is None or not hasattr(compiled, "packed_metadata"):
                return None
            params = getattr(kernel, "params", ())
            defaults = tuple(p.default for p in params[len(args):])
            if any(d is inspect.Parameter.empty for d in defaults):
                return None
            template, holes = list(args) + list(defaults), []
            for pos, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    if id(a) in where:
                        holes.append((pos, where[id(a)], None))
                        template[pos] = _SLOT
                    elif id(a) not in kept:
                        return None
                elif isinstance(getattr(a, "base", None), torch.Tensor):     # a TMA descriptor
                    slot = _slot_under(a.base, (*slots, *self.temporaries.values()))   # holes' order
                    if slot is None:
                        return None
                    holes.append((pos, slot, (tuple(a.shape), tuple(a.strides), a.padding)))
                    template[pos] = _SLOT
            launches.append((compiled, grid, tuple(template), tuple(holes)))
        return Recipe(launches, allocator, tuple(temps))


_RECORDING = threading.local()


def recording() -> Recorder | None:
    """The Recorder of the call being recorded on this thread (launches made on its behalf,
    curve_rows.copy_rows', go through it), or None."""
    return getattr(_RECORDING, "recorder", None)


@contextlib.contextmanager
def recording_into(recorder: Recorder | None):
    """Within: `recording()` is `recorder` (None: nothing is recorded)."""
    before = recording()
    _RECORDING.recorder = recorder
    try:
        yield recorder
    finally:
        _RECORDING.recorder = before


def _slot_under(view: torch.Tensor, slots: tuple) -> int | None:
    """The slot whose memory `view` (a descriptor's base) starts at, or None."""
    for i, t in enumerate(slots):
        if (isinstance(t, torch.Tensor) and t.data_ptr() == view.data_ptr()
                and t.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()):
            return i
    return None


class Descriptor:
    """A host TMA descriptor as Triton 3.6's launcher reads one (make_tensordesc_arg:
    base.data_ptr(), shape, strides, padding), over a pointer: made per replay."""

    __slots__ = ("ptr", "shape", "strides", "padding")

    def __init__(self, ptr: int, shape: tuple, strides: tuple, padding: str) -> None:
        self.ptr, self.shape, self.strides, self.padding = ptr, shape, strides, padding

    @property
    def base(self) -> "Descriptor":
        return self

    def data_ptr(self) -> int:
        return self.ptr


def _fill(args: list, holes, ptrs) -> None:
    for pos, slot, desc in holes:
        args[pos] = ptrs[slot] if desc is None else Descriptor(ptrs[slot], *desc)


class Recipe:
    """Recorded launches: `run(tensors)` launches them again with a call's tensors."""

    def __init__(self, launches: list, allocator: bool, temporaries: tuple = ()) -> None:
        self.launches = launches
        self.temporaries = temporaries  # (shape, dtype) of each temporary, allocated per run
        self.allocator = allocator      # device-side tensor descriptors need triton's allocator
        self.fill = False               # the forward's: zero out and -inf lse before launching
        # every launch through its C launch (launch.direct): the kept tables' pointers read
        # once (self.launches keeps the tables alive), a call's tensors' at each run
        goes = [direct(compiled) for compiled, *_ in launches]
        self.direct = None if None in goes else [
            (go, grid, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in template), holes)
            for go, (_, grid, template, holes) in zip(goes, launches)]

    def run(self, tensors: tuple) -> None:
        if self.temporaries:
            dev = tensors[0].device
            tensors = (*tensors, *(torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in self.temporaries))
        stream = _stream(_device())
        if self.direct is not None and not hooked():
            ptrs = [t.data_ptr() for t in tensors]
            for go, grid, template, holes in self.direct:
                args = list(template)
                _fill(args, holes, ptrs)
                go(grid, stream, args)
            return
        if self.allocator:
            ensure_descriptor_allocator()
        ptrs = [t.data_ptr() for t in tensors]
        for compiled, grid, template, holes in self.launches:
            args = list(template)
            for pos, slot, desc in holes:
                args[pos] = tensors[slot] if desc is None else Descriptor(ptrs[slot], *desc)
            launch_compiled(compiled, grid, stream, tuple(args))


_NEVER = object()      # a signature whose recording could not be kept: its calls never record again


def lookup(attn, key: tuple) -> tuple[Recipe | None, bool]:
    """(the recipe of `key` or None, whether this call should record one)."""
    hit = attn._replays.get(key)
    if hit is _NEVER:
        return None, False
    return hit, hit is None


def keep(attn, key: tuple, recipe: Recipe | None) -> None:
    """Store a call's recipe on its module, or that its signature cannot replay (bounded: a
    new shape past the limit starts over)."""
    if len(attn._replays) >= _MAX_RECIPES:
        attn._replays.clear()
    attn._replays[key] = _NEVER if recipe is None else recipe
