"""The on-disk kernel cache: keys, atomic store, verified load.

An entry is a folder `<cache>/<key[:2]>/<key>/` holding `module.py` (the generated
source) and `manifest.json` (what it was built from and the sha256 of every file).
A new entry is written into a temporary folder and moved into place with os.replace, so a
reader never sees half an entry; an entry whose files do not match their manifest is
treated as missing and repaired in place, file by file with os.replace (no locks; see
store()). Temporaries that a killed writer leaves behind are swept after an hour.

Trust. dilgen imports the modules it finds here, and a manifest is a checksum, not an
authentication, so the cache trusts only what this user made (dilgen/fsafe.py):
- the cache folder, each shard `<key[:2]>`, each entry and `tuning/` are used only if
  lstat shows a real folder (a symlink is never followed) owned by this user that group
  and others cannot write; dilgen makes them 0700 and its files 0600, whatever the umask;
- a cache folder or shard that fails this is neither read nor written: the process
  caches in a temporary folder of its own, with one warning naming the folder and why
  (`dilgen build`: one CacheError line instead); an entry folder that fails counts as
  missing and is replaced, never repaired in place;
- files are read only if they are regular files, opened without following a link and
  without waiting on a FIFO (fsafe.read_regular);
- the sweep deletes only hidden temporaries that lstat shows are this user's own regular
  files or folders, in a folder that passed the check, never through a link.
(The folders above the cache folder are not checked: the default, ~/.cache/dilgen, sits
in the user's home.)

A cache folder that cannot be written (a read-only home, a path under /proc, a file in
its place) is not fatal either: the process stores its entries in a temporary folder of
its own, with one warning naming the folder, why, and DILGEN_CACHE_DIR (entries already in
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
import stat
import tempfile
import warnings
from pathlib import Path

from . import fsafe
from .cache_fs import STALE_SECONDS, Untrusted, distrusted, trusted_entries   # noqa: F401
from .cache_fs import discard as _discard, private_folder as _private_folder
from .cache_fs import sweep as _sweep, write_new as _write_new
from .fsafe import private_reason, read_regular, stat_reason
from .knobs import flag

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
    """The cache folder cannot be written or trusted and no fallback is allowed (`dilgen
    build`)."""


class CacheWarning(UserWarning):
    """The cache folder cannot be written or trusted: this process caches in a temporary
    folder."""


_FALLBACK: dict[str, Path] = {}     # configured folder -> this process's temporary cache
_STRICT = [False]


@contextlib.contextmanager
def strict():
    """Within it, an unwritable or untrusted cache folder raises CacheError instead of
    falling back to a temporary folder (`dilgen build`: the cache is what it makes)."""
    old, _STRICT[0] = _STRICT[0], True
    try:
        yield
    finally:
        _STRICT[0] = old


def unwritable(folder: Path | None = None) -> str | None:
    """Why entries cannot be written under `folder` (default: the cache folder), in a few
    words, or None if they can: it (or a folder above it) is a file, or creating it or a
    file in it fails (read-only file system, permission, a path under /proc). A folder
    that fails the trust check (distrusted) is not probed: None, and store() and load()
    refuse it."""
    folder = Path(folder) if folder is not None else cache_dir()
    for up in (folder, *folder.parents):
        if os.path.lexists(up):
            if not up.is_dir():
                return f"{up} is a file, not a folder"
            break
    if distrusted(folder) is not None:
        return None
    try:
        fsafe.make_private_dir(folder)
        fd, probe = tempfile.mkstemp(prefix=".probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = exc.filename if isinstance(exc.filename, str) else str(folder)
        return f"cannot write {where}: {exc.strerror or exc}"
    return None


def _fall_back(root: Path, problem: str, advice: str) -> Path:
    """This process's temporary cache for the cache folder `root`, made now, with the one
    warning (`problem`; DILGEN_CACHE_DIR `advice`)."""
    tmp = Path(tempfile.mkdtemp(prefix="dilgen-cache-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    _FALLBACK[str(root)] = tmp
    warnings.warn(f"dilgen: {problem}; this process caches kernels in {tmp} instead (deleted "
                  f"at exit, so they compile again next time); set DILGEN_CACHE_DIR to "
                  f"{advice}", CacheWarning, stacklevel=4)
    return tmp


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
    return _fall_back(root, f"the kernel cache {root} is not writable ({reason})",
                      "a writable folder")


def _distrust(root: Path, folder: Path, reason: str) -> Path:
    """This process's temporary cache, now that `folder` (the cache folder `root` or one of
    its shards) failed the trust check: made with one warning on the first such finding
    (CacheError under strict())."""
    fallback = _FALLBACK.get(str(root))
    if fallback is not None:
        return fallback
    if "can write" in reason:      # this user's own folder made under a loose umask (002)
        reason += f"; if it is yours, `chmod -R go-w {folder}` makes it private"
    if _STRICT[0]:
        raise CacheError(f"the kernel cache folder {folder} cannot be trusted ({reason}): "
                         f"dilgen runs the code it finds there; set DILGEN_CACHE_DIR to a "
                         f"folder that only you can write") from None
    return _fall_back(root, f"the kernel cache folder {folder} cannot be trusted ({reason}), "
                      f"so dilgen neither reads nor writes there",
                      "a folder that only you can write")


def _roots() -> list[Path]:
    """Folders to read entries from: the cache folder (if it passes the trust check; one
    that fails it sends this process to its fallback, _distrust), then the fallback."""
    root = cache_dir()
    reason = distrusted(root)
    if reason is not None:
        _distrust(root, root, reason)
    fallback = _FALLBACK.get(str(root))
    roots = [root] if private_reason(root) is None else []
    return roots if fallback is None else [*roots, fallback]


def _shard_ok(root: Path, shard: Path) -> bool:
    """Whether entries may be read from `shard` of `root`; one that fails the trust check
    in the configured cache folder sends this process to its fallback (_distrust)."""
    if private_reason(shard) is None:
        return True
    reason = distrusted(shard)
    if reason is not None and root == cache_dir():      # not in this process's own fallback
        _distrust(root, shard, reason)
    return False


def always_compile() -> bool:
    return flag("DILGEN_ALWAYS_COMPILE", False)


def dump_dir() -> Path | None:
    root = os.environ.get("DILGEN_DUMP_DIR")
    return _folder("DILGEN_DUMP_DIR", root) if root else None


def make_key(**parts: str) -> str:
    """sha256 over the named parts (generator version, spec key, target, toolchain, ...)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _sha_file(path: Path) -> str:
    return hashlib.sha256(read_regular(path)).hexdigest()


def entry_dir(key: str, root: Path | None = None) -> Path:
    return (cache_dir() if root is None else root) / key[:2] / key


def _verify(folder: Path, key: str, require: str) -> bool:
    """Whether `folder` is a sound entry for `key`: its manifest names this key and the
    file `require`, and every file it lists is a regular file matching its sha256. (The
    caller checks the folder's trust.)"""
    try:
        manifest = json.loads(read_regular(folder / MANIFEST))
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
    except (OSError, ValueError):      # missing, a link, a FIFO, not JSON (UnicodeDecodeError)
        return False
    return True


def read_verified(folder: Path, name: str = MODULE) -> bytes | None:
    """The bytes of `name` in an entry that load() returned, read once and checked against
    its manifest's sha256, or None: what the caller runs is exactly what was verified (a
    second read of the path could see other bytes)."""
    try:
        manifest = json.loads(read_regular(folder / MANIFEST))
        data = read_regular(folder / name)
    except (OSError, ValueError):
        return None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or hashlib.sha256(data).hexdigest() != files.get(name):
        return None
    return data


def load(key: str, require: str = MODULE) -> Path | None:
    """The entry folder if it passes the trust check (with its cache folder and shard), holds
    `require` and every file matches its manifest, else None. A damaged entry is left where
    it is, for store() to repair: removing it here could remove the sound entry that a
    concurrent writer has just put in its place."""
    if always_compile():
        return None
    for root in _roots():
        folder = entry_dir(key, root)
        if (_shard_ok(root, folder.parent) and private_reason(folder) is None
                and _verify(folder, key, require)):
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
      write the same bytes;
    - an entry folder that fails the trust check (or a file or link in its place):
      discarded and written anew.

    A cache folder or shard that cannot be written or trusted sends the entry (and this
    process's later ones) to a temporary folder, with one warning (_writable_root,
    _distrust)."""
    root = cache_dir()
    fallback = _FALLBACK.get(str(root))
    if fallback is None:
        try:
            return _store(entry_dir(key, root), key, files, info, replace)
        except Untrusted as exc:
            fallback = _distrust(root, exc.folder, exc.reason)
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
    shard = final.parent
    _private_folder(shard.parent)        # the cache folder, then the shard: Untrusted if not ours
    _private_folder(shard)
    _sweep(shard)
    manifest = {**info, "key": key,
                "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}}
    blobs = {**files, MANIFEST: json.dumps(manifest, indent=2, sort_keys=True).encode()}
    rewrite = replace or always_compile()
    for _ in range(8):
        found = _lstat(final)            # one look decides both trust and kind
        trusted = found is not None and stat_reason(found) is None
        if trusted and not rewrite and _verify(final, key, require):
            return final
        if trusted:
            _repair(final, blobs)
        elif found is not None:          # another's folder, a file or a link: never used
            _discard(final, folder=stat.S_ISDIR(found.st_mode), seen=found)
        else:
            try:
                _publish(final, blobs)
            except FileNotFoundError:    # the cache folder was deleted meanwhile: again
                _private_folder(shard.parent)
                _private_folder(shard)
        rewrite = False
    raise OSError(f"{final}: could not store a sound cache entry (concurrent writers of "
                  f"different bytes for one key?)")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _publish(final: Path, blobs: dict[str, bytes]) -> None:
    """Move a complete new entry into place, unless another writer got there first."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name[:16]}-", dir=final.parent))   # 0700
    try:
        for name, data in blobs.items():
            _write_new(tmp / name, data)
        try:
            os.replace(tmp, final)
        except OSError:
            pass                         # an entry appeared meanwhile: the caller checks it
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _repair(final: Path, blobs: dict[str, bytes]) -> None:
    """Rewrite every file of an entry (a folder that passed the trust check) in place, each
    atomically, the manifest last; os.replace replaces a link or FIFO in the way, never
    follows it."""
    _sweep(final)
    for name, data in blobs.items():     # MANIFEST is the last key
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=final)
        except OSError:
            return                       # the folder went away: the caller starts over
        try:
            with os.fdopen(fd, "wb") as fh:
                os.fchmod(fh.fileno(), 0o600)
                fh.write(data)
            os.replace(tmp, final / name)
        except OSError:
            _discard(final / name, folder=True)   # a folder where the file should be
            return
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)


def _record_path(kind: str, key: str, root: Path | None = None) -> Path:
    return (cache_dir() if root is None else root) / kind / f"{key}.json"


def load_record(kind: str, key: str, parse):
    """parse(the JSON of the record `kind`/`key`), or None: none stored, or one that is
    corrupt (parse raises ValueError, KeyError or TypeError), not a regular file, or in a
    folder that fails the trust check. This process's own fallback is read first."""
    for root in reversed(_roots()):
        path = _record_path(kind, key, root)
        if private_reason(path.parent) is not None:
            continue
        try:
            return parse(json.loads(read_regular(path)))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def store_record(kind: str, key: str, data: dict) -> Path:
    """Write the JSON record `kind`/`key` atomically, 0600 in a 0700 folder (to the fallback
    if the cache is not writable or not trusted)."""
    root = cache_dir()
    fallback = _FALLBACK.get(str(root))
    if fallback is None:
        try:
            return _store_record(_record_path(kind, key, root), data)
        except Untrusted as exc:
            fallback = _distrust(root, exc.folder, exc.reason)
        except OSError as exc:
            fallback = _writable_root(root, _record_path(kind, key, root).parent, exc)
    return _store_record(_record_path(kind, key, fallback), data)


def _store_record(path: Path, data: dict) -> Path:
    _private_folder(path.parent.parent)
    _private_folder(path.parent)
    return fsafe.write_atomic(path, json.dumps(data, indent=2, sort_keys=True), mode=0o600)


def _tuning_config(data: dict) -> dict:
    config = data["config"]
    def ok(v):  # an int, or a tile row of 4 ints (bwd_kv, bwd_dq)
        return isinstance(v, int) or (isinstance(v, list) and len(v) == 4 and all(isinstance(x, int) for x in v))
    if not isinstance(config, dict) or not all(ok(v) for v in config.values()):
        raise ValueError("not a tuning record")
    return config


def load_tuning(key: str) -> dict | None:
    """A stored autotune winner, or None (a corrupt file, or one in a folder that fails the
    trust check, counts as none)."""
    return load_record("tuning", key, _tuning_config)


def store_tuning(key: str, config: dict, info: dict) -> Path:
    """Write an autotune winner atomically (to the fallback if the cache is not writable or
    not trusted)."""
    return store_record("tuning", key, {"config": config, **info})
