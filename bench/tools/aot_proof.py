"""Proof of ahead-of-time compilation on a GPU: kernels built on a CPU-only machine
(`dilgen build SPECS --arch sm90`, DILGEN_CACHE_DIR=<dir>) run here with no JIT compile.

    # on the CPU machine, in the repository:
    DILGEN_CACHE_DIR=.aot_cache python -m dilgen.cli build examples/specs --arch sm90
    # on the GPU machine, .aot_cache carried along:
    python bench/tools/aot_proof.py --cache .aot_cache --out $OUT/aot_proof.json
    python bench/tools/aot_proof.py --cache .aot_cache --mode compare --out $OUT/aot_proof.json

Modes:
  aot       (default) one fresh process: for every spec of --specs, forward + backward on
            random bf16 inputs at each --seq-len (default 4096, 16384), timed from the
            first call; the first length is checked against a float32 dense reference on
            the GPU (masks from dilgen.reference). Every triton.compile of the process is
            counted (triton.knobs.compilation.listener): it must be 0.
  build-here  `dilgen build` on this machine into a fresh cache (timed), then `aot` on it
            in a fresh process: the same proof with the binaries made here.
  jit       DILGEN_AOT=0 (no lookup), fresh Triton cache: first-call times with JIT compiles,
            for comparison.
  compare   aot (with --cache, if given), build-here and jit, each in its own process.

Triton's on-disk cache is pointed at a fresh temporary folder in every run, so nothing
compiled by an earlier run can hide a JIT compile; the launcher stubs Triton builds with
the C compiler (per kernel signature, for Python of this machine) are counted and timed
apart: they are not kernel compiles, and the JIT path builds the same ones.

Writes JSON to --out; exit status 0 when every check passed (and, in aot mode, no kernel
was compiled), 1 otherwise. `--dry-run-cpu` runs the harness on the CPU (interpreter,
tiny N, no AOT expectations) to test the script itself.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOL = {"out": 2e-2, "lse": 2e-2, "dq": 5e-2, "dk": 5e-2, "dv": 5e-2}


# --------------------------------------------------------------------------- worker

def _count_artifacts(cache_dir: Path) -> dict:
    """Artifacts in a dilgen cache: per target, and the module hashes they were built from."""
    out = {"cubins": 0, "by_target": {}, "module_sha256": {}}
    if not cache_dir.is_dir():
        return out
    for man in cache_dir.rglob("manifest.json"):
        try:
            m = json.loads(man.read_text())
        except (OSError, ValueError):
            continue
        if m.get("kind") != "aot-kernel":
            continue
        out["cubins"] += 1
        out["by_target"][m["target"]] = out["by_target"].get(m["target"], 0) + 1
        name = m["kernel"].rsplit("_fwd_kernel", 1)[0].rsplit("_bwd_", 1)[0]
        out["module_sha256"].setdefault(name, set()).add(m["module_sha256"])
    out["module_sha256"] = {k: sorted(v) for k, v in out["module_sha256"].items()}
    return out


@contextlib.contextmanager
def _count_launcher_builds(record: dict):
    """Count and time the C launcher stubs Triton builds (not kernel compiles)."""
    try:
        import triton.backends.nvidia.driver as nvdrv
    except Exception:  # noqa: BLE001 - no CUDA backend: nothing to count
        yield
        return
    name = next((n for n in ("compile_module_from_src", "compile_module_from_file") if hasattr(nvdrv, n)), None)
    if name is None:   # another Triton: the stubs are not counted (they are not kernel compiles anyway)
        record["launcher_stubs_note"] = "not counted: this Triton has no compile_module_from_src"
        yield
        return
    original = getattr(nvdrv, name)

    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            record["launcher_stubs"] += 1
            record["launcher_stub_s"] += time.perf_counter() - t0

    setattr(nvdrv, name, wrapped)
    try:
        yield
    finally:
        setattr(nvdrv, name, original)


def _sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _reference(q, k, v, dout, spec, dev):
    """out, lse, dq, dk, dv of SPEC §2 in float32 on `dev` (dense masks from
    dilgen.reference, one per head pattern)."""
    import math
    import torch
    from dilgen.reference import reference_mask_counts
    B, N, H, D = q.shape
    group = H // k.shape[2]
    scale = spec.softmax_scale if spec.softmax_scale is not None else 1.0 / math.sqrt(D)
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    masks: dict = {}
    outs, lses = [], []
    for h in range(H):
        key = tuple(h % r for r in spec.dilation_rates)
        if key not in masks:
            masks[key] = reference_mask_counts(N, spec, h).to(device=dev, dtype=torch.float32)
        M = masks[key]
        kh = h // group
        s = scale * torch.einsum("bid,bjd->bij", qf[:, :, h], kf[:, :, kh])
        s = s.masked_fill(M == 0, float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
        p = M * torch.exp(s - m)
        den = p.sum(-1)
        o = torch.einsum("bij,bjd->bid", p, vf[:, :, kh]) / den.clamp_min(1e-30)[..., None]
        outs.append(o)
        lses.append(m.squeeze(-1) + torch.log(den))
    out = torch.stack(outs, 2)
    lse = torch.stack(lses, 1)
    (out * dout.float()).sum().backward()
    return out.detach(), lse.detach(), qf.grad, kf.grad, vf.grad


def _rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _seq_lens(spec, wanted):
    if spec.hilbert is not None and spec.hilbert.scope == "sequence":
        rows, cols = spec.hilbert.grid
        return [rows * cols]
    return list(wanted)


def run_worker(args) -> dict:
    """The proof in this process (a fresh one: first calls are first calls)."""
    tmp_triton = tempfile.mkdtemp(prefix="aot-proof-triton-")
    os.environ["TRITON_CACHE_DIR"] = tmp_triton           # before triton reads its knobs
    if args.mode == "jit":
        os.environ["DILGEN_AOT"] = "0"
    if args.cache:
        os.environ["DILGEN_CACHE_DIR"] = str(Path(args.cache).resolve())
    import torch
    import triton

    import dilgen
    from dilgen import aot
    from dilgen.spec import load_spec

    dev = torch.device("cpu" if args.dry_run_cpu else "cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("aot_proof: no CUDA device (use --dry-run-cpu to test the script)")
    cache_dir = Path(os.environ.get("DILGEN_CACHE_DIR", str(Path.home() / ".cache" / "dilgen")))
    result = {
        "mode": args.mode, "python": platform.python_version(), "torch": torch.__version__,
        "triton": triton.__version__, "dilgen": dilgen.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu (dry run)",
        "cache_dir": str(cache_dir), "artifacts_in_cache": _count_artifacts(cache_dir),
        "aot_enabled": aot.enabled(), "specs": [],
    }
    launcher = {"launcher_stubs": 0, "launcher_stub_s": 0.0}
    aot.reset_stats()
    seq_lens = [64] if args.dry_run_cpu else args.seq_len
    t_all = time.perf_counter()
    with aot.count_compiles() as compiles, _count_launcher_builds(launcher):
        for path in sorted(Path(args.specs).glob("*.json")):
            spec = load_spec(path)
            if spec.ring_size > 1:
                result["specs"].append({"spec": spec.name, "skipped": "ring_size > 1"})
                continue
            kernel = dilgen.compile(spec)
            for i, n in enumerate(_seq_lens(spec, seq_lens)):
                row = {"spec": spec.name, "B": args.batch, "N": n}
                before = dict(aot.STATS)
                c0 = compiles["compiles"] + compiles["disk_cache_hits"]
                gen = torch.Generator(device="cpu").manual_seed(args.seed + n)
                dt = getattr(torch, spec.dtype)

                def rnd(*shape):
                    return torch.randn(*shape, generator=gen).to(device=dev, dtype=dt)

                q = rnd(args.batch, n, spec.num_heads, spec.head_dim).requires_grad_(True)
                k = rnd(args.batch, n, spec.num_kv_heads, spec.head_dim).requires_grad_(True)
                v = rnd(args.batch, n, spec.num_kv_heads, spec.head_dim).requires_grad_(True)
                dout = rnd(args.batch, n, spec.num_heads, spec.head_dim)
                _sync(dev)
                t0 = time.perf_counter()
                out, lse = kernel(q, k, v, return_lse=True)
                _sync(dev)
                t1 = time.perf_counter()
                out.backward(dout)
                _sync(dev)
                t2 = time.perf_counter()
                row.update(first_forward_s=t1 - t0, first_backward_s=t2 - t1, first_call_s=t2 - t0)
                # steady state: the same call again
                for t in (q, k, v):
                    t.grad = None
                _sync(dev)
                t3 = time.perf_counter()
                out2 = kernel(q, k, v)
                out2.backward(dout)
                _sync(dev)
                row["second_call_s"] = time.perf_counter() - t3
                row["module_sha256"] = hashlib.sha256(
                    kernel.compiled_for(dev).source.encode()).hexdigest()
                row["aot"] = {key: aot.STATS[key] - before.get(key, 0) for key in aot.STATS}
                row["triton_compiles"] = compiles["compiles"] + compiles["disk_cache_hits"] - c0
                if i == 0 and not args.no_check:
                    ro, rl, rdq, rdk, rdv = _reference(q, k, v, dout, spec, dev)
                    finite = torch.isfinite(rl)
                    errs = {"out": _rel(out.detach(), ro),
                            "lse": (lse.detach()[finite] - rl[finite]).abs().max().item()
                            if finite.any() else 0.0,
                            "dq": _rel(q.grad, rdq), "dk": _rel(k.grad, rdk), "dv": _rel(v.grad, rdv)}
                    same_inf = bool((torch.isfinite(lse.detach()) == finite).all())
                    row["errors"] = errs
                    row["check_passed"] = same_inf and all(errs[e] < TOL[e] for e in TOL)
                    del ro, rl, rdq, rdk, rdv
                result["specs"].append(row)
                del q, k, v, out, lse, out2, dout
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
                print(f"{row['spec']:>22} N={n:<6} first call {row['first_call_s']:.3f} s "
                      f"(fwd {row['first_forward_s']:.3f}, bwd {row['first_backward_s']:.3f}), "
                      f"second {row['second_call_s']:.4f} s, aot launches {row['aot']['aot_launches']}, "
                      f"jit launches {row['aot']['jit_launches']}, triton compiles {row['triton_compiles']}"
                      + (f", check {'ok' if row['check_passed'] else 'FAILED'} {row['errors']}"
                         if "errors" in row else ""), flush=True)
    result["total_s"] = time.perf_counter() - t_all
    result["triton_compiles"] = compiles["compiles"]
    result["triton_disk_cache_hits"] = compiles["disk_cache_hits"]
    result["compiled_kernels"] = sorted(set(compiles["names"]))
    result["aot_stats"] = dict(aot.STATS)
    result["fallbacks"] = list(aot.FALLBACKS)
    result.update(launcher)
    checks = [r.get("check_passed", True) for r in result["specs"]]
    result["checks_passed"] = all(checks)
    jit_total = result["triton_compiles"] + result["triton_disk_cache_hits"]
    if args.mode in ("aot",) and not args.dry_run_cpu:
        result["no_jit_compile"] = jit_total == 0 and result["aot_stats"]["jit_launches"] == 0
        result["passed"] = result["checks_passed"] and result["no_jit_compile"]
    else:
        result["passed"] = result["checks_passed"]
    print(f"mode {args.mode}: triton compiles {jit_total}, aot {result['aot_stats']}, launcher stubs "
          f"{launcher['launcher_stubs']} ({launcher['launcher_stub_s']:.2f} s), "
          f"passed {result['passed']}", flush=True)
    for fb in result["fallbacks"][:10]:
        print(f"  JIT fallback: {fb['kernel']}: {fb['reason']}", flush=True)
    return result


# --------------------------------------------------------------------------- orchestration

def _sub(args, mode: str, cache: str | None, out: Path) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--mode", mode, "--specs", args.specs,
           "--out", str(out), "--batch", str(args.batch), "--seed", str(args.seed)]
    for n in args.seq_len:
        cmd += ["--seq-len", str(n)]
    if cache:
        cmd += ["--cache", cache]
    if args.no_check:
        cmd.append("--no-check")
    if args.dry_run_cpu:
        cmd.append("--dry-run-cpu")
    res = subprocess.run(cmd, cwd=REPO)
    try:
        return json.loads(out.read_text())
    except (OSError, ValueError):
        return {"mode": mode, "passed": False, "error": f"exit {res.returncode}, no result"}


def _cubin_digests(cache_dir: Path) -> dict:
    out = {}
    for man in cache_dir.rglob("manifest.json"):
        try:
            m = json.loads(man.read_text())
        except (OSError, ValueError):
            continue
        if m.get("kind") == "aot-kernel":
            out[m["key"]] = m["files"].get("kernel.cubin")
    return out


def _compare_caches(a: Path, b: Path) -> dict:
    """Artifacts of one key in both caches: are their cubins byte-identical?"""
    da, db = _cubin_digests(a), _cubin_digests(b)
    both = set(da) & set(db)
    return {"keys_there": len(da), "keys_here": len(db), "common_keys": len(both),
            "identical": sum(da[k] == db[k] for k in both),
            "different": sorted(k[:16] for k in both if da[k] != db[k]),
            "note": "informative only: a cubin carries the module's file path as line info, "
                    "so caches at different paths may differ in bytes with the same code"}


def build_here(args, tmp: Path) -> tuple[str, dict]:
    cache = tmp / "built-here"
    env = dict(os.environ, DILGEN_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(tmp / "triton-build"))
    cmd = [sys.executable, "-m", "dilgen.cli", "build", args.specs, "--arch", args.arch]
    for n in args.build_seq_len or []:
        cmd += ["--seq-len", str(n)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    info = {"seconds": time.perf_counter() - t0, "returncode": res.returncode,
            "stdout_tail": res.stdout.strip().splitlines()[-3:], "stderr_tail": res.stderr[-2000:]}
    print(f"build here: {info['seconds']:.1f} s, exit {res.returncode}: {info['stdout_tail']}", flush=True)
    return str(cache), info


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("aot", "build-here", "jit", "compare"), default="aot")
    p.add_argument("--cache", default=None, help="dilgen cache built elsewhere (DILGEN_CACHE_DIR)")
    p.add_argument("--specs", default=str(REPO / "examples" / "specs"))
    p.add_argument("--seq-len", type=int, action="append", default=None,
                   help="sequence lengths (default 4096 and 16384; the first is checked)")
    p.add_argument("--build-seq-len", type=int, action="append", default=None,
                   help="--seq-len for the build in build-here mode (default: dilgen's)")
    p.add_argument("--arch", default="sm90", help="--arch of the build-here build")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--dry-run-cpu", action="store_true", help="test this script on the CPU")
    p.add_argument("--out", required=True, help="JSON result path")
    args = p.parse_args(argv)
    args.seq_len = args.seq_len or [4096, 16384]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    if args.mode in ("aot", "jit"):
        if args.mode == "aot" and args.cache and not Path(args.cache).is_dir():
            raise SystemExit(f"aot_proof: --cache {args.cache}: no such folder")
        result = run_worker(args)
    else:
        tmp = Path(tempfile.mkdtemp(prefix="aot-proof-"))
        result = {"mode": args.mode, "runs": {}}
        if args.mode == "compare" and args.cache:
            result["runs"]["aot"] = _sub(args, "aot", args.cache, tmp / "aot.json")
        cache, info = build_here(args, tmp)
        result["build_here"] = info
        run = _sub(args, "aot", cache, tmp / "built-here.json") if info["returncode"] == 0 else \
            {"passed": False, "error": "build failed"}
        result["runs"]["aot_built_here"] = run
        if args.mode == "compare":
            result["runs"]["jit"] = _sub(args, "jit", tempfile.mkdtemp(prefix="aot-proof-jit-"),
                                         tmp / "jit.json")
        if args.mode == "compare" and args.cache:
            result["same_cubins"] = _compare_caches(Path(args.cache), Path(cache))
            print(f"cubins built on the other machine vs here: {result['same_cubins']}", flush=True)
        result["passed"] = all(r.get("passed", False) for r in result["runs"].values())
        for name, r in result["runs"].items():
            firsts = {f"{s['spec']}@{s['N']}": round(s["first_call_s"], 3)
                      for s in r.get("specs", []) if "first_call_s" in s}
            print(f"[{name}] passed {r.get('passed')}, triton compiles "
                  f"{r.get('triton_compiles')}, first calls (s) {firsts}", flush=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {out}", flush=True)
    return 0 if result.get("passed") else 1


if __name__ == "__main__":
    sys.exit(main())
