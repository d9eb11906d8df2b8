"""The command line's standard streams and the import line it prints.

Contract (SPEC §4: exit 2 with one line on stderr for a user's error):
- a closed standard descriptor (`>&-`, `2>&-`) is held open on /dev/null while dilgen
  runs, so no file dilgen opens takes its number and receives output meant for a terminal;
- a closed stdout is refused in one stderr line before any work (dilgen reports there
  what it did; `>/dev/null` discards it);
- an error line goes to stderr only: dropped, never sent to stdout, when stderr is closed
  or cannot be written (`2>/dev/full`), and the exit status stays 2;
- a character the stream's encoding cannot show (`PYTHONIOENCODING=ascii`, a non-ASCII
  folder name) is printed as a backslash escape instead of failing.
"""
from __future__ import annotations

import keyword
import os
import sys
from pathlib import Path

STDOUT_CLOSED = ("standard output is closed; dilgen prints what it did there: redirect it "
                 "(>/dev/null discards it) instead of closing it")


def _is_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def prepare_streams() -> str | None:
    """Hold closed standard descriptors on /dev/null and let stdout and stderr escape what
    their encoding cannot write; the reason to refuse the command (stdout closed), or None."""
    for fd in (0, 1, 2):
        if _is_closed(fd):
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(errors="backslashreplace")
            except (OSError, ValueError):
                pass
    return STDOUT_CLOSED if sys.stdout is None else None


def silence(stream) -> None:
    """Point `stream`'s descriptor at /dev/null and drop what it holds, so that neither a
    later write nor the interpreter's flush at exit fails on it (a reader that left, a full
    device)."""
    try:
        fd = stream.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
        stream.flush()
    except (AttributeError, OSError, ValueError):
        pass


def flushed(stream) -> bool:
    """Whether `stream` (None: closed) took everything written to it; if not, it is silenced."""
    if stream is None:
        return True
    try:
        stream.flush()
        return True
    except (OSError, ValueError):
        silence(stream)
        return False


def err(line: str) -> None:
    """One line on stderr; dropped (never sent to stdout) when stderr is closed or fails."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(line + "\n")
        stream.flush()
    except (OSError, ValueError):
        silence(stream)


def import_hint(path: Path) -> str:
    """A line of Python that imports the module at `path` from any script, run from any
    folder: the folder above its enclosing packages (folders with an __init__.py whose
    names are ASCII identifiers) goes on sys.path by its absolute name, written as an ASCII
    literal, then the dotted import; the line stays valid Python whatever the encoding of
    the stream it is printed on."""
    path = Path(path).resolve()
    parts, folder = [path.stem], path.parent
    while ((folder / "__init__.py").is_file() and folder.parent != folder and folder.name.isascii()
           and folder.name.isidentifier() and not keyword.iskeyword(folder.name)):
        parts.insert(0, folder.name)
        folder = folder.parent
    return (f"import: import sys; sys.path.insert(0, {ascii(str(folder))}); "
            f"from {'.'.join(parts)} import attention")
