"""Files and folders that no other local user can use against this one.

dilgen imports Python modules and loads binaries from its cache, and writes files where a
user points it. On a shared machine another user may own, or be able to write, a folder on
the way, or leave a symlink, a FIFO or a device where a file is expected. The rules here
(docs/security.md states them for users):

- a folder dilgen reads code from is trusted only if it is a real folder (lstat: a symlink
  is never followed), owned by this user and writable by no one else (private_reason);
- folders dilgen makes are made 0700 whatever the umask, files 0600 (make_private_dir,
  write_atomic);
- a file is read only if it is a regular file, opened without following a link and without
  blocking on a FIFO (read_regular);
- a file is written to a temporary name in its folder and moved onto its name with
  os.replace; a symlink or anything but a regular file at that name is refused in one line
  (write_atomic), so a write never lands outside the folder named.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)


class UnsafePath(OSError):
    """A path dilgen will not read or write: a symlink, not a regular file or folder, or a
    folder another user owns or can write."""


def _uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def private_reason(folder: str | os.PathLike) -> str | None:
    """Why `folder` cannot be trusted with code (a few words), or None when it is a real
    folder (not a symlink) owned by this user and not writable by group or others."""
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return f"cannot stat it ({exc.strerror or exc})"
    return stat_reason(st)


def stat_reason(st: os.stat_result) -> str | None:
    """private_reason of what one lstat saw (a caller that acts on the kind it saw as well
    asks once: two lstats could see two different things at one path)."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if _uid() >= 0 and st.st_uid != _uid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {_uid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"group or others can write it (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def make_private_dir(folder: str | os.PathLike, *, parents: bool = True) -> Path:
    """Create `folder` (and missing parents when `parents`) with mode 0700 whatever the
    umask; an existing folder is left as it is (the caller checks it with private_reason)."""
    folder = Path(folder)
    if parents and not os.path.lexists(folder.parent):
        make_private_dir(folder.parent, parents=True)
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        return folder
    os.chmod(folder, 0o700)          # mkdir's mode is cut by the umask; this one is not
    return folder


def read_regular(path: str | os.PathLike) -> bytes:
    """The bytes of `path` if it is a regular file; a symlink is not followed and a FIFO or
    device is not waited on (UnsafePath)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError as exc:
        if _NOFOLLOW and exc.errno == errno.ELOOP:     # the last component is a symlink
            raise UnsafePath(f"{path} is a symlink; dilgen does not follow it") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path} is not a regular file")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def refuse_non_regular(path: str | os.PathLike) -> None:
    """UnsafePath if something other than a regular file (a symlink, dangling or not, a
    folder, a FIFO) has the name `path`; nothing if it is a regular file or absent."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(st.st_mode):
        raise UnsafePath(f"{path} is a symlink; dilgen writes only regular files and does "
                         f"not follow links: remove it or choose another folder")
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePath(f"{path} exists and is not a regular file; remove it or choose "
                         f"another folder")


def write_atomic(path: str | os.PathLike, data: bytes | str, mode: int = 0o600) -> Path:
    """Write `data` to `path`: to a temporary file in its folder, then os.replace onto the
    name, so a reader sees the old file or the whole new one. A symlink or a non-regular
    file at `path` is refused (UnsafePath), never followed."""
    path = Path(path)
    refuse_non_regular(path)
    if isinstance(data, str):
        data = data.encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:32]}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), mode)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return path
