"""The on-disk kernel cache: keys, atomic store, verified load.

An entry is a folder `<cache>/<key[:2]>/<key>/` holding `module.py` (the generated
source) and `manifest.json` (what it was built from and the sha256 of every file).
A new entry is written into a temporary folder and moved into place with os.replace, so a
reader never sees half an entry; an entry whose files do not match their manifest is
treated as missing and repaired in place, file by file with os.replace (no locks; see
store()). Temporaries that a killed writer leaves behind are swept after an hour.

A cache folder that cannot be written (a read-only home, a path under /proc, a file in
its place) is not fatal: the process stores its entries in a temporary folder of its own
instead, with one warning naming the folder, why, and DILGEN_CACHE_DIR (entries already in
the folder are still read). `dilgen build`, whose job is to fill the cache, refuses
instead (strict()).

Environment knobs (Triton style):
  DILGEN_CACHE_DIR       where the cache lives (default ~/.cache/dilgen)
  DILGEN_ALWAYS_COMPILE  1 = ignore cached entries and rebuild them
  DILGEN_DUMP_DIR        write every stage (spec, IR, source) of each compile here
"""
from __future__ import annotations

import atexit
import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

MANIFEST = "manifest.json"
MODULE = "module.py"


def _folder(variable: str, value: str) -> Path:
    """A folder named by an environment variable, with ~ expanded: one CacheError line when
    the home it names does not exist (~nosuchuser/x)."""
    try:
        return Path(value).expanduser()
    except RuntimeError as exc:       # Path.expanduser: "Could not determine home directory"
        raise CacheError(f"{variable}={value!r}: {exc}; name an existing user's home or an "
                         f"absolute folder") from None


def cache_dir() -> Path:
    """The cache folder as configured (DILGEN_CACHE_DIR, default ~/.cache/dilgen)."""
    root = os.environ.get("DILGEN_CACHE_DIR")
    return _folder("DILGEN_CACHE_DIR", root) if root else Path.home() / ".cache" / "dilgen"


class CacheError(OSError):
    """The cache folder cannot be written and no fallback is allowed (`dilgen build`)."""


class CacheWarning(UserWarning):
    """The cache folder cannot be written: this process caches in a temporary folder."""


_FALLBACK: dict[str, Path] = {}     # configured folder -> this process's temporary cache
_STRICT = [False]


@contextlib.contextmanager
def strict():
    """Within it, an unwritable cache folder raises CacheError instead of falling back to
    a temporary folder (`dilgen build`: the cache is what it makes)."""
    old, _STRICT[0] = _STRICT[0], True
    try:
        yield
    finally:
        _STRICT[0] = old


def unwritable(folder: Path | None = None) -> str | None:
    """Why entries cannot be written under `folder` (default: the cache folder), in a few
    words, or None if they can: it (or a folder above it) is a file, or creating it or a
    file in it fails (read-only file system, permission, a path under /proc)."""
    folder = Path(folder) if folder is not None else cache_dir()
    for up in (folder, *folder.parents):
        if os.path.lexists(up):
            if not up.is_dir():
                return f"{up} is a file, not a folder"
            break
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = exc.filename if isinstance(exc.filename, str) else str(folder)
        return f"cannot write {where}: {exc.strerror or exc}"
    return None


def _writable_root(root: Path, folder: Path, exc: OSError) -> Path:
    """Where to store now that writing under `folder` (in the cache `root`) raised `exc`:
    this process's temporary cache if the folder cannot be written (one warning), else
    `exc` is raised again (a failure that is not about the folder)."""
    reason = unwritable(folder)
    if reason is None and getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        reason = "no space left on its device"     # an empty probe file still fits
    if reason is None:
        raise exc
    if _STRICT[0]:
        raise CacheError(f"the kernel cache {root} is not writable ({reason}); set "
                         f"DILGEN_CACHE_DIR to a writable folder") from None
    tmp = Path(tempfile.mkdtemp(prefix="dilgen-cache-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    _FALLBACK[str(root)] = tmp
    warnings.warn(f"dilgen: the kernel cache {root} is not writable ({reason}); this process "
                  f"caches kernels in {tmp} instead (deleted at exit, so they compile again "
                  f"next time); set DILGEN_CACHE_DIR to a writable folder", CacheWarning,
                  stacklevel=3)
    return tmp


def _roots() -> list[Path]:
    """Folders to read entries from: the cache folder, then this process's fallback."""
    root = cache_dir()
    fallback = _FALLBACK.get(str(root))
    return [root] if fallback is None else [root, fallback]


def always_compile() -> bool:
    return os.environ.get("DILGEN_ALWAYS_COMPILE", "") not in ("", "0")


def dump_dir() -> Path | None:
    root = os.environ.get("DILGEN_DUMP_DIR")
    return _folder("DILGEN_DUMP_DIR", root) if root else None


def make_key(**parts: str) -> str:
    """sha256 over the named parts (generator version, spec key, target, toolchain, ...)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _sha_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def entry_dir(key: str, root: Path | None = None) -> Path:
    return (cache_dir() if root is None else root) / key[:2] / key


STALE_SECONDS = 3600   # a hidden temporary this old has no live writer (a writer takes seconds)


def _verify(folder: Path, key: str, require: str) -> bool:
    """Whether `folder` is a sound entry for `key`: its manifest names this key and the
    file `require`, and every file it lists matches its sha256."""
    try:
        manifest = json.loads((folder / MANIFEST).read_bytes())
        if not isinstance(manifest, dict) or manifest.get("key") != key:
            return False
        files = manifest.get("files")
        if not isinstance(files, dict) or require not in files:
            return False
        for name, digest in files.items():
            if not isinstance(name, str) or name in ("", ".", "..", MANIFEST) or "/" in name:
                return False
            if _sha_file(folder / name) != digest:
                return False
    except (OSError, ValueError):      # missing files, not JSON (UnicodeDecodeError too)
        return False
    return True


def load(key: str, require: str = MODULE) -> Path | None:
    """The entry folder if it holds `require` and every file matches its manifest, else
    None. A damaged entry is left where it is, for store() to repair: removing it here
    could remove the sound entry that a concurrent writer has just put in its place."""
    if always_compile():
        return None
    for root in _roots():
        folder = entry_dir(key, root)
        if _verify(folder, key, require):
            return folder
    return None


def store(key: str, files: dict[str, bytes], info: dict, *, replace: bool = False) -> Path:
    """Write the entry for `key`; return its folder. No locks:

    - no entry yet: it is written into a temporary folder and moved into place with one
      os.replace, so a reader never sees half of it; of concurrent writers the first
      one wins and the others keep its (verified) entry;
    - a sound entry: kept as it is, or rewritten in place like a damaged one with
      `replace=True` (a caller that found its contents unusable: dilgen.aot) or
      DILGEN_ALWAYS_COMPILE=1;
    - a damaged entry: repaired in place, one file at a time with os.replace and the
      manifest last, so its module path never disappears under a process that is
      importing it. An entry's bytes are a function of its key, so concurrent repairs
      write the same bytes.

    A cache folder that cannot be written sends the entry (and this process's later ones)
    to a temporary folder, with one warning (_writable_root)."""
    root = cache_dir()
    fallback = _FALLBACK.get(str(root))
    if fallback is None:
        try:
            return _store(entry_dir(key, root), key, files, info, replace)
        except OSError as exc:
            fallback = _writable_root(root, entry_dir(key, root).parent, exc)
    try:
        return _store(entry_dir(key, fallback), key, files, info, replace)
    except OSError as exc:
        raise CacheError(f"cannot store a kernel in {root} nor in this process's temporary cache "
                         f"{fallback} ({exc.strerror or exc}); free space there or set "
                         f"DILGEN_CACHE_DIR to a writable folder") from None


def _store(final: Path, key: str, files: dict[str, bytes], info: dict, replace: bool) -> Path:
    require = MODULE if MODULE in files else next(iter(files))
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep(final.parent)
    manifest = {**info, "key": key,
                "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}}
    blobs = {**files, MANIFEST: json.dumps(manifest, indent=2, sort_keys=True).encode()}
    rewrite = replace or always_compile()
    for _ in range(8):
        if not rewrite and _verify(final, key, require):
            return final
        if final.is_dir() and not final.is_symlink():
            _repair(final, blobs)
        elif os.path.lexists(final):
            _discard(final, folder=False)   # a file or a link where the folder should be
        else:
            try:
                _publish(final, blobs)
            except FileNotFoundError:    # the cache folder was deleted meanwhile: again
                final.parent.mkdir(parents=True, exist_ok=True)
        rewrite = False
    raise OSError(f"{final}: could not store a sound cache entry (concurrent writers of "
                  f"different bytes for one key?)")


def _publish(final: Path, blobs: dict[str, bytes]) -> None:
    """Move a complete new entry into place, unless another writer got there first."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name[:16]}-", dir=final.parent))
    try:
        for name, data in blobs.items():
            (tmp / name).write_bytes(data)
        try:
            os.replace(tmp, final)
        except OSError:
            pass                         # an entry appeared meanwhile: the caller checks it
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _repair(final: Path, blobs: dict[str, bytes]) -> None:
    """Rewrite every file of an entry in place, each atomically, the manifest last."""
    _sweep(final)
    for name, data in blobs.items():     # MANIFEST is the last key
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=final)
        except OSError:
            return                       # the folder went away: the caller starts over
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.chmod(tmp, 0o644)
            os.replace(tmp, final / name)
        except OSError:
            _discard(final / name, folder=True)   # a folder where the file should be
            return
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)


def _sweep(folder: Path) -> None:
    """Delete hidden temporaries (".<key>-*" folders, ".<file>-*" files, ".trash-*")
    older than STALE_SECONDS in `folder`: what a writer killed mid-store leaves behind."""
    now = time.time()
    try:
        found = [e for e in os.scandir(folder) if e.name.startswith(".")]
    except OSError:
        return
    for e in found:
        try:
            if now - e.stat(follow_symlinks=False).st_mtime < STALE_SECONDS:
                continue
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, ignore_errors=True)
            else:
                os.unlink(e.path)
        except OSError:
            pass


def _discard(path: Path, *, folder: bool) -> None:
    """Delete `path` if it is a folder (folder=True) or if it is anything else (a file or a
    link: folder=False), and leave it where it is otherwise, in one atomic step: it is renamed
    onto an empty placeholder of the kind asked for, and rename(2) refuses to put a file onto
    a folder (EISDIR) or a folder onto a file (ENOTDIR). So the sound file or folder that a
    concurrent writer has just put at `path` is never moved away from under a reader that
    holds its path (a check, then a move, would leave that window open)."""
    try:
        if folder:
            trash = Path(tempfile.mkdtemp(prefix=f".trash-{path.name[:16]}-", dir=path.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=f".trash-{path.name[:16]}-", dir=path.parent)
            os.close(fd)
            trash = Path(name)
    except OSError:
        return                           # the parent went away: the caller starts over
    with contextlib.suppress(OSError):
        os.rename(path, trash)           # fails (nothing moved) if `path` is not of that kind
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            trash.unlink()


def _tuning_path(key: str, root: Path | None = None) -> Path:
    return (cache_dir() if root is None else root) / "tuning" / f"{key}.json"


def load_tuning(key: str) -> dict | None:
    """A stored autotune winner, or None (a corrupt file counts as none)."""
    for root in reversed(_roots()):     # this process's own winner first
        config = _load_tuning(_tuning_path(key, root))
        if config is not None:
            return config
    return None


def _load_tuning(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
        config = data["config"]
        def ok(v):  # an int, or a tile row of 4 ints (bwd_kv, bwd_dq)
            return isinstance(v, int) or (isinstance(v, list) and len(v) == 4
                                          and all(isinstance(x, int) for x in v))
        if not isinstance(config, dict) or not all(ok(v) for v in config.values()):
            raise ValueError
        return config
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_tuning(key: str, config: dict, info: dict) -> Path:
    """Write an autotune winner atomically (to the fallback if the cache is not writable)."""
    root = cache_dir()
    fallback = _FALLBACK.get(str(root))
    if fallback is None:
        try:
            return _store_tuning(_tuning_path(key, root), config, info)
        except OSError as exc:
            fallback = _writable_root(root, _tuning_path(key, root).parent, exc)
    return _store_tuning(_tuning_path(key, fallback), config, info)


def _store_tuning(path: Path, config: dict, info: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tune-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"config": config, **info}, fh, indent=2, sort_keys=True)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return path
