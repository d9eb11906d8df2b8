"""A tuning changes how a spec runs, never what it computes: small random specs (one to three
branches, r dividing w or not, short last segments, GQA and MQA, causal or not) under random
values of the planner's structural knobs (which branches run as lanes, the fused dK/dV, the
lane kernels' descriptor loads), each exact against the float64 reference in the interpreter:
out, lse and dq, dk, dv (conftest.check_against_reference, outputs poisoned).

The knobs are the ones whose plans differ in which kernel takes which branch, where a wrong
split loses or doubles a branch's share (a lane branch taken out of the fused lattice once
kept its dK/dV in the fused kernel, whose key classes assume r | L). A tuning the planner
cannot run is refused in one line naming the knob. Derandomized, as test_fuzz.py's."""
from __future__ import annotations

import pytest
from hypothesis import example, given, reject
from hypothesis import strategies as st

import dilgen
from dilgen.planner import plan
from dilgen.spec import SpecError
from dilgen.targets import get_target

from conftest import check_against_reference
from spec_oracle import fuzz_settings

INTERPRETER = get_target("interpreter")
HEADS = [(2, 2), (4, 2), (4, 1)]


@st.composite
def specs_and_tunings(draw):
    most = draw(st.integers(1, 3))           # branches, at most ("nested" has two sizes)
    # "nested": segments that hold 16 x L rows, so the fused dK/dV (key tiles of the lattice)
    # runs beside the lane branches; "any": short ones, r not dividing w
    nested = draw(st.booleans())
    sizes, rates = ([64, 128], (1, 2, 4)) if nested else ([16, 24, 32, 48, 64], (1, 2, 3, 4, 8))
    ws = sorted(draw(st.lists(st.sampled_from(sizes), min_size=1, max_size=most, unique=True)))
    n_branches = len(ws)
    rs = [draw(st.sampled_from([r for r in rates if r <= w])) for w in ws]
    heads, kv_heads = draw(st.sampled_from(HEADS))
    causal = draw(st.booleans())
    n = draw(st.sampled_from([ws[-1], ws[-1] + ws[0] // 2, 2 * ws[-1] - 4]))
    chosen = st.lists(st.integers(0, n_branches - 1), min_size=1, max_size=n_branches, unique=True).map(sorted)
    lanes = draw(st.one_of(st.sampled_from(["auto", "all", "none"]), chosen, chosen))   # lists twice as often
    tuning = {"lanes": lanes, "fused_dkdv": draw(st.booleans())}
    if draw(st.booleans()):
        tuning.update(lane_tma=True, lane_ws=True)
    spec = dilgen.Spec(name="tf", num_heads=heads, num_kv_heads=kv_heads, head_dim=16, dtype="float32",
                       segment_lengths=ws, dilation_rates=rs, causal=causal)
    return spec, n, tuning


# the plan that once lost a chosen lane branch's dK/dV in the fused kernel (r = 4 left L = 1)
KNOWN = (dilgen.Spec(name="tf", num_heads=4, num_kv_heads=2, head_dim=16, dtype="float32",
                     segment_lengths=[64, 128], dilation_rates=[1, 4]), 128, {"lanes": [1], "fused_dkdv": True})


@pytest.mark.timeout(900)
@fuzz_settings(24)
@given(specs_and_tunings())
@example(KNOWN)
def test_a_tuning_never_changes_the_answer(case):
    spec, n, tuning = case
    try:
        plan(spec, INTERPRETER, tuning)
    except (SpecError, ValueError) as exc:      # refused: one line, naming the knob it cannot take
        text = str(exc)
        assert "\n" not in text and any(k in text for k in tuning), text
        reject()
    name = f"tf_{'_'.join(map(str, spec.segment_lengths))}_{'_'.join(map(str, spec.dilation_rates))}_{n}"
    check_against_reference(spec, 2 if spec.num_kv_heads == 1 else 1, n, tuning, name)
