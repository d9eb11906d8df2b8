"""What the spec tests share: a valid base spec, patches of it, spec files, the one-line check."""
from __future__ import annotations

import json
from pathlib import Path

BASE = {"name": "ok_spec", "num_heads": 4, "head_dim": 64,
        "segment_lengths": [16, 32], "dilation_rates": [1, 2]}

DELETE = object()


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def _patched(patch: dict) -> dict:
    data = dict(BASE)
    for key, value in patch.items():
        if value is DELETE:
            data.pop(key, None)
        else:
            data[key] = value
    return data


def _one_line(msg: str) -> None:
    assert msg and "\n" not in msg and "\r" not in msg, f"not one line: {msg!r}"
