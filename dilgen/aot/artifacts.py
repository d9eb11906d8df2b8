"""The cache entries of compiled kernels: their key, how they are stored and checked,
and how a stored binary becomes a Triton CompiledKernel again.

An entry is a dilgen cache folder (dilgen.cache: written atomically, sha256 manifest)
holding `kernel.cubin`, `kernel.json` (Triton's metadata of the compile) and `spec.json`
(what the key was computed from). An entry that fails its manifest or whose files are
not what they should be (no ELF binary, no Triton metadata, another kernel) counts as
missing: the run time falls back to the JIT and the next build rewrites it in place.

Entries are found only where dilgen.cache trusts them (a cache folder, shard and entry
folder that are real folders of this user's that no one else can write; no link
followed), and their files are read only if they are regular files (fsafe.read_regular:
no link followed, no FIFO waited on)."""
from __future__ import annotations

import hashlib
import json
import linecache
from pathlib import Path

from .. import __version__, cache
from ..fsafe import read_regular

CUBIN, METADATA, SPECJSON = "kernel.cubin", "kernel.json", "spec.json"


def module_hash(source: str | bytes) -> str:
    data = source.encode() if isinstance(source, str) else source
    return hashlib.sha256(data).hexdigest()


def source_fn_module_hash(source_fn) -> str | None:
    """sha256 of the source that defines a generated kernel (its module), or None: the text
    that ran (compiler._import_module keeps it in linecache under the module's path), else
    the file at that path, so a stored binary is looked up for the source that runs."""
    path = getattr(source_fn, "__globals__", {}).get("__file__")
    if not path:
        return None
    entry = linecache.cache.get(path)
    if entry is not None and entry[1] is None and entry[2]:    # mtime None: set by dilgen
        return module_hash("".join(entry[2]))
    try:
        return module_hash(read_regular(path))
    except OSError:
        return None


def target_str(gpu) -> str:
    return f"{gpu.backend}:{gpu.arch}:{gpu.warp_size}"


def env_key() -> str:
    """Triton's cache-invalidating environment (TRITON_* knobs that change the code)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    return json.dumps(get_cache_invalidating_env_vars(), sort_keys=True)


def artifact_key(module_sha: str, kernel_name: str, gpu, desc: str) -> str:
    import triton
    return cache.make_key(kind="aot-kernel", generator=__version__, module=module_sha,
                          kernel=kernel_name, target=target_str(gpu), triton=triton.__version__,
                          specialization=desc, env=env_key())


def store(key: str, cubin: bytes, meta_json: str, *, kernel: str, role: str, arch: int,
          module_sha: str, desc: str) -> Path:
    """Write the entry for `key`; an entry already there that is damaged or unusable is
    rewritten in place, file by file with os.replace and the manifest last (the caller
    compiled because load_entry refused it)."""
    import triton
    meta = json.loads(meta_json)
    info = {"kind": "aot-kernel", "kernel": kernel, "role": role, "target": f"sm{arch}",
            "triton": triton.__version__, "generator": __version__, "module_sha256": module_sha,
            "shared": meta.get("shared"), "num_warps": meta.get("num_warps"),
            "num_stages": meta.get("num_stages")}
    described = {"module_sha256": module_sha, "specialization": json.loads(desc),
                 "env": json.loads(env_key())}
    files = {CUBIN: cubin, METADATA: meta_json.encode(),
             SPECJSON: (json.dumps(described, indent=1) + "\n").encode()}
    folder = cache.store(key, files, info, replace=True)
    found = _BUILDS.get(str(cache.cache_dir()))
    if found is not None:             # the index of other_triton_builds, if read already
        _note(found, module_sha, kernel, triton.__version__)
    return folder


def load_entry(key: str, kernel: str | None = None) -> Path | None:
    """A sound entry folder for `key`, or None: a trusted entry (cache.load) whose files
    are regular files matching the manifest, the binary is an ELF file, the metadata is
    Triton's (with a target) and, when `kernel` is given, names that kernel. A refused entry is left where it is (a concurrent writer may be
    repairing it); the next build rewrites it."""
    folder = cache.load(key, require=CUBIN)
    if folder is None:
        return None
    try:
        meta = json.loads(read_regular(folder / METADATA))
        if read_regular(folder / CUBIN)[:4] != b"\x7fELF" or not isinstance(meta, dict):
            return None
        if not isinstance(meta.get("target"), dict):
            return None
        if kernel is not None and meta.get("name") != kernel:
            return None
    except (OSError, ValueError):
        return None
    return folder


def check_metadata(meta, kernel_name: str, gpu, sp, gluon: bool = False) -> str | None:
    """Why a stored artifact does not fit this launch, or None if it does. A Gluon kernel's
    num_warps counts its warp-specialized partitions too (the option: the default one's)."""
    import triton
    t = meta.target
    if (t.backend, t.arch, t.warp_size) != (gpu.backend, gpu.arch, gpu.warp_size):
        return f"built for {t.backend}:{t.arch}, device is {gpu.backend}:{gpu.arch}"
    if meta.name != kernel_name:
        return f"artifact holds {meta.name}, not {kernel_name}"
    if getattr(meta, "triton_version", None) != triton.__version__:
        return f"triton {getattr(meta, 'triton_version', '?')} != {triton.__version__}"
    for opt in ("num_warps", "num_stages", "num_ctas", "debug"):
        have, want = getattr(meta, opt, None), getattr(sp.options, opt, None)
        if gluon and opt == "num_warps" and isinstance(have, int) and isinstance(want, int) and have >= want:
            continue
        if have != want:
            return f"{opt} {have} != {want}"
    return None


def source_of(jit_fn, signature: dict, constexprs: dict, attrs: dict):
    """Triton's compile source of a specialization: an ASTSource, a GluonASTSource for a
    @gluon.jit function."""
    if jit_fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource
        return GluonASTSource(jit_fn, signature, constexprs, attrs)
    from triton.compiler import ASTSource
    return ASTSource(jit_fn, signature, constexprs, attrs)


def load_compiled(folder: Path, jit_fn, sp):
    """A triton CompiledKernel from an entry folder (no compile; the binary is loaded
    onto the current device on first launch)."""
    from triton.compiler import CompiledKernel
    src = source_of(jit_fn, sp.signature, sp.constexprs, sp.attrs)
    group = {f"{jit_fn.__name__}.json": str(folder / METADATA),
             f"{jit_fn.__name__}.cubin": str(folder / CUBIN)}
    return CompiledKernel(src, group, folder.name)


# cache folder -> {(module sha256, kernel): Triton versions of its AOT entries}: read once
# per process (a fallback asks for every kernel specialization that has no artifact, and
# reading every manifest of a large cache each time cost seconds a rank on a warm start)
_BUILDS: dict[str, dict[tuple[str, str], set[str]]] = {}


def _builds(root: Path) -> dict[tuple[str, str], set[str]]:
    """The Triton versions of every AOT entry under `root`, by (module sha256, kernel):
    the cache's manifests read on the first call, then kept (store() adds what this
    process writes). Only entries that the cache trusts are read (cache.trusted_entries: no
    link followed, no other user's folder); unreadable manifests are skipped."""
    found = _BUILDS.get(str(root))
    if found is not None:
        return found
    found = {}
    for entry in cache.trusted_entries(root):
        try:
            info = json.loads(read_regular(entry / cache.MANIFEST))
        except (OSError, ValueError):
            continue
        if isinstance(info, dict) and info.get("kind") == "aot-kernel":
            _note(found, info.get("module_sha256"), info.get("kernel"), info.get("triton"))
    _BUILDS[str(root)] = found
    return found


def _note(found: dict, module_sha, kernel, triton_version) -> None:
    found.setdefault((str(module_sha), str(kernel)), set()).add(str(triton_version))


def other_triton_builds(module_sha: str, kernel: str) -> list[str]:
    """Triton versions of cached AOT entries of this module's `kernel` built by a Triton
    other than this one (their keys include the Triton version, so this runtime can never
    use them). The cache's manifests are read once per process (_builds); entries another
    process writes later are not seen (they only change a warning's words)."""
    import triton
    versions = _builds(cache.cache_dir()).get((module_sha, kernel), ())
    return sorted(v for v in versions if v != triton.__version__)
