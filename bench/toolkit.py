"""The bench toolkit: what every script in bench/ shares.

- the configs A-F (and their toy twins for --dry-run-cpu) and their specs and useful FLOPs;
- timing: CUDA events around each call (synchronised per call), warm-ups, median; wall
  clock on the CPU so that --dry-run-cpu runs the same code;
- a header (device, versions, date) for every result file;
- `Results`: bench/results/<name>-<date>.json, rewritten atomically (temp file +
  os.replace) after every row, optionally merged with the rows of an earlier run;
- a markdown table printer, bar and roofline plots (matplotlib when installed, else a
  message), and a progress line per row (tqdm on a terminal when installed, else a plain
  line).

Nothing here imports dilgen or torch at module import time, so the toolkit is cheap to
import and to test (tests/test_bench_toolkit.py).
"""
from __future__ import annotations

import datetime
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"

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
# the same flow at toy sizes on the CPU (dilgen in Triton's interpreter, the peers' math
# fallbacks): same rates, same orderings, small N and w
DRY_CONFIGS = {
    "A": dict(B=1, H=4, N=128, D=16, ws=[16, 32, 64], rs=[1, 2, 4]),
    "B": dict(B=1, H=4, N=256, D=16, ws=[8, 16, 32, 64, 128], rs=[1, 2, 4, 8, 16]),
    "C": dict(B=2, H=8, N=64, D=16, ws=[8, 16, 32], rs=[1, 2, 4]),
    "D": dict(B=1, H=4, N=128, D=16, ws=[16, 64], rs=[4, 16]),
    "E": dict(B=1, H=4, N=256, D=16, ws=[8, 16, 32, 64, 128], rs=[1, 2, 4, 6, 12]),
    "F": dict(B=1, H=4, N=128, D=16, ws=[16, 32, 64], rs=[1, 2, 4], hilbert={"scope": "segment"}),
}


def config_text(name: str, cfg: dict) -> str:
    """One line: 'A: B1 H16 N32768 D128 w [...] r [...]' (+ Hilbert)."""
    h = cfg.get("hilbert")
    return (f"{name}: B{cfg['B']} H{cfg['H']} N{cfg['N']} D{cfg['D']} w {cfg['ws']} r {cfg['rs']}"
            + (f" hilbert {json.dumps(h)}" if h else ""))


def parse_configs(text: str, configs=CONFIGS) -> list[str]:
    names = [c.strip().upper() for c in text.split(",") if c.strip()]
    bad = [c for c in names if c not in configs]
    if bad:
        raise ValueError(f"unknown config(s) {bad}; choose from {','.join(configs)}")
    return names


def causal_flags(no_causal: bool = False, causal_only: bool = False) -> list[bool]:
    if no_causal and causal_only:
        raise ValueError("--no-causal and --causal-only exclude each other")
    return [False] if no_causal else [True] if causal_only else [False, True]


def make_spec(name: str, cfg: dict, causal: bool, prefix: str = "bench", dtype: str = "bfloat16", **extra):
    """dilgen.Spec of a config (spec name like bench_a_causal)."""
    import dilgen
    return dilgen.Spec(name=f"{prefix}_{name.lower()}_{'causal' if causal else 'full'}", num_heads=cfg["H"],
                       num_kv_heads=cfg.get("Hkv", cfg["H"]), head_dim=cfg["D"], dtype=dtype,
                       segment_lengths=list(cfg["ws"]), dilation_rates=list(cfg["rs"]), causal=causal,
                       hilbert=cfg.get("hilbert"), **extra)


def useful_flops(cfg: dict, causal: bool, fwd_bwd: bool = False) -> float:
    """Σ_i 4·B·H·(N/w_i)·(w_i/r_i)²·D (w_i capped at N), halved when causal; x3.5 fwd+bwd."""
    total = 0.0
    N = cfg["N"]
    for w, r in zip(cfg["ws"], cfg["rs"]):
        w = min(w, N)
        total += 4 * cfg["B"] * cfg["H"] * (N / w) * (w / r) ** 2 * cfg["D"]
    total = total / 2 if causal else total
    return total * 3.5 if fwd_bwd else total


# --------------------------------------------------------------------------- small helpers

def log(msg: str = "") -> None:
    print(msg, flush=True)


def short_err(e: BaseException, limit: int = 400) -> str:
    s = f"{type(e).__name__}: {e}".replace("\n", " ")
    return s if len(s) <= limit else s[:limit - 3] + "..."


def sanitize(obj):
    """JSON-able without NaN/inf (they become null); tuples become lists, keys strings."""
    if isinstance(obj, dict):
        return {str(k): sanitize(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json_atomic(path, obj) -> Path:
    """Write obj as JSON: a temp file beside path, then os.replace (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(sanitize(obj), indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def rel_err(a, b) -> float:
    """‖a − b‖ / ‖b‖ in float64 (on b's device)."""
    a64, b64 = a.detach().to(b.device).double(), b.detach().double()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item()


def lse_diff(lse, ref):
    """(max |lse − ref| where ref is finite, True when both are −inf at the same places and no NaN)."""
    import torch
    lse = lse.detach().to(ref.device, torch.float64)
    ref = ref.detach().double()
    fin = torch.isfinite(ref)
    pattern = bool(torch.equal(torch.isfinite(lse), fin)) and not bool(torch.isnan(lse).any())
    d = (lse[fin] - ref[fin]).abs().max().item() if bool(fin.any()) else 0.0
    return d, pattern


# --------------------------------------------------------------------------- timing

def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, warmup: int = 3, reps: int = 10, device="cuda") -> dict:
    """Times of `reps` calls after `warmup` calls: CUDA events around each call, recorded
    back to back with one synchronisation at the end (as triton.testing.do_bench does), so
    each time is the device time of that call and the host's launch work overlaps the
    device work of the call before (wall clock on the CPU). Every method, dilgen and peers,
    is timed the same way. Returns {median, min, max, n, times}."""
    import torch
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            events.append((s, e))
        torch.cuda.synchronize(device)
        times = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "n": len(times),
            "times": [round(t, 4) for t in times]}


def kernel_times(fn, warmup: int = 3, reps: int = 5, device="cuda", top: int = 14) -> dict:
    """Where the time of `fn` goes (torch.profiler): {kernel name: [ms per call, launches per
    call]} over `reps` calls after `warmup`, longest first (CPU time per op off the GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    _sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(reps):
            fn()
        _sync(device)
    rows = {}
    for e in prof.key_averages():
        t = (getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)) if cuda \
            else e.cpu_time_total
        if t > 0 and e.count > 0:
            rows[e.key[:80]] = [round(t / reps / 1000.0, 4), e.count // reps]
    return dict(sorted(rows.items(), key=lambda kv: -kv[1][0])[:top])


def first_call_s(fn, device="cuda"):
    """(seconds of one call, synchronised; its result): the compile time on a first call."""
    t = time.perf_counter()
    res = fn()
    _sync(device)
    return time.perf_counter() - t, res


def _out_bytes(res) -> int:
    n = 0
    for t in (res if isinstance(res, (tuple, list)) else (res,)):
        if t is not None and hasattr(t, "untyped_storage"):
            n += t.untyped_storage().nbytes()
    return n


def peak_extra_gib(fn, device="cuda"):
    """Peak memory of one call above what was allocated before it (inputs, caches) minus
    the outputs it returns, in GiB; None off CUDA."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    res = fn()
    torch.cuda.synchronize(device)
    extra = torch.cuda.max_memory_allocated(device) - base - _out_bytes(res)
    del res
    return max(extra, 0) / 2**30


def cleanup(device="cuda") -> None:
    import torch
    gc.collect()
    if torch.device(device).type == "cuda":
        try:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001 - a broken context: the next method records it
            pass


def matmul_ceiling(device="cuda", n: int = 8192, dtype=None, warmup: int = 3, reps: int = 10) -> dict:
    """TFLOP/s of one n x n x n matmul on random data (bf16 by default): the machine's
    dense ceiling for the roofline plot. On the CPU (dry run) n is capped at 512."""
    import torch
    dtype = dtype or torch.bfloat16
    device = torch.device(device)
    if device.type != "cuda":
        n = min(n, 512)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    t = time_ms(lambda: a @ b, warmup, reps, device)
    return {"n": n, "dtype": str(dtype).replace("torch.", ""), "ms": t["median"],
            "tflops": 2 * n ** 3 / t["median"] / 1e9, "timing_ms": t}


# --------------------------------------------------------------------------- header, results

def header(device="cuda", dry: bool = False, extra: dict | None = None) -> dict:
    """Device name, versions, date: the top of every result file."""
    import torch
    try:
        import triton
        triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001
        triton_version = f"unavailable ({short_err(e, 80)})"
    try:
        import dilgen
        dilgen_version = getattr(dilgen, "__version__", None)
    except Exception:  # noqa: BLE001
        dilgen_version = None
    h = {"date": datetime.date.today().isoformat(),
         "time": datetime.datetime.now().isoformat(timespec="seconds"),
         "torch": torch.__version__, "triton": triton_version, "python": sys.version.split()[0],
         "dilgen": dilgen_version, "cuda": torch.version.cuda, "dry_run_cpu": bool(dry)}
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        h.update(device=torch.cuda.get_device_name(idx), device_count=torch.cuda.device_count(),
                 capability=list(torch.cuda.get_device_capability(idx)), sm_count=props.multi_processor_count,
                 gpu_memory_gib=round(props.total_memory / 2**30, 1),
                 cudnn=torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
        try:
            h["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            pass
    else:
        h.update(device=f"CPU dry run ({platform.machine()}): numbers meaningless" if dry
                 else f"CPU ({platform.machine()})")
    if extra:
        h.update(extra)
    return h


def result_path(out_dir, name: str, dry: bool = False, date: str | None = None, ext: str = "json") -> Path:
    date = date or datetime.date.today().isoformat()
    return Path(out_dir) / f"{name}-{date}{'-cpu-dryrun' if dry else ''}.{ext}"


class Results:
    """One result file: header fields + "rows", rewritten atomically after every change.

    append=True keeps the rows of an existing file of the same name, except those whose
    `key` fields equal a row added now (a rerun replaces its row), so that several runs
    (say --configs A,B,C then D,E,F) make one file; append=PATH takes the earlier rows from
    PATH instead (an earlier run's file brought along, e.g. from another machine). Lists
    named in `lists` (the checks) are merged the same way."""

    def __init__(self, path, head: dict, key=("config", "causal"), append=False, lists=("check",)):
        self.path = Path(path)
        self.key = tuple(key)
        self.lists = tuple(lists)
        self.data = dict(head)
        self.data.setdefault("rows", [])
        self._t0 = time.time()
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
            self.data["earlier_runs"] = old.get("earlier_runs", []) + [
                {k: old.get(k) for k in ("time", "device", "torch", "triton", "args", "check_passed") if k in old}]
            for k, v in old.items():
                if k not in self.data and k != "rows":
                    self.data[k] = v
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
        out = dict(self.data)
        out["elapsed_s"] = round(time.time() - self._t0, 1)
        out["rows"] = self.all_rows()
        now = {self.row_key(r) for r in self.rows}
        for k, old in self.kept_lists.items():
            out[k] = [r for r in old if self.row_key(r) not in now] + list(self.data.get(k) or [])
        return write_json_atomic(self.path, out)


# --------------------------------------------------------------------------- output

def markdown_table(headers, rows, align=None) -> str:
    """A GitHub markdown table; cells are str()'d (None -> '—'), '|' escaped."""
    def cell(x):
        return "—" if x is None else str(x).replace("|", "\\|").replace("\n", " ")
    align = align or ["---"] * len(headers)
    lines = ["| " + " | ".join(cell(h) for h in headers) + " |", "|" + "|".join(align) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(cell(x) for x in r) + " |")
    return "\n".join(lines)


def fmt(x, spec: str = ".2f", none: str = "—") -> str:
    return none if x is None else format(x, spec)


class Progress:
    """A line per finished row: tqdm's bar on a terminal when tqdm is installed (lines go
    through tqdm.write), else plain lines '[i/n] text'."""

    def __init__(self, total: int, desc: str = ""):
        self.total, self.i, self.desc = total, 0, desc
        self.t0 = time.time()
        self.bar = None
        try:
            from tqdm import tqdm
            if sys.stderr.isatty():
                self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)
        except Exception:  # noqa: BLE001 - no tqdm: plain lines
            self.bar = None

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            log(msg)

    def tag(self) -> str:
        return f"[{min(self.i + 1, self.total)}/{self.total}]"

    def step(self, msg: str = "") -> None:
        """One row done: a line '[i/n] msg  (elapsed)' and the bar moves on."""
        self.i += 1
        self.write(f"[{self.i}/{self.total}] {msg}  ({time.time() - self.t0:.0f} s)")
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def pyplot():
    """matplotlib.pyplot with the Agg backend, or None (with a message) when missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except Exception as e:  # noqa: BLE001
        log(f"matplotlib unavailable ({short_err(e, 80)}): no plot written (pip install matplotlib)")
        return None


NAMES = {"dilgen": "dilgen", "gather_cudnn": "gather+cuDNN", "gather_flash": "gather+FA2",
         "flex": "FlexAttention", "dense": "dense SDPA (reference point)"}
COLORS = {"dilgen": "#d62728", "gather_cudnn": "#1f77b4", "gather_flash": "#17becf",
          "flex": "#2ca02c", "dense": "#7f7f7f"}


def row_label(r: dict) -> str:
    return f"{r['config']}{' causal' if r.get('causal') else ''}"


def plot_bars(rows, methods, path, ylabel: str, title: str, field: str = "{m}_ms", log_scale: bool = True):
    """Grouped bars per row (one bar per method with a value); returns the path or None."""
    plt = pyplot()
    if plt is None or not rows:
        return None
    try:
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows) + 3), 5))
        width = 0.8 / len(methods)
        for j, m in enumerate(methods):
            pts = [(i + (j - (len(methods) - 1) / 2) * width, r.get(field.format(m=m)))
                   for i, r in enumerate(rows)]
            pts = [(x, y) for x, y in pts if y]
            if pts:
                ax.bar([x for x, _ in pts], [y for _, y in pts], width, label=NAMES.get(m, m),
                       color=COLORS.get(m), hatch="//" if m == "dense" else None,
                       edgecolor="black" if m == "dense" else "white")
        if log_scale:
            ax.set_yscale("log")
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([row_label(r) for r in rows], fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        log(f"plot: {path}")
        return Path(path)
    except Exception as e:  # noqa: BLE001
        log(f"plot failed: {short_err(e)}")
        return None


def plot_roofline(rows, methods, ceiling_tflops, path, title: str):
    """Useful TFLOP/s per (config, causal) for each method (markers), with the measured
    matmul ceiling as a horizontal line. rows carry useful_tflops_by_method."""
    plt = pyplot()
    if plt is None or not rows:
        return None
    try:
        fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows) + 3), 5))
        markers = {"dilgen": "o", "gather_cudnn": "s", "gather_flash": "D", "flex": "^", "dense": "x"}
        top = ceiling_tflops or 0
        for j, m in enumerate(methods):
            pts = [(i + (j - (len(methods) - 1) / 2) * 0.08, (r.get("useful_tflops_by_method") or {}).get(m))
                   for i, r in enumerate(rows)]
            pts = [(x, y) for x, y in pts if y]
            if pts:
                ax.scatter([x for x, _ in pts], [y for _, y in pts], s=60 if m == "dilgen" else 36,
                           marker=markers.get(m, "o"), color=COLORS.get(m), label=NAMES.get(m, m), zorder=3)
                top = max(top, max(y for _, y in pts))
        if ceiling_tflops:
            ax.axhline(ceiling_tflops, color="black", linestyle="--", linewidth=1)
            ax.text(len(rows) - 0.5, ceiling_tflops, f"bf16 matmul ceiling {ceiling_tflops:.3g} TFLOP/s",
                    ha="right", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.12 * top if top else 1)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels([row_label(r) for r in rows], fontsize=8)
        ax.set_ylabel("useful TFLOP/s (same work figure for every method)")
        ax.set_title(title, fontsize=10)
        if ax.get_legend_handles_labels()[0]:     # no method had a value: no legend
            ax.legend(fontsize=8, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        log(f"plot: {path}")
        return Path(path)
    except Exception as e:  # noqa: BLE001
        log(f"plot failed: {short_err(e)}")
        return None


def setup_paths() -> None:
    """Make `import dilgen` (this checkout) and `import peers, toolkit` work from any cwd."""
    for p in (str(REPO), str(HERE)):
        if p not in sys.path:
            sys.path.insert(0, p)
