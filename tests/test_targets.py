"""dilgen/targets.py: which plan a GPU gets (issue 35). A GPU newer than every target
(Blackwell: compute capability 10.x, 12.x) runs the sm90 plan, with one warning per
process saying so; sm86 and sm89 take the sm80 plan; older GPUs are refused."""
from __future__ import annotations

import warnings

import pytest

from dilgen import targets
from dilgen.targets import SM80, SM90, TargetWarning, get_target, target_for_capability


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(targets, "_WARNED", set())


def _warnings_of(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = fn()
    return result, [str(w.message) for w in seen if issubclass(w.category, TargetWarning)]


def test_newer_gpu_runs_the_sm90_plan_with_one_warning(fresh):
    for major, minor in ((10, 0), (12, 0)):
        name = f"sm{major}{minor}"
        got, seen = _warnings_of(lambda: [target_for_capability(major, minor) for _ in range(3)])
        assert got == [SM90] * 3
        assert len(seen) == 1, seen
        assert seen[0] == (f"dilgen: this GPU ({name}, compute capability {major}.{minor}) has no "
                           f"templates of its own yet; it runs the sm90 plan (Hopper's tiles and "
                           f"TMA, compiled by Triton for {name}; not measured on {name})")


def test_known_families_are_silent(fresh):
    got, seen = _warnings_of(lambda: [target_for_capability(9, 0), target_for_capability(8, 0),
                                      target_for_capability(8, 6), target_for_capability(8, 9),
                                      get_target("sm90"), get_target("sm86")])
    assert got == [SM90, SM80, SM80, SM80, SM90, SM80] and seen == []


def test_python_api_warns_for_a_newer_arch_name(fresh):
    got, seen = _warnings_of(lambda: [get_target("sm100"), get_target("sm100")])
    assert got == [SM90, SM90] and len(seen) == 1
    assert "no sm100 templates yet; building the sm90 plan" in seen[0]


def test_older_gpu_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^this GPU \(sm75, compute capability 7\.5\): dilgen "
                                         r"needs sm80 \(Ampere\) or newer"):
        target_for_capability(7, 5)
    with pytest.raises(ValueError, match="choose one of sm90, sm80, interpreter"):
        get_target("sm75")
