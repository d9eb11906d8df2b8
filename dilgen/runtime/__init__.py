"""Run generated kernels: input checks, launch (GPU or Triton's interpreter), autograd.

A generated module needs only this package (and torch, triton): it never plans or emits.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import threading
from typing import Any

import torch

from .curve_rows import block_lists, lane_key_args
from .tables import table_tensors

_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_POISON = os.environ.get("DILGEN_POISON", "") not in ("", "0")


class InputError(ValueError):
    """q, k, v (or the call) do not fit the spec; the message says what to change."""


def set_poison(enabled: bool) -> None:
    """Fill fresh outputs with NaN before each launch, so an unwritten row shows (tests)."""
    global _POISON
    _POISON = bool(enabled)


def _check_inputs(spec: dict, q: Any, k: Any, v: Any) -> tuple[int, int]:
    name = spec["name"]
    for label, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}: {label} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name}: {label} must have 4 dims (B, N, heads, head_dim), "
                             f"got shape {tuple(t.shape)}")
    H, Hkv, D = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    B, N = q.shape[0], q.shape[1]
    if tuple(q.shape[2:]) != (H, D):
        raise InputError(f"{name}: q has shape {tuple(q.shape)}; the spec wants (B, N, {H}, {D}) "
                         f"(num_heads={H}, head_dim={D})")
    for label, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (B, N, Hkv, D):
            raise InputError(f"{name}: {label} has shape {tuple(t.shape)}; with q of shape "
                             f"{tuple(q.shape)} it must be ({B}, {N}, {Hkv}, {D}) "
                             f"(num_kv_heads={Hkv})")
    if B < 1 or N < 1:
        raise InputError(f"{name}: empty input (B = {B}, N = {N}); dilated attention needs "
                         f"B >= 1 and N >= 1")
    want = _TORCH_DTYPES[spec["dtype"]]
    for label, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != want:
            raise InputError(f"{name}: {label} has dtype {t.dtype} but the spec says "
                             f"\"{spec['dtype']}\"; pass {label}.to({want}) or change the spec")
        if t.device != q.device:
            raise InputError(f"{name}: q is on {q.device} but {label} is on {t.device}; "
                             f"move all three to one device")
        if t.stride(-1) != 1:
            raise InputError(f"{name}: {label} must be contiguous in head_dim (stride(-1) == 1, "
                             f"got {t.stride(-1)}); pass {label}.contiguous()")
    if q.device.type not in ("cuda", "cpu"):
        raise InputError(f"{name}: tensors on {q.device} are not supported; use a CUDA GPU, "
                         f"or the CPU (Triton's interpreter)")
    return B, N


_INTERPRET_LOCK = threading.RLock()


def _scalar_index(self):
    """A scalar of the interpreter as a Python int (range bounds, indices): its data is an
    array of one element, whatever its rank."""
    data = self.handle.data
    if data.size != 1:
        raise TypeError(f"only a scalar can be an index, got a block of shape {data.shape}")
    return int(data.reshape(-1)[0])


class _interpreting:
    """Run Triton's interpreter in a process where triton was imported without
    TRITON_INTERPRET=1: triton.language's own @jit helpers (tl.max, tl.sum, tl.zeros, ...)
    are then JITFunctions, which the interpreter cannot call; route them through
    InterpretedFunction for the duration of one launch.

    Also: Triton 3.6's interpreter turns a scalar into an index with int() of its
    one-element array, which NumPy 2.4 and later refuse for arrays of rank 1 ("only
    0-dimensional arrays can be converted to Python scalars"); its tensor patch gets an
    __index__ that takes the one element, for the duration of the launch.

    And: the interpreter patches triton.language's builtins for interpreted helpers (tl.max,
    tl.sum, ...) and does not undo the patches of triton.language.core, so a GPU compile later
    in the process failed ("'ir.value' object has no attribute 'dtype'"): the attributes of
    the language modules and classes are saved here and put back on exit."""

    def __enter__(self):
        from triton.runtime import interpreter
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
        _INTERPRET_LOCK.acquire()
        self._cls = JITFunction
        self._saved = JITFunction.__call__
        self._interp = interpreter
        self._saved_patch = getattr(interpreter, "_patch_lang_tensor", None)
        if self._saved_patch is not None:
            original = self._saved_patch

            def patch_lang_tensor(tensor, scope):
                original(tensor, scope)
                scope.set_attr(tensor, "__index__", _scalar_index)

            interpreter._patch_lang_tensor = patch_lang_tensor
        cache: dict[int, Any] = {}

        def call(fn_self, *args, **kwargs):
            wrapped = cache.get(id(fn_self))
            if wrapped is None:
                wrapped = cache[id(fn_self)] = InterpretedFunction(fn_self.fn)
            return wrapped(*args, **kwargs)

        JITFunction.__call__ = call
        self._language = [(obj, dict(vars(obj))) for obj in _language_namespaces()]
        return self

    def __exit__(self, *exc):
        self._cls.__call__ = self._saved
        if self._saved_patch is not None:
            self._interp._patch_lang_tensor = self._saved_patch
        for obj, saved in self._language:
            _restore_namespace(obj, saved)
        _INTERPRET_LOCK.release()
        return False


def _language_namespaces() -> list:
    """The modules and classes of triton.language whose builtins the interpreter patches."""
    import triton.language as tl
    found = [tl, tl.core, tl.math, tl.core.tensor]
    base = getattr(tl.core, "tensor_descriptor_base", None)
    return found + ([base] if base is not None else [])


def _restore_namespace(obj, saved: dict) -> None:
    """Put the attributes of a module or class back as `saved` (its vars() before)."""
    now = vars(obj)
    for name in [n for n in now if n not in saved and not inspect.ismodule(now[n])]:
        delattr(obj, name)      # (a submodule imported meanwhile stays)
    for name, value in saved.items():
        if now.get(name, _MISSING_ATTR) is not value:
            setattr(obj, name, value)


_MISSING_ATTR = object()


_TMA_ALLOCATOR = threading.local()


def _ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors (the lane kernels' TMA loads) need a scratch
    allocator. Triton keeps it per thread (a context variable), and autograd runs the
    backward on its own thread, so it is set once per thread."""
    if not getattr(_TMA_ALLOCATOR, "set", False):
        import triton
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _TMA_ALLOCATOR.set = True


def lane_order(plan: dict) -> list[int]:
    """The lane branches in launch order, as the planner scheduled them (Plan.lane_order:
    an r = 1 branch first, then the others as the spec lists them)."""
    return list(plan.get("lane_order", ()))


def lane_grid(branch: dict, n: int, block_m: int) -> tuple[int, int]:
    """(segments, lane tiles per segment) of a lane kernel launch for one branch."""
    w, r = branch["w"], branch["r"]
    return math.ceil(n / w), math.ceil(math.ceil(min(w, n) / r) / block_m)


def lattice_group_tiles(plan: dict, n_tiles: int, block: int, row_bytes: int) -> int:
    """Tiles per group of a lattice launch (common.lattice_program; grid classes x n_tiles),
    whose tiles span L*block positions and read row_bytes per position (keys and values of
    a kv head; queries and dO of a kv group for dK/dV). A head whose rows fit in half of L2
    (KernelConfig.l2_bytes) keeps one group, class-major (longest class first over the whole
    sequence); a larger one takes groups of a quarter of L2, so every class of a group finds
    the group's rows in L2 (H200, bf16, B: 16 classes of 2048 positions a tile, 64 MB of keys
    and values per head). KernelConfig.lattice_group > 0 fixes it (tuning)."""
    config = plan["config"]
    if config.get("lattice_group"):
        return max(1, min(int(config["lattice_group"]), n_tiles))
    l2 = config.get("l2_bytes", 0)
    tile_bytes = plan["query"]["lattice"] * block * row_bytes
    if not l2 or n_tiles * tile_bytes <= l2 // 2:
        return n_tiles
    return max(1, min(n_tiles, (l2 // 4) // tile_bytes))


def lane_launch_grid(plan: dict, batch_heads: int, n_seg: int, n_tiles: int, varlen: bool) -> tuple:
    """The launch grid of a lane kernel (forward or dq), as common.lane_program reads it:
    packed batches with KernelConfig.lane_tiles_fastest on (B*H * tiles, segments), else
    (B*H, tiles, segments)."""
    if varlen and plan["config"].get("lane_tiles_fastest"):
        return batch_heads * n_tiles, n_seg
    return batch_heads, n_tiles, n_seg


def _check_zero_pad(spec: dict, n: int) -> None:
    """short_segments "zero_pad" (torchscale's padding): refuse its layout slip
    (dilgen.spec.zero_pad_layout_slip) for a sequence of n rows (the longest of a batch)."""
    if spec.get("short_segments") != "zero_pad":
        return
    from ..spec import layout_slip_message
    msg = layout_slip_message(spec["name"], spec["segment_lengths"], spec["dilation_rates"], n)
    if msg:
        raise InputError(msg)


def row_order_tensors(row_order: dict, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fwd, inv) of a plan's row_order (Hilbert scope "sequence", non-causal, one device):
    curve row u is raster row fwd[u], raster row p is curve row inv[p]. The runtime gathers
    q, k, v (and in the backward out, dO, lse) with fwd, runs the kernels on the curve-
    ordered rows, and gathers out, lse (dq, dk, dv) back with inv; built once per length."""
    return table_tensors(row_order, n, device)


def decode_unsupported(plan: dict) -> str | None:
    """What of a plan the decode kernel (templates/decode.py.jinja) cannot run, or None:
    it tiles head_dim exactly and reads offsets h mod r."""
    if plan.get("head_dim_pad"):
        return f"head_dim = {plan['head_dim']} (not a power of two >= 16)"
    if any(br.get("head_offset") for br in plan["branches"]):
        return 'head_offsets = "block"'
    return None


class GeneratedAttention:
    """The callable of a generated module: `attention(q, k, v, return_lse=False)`.

    q: (B, N, H, D), k and v: (B, N, H_kv, D) of the spec's dtype on one device. Returns
    out (B, N, H, D) and, with return_lse=True, lse (B, H, N) float32 (natural log).
    CUDA tensors run the compiled kernel; CPU tensors run the same source in Triton's
    interpreter.
    """

    def __init__(self, spec: dict, plan: dict, forward_kernel, backward_kernels=None,
                 lane_kernel=None, decode_kernels=None, curve_kernel=None) -> None:
        self.spec = spec
        self.plan = plan
        self._source_fn = forward_kernel
        self.lane_kernel = lane_kernel             # one branch per launch (plan "lanes")
        self.curve_kernel = curve_kernel           # compact curve-ordered rows (runtime.curve_rows)
        self.backward_kernels = backward_kernels   # {name: python function} or None
        self.decode_kernels = decode_kernels       # incremental decoding (runtime.decode) or None
        self._jitted: dict[Any, Any] = {}
        self._device_tensors: dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        self.launches = 0
        # the op registry key: same spec, target and tiles = the same function and kernels
        tiles = hashlib.sha256(json.dumps(plan["config"], sort_keys=True).encode()).hexdigest()[:8]
        self.op_key = f"{spec['name']}@{plan['target']}:{plan['spec_key'][:16]}:{tiles}"

    def __repr__(self) -> str:
        return f"<dilgen attention {self.spec['name']} target={self.plan['target']}>"

    def decode(self, q, k_cache, v_cache, cache_seqlens, *, return_lse: bool = False,
               validate: bool = True):
        """Incremental decoding (causal specs; SPEC §3): q (B, T, H, D) new tokens, caches
        (B, N_max, H_kv, D) already holding their keys and values, cache_seqlens (B,) int32
        valid rows per item (new ones included). Returns out (B, T, H, D), the rows
        cache_seqlens[b] - T .. cache_seqlens[b] - 1 of the causal forward over each item's
        prefix, and with return_lse=True lse (B, H, T) float32. Not autograd-aware (see
        dilgen.runtime.decode)."""
        why = decode_unsupported(self.plan)
        if why:
            raise InputError(f"{self.spec['name']}: decode does not take {why} yet (issue 16): "
                             f"run the full forward instead")
        from .decode import decode
        return decode(self, q, k_cache, v_cache, cache_seqlens, return_lse=return_lse,
                      validate=validate)

    # -- kernels ------------------------------------------------------------------------
    def _kernel(self, interpret: bool, source_fn=None):
        """The Triton kernel for a generated function: jitted, or interpreted on CPU."""
        source_fn = source_fn or self._source_fn
        key = (source_fn.__name__, interpret)
        fn = self._jitted.get(key)
        if fn is None:
            with self._lock:
                fn = self._jitted.get(key)
                if fn is None:
                    if interpret:
                        from triton.runtime.interpreter import InterpretedFunction
                        fn = InterpretedFunction(source_fn)
                    else:
                        import triton
                        from ..aot import launcher   # precompiled binary if `dilgen build` made one
                        fn = launcher(triton.jit(source_fn), source_fn)
                    self._jitted[key] = fn
        return fn

    def _class_order(self, device: torch.device) -> torch.Tensor:
        """The fused kernel's query classes, longest work first, on `device` (built once)."""
        key = ("class_order", str(device))
        hit = self._device_tensors.get(key)
        if hit is None:
            hit = self._device_tensors[key] = torch.tensor(
                self.plan["query"]["class_order"], dtype=torch.int32, device=device)
        return hit

    def _launch_tensors(self, n: int, device: torch.device) -> tuple[torch.Tensor, list]:
        """The class order and the Hilbert tables for length n on `device`, built once (a
        host-to-device copy per call would stall the launch queue)."""
        key = (n, str(device))
        hit = self._device_tensors.get(key)
        if hit is None:
            tables = []
            for t in self.plan["tables"]:
                tables.extend(table_tensors(t, n, device))
            if len(self._device_tensors) > 16:
                self._device_tensors.clear()
            hit = self._device_tensors[key] = (self._class_order(device), tables)
        return hit

    def _block_lists(self, branch: dict, n: int, tile, device: torch.device, keys_listed: bool = True):
        """runtime.curve_rows.block_lists for a lane tile (rows, keys, ...), built once."""
        key = ("lists", branch["index"], n, tile[0], tile[1], keys_listed, str(device))
        hit = self._device_tensors.get(key)
        if hit is None:
            order = branch["order"] or self.plan["query"]["order"]
            fwd = table_tensors(order, n, device)[0]
            hit = self._device_tensors[key] = block_lists(branch, fwd, n, tile[0], tile[1], keys_listed)
        return hit

    def forward_raw(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    packing=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward launch without autograd: (out, lse). With a `packing`
        (dilgen.runtime.varlen.Packing), q, k, v are rows (total, heads, D) holding several
        sequences, out is (total, H, D) and lse (H, total); every kernel runs with VARLEN."""
        row_order = self.plan.get("row_order")
        if row_order is not None and packing is None:   # see row_order_tensors
            _check_inputs(self.spec, q, k, v)
            fwd, inv = row_order_tensors(row_order, q.shape[1], q.device)
            out, lse = self._forward(*(x.index_select(1, fwd) for x in (q, k, v)), None)
            return out.index_select(1, inv), lse.index_select(2, inv)
        return self._forward(q, k, v, packing)

    def _forward(self, q, k, v, packing) -> tuple[torch.Tensor, torch.Tensor]:
        plan, cfg = self.plan, self.plan["config"]
        H = plan["num_heads"]
        interpret = q.device.type == "cpu"
        if packing is None:
            B, N = _check_inputs(self.spec, q, k, v)
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
            class_order, tables = self._launch_tensors(N, q.device)
            strides = (q.stride(0), q.stride(1), q.stride(2),
                       k.stride(0), k.stride(1), k.stride(2),
                       v.stride(0), v.stride(1), v.stride(2),
                       out.stride(0), out.stride(1), out.stride(2),
                       lse.stride(0), lse.stride(1))
            groups, varlen, covers_all = [((class_order, class_order), B, N)], False, True
        else:   # program b is sequence b: it moves the row pointers itself, batch strides are 0
            from .varlen import packed_tables
            B, N = packing.num_seqs, packing.max_len
            class_order = self._class_order(q.device)
            out = torch.empty((q.shape[0], H, q.shape[2]), dtype=q.dtype, device=q.device)
            lse = torch.empty((H, q.shape[0]), dtype=torch.float32, device=q.device)
            tables = packed_tables(plan, packing, q.shape[0], q.device)
            strides = (0, q.stride(0), q.stride(1), 0, k.stride(0), k.stride(1),
                       0, v.stride(0), v.stride(1), 0, out.stride(0), out.stride(1), 0, lse.stride(0))
            groups = [((st, ln), int(st.numel()), n) for st, ln, n in packing.groups(H)]
            varlen, covers_all = True, packing.covers_all
        _check_zero_pad(self.spec, N)
        if _POISON:
            out.fill_(float("nan"))
            lse.fill_(float("nan"))
        lattice = plan["query"]["lattice"]
        lanes = lane_order(plan)
        fused = any(not br["lanes"] for br in plan["branches"])
        # the fused kernel, or a first r = 1 lane branch, writes every row of every sequence;
        # otherwise the first lane launch also writes "no branch" (0, -inf) into the rows its
        # branch does not keep (Plan.gap_lane); with padding rows between sequences, fill first
        writes_all = covers_all and (fused or (lanes and plan["branches"][lanes[0]]["r"] == 1))
        clears = covers_all and plan.get("gap_lane") is not None
        if not (writes_all or clears):
            out.zero_()
            lse.fill_(float("-inf"))
        if B == 0 or N == 0:
            return out, lse
        launches = []
        for seqs, B, N in groups:   # packed batches: one group per length class of sequences
            if fused:   # every branch that is not a lane branch
                num_m_tiles = math.ceil(math.ceil(N / lattice) / cfg["block_m"])
                group_tiles = lattice_group_tiles(plan, num_m_tiles, cfg["block_m"], 2 * k.shape[-1] * k.element_size())
                launches.append((self._kernel(interpret), (lattice * num_m_tiles, B * H),
                                 (q, k, v, out, lse, class_order, *tables, N, num_m_tiles, group_tiles, *seqs,
                                  *strides, interpret, varlen),
                                 {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}))
            accumulate, clear = fused or not (writes_all or clears), clears
            for i in lanes:
                br = plan["branches"][i]
                n_seg, n_tiles = lane_grid(br, N, cfg["lane_fwd"][0])
                kv, flag = (), ()
                if self.curve_kernel is not None:   # the plan has curve_rows branches
                    kv, flag = lane_key_args(self, interpret, br, tables, k, v, packing,
                                             cfg["lane_fwd"], class_order)
                launches.append((self._kernel(interpret, source_fn=self.lane_kernel),
                                 lane_launch_grid(plan, B * H, n_seg, n_tiles, varlen),
                                 (q, k, v, *kv, out, lse, *tables, N, n_tiles, *seqs,
                                  *strides, interpret, i, accumulate, clear, varlen, *flag),
                                 {"num_warps": cfg["lane_fwd"][2], "num_stages": cfg["lane_fwd"][3]}))
                accumulate, clear = True, False
        if ((cfg.get("lane_tma") and lanes) or cfg.get("fused_tma")) and not interpret:
            _ensure_descriptor_allocator()
        for kernel, grid, args, opts in launches:
            if interpret:
                with _interpreting():
                    kernel[grid](*args)
            else:
                kernel[grid](*args, **opts)
        self.launches += 1
        return out, lse

    def __call__(self, q, k, v, *, return_lse: bool = False, group=None,
                 chunk_order: str = "contiguous", cu_seqlens=None, max_seqlen: int | None = None):
        if cu_seqlens is not None:
            return self.varlen(q, k, v, cu_seqlens, max_seqlen=max_seqlen, return_lse=return_lse,
                               group=group, chunk_order=chunk_order)
        if max_seqlen is not None:
            raise InputError(f"{self.spec['name']}: max_seqlen goes with cu_seqlens (packed batches)")
        ring = self.plan["ring"]["ring_size"]
        if ring > 1:   # every rank of the group calls with its rows (SPEC §3)
            from .ring import ring_attention
            return ring_attention(self, q, k, v, group=group, return_lse=return_lse,
                                  chunk_order=chunk_order)
        if chunk_order != "contiguous":
            raise InputError(f"{self.spec['name']}: chunk_order applies only to ring_size > 1 specs")
        if group is not None:
            raise InputError(f"{self.spec['name']}: group= applies only to ring_size > 1 specs")
        _check_inputs(self.spec, q, k, v)   # eager InputError, before the op's schema checks
        from .op import attention_op
        out, lse = attention_op(self, q, k, v)   # torch.ops.dilgen.attention_fwd: autograd, torch.compile
        return (out, lse) if return_lse else out

    # -- variable-length batches (dilgen.runtime.varlen) --------------------------------------
    def _varlen_ready(self) -> None:
        if self.plan["ring"]["ring_size"] > 1:
            raise InputError(f"{self.spec['name']}: right-padded batches (key_padding_mask) run on "
                             f"one device; this spec has ring_size = {self.plan['ring']['ring_size']}: "
                             f"on a ring pack the items and call kernel(q, k, v, cu_seqlens=cu) on "
                             f"every rank, or use a ring_size = 1 spec")

    def varlen(self, q, k, v, cu_seqlens, *, max_seqlen: int | None = None, return_lse: bool = False,
               group=None, chunk_order: str = "contiguous"):
        """Packed sequences: q (total, H, D), k and v (total, H_kv, D), cu_seqlens int32 (B + 1)
        offsets (cu[0] = 0, non-decreasing, cu[-1] = total; empty sequences allowed). Sequence b
        is rows cu[b]:cu[b+1] and gets exactly its output alone. Returns out (total, H, D) and,
        with return_lse=True, lse (H, total) float32. Autograd-aware. On a ring spec (ring_size
        P > 1) every rank passes its N/P contiguous rows and the same cu_seqlens over the whole
        row of N rows, and gets back its rows (lse (H, N/P)): see ring.ring_varlen_attention."""
        from .varlen import check_varlen_inputs, packing_from_cu_seqlens
        if self.plan["ring"]["ring_size"] > 1:   # this rank's rows of a packed row
            from .ring import ring_varlen_attention
            return ring_varlen_attention(self, q, k, v, cu_seqlens, group=group, max_seqlen=max_seqlen,
                                         return_lse=return_lse, chunk_order=chunk_order)
        if group is not None or chunk_order != "contiguous":
            raise InputError(f"{self.spec['name']}: cu_seqlens does not combine with group= or "
                             f"chunk_order= on a ring_size = 1 spec (one device)")
        total = check_varlen_inputs(self.spec, q, k, v)
        packing = packing_from_cu_seqlens(self.spec["name"], cu_seqlens, total, q.device, max_seqlen)
        from .op import varlen_attention_op
        out, lse = varlen_attention_op(self, q, k, v, packing)
        return (out, lse) if return_lse else out

    def padded(self, q, k, v, key_padding_mask, *, return_lse: bool = False):
        """A right-padded batch: q (B, N, H, D), k and v (B, N, H_kv, D), key_padding_mask (B, N)
        bool, True = padding. Item b is computed at its own length; padded rows get out = 0,
        lse = -inf and zero gradients. lse is (B, H, N)."""
        from .varlen import packing_from_padding_mask
        self._varlen_ready()
        B, N = _check_inputs(self.spec, q, k, v)
        packing = packing_from_padding_mask(self.spec["name"], key_padding_mask, B, N, q.device)
        rows = lambda t: t.reshape(B * N, t.shape[2], t.shape[3])   # a view for (B, N, h, D) layouts
        from .op import varlen_attention_op
        out, lse = varlen_attention_op(self, rows(q), rows(k), rows(v), packing)
        out = out.view(B, N, q.shape[2], q.shape[3])
        if return_lse:
            return out, lse.view(lse.shape[0], B, N).transpose(0, 1)
        return out
