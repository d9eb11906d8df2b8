"""One parser for every boolean DILGEN_* knob (dilgen/knobs.py): on, off, and one error line."""
import os
import subprocess
import sys

import pytest

from dilgen import cache, knobs
from dilgen.aot import run as aot_run
from dilgen.runtime import interpreter

# (variable, default, reader): each reader reads the environment when it is called
READ_NOW = [
    ("DILGEN_ALWAYS_COMPILE", False, cache.always_compile),
    ("DILGEN_AOT", True, aot_run.enabled),
    ("DILGEN_INTERPRET_OVERFLOW_CHECK", False, interpreter.overflow_checks),
]


@pytest.mark.parametrize("variable,default,read", READ_NOW, ids=[v for v, _, _ in READ_NOW])
@pytest.mark.parametrize("value,want", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("off", False), ("", False)])
def test_every_knob_reads_the_same_words(monkeypatch, variable, default, read, value, want):
    monkeypatch.setenv(variable, value)
    assert read() is want


@pytest.mark.parametrize("variable,default,read", READ_NOW, ids=[v for v, _, _ in READ_NOW])
def test_unset_is_the_default_and_a_stray_word_is_one_line(monkeypatch, variable, default, read):
    monkeypatch.delenv(variable, raising=False)
    assert read() is default
    monkeypatch.setenv(variable, "maybe")
    with pytest.raises(knobs.KnobError) as err:
        read()
    line = str(err.value)
    assert "\n" not in line and variable in line and "'maybe'" in line and "true" in line


@pytest.mark.parametrize("variable,attr,module", [
    ("DILGEN_POISON", "_POISON", "dilgen.runtime.launch"),
    ("DILGEN_REPLAY", "ENABLED", "dilgen.runtime.replay")])
def test_import_time_knobs_parse_false_as_off(variable, attr, module):
    """Read once at import (in a fresh process): DILGEN_POISON=false used to turn it on."""
    values = ("false", "no", "off", "yes")
    code = (f"import importlib, os, {module} as m\n"
            f"for value in {values!r}:\n"
            f"    os.environ[{variable!r}] = value\n"
            f"    print(importlib.reload(m).{attr})")
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", "False", "False", "True"], (variable, out)
