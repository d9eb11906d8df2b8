"""`dilgen compile / build / explain` (SPEC §4). Exit 0 on success, 2 on a bad spec or
bad arguments, with one clear line on stderr."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import cli_io
from .cli_io import import_hint
from .spec import Spec, SpecError, load_spec

EXIT_OK, EXIT_USAGE = 0, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2
        self.exit(EXIT_USAGE, f"dilgen: error: {message} (see `dilgen --help`)\n")


def _target(name: str, newer: list | None = None):
    """The Target of an --arch value; a GPU without a plan of its own (sm89, sm100) gets
    one stderr line saying which plan it takes and why (targets.resolve_arch). `newer`
    collects the names newer than every target."""
    from .targets import resolve_arch
    try:
        target, note, is_newer = resolve_arch(name)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
    if note is not None:
        cli_io.err(f"dilgen: {note}")
    if is_newer and newer is not None:
        newer.append(name)
    return target


def plan_summary(plan, seq_len: int | None = None, cu: list[int] | None = None, dropout_plan=None) -> str:
    """A one-screen summary of a plan, in words (cu: a packed row, for the ring schedule;
    dropout_plan: the spec's plan for attention dropout, whose kernels it names too)."""
    from .kernel_names import kernel_families
    q, cfg = plan.query, plan.config
    lines = [
        f"spec {plan.spec['name']}  (key {plan.spec_key[:12]})  target {plan.target}",
        f"  heads {plan.num_heads} (kv {plan.num_kv_heads}), head_dim {plan.head_dim}, "
        f"{plan.dtype}, {'causal' if plan.causal else 'non-causal'}, scale {plan.scale:.6g}",
        f"  query tiles: lattice L = {q.lattice} (rows u = {q.query_map.text}), "
        f"{q.lattice} class(es), block {cfg.block_m} x {cfg.block_n}, "
        f"{cfg.num_warps} warps, {cfg.num_stages} stages"
        + (f", query order {q.order.name}" if q.order else ""),
    ]
    if q.lattice > 1:
        classes = ", ".join(f"d={d}:{w}" for d, w in zip(q.class_order, q.class_work))
        lines.append(f"  classes (delta: keys per query), longest first: {classes}")
    lines.append("  branches:")
    for b in plan.branches:
        lines.append(
            f"    [{b.index}] w = {b.segment_length:>8}  r = {b.dilation:>3}  key u = {b.key_map.text:<22}"
            f" {'class' if b.keep_map is None else 'row'} membership,"
            f" {'one segment per tile' if b.single_segment else 'tiles span segments'}"
            + (f", table {b.order.name}" if b.order else ""))
    lines.append("  kernels: " + kernel_families(plan))
    if dropout_plan is not None:
        cfg = dropout_plan.config
        loads = [x for x, on in (("forward", cfg.fused_tma), ("backward", cfg.bwd_tma)) if on]
        lines.append("  with attention dropout (dropout_p > 0): " + kernel_families(dropout_plan)
                     + (f"; {' and '.join(loads)} through tensor descriptors" if loads else "")
                     + "; Philox 4x32-7 coins in the kernels, 8 a call in the MMA's column order"
                     " (dilgen.dropout)")
    if seq_len:
        from .stats import useful_flops
        lines.append(f"  at N = {seq_len}: {useful_flops(plan, seq_len) / 1e9:.3f} GFLOP useful "
                     f"per batch element (forward)")
    lines.append(f"  ring: ring_size {plan.ring.ring_size}"
                 + (" (single device)" if plan.ring.ring_size == 1 else ""))
    if plan.ring.ring_size > 1:
        lines.extend(ring_summary(plan, seq_len, cu))
    return "\n".join(lines)


def parse_cu_seqlens(text: str) -> list[int]:
    """`--cu-seqlens 0,3000,10000`: B + 1 offsets, starting at 0, non-decreasing."""
    try:
        cu = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise SpecError(f"--cu-seqlens {text}: give comma-separated integers, e.g. 0,3000,10000") from None
    if len(cu) < 2 or cu[0] != 0:
        raise SpecError(f"--cu-seqlens {text}: give B + 1 >= 2 offsets starting at 0, e.g. 0,3000,10000")
    for i in range(1, len(cu)):
        if cu[i] < cu[i - 1]:
            raise SpecError(f"--cu-seqlens {text}: offset {cu[i]} after {cu[i - 1]}: offsets must be "
                            f"non-decreasing")
    return cu


def ring_summary(plan, seq_len: int | None, cu: list[int] | None = None) -> list[str]:
    """The ring schedule in words, for N = seq_len (default: 64K tokens per rank), or for
    the packed row of offsets cu (kernel(q, k, v, cu_seqlens=cu) on every rank)."""
    from .schedule import ring_schedule, ring_schedule_packed
    P = plan.ring.ring_size
    n = cu[-1] if cu is not None else (seq_len or 65536 * P)
    if n % P:
        return [f"    (N = {n} is not divisible by ring_size {P}: no schedule)"]
    if cu is not None:
        sched = ring_schedule_packed(plan.ring.to_json(), cu)
    else:
        sched = ring_schedule(plan.ring.to_json(), n)
    names = {b.index: f"[{b.index}]" for b in plan.branches}
    what = f"of the packed row of {n} rows" if cu is not None else f"at N = {n}"
    lines = [f"    schedule {what}: {n // P} rows per rank (contiguous chunks); "
             f"branches purely local: {' '.join(names[i] for i in sched['local_only']) or 'none'}"]
    for st in sched["steps"]:
        t = st["offset"]
        if t == 0:
            lines.append("    step 0: every rank, its own keys, all branches")
            continue
        pairs = []
        for j, r in enumerate(st["ranks"]):
            if r["recv"]:
                bits = 0
                for _, _, b in r["launches"]:
                    bits |= b
                branch_list = " ".join(names[i] for i in sorted(names) if bits >> i & 1)
                who = ""
                if cu is not None:
                    seqs = sorted({i for ss in r["seqs"] for i in ss})
                    who = f"; sequence(s) {seqs}" if len(seqs) <= 8 else f"; {len(seqs)} sequences"
                pairs.append(f"{(j - t) % P}->{j} ({branch_list}; 1/{r['stride'][0]} of rows{who})")
        lines.append(f"    step {t}: " + ", ".join(pairs))
    lines.append(f"    bytes sent: {sched['bytes_fraction']:.3f} of the key/value chunks the steps move")
    return lines


def _load(path) -> Spec:
    """A spec file, its errors naming it as the user can open it: relative to the current
    folder as given (`dilgen build baddir` -> baddir/neg.json), not by its bare name."""
    return load_spec(path, source=str(Path(path)))


def _check_out(out: str, name: str) -> None:
    """--out names a folder: refuse an empty name, and a file (or a file above it), in one
    line."""
    if out == "":
        raise SpecError("--out '' names no folder; give one, new or existing (--out . for "
                        "the current folder)")
    path = Path(out)
    for up in (path, *path.parents):
        if os.path.lexists(up):
            if not up.is_dir():
                what = "a symlink to no folder" if up.is_symlink() else "a file"
                where = f"--out {out} is {what}" if up == path else f"--out {out}: {up} is {what}"
                raise SpecError(f"{where}; --out takes a folder (the module is written as "
                                f"<folder>/{name}.py): give a folder, new or existing")
            break


def cmd_compile(args) -> int:
    spec = _load(args.spec)                # a bad spec fails before the heavy imports
    from . import cache
    from .compiler import generated_dir, write_module
    from .fsafe import UnsafePath
    target = _target(args.arch)
    if args.out is not None:
        _check_out(args.out, spec.name)
    try:
        path, plan = write_module(spec, target, args.out)   # --out default: compiler.generated_dir
    except (cache.CacheError, UnsafePath) as exc:   # DILGEN_DUMP_DIR; a link or non-file in the way
        raise SpecError(str(exc)) from None
    except OSError as exc:
        where = args.out if args.out is not None else f"{generated_dir(target)}/ (the default)"
        raise SpecError(f"cannot write the module into {where} ({exc.strerror or exc}"
                        + (f": {exc.filename}" if isinstance(exc.filename, str) else "")
                        + "); give a writable folder with --out") from None
    if args.dump_ir:
        print(plan.dumps())
        cli_io.err(f"wrote {path}")
        return EXIT_OK
    print(f"wrote {path}")
    print(import_hint(path))
    print(plan_summary(plan))
    return EXIT_OK


def cmd_build(args) -> int:
    from . import cache
    with cache.strict():        # the cache is what build makes: no temporary fallback
        return _build(args, cache)


def _build(args, cache) -> int:
    from .compiler import build
    folder = Path(args.specs_dir)
    if not folder.is_dir():
        raise SpecError(f"{folder}: not a folder of spec files")
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise SpecError(f"{folder}: no *.json spec files in it")
    specs = [_load(p) for p in paths]           # validate all before building any
    newer: list[str] = []
    targets = list(dict.fromkeys(_target(a, newer) for a in (args.arch or ["sm90"])))
    reason = cache.unwritable()
    if reason is not None:
        raise SpecError(f"the kernel cache {cache.cache_dir()} is not writable ({reason}); "
                        f"dilgen build fills the cache: set DILGEN_CACHE_DIR to a writable folder")
    jobs = [(s, t) for s in specs for t in targets]
    seq_lens = args.seq_len or None
    built = binaries = cached = repaired = 0
    # ahead-of-time binaries are per architecture: a GPU newer than every target gets the
    # sm90 plan's module, and its kernels compile on first use (a sm90 cubin would not load)
    skipped: list[str] = [f"{name}: no {name} target, so no {name} binaries; its kernels (the "
                          f"sm90 plan) compile on first use" for name in newer]
    from .targets import resolve_arch
    aot = [resolve_arch(a)[0] for a in (args.arch or ["sm90"]) if a not in newer]
    progress = _Progress(jobs, lambda job: f"{job[0].name} [{job[1].name}]")
    for spec, target in progress:
        modules = [build(spec, target)]
        if args.dropout:       # the module a call with dropout_p > 0 runs (dropout_call.dropout_twin)
            modules.append(build(spec, target, {"dropout": True}))
        changed = any(not m.cache_hit for m in modules)
        ahead = target.capability is not None and target in aot   # a GPU target: its kernels ahead of time
        for compiled in (modules if ahead else []):
            report = _compile_ahead(compiled, target, seq_lens, args.jobs, progress.note)
            binaries += report.compiled
            cached += report.cached
            repaired += report.repaired
            skipped += [s for s in report.skipped if s not in skipped]
            changed = changed or report.compiled > 0
        built += changed
    print(_build_summary(len(specs), targets, built, binaries, cached, repaired))
    for line in skipped:
        print(f"not compiled ahead of time (runs through the JIT): {line}")
    return EXIT_OK


def _build_summary(n_specs: int, targets: list, built: int, binaries: int, cached: int,
                   repaired: int) -> str:
    """The last line of `dilgen build`: how many specs were built (a spec is built once per
    target: its generated module, and for a GPU target its kernels' binaries, the cubins)
    and how many binaries were compiled or found in the cache."""
    names = ", ".join(t.name for t in targets)
    total = n_specs * len(targets)
    what = (f"spec(s) for {names}" if len(targets) == 1 else
            f"spec-target pairs ({n_specs} spec(s) x {len(targets)} targets: {names})")
    if built == 0:
        return (f"nothing to do: {total} {what} already in the cache"
                + (f", with their {cached} binaries" if cached else ""))
    line = f"built {built} of {total} {what}; {total - built} up to date"
    if binaries or cached:
        line += (f"; compiled {binaries} binaries ahead of time ({cached} already in the cache"
                 + (f", {repaired} damaged ones rebuilt" if repaired else "") + ")")
    return line


def _compile_ahead(compiled, target, seq_lens, jobs, log):
    """Compile the module's Triton kernels for `target` into the cache (dilgen.aot.build);
    `log` gets a line per binary."""
    from . import aot
    if aot.ptxas_path() is None:
        raise SpecError(f"--arch {target.name}: ahead-of-time compile needs ptxas (shipped in "
                        f"the triton wheel, triton/backends/nvidia/bin); set TRITON_PTXAS_PATH")
    try:
        return aot.compile_for_target(compiled, target, seq_lens=seq_lens, jobs=jobs, log=log)
    except Exception as exc:  # noqa: BLE001 - one line, like every other failure of the CLI
        first = (str(exc).strip().splitlines() or [""])[0]
        raise SpecError(f"{compiled.spec.name} [{target.name}]: ahead-of-time compile failed: "
                        f"{type(exc).__name__}: {first}") from None


class _Progress:
    """Iterate over `items` while showing progress on stdout: a tqdm bar on a terminal when
    tqdm is installed (`pip install dilgen[cli]`), else (a log, a pipe) one plain line per
    item as it starts. `note(text)` reports a step inside the current item (a binary
    compiled): at the bar's end on a terminal, else a line of its own, at once."""

    def __init__(self, items, label=str):
        self.items, self.label, self.bar = list(items), label, None

    def __iter__(self):
        try:
            from tqdm import tqdm
        except ImportError:
            tqdm = None
        total = len(self.items)
        if tqdm is None or not sys.stdout.isatty():
            for i, item in enumerate(self.items, 1):
                print(f"spec {i}/{total}: {self.label(item)}", flush=True)
                yield item
            return
        with tqdm(self.items, total=total, file=sys.stdout, ascii="-#", unit="spec",
                  bar_format="[{bar:30}] {n_fmt}/{total_fmt} {desc} ({elapsed}{postfix})") as bar:
            self.bar = bar
            for item in bar:
                bar.set_description_str(self.label(item))
                bar.set_postfix_str("")
                yield item
        self.bar = None

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)
        else:
            print(f"  {text}", flush=True)


def cmd_explain(args) -> int:
    spec = _load(args.spec)
    from .planner import plan as make_plan
    target = _target(args.arch)
    plan = make_plan(spec, target)
    try:
        dropout_plan = make_plan(spec, target, {"dropout": True})
    except SpecError:       # a spec the dropout plan refuses: its calls with dropout_p > 0 say why
        dropout_plan = None
    cu = parse_cu_seqlens(args.cu_seqlens) if args.cu_seqlens else None
    if cu is not None and args.seq_len is not None:
        raise SpecError("--cu-seqlens and --seq-len: give one (a packed batch has cu_seqlens[-1] rows)")
    pattern = None
    if args.png:       # checked before the plan is printed: a bad --png argument prints nothing
        from .explain import check_png_path, default_seq_len, prepare_pattern
        n = cu[-1] if cu is not None else (args.seq_len or default_seq_len(spec))
        pattern = prepare_pattern(spec, n, heads=args.heads, cu_seqlens=cu)
        check_png_path(args.png)
    print(plan_summary(plan, args.seq_len, cu, dropout_plan))
    if cu is not None:
        from .explain_packed import packed_summary
        print("\n".join(packed_summary(plan, cu)))
    if args.ring is not None:
        from .forecast import forecast_lines
        print("\n".join(forecast_lines(spec, args.seq_len or 65536 * args.ring, args.ring)))
    if pattern is not None:
        from .explain import draw_pattern
        print(f"wrote {draw_pattern(pattern, args.png)}")
    return EXIT_OK


def cmd_calibrate(args) -> int:
    from .calibrate import command
    specs = [_load(path) for path in args.spec]
    if specs and not args.seq_len:
        raise SystemExit("dilgen calibrate --spec needs --seq-len N: the tokens of the ring call to measure for")
    for line in command(args.link_mib, specs, args.seq_len):
        print(line)
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .explain import MAX_DEFAULT
    from .targets import ARCH_HELP
    parser = _Parser(prog="dilgen", description="Compile dilated-attention specs to Triton kernels.")
    parser.add_argument("--version", action="version", version=f"dilgen {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("compile", help="validate, plan and emit generated/<name>.py")
    p.add_argument("spec", help="the spec JSON file")
    p.add_argument("--arch", default="sm90", help=f"the target (default sm90): {ARCH_HELP}")
    p.add_argument("--out", default=None,
                   help="output folder (default generated/ for sm90, generated/<arch>/ for "
                        "another --arch)")
    p.add_argument("--dump-ir", action="store_true", help="print the IR as JSON on stdout")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("build", help="ahead-of-time: every spec of a folder into the cache")
    p.add_argument("specs_dir", help="a folder of spec JSON files (every *.json in it)")
    p.add_argument("--arch", action="append",
                   help=f"target(s), repeatable (default sm90): {ARCH_HELP}")
    p.add_argument("--seq-len", type=int, action="append", default=None,
                   help="compile the kernels' specializations for this sequence length, "
                        "repeatable (default: powers of two 1024..131072)")
    p.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default 1)")
    p.add_argument("--dropout", action="store_true",
                   help="also the kernels a call with dropout_p > 0 runs (the spec's dropout plan)")
    p.set_defaults(func=cmd_build)

    p = sub.add_parser("explain", help="the plan in words, and a picture of the pattern")
    p.add_argument("spec", help="the spec JSON file")
    p.add_argument("--seq-len", type=int, default=None,
                   help="sequence length N: adds the useful GFLOP at N (no such line without "
                        "it), and is the N of a ring spec's schedule (default 65536 per rank) "
                        "and of the --png picture (default two of the longest segments, at "
                        f"most {MAX_DEFAULT}); not with --cu-seqlens")
    p.add_argument("--png", default=None, metavar="FILE.png",
                   help="write a picture of who attends to whom (into a folder that exists)")
    p.add_argument("--heads", type=int, nargs="*", default=None, metavar="H",
                   help="query heads to draw, with --png only (default 0, 1 and the last head)")
    p.add_argument("--cu-seqlens", default=None, metavar="0,N1,N1+N2,...",
                   help="a packed batch (kernel(q, k, v, cu_seqlens=...)): its sequences and tiles")
    p.add_argument("--ring", type=int, default=None, metavar="P",
                   help="the cost model's forecast on 1 .. P GPUs at --seq-len (default 65536 x P): "
                        "transport, ms, efficiency, memory per GPU")
    p.add_argument("--arch", default="sm90", help=f"the target (default sm90): {ARCH_HELP}")
    p.set_defaults(func=cmd_explain)

    p = sub.add_parser("calibrate", help="measure the ring cost model's rates on this machine "
                                         "(under torchrun: every rank, links too)")
    p.add_argument("--link-mib", type=int, default=256, help="MiB per rank of each link measurement (default 256)")
    p.add_argument("--spec", action="append", default=[], metavar="SPEC.json",
                   help="measure this spec's own single-device rate (repeatable; with --seq-len), which the "
                        "cost model then prices its ring calls with, in place of the family rates; "
                        "under torchrun also its ring call's own window factor")
    p.add_argument("--seq-len", type=int, default=None, metavar="N",
                   help="with --spec: the ring call's tokens N (measured on N / P rows per rank)")
    p.set_defaults(func=cmd_calibrate)
    return parser


def main(argv: list[str] | None = None) -> int:
    refused = cli_io.prepare_streams()      # closed, full and ASCII-only streams: cli_io
    parser = build_parser()
    args = parser.parse_args(argv)
    if refused is not None:
        cli_io.err(f"dilgen: error: {refused}")
        return EXIT_USAGE
    seq = getattr(args, "seq_len", None)
    for n in (seq if isinstance(seq, list) else [seq]):    # build takes a list of them
        if n is not None and n < 1:
            parser.error(f"--seq-len {n}: must be >= 1")
    if getattr(args, "jobs", 1) < 1:
        parser.error(f"--jobs {args.jobs}: must be >= 1")
    if getattr(args, "ring", None) is not None and args.ring < 1:
        parser.error(f"--ring {args.ring}: must be >= 1")
    try:
        rc = args.func(args)
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        # the reader left (`dilgen compile ... | head`): stop quietly with the status of a
        # process ended by SIGPIPE; stdout goes to /dev/null so the flush at exit cannot fail
        cli_io.silence(sys.stdout)
        return 128 + 13
    except (SpecError, OSError) as exc:
        cli_io.err(f"dilgen: error: {exc}")
        cli_io.flushed(sys.stdout)          # a full stdout must not fail again at exit
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
