"""The on-disk kernel cache: keys, atomic store, verified load.

An entry is a folder `<cache>/<key[:2]>/<key>/` holding `module.py` (the generated
source) and `manifest.json` (what it was built from and the sha256 of every file).
Entries are written into a temporary folder and moved into place with os.replace, so a
reader never sees half an entry; an entry whose files do not match their manifest is
treated as missing and rebuilt.

Environment knobs (Triton style):
  DILGEN_CACHE_DIR       where the cache lives (default ~/.cache/dilgen)
  DILGEN_ALWAYS_COMPILE  1 = ignore cached entries and rebuild them
  DILGEN_DUMP_DIR        write every stage (spec, IR, source) of each compile here
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

MANIFEST = "manifest.json"
MODULE = "module.py"


def cache_dir() -> Path:
    root = os.environ.get("DILGEN_CACHE_DIR")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "dilgen"
    return path


def always_compile() -> bool:
    return os.environ.get("DILGEN_ALWAYS_COMPILE", "") not in ("", "0")


def dump_dir() -> Path | None:
    root = os.environ.get("DILGEN_DUMP_DIR")
    return Path(root).expanduser() if root else None


def make_key(**parts: str) -> str:
    """sha256 over the named parts (generator version, spec key, target, toolchain, ...)."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _sha_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def entry_dir(key: str) -> Path:
    return cache_dir() / key[:2] / key


def load(key: str) -> Path | None:
    """The entry folder if it exists and every file matches its manifest, else None
    (a corrupt or torn entry is removed so that it gets rebuilt)."""
    if always_compile():
        return None
    folder = entry_dir(key)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest.get("key") != key or MODULE not in files:
            raise ValueError("manifest does not describe this entry")
        for name, digest in files.items():
            if _sha_file(folder / name) != digest:
                raise ValueError(f"{name} does not match its checksum")
    except (OSError, ValueError, KeyError, TypeError):
        _remove(folder)
        return None
    return folder


def store(key: str, files: dict[str, bytes], info: dict) -> Path:
    """Write an entry atomically; return its folder. If another process stored the same
    key first, its (verified) entry is kept."""
    final = entry_dir(key)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=final.parent))
    try:
        digests = {}
        for name, data in files.items():
            (tmp / name).write_bytes(data)
            digests[name] = hashlib.sha256(data).hexdigest()
        manifest = {"key": key, "files": digests, **info}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if final.exists():
            if load(key) is not None and not always_compile():
                return final
            _remove(final)
        try:
            os.replace(tmp, final)
        except OSError:
            # Lost a race: a concurrent writer moved its entry in first. Use it if sound.
            if load(key) is None:
                raise
        return final
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _remove(folder: Path) -> None:
    """Move a bad entry aside, then delete it (never leaves a half-deleted entry in place)."""
    if not folder.exists():
        return
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}")
    try:
        os.replace(folder, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _tuning_path(key: str) -> Path:
    return cache_dir() / "tuning" / f"{key}.json"


def load_tuning(key: str) -> dict | None:
    """A stored autotune winner, or None (a corrupt file counts as none)."""
    path = _tuning_path(key)
    try:
        data = json.loads(path.read_text())
        config = data["config"]
        if not isinstance(config, dict) or not all(isinstance(v, int) for v in config.values()):
            raise ValueError
        return config
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_tuning(key: str, config: dict, info: dict) -> Path:
    """Write an autotune winner atomically."""
    path = _tuning_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tune-", dir=path.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump({"config": config, **info}, fh, indent=2, sort_keys=True)
    os.replace(tmp, path)
    return path
