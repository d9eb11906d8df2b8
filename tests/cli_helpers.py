"""What the command-line tests share: spec tables, `python -m dilgen.cli` in a fresh
interpreter with a private cache, the one-error-line check, and the in-process run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import run_cli

LONGNET_BASE = Path(__file__).resolve().parents[1] / "examples" / "specs" / "longnet_base.json"
LONGNET = {"name": "longnet_t", "num_heads": 16, "num_kv_heads": 16, "head_dim": 128,
           "dtype": "bfloat16", "segment_lengths": [2048, 4096, 8192],
           "dilation_rates": [1, 2, 4], "causal": False, "hilbert": None, "ring_size": 1}
TINY = {"name": "tiny_attn", "num_heads": 2, "head_dim": 16, "dtype": "float32",
        "segment_lengths": [16, 32], "dilation_rates": [1, 2]}
TINY_GQA_CAUSAL = {"name": "tiny_gqa_causal", "num_heads": 4, "num_kv_heads": 2,
                   "head_dim": 16, "dtype": "float32", "causal": True,
                   "segment_lengths": [8, 24], "dilation_rates": [1, 3]}


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DILGEN_")}
    env["DILGEN_CACHE_DIR"] = str(tmp_path / "cache")
    return env


def dilgen_cli(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dilgen.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=tmp_path,
                          env=env or cli_env(tmp_path), timeout=300)


def write_spec(folder: Path, data: dict, filename: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (filename or f"{data['name']}.json")
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def one_error_line(res: subprocess.CompletedProcess | tuple) -> str:
    rc, stderr = (res.returncode, res.stderr) if hasattr(res, "returncode") else res
    assert "Traceback" not in stderr, stderr
    assert rc == 2, (rc, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {stderr!r}"
    assert lines[0].startswith("dilgen: error:"), lines[0]
    return lines[0]


def main_in_process(*argv) -> tuple[int, str, str]:
    return run_cli(argv)

