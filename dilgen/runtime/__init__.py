"""Run generated kernels. A generated module needs only this package (and torch, triton):
it never plans or emits. One job per module, and a call's path goes down this list:

    attention.py   GeneratedAttention, a generated module's `attention`: checks and routes a call
    dispatch.py    a dilgen.Kernel's call under torch.compile (by registry key)
    op.py          torch custom ops and autograd: fixed-length and packed forward/backward, decode
    ring/          the ring over P ranks (schedule execution, transfers, its own ops)
    decode.py      incremental decoding over a KV cache
    forward.py     the forward launches (fused lattice kernel, lane kernels)
    backward.py    the backward launches (preprocess, dK/dV, dQ)
    varlen.py      packings of packed and padded batches, their per-sequence tables
    gluon_launch.py  sm90's Gluon launches over fixed-length rows (descriptors, when a call takes them)
    gluon_packed.py  ... over packed rows (the lattice kernels' and a causal plan's lanes' packed twins)
    curve_rows.py  compact curve-ordered rows and causal block lists of Hilbert branches
    registry.py    the string keys torch ops hold, and the objects behind them
    launch.py      a kernel from generated source (JIT, AOT binary, interpreter, RepeatLauncher)
    replay.py      a call's launches recorded once per signature and launched again (GPU)
    interpreter.py Triton's interpreter inside a process that also compiles for the GPU
    grids.py       launch grids (shared with dilgen.aot's launch model)
    tables.py      Hilbert permutation tables on a device
    checks.py      input checks: InputError
"""
from .attention import GeneratedAttention
from .checks import InputError
from .grids import lane_grid, lane_launch_grid, lane_order, lattice_group_tiles
from .launch import set_poison

__all__ = ["GeneratedAttention", "InputError", "lane_grid", "lane_launch_grid", "lane_order",
           "lattice_group_tiles", "set_poison"]
