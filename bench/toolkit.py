"""What every script in bench/ shares: the configs A-F (and their toy twins for --dry-run-cpu),
specs and useful FLOPs; the shared options; timing (CUDA events, median; wall clock on the CPU,
so --dry-run-cpu runs the same code), compile time, peak memory; the header of every result
file (device, versions, commit) and `Results`, rewritten atomically after every row; tables,
plots, progress lines. Importing it puts this checkout's dilgen on sys.path, imports no torch.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO, RESULTS = HERE.parent, HERE / "results"
for _p in (str(REPO), str(HERE)):      # `import dilgen` (this checkout) and `import peers` from any cwd
    if _p not in sys.path:
        sys.path.insert(0, _p)

# --------------------------------------------------------------------------- configs
# B, H, N, D; branches (ws, rs); "hilbert" is the spec field (None: raster order).
CONFIGS = {
    "A": dict(B=1, H=16, N=32768, D=128, ws=[2048, 4096, 8192], rs=[1, 2, 4]),
    "B": dict(B=1, H=16, N=131072, D=128, ws=[2048, 4096, 8192, 16384, 32768], rs=[1, 2, 4, 8, 16]),
    "C": dict(B=2, H=32, N=16384, D=64, ws=[1024, 2048, 4096], rs=[1, 2, 4]),
    "D": dict(B=1, H=16, N=65536, D=128, ws=[4096, 16384], rs=[4, 16]),
    # E: B with LongNet's rates 6 and 12, which do not divide w
    "E": dict(B=1, H=16, N=131072, D=128, ws=[2048, 4096, 8192, 16384, 32768], rs=[1, 2, 4, 6, 12]),
    # F: A with every segment walked along the generalized Hilbert curve of its grid
    "F": dict(B=1, H=16, N=32768, D=128, ws=[2048, 4096, 8192], rs=[1, 2, 4], hilbert={"scope": "segment"}),
}
# the same rates and orderings at toy sizes (dilgen in Triton's interpreter, the peers' math)
DRY_CONFIGS = {
    "A": dict(B=1, H=4, N=128, D=16, ws=[16, 32, 64], rs=[1, 2, 4]),
    "B": dict(B=1, H=4, N=256, D=16, ws=[8, 16, 32, 64, 128], rs=[1, 2, 4, 8, 16]),
    "C": dict(B=2, H=8, N=64, D=16, ws=[8, 16, 32], rs=[1, 2, 4]),
    "D": dict(B=1, H=4, N=128, D=16, ws=[16, 64], rs=[4, 16]),
    "E": dict(B=1, H=4, N=256, D=16, ws=[8, 16, 32, 64, 128], rs=[1, 2, 4, 6, 12]),
    "F": dict(B=1, H=4, N=128, D=16, ws=[16, 32, 64], rs=[1, 2, 4], hilbert={"scope": "segment"}),
}


def parse_configs(text: str, configs=CONFIGS) -> list[str]:
    names = [c.strip().upper() for c in text.split(",") if c.strip()]
    if [c for c in names if c not in configs]:
        raise ValueError(f"unknown config(s) {[c for c in names if c not in configs]}; choose from {','.join(configs)}")
    return names


def causal_flags(no_causal: bool = False, causal_only: bool = False) -> list[bool]:
    if no_causal and causal_only:
        raise ValueError("--no-causal and --causal-only exclude each other")
    return [False] if no_causal else [True] if causal_only else [False, True]


def make_spec(name: str, cfg: dict, causal: bool, prefix: str = "bench", dtype: str = "bfloat16"):
    """dilgen.Spec of a config, bf16 unless told (spec name like bench_a_causal)."""
    import dilgen
    return dilgen.Spec(name=f"{prefix}_{name.lower()}_{'causal' if causal else 'full'}", num_heads=cfg["H"],
                       head_dim=cfg["D"], dtype=dtype, segment_lengths=list(cfg["ws"]),
                       dilation_rates=list(cfg["rs"]), causal=causal, hilbert=cfg.get("hilbert"))


def useful_flops(cfg: dict, causal: bool, fwd_bwd: bool = False) -> float:
    """Σ_i 4·B·H·(N/w_i)·(w_i/r_i)²·D (w_i capped at N), halved when causal (dilgen.stats); x3.5 fwd+bwd."""
    from dilgen.stats import forward_flops
    return forward_flops(cfg["ws"], cfg["rs"], cfg["H"], cfg["D"], causal, cfg["N"], cfg["B"]) * (3.5 if fwd_bwd else 1)


# --------------------------------------------------------------------------- small helpers
def log(msg: str = "") -> None:
    print(msg, flush=True)


def short_err(e: BaseException, limit: int = 400) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s if len(s) <= limit else s[:limit - 3] + "..."


@contextlib.contextmanager
def failsoft(rec: dict, limit: int = 400, **extra):
    """Fail soft: an exception in the block goes into rec (error: short_err, then `extra`), the run goes on."""
    try:
        yield rec
    except Exception as e:  # noqa: BLE001 - recorded; the next row runs
        rec.update(error=short_err(e, limit), **extra)


def sanitize(obj):
    """JSON-able without NaN/inf (they become null); tuples become lists, keys strings."""
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj) if isinstance(obj, Path) else obj


def write_json_atomic(path, obj) -> Path:
    """Write obj as JSON: a temp file beside path, then os.replace (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(sanitize(obj), indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64 (on b's device)."""
    a64, b64 = a.detach().to(b.device).double(), b.detach().double()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item()


def lse_diff(lse, ref):
    """(max |lse − ref| where ref is finite, True when both are −inf at the same places and no NaN)."""
    import torch
    lse, ref = lse.detach().to(ref.device, torch.float64), ref.detach().double()
    fin = torch.isfinite(ref)
    pattern = bool(torch.equal(torch.isfinite(lse), fin)) and not bool(torch.isnan(lse).any())
    return ((lse[fin] - ref[fin]).abs().max().item() if bool(fin.any()) else 0.0), pattern


def quiet() -> None:
    for cat in (DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=cat)
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def no_gpu(dry: bool, script: str, cpu_flag: str = "--dry-run-cpu") -> bool:
    """True (after saying so) when a GPU run was asked for on a machine without CUDA."""
    import torch
    if not dry and not torch.cuda.is_available():
        log(f"{script} needs a CUDA GPU; {cpu_flag} runs the flow on the CPU at toy sizes.")
        return True
    return False


def pick(text, choices, what="--methods") -> list[str]:
    got = [m.strip() for m in str(text).split(",") if m.strip()]
    if [m for m in got if m not in choices]:
        raise SystemExit(f"{what}: choose from {','.join(choices)}")
    return got


SHARED = {      # options several scripts share: dest -> add_argument keywords
    "out": dict(default=str(RESULTS), help="output folder (default bench/results)"),
    "dry_run_cpu": dict(action="store_true", help="the whole flow at toy sizes on the CPU (numbers meaningless)"),
    "no_causal": dict(action="store_true", help="only the non-causal variants"),
    "causal_only": dict(action="store_true", help="only the causal variants"),
    "warmup": dict(type=int, default=None, help="warm-up calls (default 3; dry run 0)"),
    "reps": dict(type=int, default=None, help="timed calls, median taken (default 10; dry run 1)"),
    "append": dict(nargs="?", const=True, default=False, metavar="FILE",
                   help="keep the rows of an earlier run that this run does not redo: today's file in --out or FILE"),
    "seed": dict(type=int, default=0),
    "no_plot": dict(action="store_true", help="write no PNG"),
}


def parser(doc, *shared, methods=(), **changed):
    """An ArgumentParser with `doc` as --help, the SHARED options named (keywords changed per
    dest: reps=dict(default=50)) and --methods (a subset of `methods`, default all)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for dest in shared:
        ap.add_argument("--" + dest.replace("_", "-"), **SHARED[dest] | changed.get(dest, {}))
    if methods:
        ap.add_argument("--methods", default=",".join(methods), help=f"a subset of {','.join(methods)}")
    return ap


# --------------------------------------------------------------------------- timing
def sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, warmup: int = 3, reps: int = 10, device="cuda", alone: bool = False) -> dict:
    """{median, min, max, n, times} ms of `reps` calls after `warmup`: CUDA events around each call,
    recorded back to back, one synchronisation at the end (as triton's do_bench); CPU: wall clock."""
    import torch
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    sync(device)
    marks = []
    for _ in range(reps):
        if alone:   # one call, the GPU idle before it (a model's host time is not hidden)
            sync(device)
        s = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        s.record() if cuda else None
        fn()
        e = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
        e.record() if cuda else None
        marks.append((s, e))
    sync(device)
    times = [s.elapsed_time(e) if cuda else (e - s) * 1e3 for s, e in marks]
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times),
            "times": [round(t, 4) for t in times]}


def first_call_s(fn, device="cuda"):
    """(seconds of one call, synchronised; its result): the compile time on a first call."""
    t = time.perf_counter()
    res = fn()
    sync(device)
    return time.perf_counter() - t, res


def peak_extra_gib(fn, device="cuda", with_peak: bool = False):
    """Peak memory of one call above what was allocated before it minus the outputs it
    returns, in GiB; with_peak: (the peak, the peak minus what was allocated before); None off CUDA."""
    import torch
    if torch.device(device).type != "cuda":
        return None
    gc.collect()
    sync(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    res = fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device)
    if with_peak:
        return peak / 2**30, (peak - base) / 2**30
    outs = sum(t.untyped_storage().nbytes() for t in (res if isinstance(res, (tuple, list)) else (res,))
               if hasattr(t, "untyped_storage"))
    return max(peak - base - outs, 0) / 2**30


def cleanup(device="cuda") -> None:
    import torch
    gc.collect()
    if torch.device(device).type == "cuda":
        with contextlib.suppress(Exception):    # a broken context: the next method records it
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------- header, results
def commit() -> str | None:
    """`git rev-parse --short HEAD` of REPO, + "+dirty" when dilgen/, templates/ or bench/ (its
    results aside) differ from it; without git (a copied tree) $DILGEN_COMMIT, else None."""
    def git(*args):
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=20,
                              check=True).stdout.strip()
    with contextlib.suppress(Exception):        # no git, no repository, a timeout: the fallback
        if (REPO / ".git").exists():
            dirty = git("status", "--porcelain", "--", "dilgen", "templates", "bench", ":(exclude)bench/results")
            return git("rev-parse", "--short", "HEAD") + "+dirty" * bool(dirty)
    return os.environ.get("DILGEN_COMMIT") or None


def header(device="cuda", dry: bool = False, extra: dict | None = None) -> dict:
    """Device name, versions, commit, date: the top of every result file (and of the run's log)."""
    import torch
    import triton
    import dilgen
    h = {"date": datetime.date.today().isoformat(), "time": datetime.datetime.now().isoformat(timespec="seconds"),
         "commit": commit(), "torch": torch.__version__, "triton": triton.__version__,
         "python": sys.version.split()[0], "dilgen": getattr(dilgen, "__version__", None), "cuda": torch.version.cuda,
         "dry_run_cpu": bool(dry)}
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        h.update(device=torch.cuda.get_device_name(idx), device_count=torch.cuda.device_count(),
                 capability=list(torch.cuda.get_device_capability(idx)), sm_count=props.multi_processor_count,
                 gpu_memory_gib=round(props.total_memory / 2**30, 1),
                 cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
        with contextlib.suppress(Exception):
            h["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    else:
        h["device"] = f"CPU{' dry run' * dry} ({platform.machine()}){': numbers meaningless' * dry}"
    log(f"device {h['device']}  torch {h['torch']}  triton {h['triton']}  commit {h['commit']}  date {h['date']}")
    return h | (extra or {})


def result_path(out_dir, name: str, dry: bool = False, date: str | None = None, ext: str = "json",
                tag: str | None = None) -> Path:
    """<out_dir>/<name>-<date>[-cpu-dryrun][-<tag>].<ext>"""
    return Path(out_dir) / (f"{name}-{date or datetime.date.today().isoformat()}{'-cpu-dryrun' * dry}"
                            f"{'-' + tag if tag else ''}.{ext}")


def gpu_tag(name: str) -> str:
    low = name.lower()
    return next((t for t in ("h200", "h100", "a100", "b200") if t in low), None) or \
        "".join(c for c in low if c.isalnum())[:16] or "gpu"


class Results:
    """One result file: header fields + "rows", rewritten atomically after every change. append=True
    keeps the rows of the existing file except those whose `key` fields equal a row added now (a
    rerun replaces its row); append=PATH takes them from PATH; the `lists` (checks) merge alike."""

    def __init__(self, path, head: dict, key=("config", "causal"), append=False, lists=("check",)):
        self.path, self.key, self.lists, self._t0 = Path(path), tuple(key), tuple(lists), time.time()
        self.data = {"rows": []} | dict(head)
        self.kept, self.kept_lists = [], {}
        source = self.path if append is True else Path(append) if append else None
        if source is not None and source.exists():
            try:
                old = json.loads(source.read_text())
            except (OSError, ValueError) as e:
                log(f"--append: cannot read {source} ({short_err(e, 120)}); starting a new file")
                old = {}
            self.kept = list(old.get("rows", []))
            self.kept_lists = {k: list(old.get(k) or []) for k in self.lists}
            self.data["earlier_runs"] = old.get("earlier_runs", []) + [{k: old[k] for k in (
                "time", "device", "commit", "torch", "triton", "args", "check_passed") if k in old}]
            self.data |= {k: v for k, v in old.items() if k not in self.data and k != "rows"}
        elif source is not None and append is not True:
            raise FileNotFoundError(f"--append {source}: no such file")
        self.save()

    @property
    def rows(self) -> list:
        return self.data["rows"]

    def row_key(self, row: dict) -> tuple:
        return tuple(json.dumps(row.get(k), sort_keys=True) for k in self.key)

    def add(self, row: dict) -> dict:
        """Append a row (it may still be filled in: call save() again after changes)."""
        self.rows.append(row)
        self.save()
        return row

    def all_rows(self) -> list:
        """The earlier run's rows that were not rerun, then this run's rows."""
        now = {self.row_key(r) for r in self.rows}
        return [r for r in self.kept if self.row_key(r) not in now] + self.rows

    def save(self) -> Path:
        out = dict(self.data, elapsed_s=round(time.time() - self._t0, 1), rows=self.all_rows())
        now = {self.row_key(r) for r in self.rows}
        for k, old in self.kept_lists.items():
            out[k] = [r for r in old if self.row_key(r) not in now] + list(self.data.get(k) or [])
        return write_json_atomic(self.path, out)


# --------------------------------------------------------------------------- output
def markdown_table(headers, rows) -> str:
    """A GitHub markdown table; cells are str()'d (None -> '—'), '|' escaped."""
    def line(cells):
        return "| " + " | ".join("—" if x is None else str(x).replace("|", "\\|").replace("\n", " ")
                                 for x in cells) + " |"
    return "\n".join([line(headers), "|" + "|".join(["---"] * len(headers)) + "|"] + [line(r) for r in rows])


def fmt(x, spec: str = ".2f", none: str = "—") -> str:
    return none if x is None else format(x, spec)


class Progress:
    """A line per finished row: '[i/n] text  (elapsed)'."""

    def __init__(self, total: int):
        self.total, self.i, self.t0 = total, 0, time.time()

    def step(self, msg: str = "") -> None:
        self.i += 1
        log(f"[{self.i}/{self.total}] {msg}  ({time.time() - self.t0:.0f} s)")


NAMES = {"dilgen": "dilgen", "gather_cudnn": "gather+cuDNN", "gather_flash": "gather+FA2", "flex": "FlexAttention",
         "dense": "dense SDPA (reference point)", "cudnn_floor": "cuDNN on gathered lanes (floor)"}
COLORS = {"dilgen": "#d62728", "gather_cudnn": "#1f77b4", "gather_flash": "#17becf", "flex": "#2ca02c",
          "dense": "#7f7f7f", "cudnn_floor": "#bcbd22"}


def figure(path, title, draw, size=(8, 5), ncols=1, dpi=120):
    """One PNG at path: draw(ax) fills the axes (a list of them when ncols > 1), the title (if any)
    goes on top. Returns the path, or None (with a message) without matplotlib or when drawing fails."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        return log(f"matplotlib unavailable ({short_err(e, 80)}): no plot written (pip install matplotlib)")
    try:
        fig, ax = plt.subplots(1, ncols, figsize=size)
        draw(ax)
        if title:
            (fig.suptitle if ncols > 1 else ax.set_title)(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
        plt.close(fig)
        log(f"plot: {path}")
        return Path(path)
    except Exception as e:  # noqa: BLE001
        log(f"plot failed: {short_err(e)}")


def plot_bars(rows, methods, path, ylabel: str, title: str, field="{m}_ms", log_scale: bool = True, extra=None):
    """Grouped bars per row, one per method with a value (row[field.format(m)], or field(row, m));
    extra(ax) draws more. Returns the path or None."""
    value = field if callable(field) else lambda r, m: r.get(field.format(m=m))

    def draw(ax):
        width = 0.8 / len(methods)
        for j, m in enumerate(methods):
            pts = [(i + (j - (len(methods) - 1) / 2) * width, value(r, m)) for i, r in enumerate(rows)]
            if [y for _, y in pts if y]:
                ax.bar([x for x, y in pts if y], [y for _, y in pts if y], width, label=NAMES.get(m, m),
                       color=COLORS.get(m), hatch="//" if m == "dense" else None,
                       edgecolor="black" if m == "dense" else "white")
        ax.set(yscale="log" if log_scale else "linear", ylabel=ylabel)
        ax.legend(fontsize=8)
        ax.grid(axis="y", which="both", alpha=0.3)
        ax.set_xticks(range(len(rows)))       # one position per row: "A", "A causal", ...
        ax.set_xticklabels([f"{r['config']}{' causal' if r.get('causal') else ''}" for r in rows], fontsize=8)
        extra(ax) if extra else None
    return figure(path, title, draw, (max(8, 1.1 * len(rows) + 3), 5)) if rows else None
