"""Checks that every rank of a ring call passes or fails together: the process group fits
the spec, and one all_gather of a fingerprint (spec, shapes, dtype, order, local errors)
catches ranks that disagree before any transfer, with the same one-line error everywhere."""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable

import torch

from ...schedule import CHUNK_ORDERS
from ..checks import InputError, check_inputs, check_varlen_inputs
from ..varlen import packing_from_cu_seqlens

_DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


class RingError(InputError):
    """The ranks of a ring call disagree, or the process group does not fit the spec."""


def let_go(tensors, timeout_s: float = 2.0) -> None:
    """Return once no thread of the process group holds a reference to `tensors` (the
    inputs and outputs of a finished collective), or after timeout_s.

    Why: gloo runs a collective on a worker thread (ProcessGroupGloo::runLoop), which
    drops its Work, and with it its references to the tensors, just after wait() returns
    on this thread. A tensor made in Python keeps its Python object alive while C++ holds
    it, so dropping the Work takes the GIL (c10 PyObject preservation:
    TensorImpl::decref_pyobject), once per tensor. If the interpreter is
    already finalizing by then (the call raised and nothing caught it, or the script ended
    right after the collective), Python ends that thread with pthread_exit inside the
    noexcept ~AsyncAllgatherWork: std::terminate, "terminate called without an active
    exception", SIGABRT (seen in a core: ProcessGroupGloo::runLoop -> ~AsyncAllgatherWork ->
    decref_pyobject -> take_gil -> PyThread_exit_thread). Sleeping here releases the GIL, so
    the worker finishes now. The tensors' use counts say when: 1 is this thread's own
    Python reference."""
    deadline = time.monotonic() + timeout_s
    while any(getattr(t, "_use_count", lambda: 1)() > 1 for t in tensors):
        if time.monotonic() > deadline:
            return
        time.sleep(0.0002)


def _group_info(spec: dict, group) -> tuple[int, int, Any]:
    import torch.distributed as dist
    name, P = spec["name"], spec["ring_size"]
    if not (dist.is_available() and dist.is_initialized()):
        raise RingError(f"{name}: ring_size = {P} needs torch.distributed: launch with "
                        f"`torchrun --nproc-per-node {P} ...` and call "
                        f"torch.distributed.init_process_group() first")
    world = dist.get_world_size(group)
    if world != P:
        raise RingError(f"{name}: the process group has {world} ranks but the spec says "
                        f"ring_size = {P}; launch {P} ranks or change ring_size")
    return P, dist.get_rank(group), dist


def _fingerprint(spec: dict, q, k, v, order: str, error: str | None, device,
                 cu: list[int] | None = None) -> torch.Tensor:
    key = int.from_bytes(hashlib.sha256(spec["name"].encode() + b"/" + repr(sorted(
        (k_, str(v_)) for k_, v_ in spec.items())).encode()).digest()[:7], "big")
    def shape(t, i):
        return t.shape[i] if isinstance(t, torch.Tensor) and t.dim() > i else -1
    vals = [key, shape(q, 0), shape(q, 1), shape(q, 2), shape(q, 3), shape(k, 2), shape(k, 1),
            shape(v, 1), _DTYPE_CODE.get(getattr(q, "dtype", None), 0), CHUNK_ORDERS.index(order),
            _cu_key(cu), int(error is not None)]
    return torch.tensor(vals, dtype=torch.int64, device=device)


_FIELDS = ["spec", "batch", "local rows of q", "heads of q", "head_dim", "kv heads",
           "local rows of k", "local rows of v", "dtype", "chunk order", "cu_seqlens",
           "input error"]


def _cu_key(cu: list[int] | None) -> int:
    """A packed row's offsets as one int64 (0: not packed)."""
    if cu is None:
        return 0
    return 1 + int.from_bytes(hashlib.sha256(repr(list(cu)).encode()).digest()[:7], "big")


def _check_packed(spec: dict, q, k, v, order: str, P: int, cu_seqlens, max_seqlen) -> list[int]:
    """A packed row on a ring (SPEC §3): q (N/P, H, D), k, v (N/P, H_kv, D) on every rank, and
    cu_seqlens the offsets over the whole row of N = P x N/P rows. Returns the offsets."""
    name = spec["name"]
    hil = spec.get("hilbert")
    if hil is not None and hil.get("scope") == "sequence":
        raise InputError(f"{name}: hilbert scope 'sequence' fixes N = rows * cols (one image), so "
                         f"a packed sequence of another length has no curve: use scope 'segment'")
    if order != "contiguous":
        raise InputError(f"{name}: a packed row (cu_seqlens) on a ring is split in contiguous "
                         f"chunks: chunk_order must be 'contiguous', got {order!r}")
    n_loc = check_varlen_inputs(spec, q, k, v)
    if (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dtype == torch.int32
            and cu_seqlens.dim() == 1 and cu_seqlens.numel() >= 2):
        total = int(cu_seqlens[-1])
        if total % P:
            raise InputError(f"{name}: cu_seqlens[-1] = {total} packed rows is not divisible by "
                             f"ring_size = {P}: every rank holds N / {P} rows of the row; pad "
                             f"the packed row to a multiple of {P} rows (e.g. one more sequence)")
        if total != n_loc * P:
            raise InputError(f"{name}: cu_seqlens[-1] = {total} but this rank holds {n_loc} rows "
                             f"({P} x {n_loc} = {n_loc * P} in all): cu_seqlens covers the whole "
                             f"packed row and every rank passes its {total // P} rows")
    packing_from_cu_seqlens(name, cu_seqlens, n_loc * P, q.device, max_seqlen)
    return cu_seqlens.tolist()


def _agree(spec: dict, q, k, v, order: str, group, P: int, me: int, dist,
           cu_seqlens=None, max_seqlen=None,
           local_check: Callable[[int], None] | None = None) -> list[int] | None:
    """One all_gather of a small fingerprint: bad inputs or disagreeing ranks raise the
    same error on every rank instead of hanging in a later send. With cu_seqlens (a packed
    row: q, k, v of 3 dims) every rank must pass the same offsets; returns them.
    local_check(local rows) raises InputError for what else this rank cannot run (it
    joins the fingerprint's error bit, so every rank refuses together). Nothing of the
    collective is left pending when this returns or raises (let_go)."""
    name = spec["name"]
    error = cu = None
    try:
        if order not in CHUNK_ORDERS:
            raise InputError(f"{name}: chunk_order {order!r} must be one of {CHUNK_ORDERS}")
        if cu_seqlens is None:
            check_inputs(spec, q, k, v)
            n_loc = q.shape[1]
        else:
            cu = _check_packed(spec, q, k, v, order, P, cu_seqlens, max_seqlen)
            n_loc = q.shape[0]
        if local_check is not None:
            local_check(n_loc)
    except InputError as exc:
        error = str(exc)
    if cu_seqlens is not None:   # the fingerprint reads packed rows as one batch element
        q, k, v = (t.unsqueeze(0) if isinstance(t, torch.Tensor) and t.dim() == 3 else t
                   for t in (q, k, v))
    device = q.device if isinstance(q, torch.Tensor) and dist.get_backend(group) != "gloo" else torch.device("cpu")
    mine = _fingerprint(spec, q, k, v, order if order in CHUNK_ORDERS else "contiguous", error, device,
                        cu if cu_seqlens is not None else None)
    every = [torch.empty_like(mine) for _ in range(P)]
    dist.all_gather(every, mine, group=group)
    rows = [x.tolist() for x in every]
    if dist.get_backend(group) == "gloo":
        # nothing left pending, refused or not: the process may end right after the call
        # (cheap: the worker thread only waits for the GIL). Other backends: not examined.
        let_go((mine, *every))
    message = _verdict(name, rows, error, P)
    if message is not None:
        raise RingError(message)
    return cu


def _verdict(name: str, rows: list[list[int]], error: str | None, P: int) -> str | None:
    """The error every rank raises for the gathered fingerprints (None: the call runs)."""
    bad_inputs = [r for r in range(P) if rows[r][-1]]
    if bad_inputs:
        detail = f": {error}" if error else ""
        return (f"{name}: ring call refused on every rank: rank(s) {bad_inputs} passed "
                f"bad inputs" + (f" (this rank{detail})" if error else
                                 "; see the error on those ranks"))
    for f, label in enumerate(_FIELDS[:-1]):
        values = [r[f] for r in rows]
        if len(set(values)) > 1:
            by_rank = ", ".join(f"rank {r}: {x}" for r, x in enumerate(values))
            if label == "cu_seqlens":
                return (f"{name}: the ranks disagree on cu_seqlens (offsets hash by rank: "
                        f"{by_rank}); every rank must pass the same cu_seqlens, the "
                        f"offsets of the sequences over the whole packed row")
            hint = ("every rank must compile the same spec" if f == 0 else
                    "N must be divisible by ring_size, every rank passing N / ring_size rows"
                    if "rows" in label else "every rank must pass tensors of the same shape and dtype")
            return f"{name}: the ranks disagree on {label} ({by_rank}); {hint}"
    return None
