"""What a new user reads (issue 57 §4): the explain plan's lines in docs/cli.md, the layer
table of docs/api.md against dilgen.nn, the examples' help and docstrings against what
they run, the stated times of the examples naming their machine, and a misspelt spec field
answered with the field meant."""
from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import dilgen
from dilgen.spec import SpecError, spec_from_dict

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(name="t", num_heads=2, head_dim=16, segment_lengths=[16, 32], dilation_rates=[1, 2])


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_md_explains_every_line_of_explain():
    """The plan's `classes (delta: keys per query)` line was explained nowhere: docs/cli.md
    shows longnet_base's plan and says what each line means."""
    from dilgen.cli import plan_summary
    from dilgen.planner import plan
    from dilgen.targets import SM90
    doc = (ROOT / "docs" / "cli.md").read_text()
    text = plan_summary(plan(dilgen.load_spec(ROOT / "examples" / "specs" / "longnet_base.json"), SM90), 65536)
    classes = [line for line in text.splitlines() if line.lstrip().startswith("classes")]
    assert classes and classes[0] in doc, classes
    for label in ("key", "query tiles", "classes (delta: keys per query)", "branches", "kernels",
                  "at N", "ring"):
        assert f"- **{label}**:" in doc, label
        assert label.split(" (")[0] in text, label
    assert "6144" in doc and "2048 + 2048 + 2048" in doc


def _signature_text(fn) -> str:
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    parts, star = [], False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(p.name if p.default is p.empty else f"{p.name}={p.default!r}")
    return ", ".join(parts)


@pytest.mark.parametrize("call", [
    "DilatedAttention", "DilatedAttention.forward", "MultiheadDilatedAttention",
    "MultiheadDilatedAttention.forward", "LongNetDecoderBlock", "LongNetDecoderBlock.forward",
    "KVCache.for_layer"])
def test_api_md_layer_table_has_the_real_arguments(call):
    """docs/api.md's table missed dtype, device, name, dropout and batch_first: every
    signature it shows is the code's, argument for argument and default for default."""
    import dilgen.nn as nn_mod
    owner, _, method = call.partition(".")
    fn = getattr(getattr(nn_mod, owner), method) if method else getattr(nn_mod, owner)
    table = (ROOT / "docs" / "api.md").read_text().split("## Layers", 1)[1].split("\n\n", 2)[1]
    shown = method or owner
    if method == "for_layer":
        shown = "KVCache.for_layer"
    row = next(line for line in table.splitlines() if line.startswith(f"| `{owner}"))
    assert f"`{shown}({_signature_text(fn)})`" in row, (row, _signature_text(fn))


def test_quickstart_docstring_says_what_the_cpu_run_shrinks():
    quickstart = _example("quickstart")
    doc = quickstart.__doc__
    assert "same heads" not in doc
    for name, heads, kv, dim, longest in (("longnet_base", 4, 4, 32, 64), ("longnet_causal_gqa", 4, 1, 32, 64)):
        spec = dilgen.load_spec(ROOT / "examples" / "specs" / f"{name}.json")
        small = quickstart.cpu_spec(spec)
        assert (small.num_heads, small.num_kv_heads, small.head_dim, max(small.segment_lengths)) == \
               (heads, kv, dim, longest), small
        assert small.num_heads // small.num_kv_heads == spec.num_heads // spec.num_kv_heads
        assert (small.dilation_rates, small.dtype, small.causal) == (spec.dilation_rates, spec.dtype, spec.causal)
    for words in ("at most 4\nquery heads", "head_dim at most 32", "about 64 tokens", "dilation rates"):
        assert words.replace("\n", " ") in " ".join(doc.split()), words


def test_ring_torchrun_help_names_its_spec_and_what_cpu_shrinks():
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "ring_torchrun.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    ring = _example("ring_torchrun")
    for spec in (ring.GPU_SPEC, ring.CPU_SPEC):
        assert f"{spec['num_heads']} heads, head_dim {spec['head_dim']}, {spec['dtype']}" in text, text
        assert f"w = {spec['segment_lengths']}" in text and f"r = {spec['dilation_rates']}" in text, text
    cpu = text.split("--cpu", 2)[2]                      # the option's own help
    assert "smaller spec" in cpu and "interpreter" in cpu and str(ring.CPU_TOKENS) in cpu, cpu


# A stated time of an example (`~1 min`, `about 15 s`, `about a minute`) names the machine
# it was measured on, in the same stretch of text or in the footnote its `(*)` points to.
TIME = re.compile(r"(~|about |under |in )\d+(\.\d+)? ?(s|min|minutes?|seconds?)\b|(about|under) a minute")
MACHINE = re.compile(r"\d+-core|\d+ cores|H[12]00")


@pytest.mark.parametrize("path", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "examples").glob("*.py"))
                         + ["docs/training.md", "docs/decode.md"])
def test_stated_example_times_name_their_machine(path):
    text = " ".join((ROOT / path).read_text().split())
    for m in TIME.finditer(text):
        around = text[max(0, m.start() - 80):m.end() + 80]
        if text[m.end():m.end() + 4] == " (*)":
            around = text[text.rindex("(*) "):][:80]           # the footnote (the last "(*) ")
        assert MACHINE.search(around), f"{path}: {around!r}"


@pytest.mark.parametrize("field, meant", [("segment_length", "segment_lengths"),
                                          ("dilatation_rates", "dilation_rates"),
                                          ("Causal", "causal"), ("num_kv_head", "num_kv_heads"),
                                          ("hilbert.scop", "scope")])
def test_a_misspelt_field_gets_did_you_mean(field, meant):
    data = dict(BASE, **{field: 1}) if "." not in field else dict(BASE, hilbert={"scope": "segment", "scop": 1})
    with pytest.raises(SpecError) as exc:
        spec_from_dict(data, source="s.json")
    assert f": unknown field; did you mean {meant}? (allowed: " in str(exc.value), str(exc.value)
    with pytest.raises(SpecError, match=r"foo = 1: unknown field \(allowed: "):     # nothing close
        spec_from_dict(dict(BASE, foo=1))
