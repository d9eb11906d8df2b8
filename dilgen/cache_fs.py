"""Trust checks and link-safe file operations for the kernel cache's folders (the rules
are stated in dilgen/cache.py; the primitives are dilgen/fsafe.py's).

A cache folder, shard or entry is used only if lstat shows a real folder owned by this user
that group and others cannot write (fsafe.private_reason); dilgen makes its own 0700 and
its files 0600. Deleting (sweep, discard) never follows a link and touches only what lstat
shows is this user's own file or folder, or renames a link itself.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Iterator

from . import fsafe
from .fsafe import UnsafePath, private_reason

STALE_SECONDS = 3600   # a hidden temporary this old has no live writer (a writer takes seconds)


class Untrusted(UnsafePath):
    """A cache folder that is a symlink, or that another user owns or can write."""

    def __init__(self, folder: Path, reason: str) -> None:
        super().__init__(f"{folder}: {reason}")
        self.folder, self.reason = folder, reason


def distrusted(folder: Path) -> str | None:
    """Why dilgen must not use `folder` as a folder of its own (a symlink, a folder another
    user owns or group or others can write), or None: a private folder, nothing there, or a
    file (which cannot be used anyway: reported as unwritable)."""
    reason = private_reason(folder)
    if reason is None:
        return None
    try:
        mode = os.lstat(folder).st_mode
    except OSError:
        return None
    return reason if stat.S_ISLNK(mode) or stat.S_ISDIR(mode) else None


def private_folder(folder: Path) -> Path:
    """`folder`, made 0700 (its missing parents too) if it is missing: Untrusted if what is
    there fails the trust check, NotADirectoryError if it is a file. A folder deleted
    meanwhile (a concurrent `rm -rf` of the cache) is made again."""
    for _ in range(8):
        try:
            fsafe.make_private_dir(folder)
        except FileNotFoundError:
            continue                     # a parent vanished between its check and the mkdir
        if private_reason(folder) is None:
            return folder
        reason = distrusted(folder)
        if reason is not None:
            raise Untrusted(folder, reason)
        if os.path.lexists(folder):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(folder))
    raise FileNotFoundError(errno.ENOENT, "deleted again and again while it was made", str(folder))


def trusted_entries(root: Path) -> Iterator[Path]:
    """Entry folders `<root>/<xx>/<key>` whose root, shard and own folder pass the trust
    check; nothing else (no link is followed, no other user's folder is listed)."""
    if private_reason(root) is not None:
        return
    for shard in _listdir(root):
        if len(shard.name) == 2 and private_reason(shard) is None:
            yield from (e for e in _listdir(shard)
                        if not e.name.startswith(".") and private_reason(e) is None)


def _listdir(folder: Path) -> list[Path]:
    try:
        return sorted(Path(e.path) for e in os.scandir(folder))
    except OSError:
        return []


def write_new(path: Path, data: bytes) -> None:
    """Create the file `path` (0600, never through a link, never an existing file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), 0o600)
        fh.write(data)


def sweep(folder: Path) -> None:
    """Delete hidden temporaries (".<key>-*" folders, ".<file>-*" files, ".trash-*")
    older than STALE_SECONDS in `folder`: what a writer killed mid-store leaves behind.
    Only in a folder that passes the trust check, and only what lstat shows is this user's
    own regular file or real folder: a link is never followed nor removed, and rmtree does
    not follow the links inside a folder."""
    if private_reason(folder) is not None:
        return
    now, uid = time.time(), os.geteuid()
    try:
        found = [e for e in os.scandir(folder) if e.name.startswith(".")]
    except OSError:
        return
    for e in found:
        try:
            st = os.lstat(e.path)
            if st.st_uid != uid or now - st.st_mtime < STALE_SECONDS:
                continue
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(e.path, ignore_errors=True)
            elif stat.S_ISREG(st.st_mode):
                os.unlink(e.path)
        except OSError:
            pass


def discard(path: Path, *, folder: bool, seen: os.stat_result | None = None) -> None:
    """Delete `path` if it is a folder (folder=True) or if it is anything else (a file or a
    link: folder=False), and leave it where it is otherwise, in one atomic step: it is renamed
    onto an empty placeholder of the kind asked for, and rename(2) refuses to put a file onto
    a folder (EISDIR) or a folder onto a file (ENOTDIR). So the sound file or folder that a
    concurrent writer has just put at `path` is never moved away from under a reader that
    holds its path (a check, then a move, would leave that window open). A link is renamed,
    never followed.

    A folder renamed onto an empty folder is the one case rename(2) does not sort by kind:
    with `seen` (the lstat that found the folder untrusted), a folder that turns out to be
    another (a concurrent writer's sound entry, put there after that lstat) is renamed back."""
    try:
        if folder:
            trash = Path(tempfile.mkdtemp(prefix=f".trash-{path.name[:16]}-", dir=path.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=f".trash-{path.name[:16]}-", dir=path.parent)
            os.close(fd)
            trash = Path(name)
    except OSError:
        return                           # the parent went away: the caller starts over
    placeholder = os.lstat(trash)
    with contextlib.suppress(OSError):
        os.rename(path, trash)           # fails (nothing moved) if `path` is not of that kind
    with contextlib.suppress(OSError):
        st = os.lstat(trash)
        moved = (st.st_ino, st.st_dev) != (placeholder.st_ino, placeholder.st_dev)
        if moved and seen is not None and stat.S_ISDIR(st.st_mode) and \
                (st.st_ino, st.st_dev) != (seen.st_ino, seen.st_dev):
            with contextlib.suppress(OSError):
                os.rename(trash, path)   # not the folder that was judged: back (unless a newer one is there)
                return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(trash, ignore_errors=True)
        else:
            trash.unlink()
