"""The suite's own bookkeeping: a test that starts ranks or a process pool carries the `ranks`
mark (CI's Triton 3.6 run leaves those out to stay inside its time limit: docs/testing.md,
"CI"). Checked on the source: a test whose body starts processes (torch.multiprocessing,
multiprocessing, torchrun, the ring tests' runners) or calls a helper of its file that does."""
from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).parent
STARTS = re.compile(r"\b(spawn|start_processes|_run_ring|_refused_run|Process|Pool|get_context)\(|torch\.distributed\.run")


def _marked(src: str, node) -> bool:
    return any("pytest.mark.ranks" in ast.get_source_segment(src, d) for d in node.decorator_list)


def _unmarked_starters(path: Path) -> list[str]:
    src = path.read_text()
    tree = ast.parse(src)
    module_mark = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                      and "pytest.mark.ranks" in ast.get_source_segment(src, n) for n in tree.body)
    helpers = {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("test_")
               and STARTS.search(ast.get_source_segment(src, n))}
    found = []
    for node in tree.body:
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test_")):
            continue
        called = {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        if (STARTS.search(ast.get_source_segment(src, node)) or called & helpers) \
                and not (module_mark or _marked(src, node)):
            found.append(f"{path.name}::{node.name}")
    return found


def test_tests_that_start_ranks_carry_the_mark():
    unmarked = [name for path in sorted(TESTS.glob("test_*.py")) if path.name != Path(__file__).name
                for name in _unmarked_starters(path)]
    assert not unmarked, f"add @pytest.mark.ranks to: {', '.join(unmarked)}"


def test_the_check_sees_an_unmarked_starter(tmp_path):
    path = tmp_path / "test_probe.py"
    path.write_text("import pytest\n\n\ndef _go(n):\n    return mp.start_processes(f, nprocs=n)\n\n\n"
                    "def test_a():\n    _go(2)\n\n\n@pytest.mark.ranks\ndef test_b():\n    _go(2)\n\n\n"
                    "def test_c():\n    assert 1\n")
    assert _unmarked_starters(path) == ["test_probe.py::test_a"]
