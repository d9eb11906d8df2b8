"""How a spec file's JSON is decoded: a key written twice is refused, and an integer
literal too long to convert becomes a `LongInt` marker, shown in the message that refuses
it and never used. Imports only the standard library."""
from __future__ import annotations

import difflib
import json
from typing import Any

#: the largest spec file read (a spec is a few hundred bytes; a grids list stays far below)
MAX_SPEC_BYTES = 1 << 20


class LongInt(str):
    """An integer literal too long to convert; shown, never used."""


class DuplicateKey(ValueError):
    """A key written twice in one JSON object (args[0]: the key)."""


def _no_duplicate_keys(pairs) -> dict:
    """json object hook: a key written twice is refused (the last one would win silently)."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise DuplicateKey(key)
        seen[key] = value
    return seen


def _parse_int(text: str) -> Any:
    return int(text) if len(text) <= 64 else LongInt(text[:20] + "...")


def decode(text: str) -> Any:
    """json.loads with the rules above; raises what json.loads raises, or DuplicateKey."""
    return json.loads(text, parse_int=_parse_int, object_pairs_hook=_no_duplicate_keys)


def unknown_field(key: Any, allowed) -> str:
    """The rule an unknown field breaks, naming the allowed field it is closest to when one
    is close (a misspelling: `segment_length`, `dilatation_rates`, `Causal`)."""
    close = []
    if isinstance(key, str):
        by_lower = {name.lower(): name for name in allowed}
        close = [by_lower[m] for m in difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.75)]
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"unknown field{hint} (allowed: {', '.join(allowed)})"
