"""Dilation rates far past the segment length (issue 56, item 6): a segment of w positions has
min(r, w) offsets, and with r > w a head h keeps offset h mod r only where it is below w, so
every loop, launch grid and per-offset table of the kernels and the runtime is bounded by
min(r, w) (and the rows present), not by r (valid up to 2^24 - 1, SPEC §1).

Checked here: out, lse and gradients against the float64 reference (outputs poisoned by
conftest) for r far past w, r between w and 2w, causal, GQA, head bases past w and a Hilbert
curve; while they run, every `range` loop of the generated module is counted (one past
min(r, w), or past the rows, fails at once), every launch grid and every tensor a launch
reads is bounded; the loops of the generated source for every target (sm90, sm80, the
interpreter) have no bound of r; and the w = 64, r = 65536 call on 5 rows takes seconds in
the interpreter (under one on an idle core; over 200 s when the gap loops ran r offsets).
On a GPU the same cases run the compiled kernels against the reference."""
from __future__ import annotations

import ast
import builtins
import math
import time

import pytest
import torch

import dilgen
from dilgen.codegen import emit
from dilgen.compiler import Kernel
from dilgen.planner import plan
from dilgen.targets import INTERPRETER, SM80, SM90

from conftest import TOL, device, forward_and_gradients_against_reference, rel_error

MAX_RATE = (1 << 24) - 1

# (id, spec fields, (B, N), tuning)
CASES = [
    ("w64_r65536", dict(segment_lengths=[64], dilation_rates=[65536]), (1, 5), None),
    ("w64_rmax", dict(segment_lengths=[64], dilation_rates=[MAX_RATE]), (2, 5), None),
    ("w64_r65536_causal", dict(segment_lengths=[64], dilation_rates=[65536], causal=True), (1, 5), None),
    # w < r < 2w: every offset of a segment has one lane; a short last segment
    ("w64_r100", dict(segment_lengths=[64], dilation_rates=[100]), (1, 150), None),
    ("w64_r100_causal_gqa", dict(segment_lengths=[64], dilation_rates=[100], causal=True, num_kv_heads=2),
     (1, 150), None),
    # heads 62..65 keep offsets 62, 63 of w = 64 and none of w = 16 (22..25 mod 40): heads with
    # no row at all (lse -inf, zero gradients)
    ("head_base_past_w", dict(segment_lengths=[64, 16], dilation_rates=[100, 40], head_base=62), (1, 90), None),
    # a curve table with causal block lists per offset, two heads past w
    ("hilbert_causal_past_w", dict(segment_lengths=[64], dilation_rates=[65536], causal=True,
                                   hilbert={"scope": "segment"}, head_base=62), (1, 70), None),
    # every branch as lanes: r past w launched first (it writes the gap rows), then r = 2, whose
    # queries see many keys (dq, dk not vanishing)
    ("r100_then_r2_causal", dict(segment_lengths=[64, 32], dilation_rates=[100, 2], causal=True), (1, 150),
     {"lanes": "all"}),
    # 16-bit, causal, GQA: on sm90 the lane kernels read through tensor descriptors, whose
    # boxes are empty for the heads past w
    ("bf16_causal_gqa_past_w", dict(segment_lengths=[64, 128], dilation_rates=[100, 2], dtype="bfloat16",
                                    causal=True, num_kv_heads=2, head_base=62), (1, 200), None),
    # beside an r = 1 branch (it writes every row first; no gap rows)
    ("beside_r1", dict(segment_lengths=[16, 64], dilation_rates=[1, 65536]), (1, 40), None),
]


def check_against_reference(spec, batch: int, n: int, tuning, seed_name: str) -> None:
    """conftest.check_against_reference, with the gradients compared as one vector (dq, dk,
    dv) and each alone where it is not vanishing: with r >= w a branch keeps one lane of a
    segment per offset, so a query it alone keeps attends to itself (P = 1) and its dq, dk
    are 0 but for rounding, which no relative error of that tensor alone can measure."""
    (q, k, v), ref_in = forward_and_gradients_against_reference(spec, batch, n, tuning, seed_name)
    tol = TOL[spec.dtype]
    mine = torch.cat([t.grad.detach().double().cpu().flatten() for t in (q, k, v)])
    ref = torch.cat([t.grad.flatten() for t in ref_in])
    assert not torch.isnan(mine).any()
    assert rel_error(mine, ref) < 2 * tol
    for got, want in zip((q, k, v), ref_in):
        if want.grad.norm() > 1e-3 * ref.norm():
            assert rel_error(got.grad, want.grad) < 2 * tol


class LoopPastBound(AssertionError):
    """A loop of a generated kernel would run past its bound."""


def _loop_bound(spec, n: int) -> int:
    """The most iterations any loop of these kernels may run: the offsets a segment can have,
    min(r, w), and the rows present."""
    return min(n, max(min(r, w) for w, r in spec.branches()))


def _program_bound(spec, batch: int, n: int) -> int:
    """The most programs a launch may have: per (batch item, head, segment) one per offset."""
    return batch * spec.num_heads * max(math.ceil(n / w) * min(r, w, n) for w, r in spec.branches())


class _Launches:
    """Counts every `range` loop of the generated module and notes every launch's grid and
    tensor arguments while installed on a GeneratedAttention."""

    def __init__(self, attn, loop_bound: int):
        self.attn, self.loop_bound = attn, loop_bound
        self.loops, self.launches = 0, []
        self.globals = attn.lane_kernel.__globals__      # the generated module's namespace
        self.real_kernel = attn._kernel

    def _range(self, *args):
        loop = builtins.range(*args)
        self.loops += 1
        if len(loop) > self.loop_bound:
            raise LoopPastBound(f"range{tuple(int(a) for a in args)}: {len(loop)} iterations, "
                                f"past the bound {self.loop_bound}")
        return loop

    def _kernel(self, interpret, source_fn=None):
        kernel, log = self.real_kernel(interpret, source_fn), self.launches
        name = (source_fn or self.attn._source_fn).__name__

        class Spy:
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    log.append((name, tuple(grid), [a for a in args if isinstance(a, torch.Tensor)]))
                    return kernel[grid](*args, **kwargs)
                return run
        return Spy()

    def __enter__(self):
        self.globals["range"] = self._range
        self.attn._kernel = self._kernel
        return self

    def __exit__(self, *exc):
        del self.globals["range"]
        del self.attn._kernel


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_rates_past_w_match_the_reference_within_bounded_loops(case):
    name, fields, (batch, n), tuning = case
    fields = {"num_heads": 4, "head_dim": 16, "dtype": "float32", **fields}
    spec = dilgen.Spec(name="rb_" + name, **fields)
    if device().type != "cpu":      # compiled kernels: their loops are counted in the interpreter
        check_against_reference(spec, batch, n, tuning, name)
        return
    attn = Kernel(spec, None, tuning).compiled_for(torch.device("cpu")).attention
    with _Launches(attn, _loop_bound(spec, n)) as seen:
        check_against_reference(spec, batch, n, tuning, name)
    kernels = {k for k, _, _ in seen.launches}
    assert any(k.endswith("_fwd_lanes") for k in kernels) and any(k.endswith("_bwd_dkdv") for k in kernels), kernels
    assert seen.loops > 0, "the generated module's loops were not counted"
    programs = _program_bound(spec, batch, n)
    largest = max(batch * n * spec.num_heads * spec.head_dim, 1)   # q's elements
    for kernel, grid, tensors in seen.launches:
        assert math.prod(grid) <= programs, (kernel, grid, programs)
        for t in tensors:
            assert t.numel() <= largest, (kernel, tuple(t.shape), largest)


def test_r_65536_on_five_rows_takes_seconds():
    """The issue's reproduction: w = 64, r = 65536, N = 5, forward and backward (the gap loops
    ran 65536 offsets a program: over 200 s)."""
    spec = dilgen.Spec(name="rb_time", num_heads=4, head_dim=16, dtype="float32",
                       segment_lengths=[64], dilation_rates=[65536])
    kernel = Kernel(spec)
    kernel.compiled_for(torch.device("cpu"))
    q, k, v = (torch.randn(1, 5, 4, 16, requires_grad=True) for _ in range(3))
    start = time.perf_counter()
    out = kernel(q, k, v)
    out.sum().backward()
    took = time.perf_counter() - start
    assert took < 10.0, f"forward + backward took {took:.1f} s"


def _loop_bounds(source: str) -> list[tuple[str, int]]:
    """(loop, largest integer literal in its start and stop) of every `for` over range,
    tl.range, tl.static_range or gl.static_range in a generated module (a step is no bound)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        call = node.iter if isinstance(node, ast.For) else None
        if not isinstance(call, ast.Call):
            continue
        fn = ast.unparse(call.func)
        if fn not in ("range", "tl.range", "tl.static_range", "gl.static_range"):
            continue
        bounds = call.args[:2]
        literals = [c.value for a in bounds for c in ast.walk(a)
                    if isinstance(c, ast.Constant) and type(c.value) is int]
        # a rate reaches a kernel as a literal of its branch, or as the Gluon lanes'
        # constexpr R: a bound naming R counts as unbounded
        names = {c.id for a in bounds for c in ast.walk(a) if isinstance(c, ast.Name)}
        out.append((ast.unparse(call), float("inf") if "R" in names else max(literals, default=0)))
    return out


@pytest.mark.parametrize("target", [SM90, SM80, INTERPRETER], ids=lambda t: t.name)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("hilbert", [None, {"scope": "segment"}], ids=["raster", "hilbert"])
def test_generated_loops_have_no_bound_of_r(target, causal, hilbert):
    """Every loop of the source for every target (GPU paths included: descriptors, warp
    specialization) takes its start and stop from min(r, w), the rows or the heads, never r."""
    spec = dilgen.Spec(name="rb_source", num_heads=4, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                       segment_lengths=[64, 16], dilation_rates=[65536, 100], causal=causal, hilbert=hilbert)
    source = emit(plan(spec, target))
    loops = _loop_bounds(source)
    assert loops
    bound = max(min(r, w) for w, r in spec.branches())
    assert [(loop, top) for loop, top in loops if top > bound] == []


@pytest.mark.parametrize("r", [65, 65536, MAX_RATE])
def test_causal_curve_block_lists_hold_min_r_w_offsets(r):
    """runtime.curve_rows.block_lists keeps the min(r, w) offsets a segment has: for every
    offset o < w, its one lane j = 0 per segment sees itself alone (a partial block)."""
    from dilgen.runtime.curve_rows import block_lists
    from dilgen.runtime.tables import table_tensors
    w, n = 64, 150
    table = {"scope": "segment", "grid": [8, 8], "name": "t", "curve": "gilbert2d"}
    fwd = table_tensors(table, n, torch.device("cpu"))[0].long()
    for keys_listed in (True, False):
        counts, blocks = block_lists({"w": w, "r": r}, fwd, n, 16, 16, keys_listed)
        n_seg = -(-n // w)
        assert counts.shape == (n_seg, w, 1, 2) and blocks.shape == (n_seg, w, 1, 2, 1)
        for s in range(n_seg):
            present = min(n - s * w, w)
            expect = torch.tensor([[[0, 1]] if o < present else [[0, 0]] for o in range(w)], dtype=torch.int32)
            assert torch.equal(counts[s], expect), s
            assert (blocks[s, :present, 0, 1, 0] == 0).all()
