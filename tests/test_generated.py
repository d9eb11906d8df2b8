"""generated/ holds the modules of the bundled specs (examples/specs/*.json), one per spec
and architecture, as `dilgen compile` writes them from the repository root:

    generated/<name>.py          sm90, the default --arch    from generated.<name> import attention
    generated/sm80/<name>.py     sm80 (generated/<arch>/)    from generated.sm80.<name> import attention

They change only on purpose: these tests compile every bundled spec afresh and compare it
byte for byte with the committed file. To accept an intended change (templates, planner):

    DILGEN_UPDATE_GOLDEN=1 python -m pytest tests/test_generated.py

rewrites generated/ (running `dilgen compile` for each spec and arch, and removing the
modules of specs that are gone); review its diff like any other code change."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dilgen
from dilgen.codegen import emit
from dilgen.compiler import DEFAULT_ARCH, generated_dir
from dilgen.planner import plan
from dilgen.targets import get_target

from conftest import run_cli

ROOT = Path(__file__).resolve().parent.parent
GENERATED = ROOT / "generated"
SPECS = sorted((ROOT / "examples" / "specs").glob("*.json"))
ARCHES = ("sm90", "sm80")
CASES = [(path, arch) for path in SPECS for arch in ARCHES]
UPDATE = os.environ.get("DILGEN_UPDATE_GOLDEN") == "1"


def _module(root: Path, spec_path: Path, arch: str) -> Path:
    """Where `dilgen compile SPEC --arch ARCH` run in `root` writes the module."""
    name = dilgen.load_spec(spec_path).name
    return root / generated_dir(arch) / f"{name}.py"


def _modules(folder: Path) -> set[Path]:
    return {p.relative_to(folder) for p in folder.rglob("*.py")
            if p.name != "__init__.py" and "__pycache__" not in p.parts}


def _compile(cwd: Path, spec_path: Path, arch: str, monkeypatch) -> None:
    monkeypatch.chdir(cwd)
    rc, out, err = run_cli(["compile", spec_path, "--arch", arch])   # the default --out
    assert rc == 0, err
    assert out.startswith(f"wrote {generated_dir(arch) / dilgen.load_spec(spec_path).name}.py\n")


@pytest.mark.parametrize("spec_path, arch", CASES, ids=[f"{p.stem}-{a}" for p, a in CASES])
def test_generated_module_matches_a_fresh_compile(spec_path, arch, tmp_path, monkeypatch):
    if UPDATE:
        _compile(ROOT, spec_path, arch, monkeypatch)
    committed = _module(ROOT, spec_path, arch)
    assert committed.is_file(), (f"missing {committed.relative_to(ROOT)}; create it with "
                                 f"DILGEN_UPDATE_GOLDEN=1 python -m pytest tests/test_generated.py")
    _compile(tmp_path, spec_path, arch, monkeypatch)
    fresh = _module(tmp_path, spec_path, arch).read_bytes()
    assert fresh == committed.read_bytes(), (
        f"{committed.relative_to(ROOT)} differs from a fresh `dilgen compile {spec_path.name} "
        f"--arch {arch}`; if on purpose, regenerate with DILGEN_UPDATE_GOLDEN=1 and review "
        f"the diff")
    assert fresh.decode() == emit(plan(dilgen.load_spec(spec_path), get_target(arch)))


def test_generated_holds_exactly_the_bundled_specs():
    """No module of a spec that is gone, no arch or spec missing."""
    want = {_module(ROOT, p, a).relative_to(GENERATED) for p, a in CASES}
    if UPDATE:
        for stale in _modules(GENERATED) - want:
            (GENERATED / stale).unlink()
    assert _modules(GENERATED) == want
    for folder in {GENERATED / p.parent for p in want}:
        assert (folder / "__init__.py").is_file(), f"{folder} is not a package"


def test_committed_modules_import_from_the_repository_root():
    """README/SPEC §5: `from generated.<name> import attention` (and the sm80 subpackage),
    in a fresh process, without planning or emitting anything."""
    names = sorted({dilgen.load_spec(p).name for p in SPECS})
    script = "\n".join([
        "import json, sys",
        *(f"from generated.{n} import attention as a{i}" for i, n in enumerate(names)),
        *(f"from generated.sm80.{n} import attention as b{i}" for i, n in enumerate(names)),
        f"targets = [a.plan['target'] for a in ({', '.join(f'a{i}' for i in range(len(names)))},)]",
        f"targets += [b.plan['target'] for b in ({', '.join(f'b{i}' for i in range(len(names)))},)]",
        "print(json.dumps({'targets': targets, 'loaded': [m for m in ('dilgen.planner', "
        "'dilgen.codegen', 'dilgen.compiler', 'jinja2') if m in sys.modules]}))",
    ])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["targets"] == ["sm90"] * len(names) + ["sm80"] * len(names)
    assert got["loaded"] == [], f"importing a generated module loaded {got['loaded']}"


def test_a_module_of_an_older_plan_format_is_refused_by_name():
    """A module generated before the plan marked the fused dK/dV's branches (BranchIR.fused_dkdv)
    would have its dK, dV counted twice by today's runtime: it is refused at import, naming
    the fix, never run."""
    from generated.longnet_base import attention
    from dilgen.runtime import GeneratedAttention
    assert attention.plan["fused_dkdv"] and all(b["fused_dkdv"] for b in attention.plan["branches"])
    old = json.loads(json.dumps(attention.plan))
    for b in old["branches"]:
        del b["fused_dkdv"]
    with pytest.raises(RuntimeError, match="generated by an older dilgen.*generate it again"):
        GeneratedAttention(attention.spec, old, forward_kernel=attention._source_fn)


def test_compile_defaults_match_the_layout():
    from dilgen.cli import build_parser
    args = build_parser().parse_args(["compile", "x.json"])
    assert args.arch == DEFAULT_ARCH and args.out is None
    assert generated_dir(DEFAULT_ARCH) == Path("generated")
    assert generated_dir("sm80") == Path("generated") / "sm80"


@pytest.mark.parametrize("spec_path, arch", CASES, ids=[f"{p.stem}-{a}" for p, a in CASES])
def test_emit_is_byte_stable(spec_path, arch):
    spec = dilgen.load_spec(spec_path)
    first = emit(plan(spec, get_target(arch)))
    again = emit(plan(dilgen.Spec(**{k: v for k, v in spec.to_json().items()}), get_target(arch)))
    assert first.encode() == again.encode()


def test_provenance_header():
    spec = dilgen.load_spec(ROOT / "examples" / "specs" / "longnet_base.json")
    head = emit(plan(spec, get_target("sm90"))).splitlines()[:6]
    assert head[0].startswith(f"# Generated by dilgen {dilgen.__version__}")
    assert any(spec.key() in line for line in head)
    assert any("target:        sm90" in line for line in head)
    assert any("template hash" in line for line in head)
