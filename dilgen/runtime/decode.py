"""Incremental decoding with a KV cache (issue 15; SPEC §3 "Incremental decoding"): input
checks and the launches of a generated module's decode kernels (templates/decode.py.jinja).

`decode(attention, q, k_cache, v_cache, cache_seqlens)`: q (B, T, H, D) holds T new tokens
per item; k_cache, v_cache (B, N_max, H_kv, D) already hold their keys and values;
cache_seqlens (B,) int32 counts each item's valid rows, new ones included. The new tokens
sit at positions cache_seqlens[b] - T .. cache_seqlens[b] - 1, and the result equals those
rows of the causal forward over each item's prefix.

Work per step does not grow with the context: in a branch (w, r) a query reads at most
ceil(w / r) kept keys of its own segment, straight from the cache (no copy, no gather).
Two launches: the split kernel (one program per (item, new token, kv head, chunk of a
branch's kept keys), partial (out, lse) in fp32) and the combine kernel (LongNet Eq. 10).

Not autograd-aware: decoding is inference. With grad mode on and an input that requires
grad, decode raises InputError (call it under torch.no_grad() or torch.inference_mode()).
"""
from __future__ import annotations

from typing import Any

import torch

from .checks import InputError, check_layout, needs_grad
from .launch import RepeatLauncher, poison, run_launches
from .replay import Recorder, enabled, keep, lookup, signature
from .tables import table_tensors

#: The runtime halves the planner's split until the split kernel has at least this many
#: programs per SM (a small batch still fills the GPU), but not below MIN_SPLIT_BLOCKS key
#: blocks: a program's fixed work (its query tile, its partial, the combine's read of it)
#: must stay small beside its keys. H200, bf16, H 32/8, D 128, LongNet's five branches, CUDA
#: graphs (bench/results/decode-2026-11-23-h200.json, split sweep): the best splits were
#: 256-512 at batch 1, 512 at 8, 512-1024 at 16, 2048 at 64; this rule picks 256, 512, 1024, 2048.
PROGRAMS_PER_SM = 9
MIN_SPLIT_BLOCKS = 4

_SM_COUNT: dict[int, int] = {}


def why_no_decode(spec: dict) -> str | None:
    """None if the spec can decode, else the reason (one sentence, with the fix)."""
    name = spec["name"]
    if not spec.get("causal"):
        return (f"{name}: decode needs a causal spec (a new token must not see keys after it); "
                f"this spec has causal = false: set \"causal\": true")
    if spec.get("ring_size", 1) > 1:
        return (f"{name}: decode runs on one device; this spec has ring_size = "
                f"{spec['ring_size']}: use the same spec with ring_size = 1 for generation")
    if spec.get("head_offsets", "mod") != "mod":
        return (f"{name}: decode supports head_offsets \"mod\" (head h keeps offset h mod r) only; "
                f"this spec has head_offsets = \"{spec['head_offsets']}\"")
    hil = spec.get("hilbert")
    if hil is not None and hil.get("scope") == "sequence":
        return (f"{name}: decode does not support Hilbert scope \"sequence\" (the whole sequence is "
                f"one image of fixed size, so a growing prefix has no curve order); use scope "
                f"\"segment\" or no Hilbert order")
    return None


def decode_unsupported(plan: dict) -> str | None:
    """What of a plan the decode kernel (templates/decode.py.jinja) cannot run, or None:
    it tiles head_dim exactly and reads offsets h mod r."""
    if plan.get("head_dim_pad"):
        return f"head_dim = {plan['head_dim']} (not a power of two >= 16)"
    if any(br.get("head_offset") for br in plan["branches"]):
        return 'head_offsets = "block"'
    return None


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    n = _SM_COUNT.get(idx)
    if n is None:
        n = _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return n


def check_decode_inputs(spec: dict, q: Any, k_cache: Any, v_cache: Any, cache_seqlens: Any,
                        validate: bool = True) -> tuple[int, int, int]:
    """(B, T, N_max), or InputError naming what is wrong and how to fix it. With validate,
    also checks T <= cache_seqlens[b] <= N_max for every item (one small copy to the host)."""
    name = spec["name"]
    for label, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache),
                     ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name}: decode: {label} must be a torch.Tensor, got {type(t).__name__}")
    H, Hkv, D = spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    if q.dim() != 4 or tuple(q.shape[2:]) != (H, D):
        raise InputError(f"{name}: decode: q has shape {tuple(q.shape)}; it must be (B, T, {H}, {D}) "
                         f"(T new tokens; num_heads={H}, head_dim={D})")
    B, T = q.shape[0], q.shape[1]
    if B < 1 or T < 1:
        raise InputError(f"{name}: decode: empty q (B = {B}, T = {T}); pass at least one new token")
    for label, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4 or t.shape[0] != B or tuple(t.shape[2:]) != (Hkv, D):
            raise InputError(f"{name}: decode: {label} has shape {tuple(t.shape)}; with q of shape "
                             f"{tuple(q.shape)} it must be ({B}, N_max, {Hkv}, {D}) "
                             f"(num_kv_heads={Hkv})")
    if k_cache.shape != v_cache.shape:
        raise InputError(f"{name}: decode: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} must have the same shape")
    n_max = k_cache.shape[1]
    check_layout(spec, (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)), f"{name}: decode: ",
                 "q, the caches and cache_seqlens")
    if cache_seqlens.dim() != 1 or cache_seqlens.shape[0] != B or cache_seqlens.dtype != torch.int32:
        raise InputError(f"{name}: decode: cache_seqlens must be an int32 tensor of shape ({B},) "
                         f"(valid cache rows per item, new tokens included), got "
                         f"{cache_seqlens.dtype} of shape {tuple(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise InputError(f"{name}: decode: cache_seqlens is on {cache_seqlens.device} but q is on "
                         f"{q.device}; pass cache_seqlens.to({str(q.device)!r})")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k_cache, v_cache)):
        raise InputError(f"{name}: decode is not autograd-aware (it is for generation); call it "
                         f"under torch.no_grad() or torch.inference_mode(), or pass detached tensors")
    if validate:
        check_lengths(name, cache_seqlens, T, n_max)
    return B, T, n_max


def check_lengths(name: str, cache_seqlens: torch.Tensor, T: int, n_max: int) -> None:
    """T <= cache_seqlens[b] <= N_max for every item (one small copy to the host)."""
    for b, n in enumerate(cache_seqlens.tolist()):
        if n < T:
            raise InputError(f"{name}: decode: cache_seqlens[{b}] = {n} < T = {T}: the cache must "
                             f"already hold the keys and values of the {T} new token(s) (append "
                             f"them first; cache_seqlens counts them)")
        if n > n_max:
            raise InputError(f"{name}: decode: cache_seqlens[{b}] = {n} > N_max = {n_max} rows of "
                             f"k_cache/v_cache; allocate a larger cache")


def num_chunks(lanes: list[int], split: int) -> list[int]:
    """Cumulative chunk ends per branch: branch i owns chunks [end_(i-1), end_i)."""
    ends, total = [], 0
    for n in lanes:
        total += -(-n // split)
        ends.append(total)
    return ends


def cache_lanes(plan: dict, config: dict, n_max: int) -> list[int]:
    """The key lanes per branch (chunk order: raster branches, then Hilbert) a query over a
    cache of n_max rows can keep: a raster branch's ceil(min(w, n) / r) with n the power of
    two at or above n_max (so that the chunks follow the cache, not w, and a growing cache
    changes them log2-many times); a Hilbert branch walks curve indices [0, w)."""
    cap = 1 << max(n_max - 1, 0).bit_length()
    raster = [b for b in plan["branches"] if b.get("order") is None]
    return [-(-min(b["w"], cap) // b["r"]) if i < len(raster) else n
            for i, (b, n) in enumerate(zip(raster + [b for b in plan["branches"] if b.get("order") is not None],
                                           config["lanes"]))]


def choose_split(config: dict, rows: int, device: torch.device, lanes: list[int] | None = None) -> int:
    """The planner's split, halved while the split kernel would have fewer than
    PROGRAMS_PER_SM programs per SM, down to MIN_SPLIT_BLOCKS key blocks (GPU only: the
    interpreter runs programs one by one, so fewer is faster there)."""
    split, block = config["split"], config["block_n"]
    lanes = config["lanes"] if lanes is None else lanes
    if device.type != "cuda":
        return split
    want = PROGRAMS_PER_SM * _sm_count(device)
    floor = min(split, MIN_SPLIT_BLOCKS * block)
    while split // 2 >= floor and rows * num_chunks(lanes, split)[-1] < want:
        split //= 2
    return split


def _kernel(attention, fn, interpret: bool):
    """A decode kernel: Triton's interpreter on CPU, triton.jit on CUDA through a
    RepeatLauncher (a step's host time counts once per layer; decode kernels are not in
    `dilgen build`'s ahead-of-time cache, so they skip its lookup)."""
    key = ("decode", fn.__name__, interpret)
    k = attention._jitted.get(key)
    if k is None:
        with attention._lock:
            k = attention._jitted.get(key)
            if k is None:
                if interpret:
                    from triton.runtime.interpreter import InterpretedFunction
                    k = InterpretedFunction(fn)
                else:
                    import triton
                    k = RepeatLauncher(triton.jit(fn))
                attention._jitted[key] = k
    return k


def _curves(attention, device: torch.device) -> list:
    """[Curve, CurveInv] of the Hilbert segment branches (their full-grid curves, curve index
    -> raster offset and back, one after the other in chunk order), built once per device;
    [] when no branch has a curve table."""
    grids = attention.decode_kernels["config"]["curves"]
    if not grids:
        return []
    cache, key = attention._device_tensors, ("decode curves", str(device))   # kept: no length
    hit = cache.get(key)
    if hit is None:
        fwd, inv = [], []
        for rows, cols in grids:
            f, i = table_tensors({"scope": "segment", "grid": [rows, cols]}, rows * cols, device)
            fwd.append(f)
            inv.append(i)
        hit = cache[key] = [torch.cat(fwd), torch.cat(inv)]
    return hit


def _refusal(attention) -> str | None:
    """Why this module cannot decode (one line), or None."""
    spec, plan = attention.spec, attention.plan
    unsupported = decode_unsupported(plan)
    if unsupported:
        return (f"{spec['name']}: decode does not take {unsupported} yet (issue 16): "
                f"run the full forward instead")
    why = why_no_decode(spec)
    if why is None and attention.decode_kernels is None:
        why = (f"{spec['name']}: this generated module has no decode kernels; "
               f"re-run `dilgen compile` with this version of dilgen")
    return why


def decode(attention, q, k_cache, v_cache, cache_seqlens, *, return_lse: bool = False,
           validate: bool = True, split: int | None = None, keep_scratch: bool = True):
    """See the module docstring and GeneratedAttention.decode (what validate=False leaves
    unchecked). `split` (kept keys per program) overrides the runtime's choice (tests,
    benchmarks). keep_scratch=False allocates the partials afresh (torch.ops.dilgen.decode:
    inductor's CUDA graphs refuse a tensor of their pool kept alive past the graph's outputs)."""
    spec, plan = attention.spec, attention.plan
    refusal = attention.__dict__.get("_decode_refusal", False)
    if refusal is False:
        refusal = attention.__dict__["_decode_refusal"] = _refusal(attention)
    if refusal is not None:
        raise InputError(refusal)
    step_key, tensors = None, (q, k_cache, v_cache, cache_seqlens)   # step_key: record this step
    if keep_scratch and split is None and q.is_cuda and enabled() and not needs_grad(q, k_cache, v_cache):
        # a step like an earlier one (what its checks read: shapes, strides, dtypes,
        # devices, alignment) launches what it launched (replay.py)
        step_key = signature("decode", tensors, return_lse)
        recipe, fresh = lookup(attention, step_key)
        if recipe is not None:
            return _replay(attention, recipe, tensors, validate, return_lse)
        step_key = step_key if fresh else None
    B, T, _ = check_decode_inputs(spec, q, k_cache, v_cache, cache_seqlens, validate)
    kernels = attention.decode_kernels
    cfg = kernels["config"]
    H, Hkv, D = plan["num_heads"], plan["num_kv_heads"], plan["head_dim"]
    device = q.device
    interpret = device.type == "cpu"
    if split is not None and split < 1:
        raise InputError(f"{spec['name']}: decode: split = {split}: must be >= 1")
    chunks = attention.__dict__.setdefault("_decode_chunks", {})
    key = (B * T * Hkv, device, split, (k_cache.shape[1] - 1).bit_length())
    hit = chunks.get(key)
    if hit is None:
        if len(chunks) > 64:
            chunks.clear()
        lanes = cache_lanes(plan, cfg, k_cache.shape[1])
        s = choose_split(cfg, B * T * Hkv, device, lanes) if split is None else split
        hit = chunks[key] = (s, num_chunks(lanes, s))
    split, ends = hit
    C = ends[-1]
    out = torch.empty((B, T, H, D), dtype=q.dtype, device=device)
    if interpret or not keep_scratch:
        lse = torch.empty((B, H, T), dtype=torch.float32, device=device)
        out_p = torch.empty((B * T * H, C, D), dtype=torch.float32, device=device)
        lse_p = torch.empty((B * T * H, C), dtype=torch.float32, device=device)
    else:   # partials (and an unreturned lse) in buffers kept per stream: calls on it are ordered
        lse, out_p, lse_p = _scratch(attention, device, (B, T, H, D, C), return_lse)
    poison(out, lse)
    strides = (q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
               k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    split_args = (q, k_cache, v_cache, cache_seqlens, out_p, lse_p, *_curves(attention, device),
                  T, split, C, *ends, *strides, interpret)
    combine_args = (out_p, lse_p, out, lse, T, C,
                    out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1))
    split_kernel = _kernel(attention, kernels["split"], interpret)
    combine_kernel = _kernel(attention, kernels["combine"], interpret)
    grids = ((B * T * Hkv, C), (B * T * H,))
    if interpret:
        run_launches([(split_kernel, grids[0], split_args, {}), (combine_kernel, grids[1], combine_args, {})],
                     interpret)
    elif step_key is not None:
        recorder = Recorder()
        for launcher, grid, a, o in zip((split_kernel, combine_kernel), grids, (split_args, combine_args),
                                        (cfg["launch"]["split"], cfg["launch"]["combine"])):
            recorder.launch(launcher.jit_fn, grid, a, o)
        recipe = recorder.recipe((*tensors, out, lse, out_p, lse_p), attention)
        if recipe is not None:
            recipe.shape = (B, T, H, D, C)      # the step's buffers (_replay)
        keep(attention, step_key, recipe)
    else:
        _launch(attention, (split_kernel, combine_kernel), grids, (split_args, combine_args),
                (cfg["launch"]["split"], cfg["launch"]["combine"]), (T, split, *ends), strides,
                (q, k_cache, v_cache, cache_seqlens, out))
    attention.launches += 1
    return (out, lse) if return_lse else out


def _replay(attention, recipe, tensors, validate: bool, return_lse: bool):
    """decode's outputs and launches for a step whose signature was recorded."""
    B, T, H, D, C = recipe.shape
    q = tensors[0]
    if validate:
        check_lengths(attention.spec["name"], tensors[3], T, tensors[1].shape[1])
    out = torch.empty((B, T, H, D), dtype=q.dtype, device=q.device)
    lse, out_p, lse_p = _scratch(attention, q.device, recipe.shape, return_lse)
    poison(out, lse)
    recipe.run((*tensors, out, lse, out_p, lse_p))
    attention.launches += 1
    return (out, lse) if return_lse else out


def _scratch(attention, device, shape: tuple, fresh_lse: bool):
    """(lse, out_p, lse_p) for a call of `shape` (B, T, H, D, chunks) on the current stream:
    the partials' buffers are kept (every call on a stream runs after the one before), lse
    is fresh when the caller gets it."""
    B, T, H, D, C = shape
    stream = torch._C._cuda_getCurrentRawStream(device.index if device.index is not None
                                                else torch.cuda.current_device())
    keep = attention.__dict__.setdefault("_decode_scratch", {})
    hit = keep.get((stream, shape))
    if hit is None:
        if len(keep) > 16:
            keep.clear()
        hit = keep[(stream, shape)] = (
            torch.empty((B, H, T), dtype=torch.float32, device=device),
            torch.empty((B * T * H, C, D), dtype=torch.float32, device=device),
            torch.empty((B * T * H, C), dtype=torch.float32, device=device))
    lse = torch.empty((B, H, T), dtype=torch.float32, device=device) if fresh_lse else hit[0]
    return lse, hit[1], hit[2]


def _launch(attention, launchers, grids, args, options, sizes, strides, tensors) -> None:
    """The split and combine launches of a step. Their compiled kernels are kept under the
    step's key: what Triton specializes on beyond the module's fixed sizes and dtypes, i.e.
    the strides' divisibility by 16 and equality to 1, their int32 range and the tensors'
    16-byte alignment (sizes, split and chunk ends are exact in the key). A new key goes
    through Triton's binder once (RepeatLauncher.run)."""
    key = (tensors[0].get_device(), sizes, grids, tuple((s & 15 == 0) + 2 * (s == 1) for s in strides),
           max(strides) < 2**31, tuple(t.data_ptr() & 15 == 0 for t in tensors))
    fast = attention.__dict__.setdefault("_decode_fast", {})
    hit = fast.get(key)
    if hit is None:
        hit = tuple(launcher.run(grid, a, o) for launcher, grid, a, o in zip(launchers, grids, args, options))
        if None not in hit:
            fast[key] = hit
        return
    for launcher, kernel, grid, a in zip(launchers, hit, grids, args):
        launcher.launch(kernel, grid, a)


__all__ = ["decode", "check_decode_inputs", "decode_unsupported", "why_no_decode", "choose_split", "num_chunks",
           "PROGRAMS_PER_SM", "MIN_SPLIT_BLOCKS"]
