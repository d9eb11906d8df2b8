"""Row offsets in 64-bit: every `row * stride_<x>n` of the emitted kernels is computed in int64.

Triton types an int argument that fits in 32 bits (a row stride H*D, a segment start s*w) as
int32, and int32 products wrap: with 16 heads of 128 (row stride 2048) a row index past
1,048,576 overflows, so one sequence of 1.3M tokens read its last segments from a wrapped
address (silently wrong, or an illegal memory access on the H200). The interpreter cannot show
this at test sizes (it would need tensors of more than 2^31 elements), so this test reads the
generated source instead: the left operand of every product with a row stride must be cast to
int64 in place, or be a name that every function using it assigns from an int64 expression.
"""
from __future__ import annotations

import re

import pytest

import dilgen
from dilgen.codegen import emit
from dilgen.planner import plan
from dilgen.targets import get_target

BASE = dict(num_heads=8, head_dim=64, dtype="bfloat16")
FAMILIES = {   # name: (spec fields, tuning)
    "raster": (dict(segment_lengths=[64, 128], dilation_rates=[1, 2]), None),
    "raster_causal_lanes": (dict(segment_lengths=[64, 128, 256], dilation_rates=[1, 2, 4], causal=True),
                            {"lanes": "all"}),
    "r_not_dividing_w_gqa": (dict(segment_lengths=[64, 128], dilation_rates=[1, 6], causal=True,
                                  num_kv_heads=2), None),
    "hilbert_segment": (dict(segment_lengths=[64, 128], dilation_rates=[1, 4],
                             hilbert={"scope": "segment"}), None),
    "hilbert_causal_lanes": (dict(segment_lengths=[64, 128], dilation_rates=[1, 4], causal=True,
                                  hilbert={"scope": "segment"}), {"lanes": "all"}),
    "ring": (dict(segment_lengths=[64, 128], dilation_rates=[1, 2], causal=True, ring_size=2), None),
    "lane_dq_tma": (dict(segment_lengths=[64, 128], dilation_rates=[1, 6]), {"lane_dq_tma": True}),
}
# names the kernels assign from int64 expressions before multiplying them by a row stride
INT64_NAMES = ("row0", "rows", "q_shift", "k_shift", "p", "k_row_lo", "q_row_lo")
ROW_STRIDE = re.compile(r"([\w\.\(\)\[\]:, +\-]+?)\s\*\s(stride_\w*n)\b")


def _int64_operand(operand: str) -> bool:
    operand = operand.strip()
    if re.search(r"\.to\(tl\.int64\)(\[[^\]]*\])?$", operand):
        return True
    bare = re.sub(r"\[[^\]]*\]$", "", operand)
    return bare in INT64_NAMES


def _functions(src: str):
    return re.split(r"\n(?=def )", src)


def _sources():
    for family, (fields, tuning) in FAMILIES.items():
        spec = dilgen.Spec(name=f"rowoff_{family}", **{**BASE, **fields})
        for arch in ("sm90", "sm80"):
            yield f"{family}-{arch}", emit(plan(spec, get_target(arch), tuning))


SOURCES = dict(_sources())


@pytest.mark.parametrize("case", sorted(SOURCES))
def test_every_row_stride_product_is_64_bit(case):
    src = SOURCES[case]
    bad, seen = [], 0
    for fn in _functions(src):
        for line in fn.splitlines():
            if line.lstrip().startswith("#"):
                continue
            for m in ROW_STRIDE.finditer(line):
                operand = _last_term(m.group(1))
                if re.fullmatch(r"\d+", operand.strip()):   # a descriptor's stride (r * stride): no row
                    continue
                seen += 1
                if not _int64_operand(operand):
                    bad.append(line.strip())
                    continue
                bare = re.sub(r"\[[^\]]*\]$", "", operand.strip())
                if bare in INT64_NAMES:      # its assignments in this function are int64
                    defs = re.findall(rf"^\s*{bare} = (.*)$", fn, flags=re.M)
                    assert defs, f"{case}: {bare} * stride used without an assignment: {line.strip()}"
                    for d in defs:
                        if "int64" not in d:
                            bad.append(f"{bare} = {d.strip()}  (used in: {line.strip()})")
    assert seen > 10, f"{case}: the pattern found only {seen} row-stride products; is the regex stale?"
    assert not bad, f"{case}: row offsets computed in 32 bits:\n" + "\n".join(bad[:10])


def _last_term(expr: str) -> str:
    """The factor directly left of ' * stride': the last top-level '+' term of expr, with
    parentheses balanced (`k_base + (seg_start + o).to(tl.int64)` -> `(seg_start + o).to(tl.int64)`)."""
    depth = 0
    for i in range(len(expr) - 1, -1, -1):
        c = expr[i]
        if c in ")]":
            depth += 1
        elif c in "([":
            if depth == 0:
                return expr[i + 1:].strip()
            depth -= 1
        elif depth == 0 and c in "+-=,":
            return expr[i + 1:].strip()
    return expr.strip()


def test_the_check_catches_a_32_bit_segment_start():
    """The bug it guards against: a descriptor base at (seg_start + o) * stride_kn."""
    assert not _int64_operand(_last_term("k_base + (seg_start + o)"))
    assert _int64_operand(_last_term("k_base + (seg_start + o).to(tl.int64)"))
    assert _int64_operand(_last_term("q_base + p_q.to(tl.int64)[:, None]"))
    assert not _int64_operand(_last_term("q_base + p_q[:, None]"))


LONG_CASES = {   # spec fields at 16 heads of 128 (row stride 2048): rows past 2^20 overflow int32
    "causal_lanes": dict(segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 4], causal=True),
    "r_not_dividing_w": dict(segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 6]),
    # causal: r = 6 runs the Gluon lanes over rows (rows past the views' N // 6 too) on sm90
    "causal_r_not_dividing_w": dict(segment_lengths=[2048, 4096, 8192], dilation_rates=[1, 2, 6], causal=True),
}


@pytest.mark.parametrize("case", sorted(LONG_CASES))
def test_rows_past_two_to_the_31_elements_on_the_gpu(case):
    """One sequence of 1,064,960 rows (2.2e9 elements per tensor): attention is local to the
    8192-row segments, so the last three segments' out, dq, dk, dv must equal a run on those
    rows alone (which has small offsets). Skipped without a GPU (about 40 GB of memory)."""
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU: the tensors hold more than 2^31 elements")
    if torch.cuda.get_device_properties(0).total_memory < 70 * 2**30:
        pytest.skip("needs about 40 GB of GPU memory")
    spec = dilgen.Spec(name=f"long_{case}", num_heads=16, head_dim=128, dtype="bfloat16", **LONG_CASES[case])
    kernel = dilgen.compile(spec)
    n, tail = 2**20 + 2 * 8192, 3 * 8192
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v, do = (torch.randn(1, n, 16, 128, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = kernel(*leaves)
    grads = torch.autograd.grad(out, leaves, do)
    got = [t[:, n - tail:].float() for t in (out.detach(), *grads)]
    del out, grads
    small = [t[:, n - tail:].detach().clone().requires_grad_() for t in (q, k, v)]
    out_s = kernel(*small)
    want = [out_s.detach().float(), *(t.float() for t in torch.autograd.grad(out_s, small, do[:, n - tail:]))]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = ((a - b).norm() / b.norm()).item()
        assert err < 1e-3, f"{case}: {name} of the rows past 2^20 differs from the short run (rel {err:.2e})"
