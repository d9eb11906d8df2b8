"""GeneratedAttention: the `attention` object of a generated module, the one door every
call goes through. It holds the module's kernel functions, their jitted (or interpreted)
kernels and the device tables they read, checks a call's inputs and routes it:

    attention(q, k, v)              -> op.attention_op (torch op: autograd, torch.compile)
    attention(..., cu_seqlens=cu)   -> varlen packing -> op.varlen_attention_op
    attention.padded(q, k, v, mask) -> varlen packing -> op.varlen_attention_op
    attention.decode(q, caches, n)  -> decode.decode
    ring_size > 1                   -> ring.ring_attention / ring.ring_varlen_attention
"""
from __future__ import annotations

import hashlib
import json
import threading
from typing import Any

import torch

from .checks import InputError, check_inputs, check_varlen_inputs
from .curve_rows import block_lists
from .decode import decode
from .dispatch import traced_decode
from .dropout_call import dropout_attention
from .forward import forward_raw, replay_forward
from .launch import make_kernel
from .op import attention_op, needs_grad, plain_eager, varlen_attention_op
from .registry import made
from .replay import lookup, signature
from .ring.op import ring_attention, ring_varlen_attention
from .tables import table_tensors
from .varlen import packing_from_cu_seqlens, packing_from_padding_mask


class GeneratedAttention:
    """The callable of a generated module: `attention(q, k, v, return_lse=False)`.

    q: (B, N, H, D), k and v: (B, N, H_kv, D) of the spec's dtype on one device. Returns
    out (B, N, H, D) and, with return_lse=True, lse (B, H, N) float32 (natural log).
    CUDA tensors run the compiled kernel; CPU tensors run the same source in Triton's
    interpreter.
    """

    def __init__(self, spec: dict, plan: dict, forward_kernel, backward_kernels=None,
                 lane_kernel=None, decode_kernels=None, curve_kernel=None, gluon_kernel=None,
                 gluon_dkdv=None, gluon_dq=None, gluon_lanes=None, gluon_dkdv_lanes=None,
                 gluon_dq_lanes=None, gluon_raster_lanes=None) -> None:
        self.spec = spec
        self.plan = plan
        self._source_fn = forward_kernel
        self.lane_kernel = lane_kernel             # one branch per launch (plan "lanes")
        self.curve_kernel = curve_kernel           # compact curve-ordered rows (curve_rows.py)
        self.gluon_fn = gluon_kernel               # sm90's Gluon forward (@gluon.jit, gluon_launch.py) or None
        self.gluon_dkdv_fn = gluon_dkdv            # sm90's Gluon fused dK/dV (@gluon.jit) or None
        self.gluon_dq_fn = gluon_dq                # sm90's Gluon dQ (@gluon.jit) or None
        self.gluon_lanes_fn = gluon_lanes          # sm90's Gluon lane branches (@gluon.jit) or None
        self.gluon_raster_lanes_fn = gluon_raster_lanes    # beside curve lanes, the raster ones (sm90) or None
        self.gluon_dkdv_lanes_fn = gluon_dkdv_lanes    # sm90's Gluon causal dK/dV per branch or None
        self.gluon_dq_lanes_fn = gluon_dq_lanes        # sm90's Gluon causal lane dq or None
        self.backward_kernels = backward_kernels   # {name: python function} or None
        self.decode_kernels = decode_kernels       # incremental decoding (decode.py) or None
        self._jitted: dict[Any, Any] = {}
        self._device_tensors: dict[tuple, tuple] = {}
        self._replays: dict[tuple, Any] = {}        # call signature -> replay.Recipe (GPU)
        # a plain call may go straight to its recipe: one device, raster rows (replayed)
        self._direct = plan["ring"]["ring_size"] == 1 and plan.get("row_order") is None
        self._lock = threading.Lock()
        self.launches = 0
        self.last_ring_transport = None            # ring specs: the transport of the last call
        # the op registry key: same spec, target and tiles = the same function and kernels
        tiles = hashlib.sha256(json.dumps(plan["config"], sort_keys=True).encode()).hexdigest()[:8]
        self.op_key = f"{spec['name']}@{plan['target']}:{plan['spec_key'][:16]}:{tiles}"
        made(self)

    def __repr__(self) -> str:
        return f"<dilgen attention {self.spec['name']} target={self.plan['target']}>"

    def decode(self, q, k_cache, v_cache, cache_seqlens, *, return_lse: bool = False,
               validate: bool = True):
        """Incremental decoding (causal specs; SPEC §3): q (B, T, H, D) new tokens, caches
        (B, N_max, H_kv, D) already holding their keys and values, cache_seqlens (B,) int32
        valid rows per item (new ones included). Returns out (B, T, H, D), the rows
        cache_seqlens[b] - T .. cache_seqlens[b] - 1 of the causal forward over each item's
        prefix, and with return_lse=True lse (B, H, T) float32. Not autograd-aware (see
        dilgen.runtime.decode). validate=False skips the host check T <= cache_seqlens[b] <= N_max: no device-to-host
        copy and no sync (10-42 us a step on an H200 at batch 1-8, and a call that can be
        captured in a CUDA graph; bench/results/decode_host-2026-11-25-h200.json). Unchecked,
        a length past N_max makes the kernels read rows beyond the cache (other memory, or
        an illegal-address fault) and one below T reads rows before the item: the output is
        then unspecified (finite garbage, usually), with no InputError. For loops that track the
        lengths themselves (nn.KVCache, the transformers integration). Under torch.compile the
        call is torch.ops.dilgen.decode and the lengths are checked on the device (a failed
        check is a device-side assert when the graph runs)."""
        if torch.compiler.is_compiling():    # torch.ops.dilgen.decode, lengths checked on the device
            return traced_decode(self.spec, self.op_key, q, k_cache, v_cache, cache_seqlens, return_lse)
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
                    fn = self._jitted[key] = make_kernel(source_fn, interpret)
        return fn

    @property
    def gluon_kernel(self):
        """The Gluon forward as launched on a GPU: its `dilgen build` binary where there is
        one, else Gluon's JIT (aot.run.launcher), made on first use; None without one."""
        return self._gluon("gluon", self.gluon_fn)

    @property
    def gluon_dkdv_kernel(self):
        """The Gluon dK/dV as launched on a GPU (as gluon_kernel); None without one."""
        return self._gluon("gluon_dkdv", self.gluon_dkdv_fn)

    @property
    def gluon_dq_kernel(self):
        """The Gluon dQ as launched on a GPU (as gluon_kernel); None without one."""
        return self._gluon("gluon_dq", self.gluon_dq_fn)

    @property
    def gluon_lanes_kernel(self):
        """The Gluon lane branches as launched on a GPU (as gluon_kernel); None without one."""
        return self._gluon("gluon_lanes", self.gluon_lanes_fn)

    @property
    def gluon_raster_lanes_kernel(self):
        """Beside a plan's Gluon curve lanes, its raster lane branches' Gluon kernel; None without one."""
        return self._gluon("gluon_raster_lanes", self.gluon_raster_lanes_fn)

    @property
    def gluon_dkdv_lanes_kernel(self):
        """The Gluon causal dK/dV per branch as launched on a GPU (as gluon_kernel); None without one."""
        return self._gluon("gluon_dkdv_lanes", self.gluon_dkdv_lanes_fn)

    @property
    def gluon_dq_lanes_kernel(self):
        """The Gluon causal lane dq as launched on a GPU (as gluon_kernel); None without one."""
        return self._gluon("gluon_dq_lanes", self.gluon_dq_lanes_fn)

    def _gluon(self, key: str, fn):
        if fn is None:
            return None
        hit = self._jitted.get(key)
        if hit is None:
            from ..aot.run import launcher
            hit = self._jitted[key] = launcher(fn, fn.fn)
        return hit

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
        key = (n, "tables", str(device))
        hit = self._device_tensors.get(key)
        if hit is None:
            tables = []
            for t in self.plan["tables"]:
                tables.extend(table_tensors(t, n, device))
            hit = self._keep(key, (self._class_order(device), tables))
        return hit

    def _block_lists(self, branch: dict, n: int, tile, device: torch.device, keys_listed: bool = True):
        """runtime.curve_rows.block_lists for a lane tile (rows, keys, ...), built once."""
        key = (n, "lists", branch["index"], tile[0], tile[1], keys_listed, str(device))
        hit = self._device_tensors.get(key)
        if hit is None:
            order = branch["order"] or self.plan["query"]["order"]
            fwd = table_tensors(order, n, device)[0]
            hit = self._keep(key, block_lists(branch, fwd, n, tile[0], tile[1], keys_listed))
        return hit

    KEPT_LENGTHS = 8     # sequence lengths whose tables stay on the device at once

    def _keep(self, key: tuple, value):
        """Keep `value` under `key`, whose first item is a sequence length. The tables of at
        most KEPT_LENGTHS lengths are kept: a new one drops every entry of the length kept
        longest, whatever the number of entries a length has (a causal Hilbert plan keeps up
        to three block lists per branch); the class order, of no length, stays."""
        kept = self._device_tensors
        lengths = list(dict.fromkeys(k[0] for k in kept if isinstance(k[0], int)))
        if key[0] not in lengths and len(lengths) >= self.KEPT_LENGTHS:
            for k in [k for k in kept if k[0] == lengths[0]]:
                del kept[k]
        kept[key] = value
        return value

    def forward_raw(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    packing=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward launches without autograd: (out, lse) (forward.forward_raw)."""
        return forward_raw(self, q, k, v, packing)

    def __call__(self, q, k, v, *, return_lse: bool = False, group=None,
                 chunk_order: str = "contiguous", cu_seqlens=None, max_seqlen: int | None = None,
                 dropout_p: float = 0.0):
        if dropout_p and cu_seqlens is None and max_seqlen is None:   # attention dropout (dropout_call.py)
            if self.plan["ring"]["ring_size"] > 1:      # every transport of the ring draws the coins
                return ring_attention(self, q, k, v, group=group, return_lse=return_lse,
                                      chunk_order=chunk_order, dropout_p=dropout_p)
            self._dropout_ready(group, chunk_order)
            check_inputs(self.spec, q, k, v)
            return dropout_attention(self, q, k, v, dropout_p, return_lse=return_lse)
        if self._direct and cu_seqlens is None and max_seqlen is None and group is None \
                and chunk_order == "contiguous":
            hit = self._replayed(q, k, v)
            if hit is not None:
                return hit if return_lse else hit[0]
        if cu_seqlens is not None:
            return self.varlen(q, k, v, cu_seqlens, max_seqlen=max_seqlen, return_lse=return_lse,
                               group=group, chunk_order=chunk_order, dropout_p=dropout_p)
        if max_seqlen is not None:
            raise InputError(f"{self.spec['name']}: max_seqlen goes with cu_seqlens (packed batches)")
        ring = self.plan["ring"]["ring_size"]
        if ring > 1:   # every rank of the group calls with its rows (SPEC §3)
            return ring_attention(self, q, k, v, group=group, return_lse=return_lse,
                                  chunk_order=chunk_order)
        if chunk_order != "contiguous":
            raise InputError(f"{self.spec['name']}: chunk_order applies only to ring_size > 1 specs")
        if group is not None:
            raise InputError(f"{self.spec['name']}: group= applies only to ring_size > 1 specs")
        check_inputs(self.spec, q, k, v)   # eager InputError, before the op's schema checks
        out, lse = attention_op(self, q, k, v)   # torch.ops.dilgen.attention_fwd: autograd, torch.compile
        return (out, lse) if return_lse else out

    def _replayed(self, q, k, v):
        """(out, lse) of a call whose signature was recorded (replay.py), launched with no
        further checks or dispatch: plain CUDA tensors needing no gradient, not traced. The
        recorded call passed check_inputs, which reads only what the signature holds. None
        for any other call."""
        if not (self._replays and plain_eager(q, k, v) and q.is_cuda) or needs_grad(q, k, v):
            return None
        recipe = lookup(self, signature("fwd", (q, k, v)))[0]
        return None if recipe is None else replay_forward(self, recipe, q, k, v)

    def _dropout_ready(self, group, chunk_order) -> None:
        if self.plan["ring"]["ring_size"] == 1 and (group is not None or chunk_order != "contiguous"):
            raise InputError(f"{self.spec['name']}: group= and chunk_order= apply only to ring_size > 1 specs")

    # -- variable-length batches (dilgen.runtime.varlen) --------------------------------------
    def _varlen_ready(self) -> None:
        if self.plan["ring"]["ring_size"] > 1:
            raise InputError(f"{self.spec['name']}: padded batches (key_padding_mask) run on "
                             f"one device; this spec has ring_size = {self.plan['ring']['ring_size']}: "
                             f"on a ring pack the items and call kernel(q, k, v, cu_seqlens=cu) on "
                             f"every rank, or use a ring_size = 1 spec")

    def varlen(self, q, k, v, cu_seqlens, *, max_seqlen: int | None = None, return_lse: bool = False,
               group=None, chunk_order: str = "contiguous", dropout_p: float = 0.0):
        """Packed sequences: q (total, H, D), k and v (total, H_kv, D), cu_seqlens int32 (B + 1)
        offsets (cu[0] = 0, non-decreasing, cu[-1] = total; empty sequences allowed). Sequence b
        is rows cu[b]:cu[b+1] and gets exactly its output alone. Returns out (total, H, D) and,
        with return_lse=True, lse (H, total) float32. Autograd-aware. On a ring spec (ring_size
        P > 1) every rank passes its N/P contiguous rows and the same cu_seqlens over the whole
        row of N rows, and gets back its rows (lse (H, N/P)): see ring.ring_varlen_attention.
        dropout_p > 0: attention dropout, the packed rows drawn as one sequence (dropout_call)."""
        if dropout_p:
            self._dropout_ready(group, chunk_order)
        if self.plan["ring"]["ring_size"] > 1:   # this rank's rows of a packed row
            return ring_varlen_attention(self, q, k, v, cu_seqlens, group=group, max_seqlen=max_seqlen,
                                         return_lse=return_lse, chunk_order=chunk_order, dropout_p=dropout_p)
        if group is not None or chunk_order != "contiguous":
            raise InputError(f"{self.spec['name']}: cu_seqlens does not combine with group= or "
                             f"chunk_order= on a ring_size = 1 spec (one device)")
        total = check_varlen_inputs(self.spec, q, k, v)
        packing = packing_from_cu_seqlens(self.spec["name"], cu_seqlens, total, q.device, max_seqlen)
        if dropout_p:
            out, lse = dropout_attention(self, q, k, v, dropout_p, return_lse=True, packing=packing)
        else:
            out, lse = varlen_attention_op(self, q, k, v, packing)
        return (out, lse) if return_lse else out

    def padded(self, q, k, v, key_padding_mask, *, return_lse: bool = False, dropout_p: float = 0.0):
        """A padded batch: q (B, N, H, D), k and v (B, N, H_kv, D), key_padding_mask (B, N)
        bool, True = padding, each item's tokens one run (left or right padding). Item b is
        computed alone, its segments starting at its first token; padded rows get out = 0,
        lse = -inf and zero gradients. lse is (B, H, N). dropout_p > 0: attention dropout, the
        batch's B x N rows drawn as one packed sequence (dropout_call)."""
        if dropout_p:
            self._dropout_ready(None, "contiguous")
        self._varlen_ready()
        B, N = check_inputs(self.spec, q, k, v)
        packing = packing_from_padding_mask(self.spec["name"], key_padding_mask, B, N, q.device)
        rows = lambda t: t.reshape(B * N, t.shape[2], t.shape[3])   # a view for (B, N, h, D) layouts
        if dropout_p:
            out, lse = dropout_attention(self, rows(q), rows(k), rows(v), dropout_p, return_lse=True,
                                         packing=packing)
        else:
            out, lse = varlen_attention_op(self, rows(q), rows(k), rows(v), packing)
        out = out.view(B, N, q.shape[2], q.shape[3])
        if return_lse:
            return out, lse.view(lse.shape[0], B, N).transpose(0, 1)
        return out
