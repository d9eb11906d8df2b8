"""What the cache tests share: a tiny spec and the checks of a cache folder's layout
(whole entries <root>/<key[:2]>/<key>, nothing hidden, torn or stray)."""
from __future__ import annotations

from pathlib import Path

from dilgen import cache

TINY = {"name": "cache_race", "num_heads": 2, "head_dim": 16, "dtype": "float32",
        "segment_lengths": [8, 16], "dilation_rates": [1, 2]}
ENTRY_FILES = {cache.MODULE, "plan.json", cache.MANIFEST}
HEX64 = set("0123456789abcdef")
# an entry's files for the store races (a module long enough to be read in pieces)
RACE_FILES = {cache.MODULE: b"# module\n" + b"x = 1\n" * 2000, "plan.json": b'{"plan": 1}\n'}
RACE_INFO = {"generator": "test"}


def spec():
    from dilgen.spec import spec_from_dict
    return spec_from_dict(dict(TINY))


def entries(root: Path) -> list[Path]:
    """Entry folders: <root>/<key[:2]>/<key> with a 64-hex-digit key."""
    return sorted(p for p in root.glob("*/*")
                  if len(p.name) == 64 and set(p.name) <= HEX64 and p.parent.name == p.name[:2])


def stray(root: Path) -> list[str]:
    """Temporary, trash or torn leftovers: anything hidden, anything not in an entry."""
    found = set(entries(root))
    bad = []
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if any(part.startswith(".") for part in rel.parts):
            bad.append(str(rel))
        elif len(rel.parts) == 1 and not (p.is_dir() and len(p.name) == 2):
            bad.append(str(rel))
        elif len(rel.parts) == 2 and p not in found:
            bad.append(str(rel))
        elif len(rel.parts) == 3 and p.name not in ENTRY_FILES:
            bad.append(str(rel))
        elif len(rel.parts) > 3:
            bad.append(str(rel))
    return sorted(bad)


