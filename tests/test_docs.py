"""Every ```python block of README.md and docs/*.md runs (on the CPU here, through Triton's
interpreter), so that a snippet cannot drift from the code.

The blocks of one file run in order in one fresh interpreter (a block may use what an
earlier one made), from the repository root, with a private kernel cache. A block may be
preceded by a directive, visible in the Markdown source:

    <!-- doc-test {"shrink": {"N = 16384": "N = 64"}} -->   sizes the CPU run makes smaller,
                                                              or a stand-in for "model = ..."
    <!-- doc-test {"ranks": 2} -->                            run in 2 processes as torchrun
                                                              starts them (gloo), after the
                                                              file's other 2-rank blocks

A shrink whose text is not in its block fails the test (the directive went stale)."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"(?:^<!-- doc-test (?P<directive>\{[^\n]*\}) -->\n)?^```python\n(?P<code>.*?)^```",
                   re.S | re.M)


@dataclass
class Block:
    path: Path
    line: int
    code: str
    shrink: dict = field(default_factory=dict)
    ranks: int = 1

    def source(self) -> str:
        code = self.code
        for old, new in self.shrink.items():
            assert old in code, f"{self.where}: shrink {old!r} is not in the block"
            code = code.replace(old, new)
        return code

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for m in FENCE.finditer(text):
        directive = json.loads(m.group("directive") or "{}")
        unknown = set(directive) - {"shrink", "ranks"}
        assert not unknown, f"{path.name}: unknown doc-test keys {unknown}"
        line = text.count("\n", 0, m.start("code")) + 1
        found.append(Block(path, line, m.group("code"), directive.get("shrink", {}),
                           directive.get("ranks", 1)))
    return found


def _script(blocks: list[Block]) -> str:
    parts = []
    for b in blocks:
        parts.append(f"print('== {b.where}', flush=True)\n{b.source()}")
    return "\n".join(parts)


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILGEN_")}
    env.update(DILGEN_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _run(script: str, env: dict, ranks: int, timeout: float = 600) -> None:
    if ranks == 1:
        res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=timeout)
        assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
        return
    import torch
    if torch.cuda.device_count() < ranks:   # a block picks NCCL and a GPU a rank where CUDA is
        env = dict(env, CUDA_VISIBLE_DEVICES="")   # there: with fewer GPUs, gloo on the CPU
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(ranks),
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for r in range(ranks)]
    try:
        for r, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, f"rank {r}:\n{out[-2000:]}\n{err[-4000:]}"
    finally:
        for p in procs:
            p.kill()


def _cases():
    """One case per (file, number of ranks): its blocks in order, in one namespace."""
    for path in DOCS:
        blocks = blocks_of(path)
        for ranks in sorted({b.ranks for b in blocks}):
            group = [b for b in blocks if b.ranks == ranks]
            yield pytest.param(group, id=path.name if ranks == 1 else f"{path.name}-{ranks}ranks",
                               marks=() if ranks == 1 else pytest.mark.ranks)


@pytest.mark.parametrize("blocks", list(_cases()))
def test_doc_blocks_run(blocks, tmp_path):
    _run(_script(blocks), _env(tmp_path), blocks[0].ranks)


def test_every_doc_has_its_blocks_found():
    """The fence pattern finds every ```python block (none is skipped by a typo)."""
    for path in DOCS:
        assert len(blocks_of(path)) == path.read_text().count("```python\n"), path.name
