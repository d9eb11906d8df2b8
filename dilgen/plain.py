"""Plain values: what a Spec stores and what a template may render.

A spec's values end up printed into generated Python source, and the cache key is the
sha256 of their JSON form. JSON prints an ``int`` subclass by ``int.__repr__``, while a
template prints it by its own ``__str__`` or ``__format__``: a subclass could give the
clean key and different source. So every value is copied to exactly ``int``, ``float``,
``str``, ``bool`` or ``None`` (lists, tuples and dicts of them rebuilt as exact
containers) before anything reads it, using only the base types' own methods
(``int.__int__``, ``float.__float__``, ``str.__str__``, ``list.__getitem__`` of a slice,
``dict.items``), which a subclass cannot override: the copy holds the value as stored,
whatever the subclass's ``__index__``, ``__int__``, ``__iter__`` or ``keys`` claim.

Imports only the standard library.
"""
from __future__ import annotations

import dataclasses
from typing import Any

PLAIN = (int, float, str, bool, type(None))
MAX_DEPTH = 6    # a spec nests three deep (hilbert.grids[i][j]); deeper is left to be refused


def plain(value: Any, keep: tuple[type, ...] = (), depth: int = MAX_DEPTH) -> Any:
    """`value` as exact base types (see the module doc). A value of another type (an
    object, a set, a container nested past `depth`) comes back unchanged for the caller's
    validation to refuse by its type; so does one whose exact type is in `keep` (the
    caller's own markers, which its validation refuses)."""
    kind = type(value)
    if kind in PLAIN or kind in keep:
        return value
    if issubclass(kind, int):            # bool cannot be subclassed: never here
        return int.__int__(value)
    if issubclass(kind, float):
        return float.__float__(value)
    if issubclass(kind, str):
        return str.__str__(value)
    if depth <= 0:
        return value
    if issubclass(kind, list):
        return [plain(x, keep, depth - 1) for x in list.__getitem__(value, slice(None))]
    if issubclass(kind, tuple):
        return tuple(plain(x, keep, depth - 1) for x in tuple.__getitem__(value, slice(None)))
    if issubclass(kind, dict):
        return {plain(k, keep, 1): plain(v, keep, depth - 1) for k, v in dict.items(value)}
    return value


def check_plain(value: Any, path: str, allow: tuple[type, ...] = (), depth: int = 12) -> None:
    """Raise TypeError naming `path` unless `value` is plain: a PLAIN value, or a list,
    tuple or dict (exactly those types) of plain values, or a dataclass instance whose
    fields are plain, or an instance of `allow` (types that print themselves, e.g. sympy
    expressions). Used on a template's context just before rendering."""
    kind = type(value)
    if kind in PLAIN or (allow and isinstance(value, allow)):
        return
    if depth <= 0:
        raise TypeError(f"{path}: nested too deeply to render")
    if kind is list or kind is tuple:
        for i, item in enumerate(value):
            check_plain(item, f"{path}[{i}]", allow, depth - 1)
        return
    if kind is dict:
        for key, item in value.items():
            check_plain(key, f"{path} key {key!r}" if type(key) in PLAIN else f"{path} key",
                        allow, depth - 1)
            check_plain(item, f"{path}[{key!r}]", allow, depth - 1)
        return
    if dataclasses.is_dataclass(kind):
        for f in dataclasses.fields(kind):
            check_plain(getattr(value, f.name), f"{path}.{f.name}", allow, depth - 1)
        return
    raise TypeError(f"{path} is a {kind.__module__}.{kind.__qualname__}: only int, float, "
                    f"str, bool, None and lists, tuples, dicts of them reach a template")
