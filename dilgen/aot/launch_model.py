"""The arguments dilgen.runtime passes to each generated kernel, modelled for a sequence
length N without tensors: what `dilgen build` compiles for.

Pointers are Triton MockTensors (data_ptr() == 0: 16-byte aligned, like torch's
allocations); ints are the real values the runtime passes for contiguous inputs
(B, N, H, D) (dilgen.runtime.forward.forward_raw, runtime.backward.backward_raw). B is not a
kernel argument, so one model covers every batch size. tests/test_aot.py checks that the
model gives exactly the specializations of the runtime's real launches."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Iterable

#: Sequence lengths whose specializations `dilgen build` compiles unless told otherwise.
#: Specializations depend on N only through classes (1, divisible by 16, other; i32/i64),
#: so a handful of lengths covers every N of the same classes.
DEFAULT_SEQ_LENS = tuple(2 ** k for k in range(10, 18))   # 1024 .. 131072


class UnknownParameter(ValueError):
    """A kernel parameter the launch model does not know (a template changed)."""


_Q_LIKE = {"q", "o", "do", "dq"}
_STRIDE = re.compile(r"^stride_(q|k|v|o|do|dq|dk|l)(b|n|h)$")


def _mock(dtype):
    from triton.runtime.jit import MockTensor
    return MockTensor(dtype)       # data_ptr() == 0: 16-byte aligned, like torch's allocations


_DROPOUT_SCALARS = {"drop_cut": lambda ctx: 6554, "drop_pos0": lambda ctx: 0, "drop_scale": lambda ctx: 1.0,
                    "drop_n": lambda ctx: ctx["N"]}


def _gluon_args(plan: dict, role: str, N: int, base: dict) -> tuple:
    """The Gluon forward's, dK/dV's or dQ's arguments at batch 1, as runtime/gluon_launch.py
    makes them (a dropout plan's forward and dQ take its arguments after them)."""
    import torch
    from ..runtime.gluon_launch import gluon_args, gluon_dkdv_args, gluon_dq_args
    x, f32 = _mock(base["dtype"]), _mock(torch.float32)
    if role == "gluon_forward":
        return (*gluon_args(plan, x, x, x, x, f32, 1, N), *_dropout_values(plan, base))
    if role == "gluon_dq":
        return (*gluon_dq_args(plan, x, x, x, x, f32, f32, x, 1, N), *_dropout_values(plan, base))
    return gluon_dkdv_args(plan, x, x, x, x, f32, f32, x, x, 1, N)


def _gluon_packed_args(plan: dict, role: str, N: int, base: dict) -> tuple:
    """The packed Gluon kernels' arguments for a packed call of N rows, as
    runtime/gluon_launch.py makes them (the sequences' starts and lengths are device values)."""
    import torch
    from ..runtime.gluon_packed import gluon_dkdv_packed_args, gluon_dq_packed_args, gluon_packed_args
    x, f32, seqs = _mock(base["dtype"]), _mock(torch.float32), (_mock(torch.int32), _mock(torch.int32))
    if role == "gluon_forward_packed":
        return gluon_packed_args(plan, x, x, x, x, f32, seqs, N)
    if role == "gluon_dq_packed":
        return gluon_dq_packed_args(plan, x, x, x, x, f32, f32, x, seqs, N)
    return gluon_dkdv_packed_args(plan, x, x, x, x, f32, f32, x, x, seqs, N)


def _dropout_values(plan: dict, ctx: dict) -> tuple:
    """A dropout plan's trailing arguments of its Gluon kernels (its `tl` kernels name theirs)."""
    names = ("seed_ptr", "drop_cut", "drop_scale", "drop_n", "drop_pos0", "drop_streams")
    return tuple(_param_value(n, ctx) for n in names) if plan.get("dropout") else ()


def _param_value(name: str, ctx: dict):
    """The value the runtime passes for parameter `name` for inputs (B, N, H, D),
    contiguous (dilgen.runtime.forward.forward_raw, runtime.backward.backward_raw)."""
    import torch
    if name in ctx:                 # launch-specific values first (e.g. DK in k's dtype)
        return ctx[name]
    if name in ("Q", "K", "V", "Out", "DO", "DQ", "DK", "DV", "KC", "VC", "QC", "DOC"):
        return _mock(ctx["dtype"])      # gradients in the inputs' dtype (runtime.backward)
    if name in ("Lse", "Delta", "DLse", "LC", "DC"):
        return _mock(torch.float32)
    if name in ("ClassOrder", "SeqStart", "SeqLen", "CurveBlockCount", "CurveBlocks") or re.fullmatch(r"(Fwd|Inv)\d+", name):
        return _mock(torch.int32)
    # attention dropout (a dropout plan, runtime.dropout_call.dropout_args): the seed and the
    # (heads, branches) streams on the device, the cut and row 0's position (neither
    # specializes: binder.UNSPECIALIZED), the 1 / (1 - p) scale, the counter's N
    if name in ("seed_ptr", "drop_streams"):
        return _mock(torch.int64)
    if name in _DROPOUT_SCALARS:
        return _DROPOUT_SCALARS[name](ctx)
    m = _STRIDE.match(name)
    if m:
        N, H, Hkv, D = ctx["N"], ctx["H"], ctx["Hkv"], ctx["D"]
        t, dim = m.groups()
        if t == "l":
            return {"b": H * N, "h": N}[dim]
        heads = H if t in _Q_LIKE else Hkv
        return {"b": N * heads * D, "n": heads * D, "h": D}[dim]
    raise UnknownParameter(name)


@dataclass(frozen=True)
class Launch:
    role: str               # forward, preprocess, dkdv or dkdv_fused, dq
    source_fn: Callable
    args: tuple
    launch_opts: dict


def kernel_roles(attention) -> list[tuple[str, Callable, dict]]:
    """(role, generated python function, launch options) of a GeneratedAttention."""
    from ..runtime.grids import dkdv_per_branch
    cfg = attention.plan["config"]
    roles = [("forward", attention._source_fn,
              {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})]
    bwd = attention.backward_kernels
    if bwd is not None:
        launch = bwd["config"]["launch"]
        fused = bwd["config"].get("fused_dkdv", False)
        per_branch = any(dkdv_per_branch(attention.plan, fused, gluon)
                         for gluon in {False, bool(cfg.get("gluon_dkdv"))})
        for role in ("preprocess", "dkdv_fused" if fused else None, "dkdv" if per_branch else None,
                     "dq", "dq_lanes" if "dq_lanes" in bwd else None):
            if role is not None:
                roles.append((role, bwd[role], dict(launch[role])))
    if getattr(attention, "lane_kernel", None) is not None:
        roles.insert(1, ("forward_lanes", attention.lane_kernel,
                         {"num_warps": cfg["lane_fwd"][2], "num_stages": cfg["lane_fwd"][3]}))
    if getattr(attention, "curve_kernel", None) is not None:
        roles.insert(1, ("curve_rows", attention.curve_kernel, {"num_warps": 4, "num_stages": 1}))
    # the Gluon kernels (@gluon.jit functions already): forwards after the first role, the rest last
    for role, attr, forward in (("gluon_forward", "gluon_fn", True), ("gluon_dkdv", "gluon_dkdv_fn", False),
                                ("gluon_dq", "gluon_dq_fn", False), ("gluon_lanes", "gluon_lanes_fn", True),
                                ("gluon_raster_lanes", "gluon_raster_lanes_fn", True),
                                ("gluon_dkdv_lanes", "gluon_dkdv_lanes_fn", False),
                                ("gluon_dq_lanes", "gluon_dq_lanes_fn", False),
                                ("gluon_forward_packed", "gluon_packed_fn", True),
                                ("gluon_dkdv_packed", "gluon_dkdv_packed_fn", False),
                                ("gluon_dq_packed", "gluon_dq_packed_fn", False),
                                ("gluon_lanes_packed", "gluon_lanes_packed_fn", True),
                                ("gluon_dkdv_lanes_packed", "gluon_dkdv_lanes_packed_fn", False),
                                ("gluon_dq_lanes_packed", "gluon_dq_lanes_packed_fn", False)):
        fn = getattr(attention, attr, None)
        if fn is not None:
            from ..runtime.gluon_launch import OPTIONS
            roles.insert(1 if forward else len(roles), (role, fn, dict(OPTIONS)))
    return roles


def seq_lens_for(plan: dict, seq_lens: Iterable[int]) -> list[int]:
    """The lengths a plan can run: Hilbert scope 'sequence' takes exactly rows*cols."""
    for t in [*plan.get("tables", []), *([plan["row_order"]] if plan.get("row_order") else [])]:
        if t.get("scope") == "sequence":
            rows, cols = t["grid"]
            return [rows * cols]
    return sorted({int(n) for n in seq_lens if int(n) >= 1})


def predicted_launches(attention, seq_len: int) -> list[Launch]:
    """Every kernel launch of one forward + backward at sequence length `seq_len` (any
    batch: B is not a kernel argument), as the runtime makes them on a GPU, and the Gluon
    kernels of a packed call of `seq_len` rows (the `tl` kernels' VARLEN variants compile on
    first use)."""
    import inspect
    import torch
    from ..runtime.gluon_launch import lane_options
    from ..runtime.grids import dkdv_per_branch, lane_grid, lane_order, lattice_group_tiles
    plan = attention.plan
    N = int(seq_len)
    base = {"N": N, "H": plan["num_heads"], "Hkv": plan["num_kv_heads"], "D": plan["head_dim"],
            "dtype": {"float16": torch.float16, "bfloat16": torch.bfloat16,
                      "float32": torch.float32}[plan["dtype"]],
            "UPCAST": False, "VARLEN": False, "CURVE_ROWS": False}
    lattice = plan["query"]["lattice"]
    kv_row_bytes = 2 * base["D"] * base["dtype"].itemsize  # k and v of a kv head, per position
    out = []

    def add(role, fn, opts, **extra):
        ctx = dict(base, **extra)
        names = list(inspect.signature(fn).parameters)
        out.append(Launch(role, fn, tuple(_param_value(n, ctx) for n in names), opts))

    for role, fn, opts in kernel_roles(attention):
        if role == "forward":
            if not any(not br["lanes"] for br in plan["branches"]):
                continue
            n_t = math.ceil(math.ceil(N / lattice) / plan["config"]["block_m"])
            add(role, fn, opts, num_m_tiles=n_t,
                group_tiles=lattice_group_tiles(plan, n_t, plan["config"]["block_m"], kv_row_bytes))
        elif role in ("gluon_forward", "gluon_dkdv", "gluon_dq"):
            # sm90 takes them for whole segments (runtime/gluon_launch.py); B is in no argument
            # that specializes them (their descriptors' shapes are not specialized)
            if all(N % br["w"] == 0 for br in plan["branches"]):
                out.append(Launch(role, fn, _gluon_args(plan, role, N, base), opts))
        elif role in ("gluon_forward_packed", "gluon_dkdv_packed", "gluon_dq_packed"):
            # a packed call of N rows (runtime/gluon_packed.py _packed_takes: N a multiple of L)
            if N % lattice == 0 and (role == "gluon_forward_packed" or plan["config"].get(role[:-len("_packed")])):
                out.append(Launch(role, fn, _gluon_packed_args(plan, role, N, base), opts))
        elif role in ("gluon_lanes_packed", "gluon_dkdv_lanes_packed", "gluon_dq_lanes_packed"):
            # a packed call of N rows whose sequences cover them; options as the raster lanes'
            opts = dict(lane_options(plan, dkdv=role == "gluon_dkdv_lanes_packed"))
            out.extend(Launch(role, fn, args, opts) for args in _gluon_lanes_packed_args(plan, role, N, base))
        elif role in ("gluon_lanes", "gluon_raster_lanes"):    # per lane branch, as runtime/forward.py launches them
            if all(N % br["w"] == 0 for br in plan["branches"]):
                if role == "gluon_raster_lanes" or not plan["config"].get("gluon_curve_lanes"):
                    opts = dict(lane_options(plan))     # raster rows: maybe with PDL
                out.extend(Launch(role, fn, args, opts) for args in _gluon_lanes_fwd_args(plan, role, N, base))
        elif role in ("gluon_dkdv_lanes", "gluon_dq_lanes"):     # as runtime/backward.py launches them
            if all(N % br["w"] == 0 for br in plan["branches"]):
                opts = dict(lane_options(plan, dkdv=role == "gluon_dkdv_lanes"))
                out.extend(Launch(role, fn, args, opts) for args in _gluon_lanes_bwd_args(plan, role, N, base))
        elif role == "preprocess":      # STEP: Plan.delta_step for fixed-length calls, 1 for packed ones
            for has_dlse in (True, False):
                for step in sorted({1, attention.backward_kernels["config"].get("delta_step", 1)}):
                    add(role, fn, opts, HAS_DLSE=has_dlse, STEP=step)
        elif role == "curve_rows":
            # per curve_rows branch: k and v (kv heads), q and dO, lse and Delta (query heads)
            H, Hkv, D = base["H"], base["Hkv"], base["D"]
            row_pad = plan.get("head_dim_pad") or D     # the kernels' tile width
            rows = (N * Hkv * D, Hkv * D, D) * 2
            qrows = (N * H * D, H * D, D) * 2
            values = (H * N, 1, N) * 2
            for br in plan["branches"]:
                if not br.get("curve_rows"):
                    continue
                for heads, group, strides, row, pad, dtype in (
                        (Hkv, H // Hkv, rows, D, row_pad, base["dtype"]),
                        (H, 1, qrows, D, row_pad, base["dtype"]),
                        (H, 1, values, 1, 1, torch.float32)):
                    names = ("stride_xb", "stride_xn", "stride_xh", "stride_yb", "stride_yn", "stride_yh")
                    add(role, fn, opts, X=_mock(dtype), Y=_mock(dtype), XC=_mock(dtype), YC=_mock(dtype),
                        HEADS=heads, GROUP=group, NSLOT=min(group, br["r"]), ROW=row, ROW_PAD=pad,
                        BRANCH=br["index"], **dict(zip(names, strides)))
        elif role in ("forward_lanes", "dq_lanes"):
            # one launch per lane branch; with no fused kernel the first one writes (ACCUMULATE
            # False), and unless its r is 1 also clears the rows it does not keep (CLEAR_GAPS)
            lanes = lane_order(plan)
            fused_q = any(not br["lanes"] for br in plan["branches"])
            block = plan["config"]["lane_fwd" if role == "forward_lanes" else "lane_dq"][0]
            for n, i in enumerate(lanes):
                br = plan["branches"][i]
                first = n == 0 and not fused_q
                add(role, fn, opts, BRANCH=i, ACCUMULATE=not first, CLEAR_GAPS=i == plan.get("gap_lane"),
                    num_lane_tiles=lane_grid(br, N, block)[1],
                    CURVE_ROWS=bool(br.get("curve_rows")))
        elif role == "dkdv":
            conf = attention.backward_kernels["config"]
            fused = conf.get("fused_dkdv", False)
            # after a Gluon dK/dV (whole segments) every lane branch, after the `tl` fused one the row branches
            gluon = plan["config"].get("gluon_dkdv") and all(N % br["w"] == 0 for br in plan["branches"])
            per_branch = dkdv_per_branch(plan, fused, bool(gluon))
            for n, br in enumerate(per_branch):
                lanes = math.ceil(min(br["w"], N) / br["r"])
                clears = n == 0 and plan.get("dkdv_first_writes", False)   # Plan.dkdv_first_writes
                add(role, fn, opts, BRANCH=br["index"], CURVE_ROWS=bool(br.get("curve_rows")),
                    ACCUMULATE=not clears, CLEAR_GAPS=clears,
                    num_j_tiles=math.ceil(lanes / conf["kv_block_n"]))
        elif role == "dkdv_fused":
            conf = attention.backward_kernels["config"]
            n_kt = math.ceil(math.ceil(N / lattice) / conf["kv_block_n"])
            add(role, fn, opts, num_k_tiles=n_kt,
                group_tiles=lattice_group_tiles(plan, n_kt, conf["kv_block_n"], kv_row_bytes * base["H"] // base["Hkv"]))
        elif role == "dq":
            conf = attention.backward_kernels["config"]
            if not any(not br["lanes"] for br in plan["branches"]):
                continue
            n_t = math.ceil(math.ceil(N / lattice) / conf["dq_block_m"])
            add(role, fn, opts, num_m_tiles=n_t,
                group_tiles=lattice_group_tiles(plan, n_t, conf["dq_block_m"], kv_row_bytes))
    return out


def _gluon_lanes_fwd_args(plan: dict, role: str, N: int, base: dict) -> list[tuple]:
    """The Gluon lane forward's arguments per lane branch it takes, in launch order (an r = 1
    branch first: it writes; else the first clears, Plan.gap_lane): role "gluon_lanes" the
    plan's lane kernel (a curve plan's: its curve branches), "gluon_raster_lanes" beside curve
    lanes the raster ones (KernelConfig.gluon_raster_lanes)."""
    import torch
    from ..gluon_plan import gluon_lane_branch
    from ..runtime.gluon_launch import gluon_curve_lanes_args, gluon_lanes_args
    from ..runtime.grids import lane_order
    mock, out = _mock(base["dtype"]), []
    fused_q = any(not br["lanes"] for br in plan["branches"])
    keys = plan["config"]["gluon_lanes"][0]
    curve = plan["config"].get("gluon_curve_lanes", False)
    for n, i in enumerate(lane_order(plan)):
        br = plan["branches"][i]
        kind = "curve" if curve and br.get("curve_rows") else "raster"
        mine = kind == "curve" or not curve if role == "gluon_lanes" else kind == "raster"
        if not mine or not gluon_lane_branch(br["w"], br["r"], keys):
            continue                                # the `tl` lane kernel, or the other Gluon one
        if kind == "curve":     # curve lanes: q, the table, descriptors over the compact copies
            lists = (_mock(torch.int32),) * 2 if plan["causal"] else ()
            out.append(gluon_curve_lanes_args(plan, mock, mock, mock, mock, _mock(torch.float32),
                                              _mock(torch.int32), 1, N, br, n > 0 or fused_q, lists))
        else:
            out.append(gluon_lanes_args(plan, mock, mock, mock, mock, _mock(torch.float32), 1, N, br,
                                        n > 0 or fused_q, n == 0 and plan.get("gap_lane") is not None,
                                        _dropout_values(plan, base)))
    return out


def _gluon_lanes_bwd_args(plan: dict, role: str, N: int, base: dict) -> list[tuple]:
    """The Gluon backward's launches per branch at length N (batch 1), as runtime/backward.py
    makes them: per branch for dK/dV (the first writes and clears where Plan.dkdv_first_writes is
    on), per lane branch for dq (the first writes unless a fused dq ran, and clears where it is
    Plan.gap_lane); only the branches gluon_lanes_bwd_branch takes (the `tl` kernels run the others)."""
    import torch
    from ..gluon_plan import gluon_lanes_bwd_branch
    from ..runtime.gluon_launch import gluon_dkdv_lanes_args, gluon_dq_lanes_args
    from ..runtime.grids import lane_order
    mock, f32 = _mock({"float16": torch.float16, "bfloat16": torch.bfloat16}[plan["dtype"]]), _mock(torch.float32)
    out = []
    if role == "gluon_dkdv_lanes" and plan["config"].get("gluon_dkdv_lanes"):
        adds_dq = plan["config"].get("gluon_dkdv_dq", False)   # every launch adds (runtime/backward.py)
        writes = plan.get("dkdv_first_writes", False) and not adds_dq
        for n, br in enumerate(plan["branches"]):
            first = n == 0 and writes
            if gluon_lanes_bwd_branch(br["w"], br["r"]):
                out.append(gluon_dkdv_lanes_args(plan, mock, mock, mock, mock, f32, f32, mock, mock, 1, N, br,
                                                 not first, first, _dropout_values(plan, base),
                                                 f32 if adds_dq else None))
    elif role == "gluon_dq_lanes":
        fused_q = any(not br["lanes"] for br in plan["branches"])
        for n, i in enumerate(lane_order(plan)):
            br = plan["branches"][i]
            if gluon_lanes_bwd_branch(br["w"], br["r"]):
                out.append(gluon_dq_lanes_args(plan, mock, mock, mock, mock, f32, f32, mock, 1, N, br,
                                               n > 0 or fused_q, n == 0 and plan.get("gap_lane") is not None,
                                               _dropout_values(plan, base)))
    return out


def _gluon_lanes_packed_args(plan: dict, role: str, N: int, base: dict) -> list[tuple]:
    """A causal plan's Gluon lanes, dK/dV and lane dq over packed rows: per branch they take
    (runtime/gluon_packed.py: at least r rows, not a first launch that clears), in launch
    order, for a packing whose sequences cover the N rows (so first launches write). They also
    model a fixed-length call's branches with r not dividing w, one sequence of N rows a launch
    (gluon_packed.one_sequence_launches)."""
    import torch
    from ..gluon_plan import gluon_rows_lane_branch, gluon_rows_lanes_bwd_branch
    from ..runtime import gluon_packed as gp
    from ..runtime.grids import dkdv_per_branch, lane_order
    x, f32, seqs, out = _mock(base["dtype"]), _mock(torch.float32), (_mock(torch.int32), _mock(torch.int32)), []
    fused = any(not br["lanes"] for br in plan["branches"])
    if role == "gluon_dkdv_lanes_packed":       # the per-branch ones, the first writing (Plan.dkdv_first_writes)
        writes, group = plan.get("dkdv_first_writes", False), plan["num_heads"] // plan["num_kv_heads"]
        for n, br in enumerate(dkdv_per_branch(plan, bool(plan.get("fused_dkdv")), False)):
            first = n == 0 and writes
            if N >= br["r"] and gluon_rows_lanes_bwd_branch(br["w"], br["r"]) and not (first and br["r"] > group):
                out.append(gp.gluon_dkdv_lanes_packed_args(plan, x, x, x, x, f32, f32, x, x, seqs, N, br, not first))
        return out
    for n, i in enumerate(lane_order(plan)):
        br = plan["branches"][i]
        clears = n == 0 and not fused and plan.get("gap_lane") is not None
        if clears or N < br["r"]:
            continue
        if role == "gluon_lanes_packed" and gluon_rows_lane_branch(br["w"], br["r"], plan["config"]["gluon_lanes"][0]):
            out.append(gp.gluon_lanes_packed_args(plan, x, x, x, x, f32, seqs, N, br, n > 0 or fused))
        elif role == "gluon_dq_lanes_packed" and gluon_rows_lanes_bwd_branch(br["w"], br["r"]):
            out.append(gp.gluon_dq_lanes_packed_args(plan, x, x, x, x, f32, f32, x, seqs, N, br, n > 0 or fused))
    return out
