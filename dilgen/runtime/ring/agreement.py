"""Checks that every rank of a ring call passes or fails together: the process group fits
the spec, and one all_gather of a fingerprint (spec, shapes, dtype, order, transport
override, local errors) catches ranks that disagree before any transfer, with the same
one-line error everywhere. The same all_gather hands every rank the call's fault key
(faults.py) and the smallest free memory of the ranks (the transport cost model's bound)."""
from __future__ import annotations

import contextlib

import hashlib
import os
from typing import Any, Callable

import torch

from ...schedule import CHUNK_ORDERS
from ..checks import InputError, check_inputs, check_varlen_inputs
from ..varlen import read_cu_seqlens
from .faults import PeerLost, RingError, _group_name, collective, fault_key, new_key, refuse_closed, side_groups

_DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
_DTYPE_NAMES = {0: "another dtype", **{code: str(t).replace("torch.", "") for t, code in _DTYPE_CODE.items()}}


def _named(names, code: int) -> str:
    """A gathered code as the name it stands for (CHUNK_ORDERS: quoted, as it is passed)."""
    if isinstance(names, dict):
        return names.get(code, f"code {code}")
    return repr(names[code]) if 0 <= code < len(names) else f"code {code}"
_TRANSPORTS = ("auto", "ring", "allgather", "heads", "recut", "hybrid")
_MEASURE = ("auto", "1", "0")           # DILGEN_RING_MEASURE (ring.measure.MODES)


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


def rates_code(dist, group, P: int, q) -> int:
    """56 bits of the digest of the cost model's rates this rank prices the call with
    (dilgen.calibration.rates_for: this machine's calibration, or the committed profile)."""
    from ...calibration import rates_for
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    try:
        return int(rates_for(P, dist.get_backend(group), device).key()[:14], 16)
    except Exception:  # noqa: BLE001 - a rank that cannot price is told apart, never raises alone
        return 0


def _call_fields(spec: dict, q, k, v, order: str, cu: list[int] | None, kind: str, rates: int,
                 dropout: int = 0) -> list[int]:
    """The compared fields of a call (_FIELDS, but the input error) as ints; `rates`:
    rates_code; `dropout`: the call's drop threshold (dropout.threshold, 0 without)."""
    key = int.from_bytes(hashlib.sha256(spec["name"].encode() + b"/" + repr(sorted(
        (k_, str(v_)) for k_, v_ in spec.items())).encode()).digest()[:7], "big")
    def shape(t, i):
        return t.shape[i] if isinstance(t, torch.Tensor) and t.dim() > i else -1
    return [key, shape(q, 0), shape(q, 1), shape(q, 2), shape(q, 3), shape(k, 2), shape(k, 1),
            shape(v, 1), _DTYPE_CODE.get(getattr(q, "dtype", None), 0), CHUNK_ORDERS.index(order),
            _cu_key(cu), _transport_code(), rates, dropout, CALLS.index(kind), _measure_code()]


def _fingerprint(fields: list[int], error: str | None, device, free: int = -1, seed: int = 0) -> torch.Tensor:
    """The compared fields (_FIELDS: the call's, then the input error bit), then three that
    are not: this rank's proposals for the call's fault key and for its dropout seed, and its
    free memory (-1: not a GPU, or the transport is forced)."""
    vals = fields + [int(error is not None), new_key(), seed, free]
    return torch.tensor(vals, dtype=torch.int64, device=device)


#: (group, device, call fields) -> what the last eager agreement of that call returned
_AGREED: dict[tuple, tuple] = {}


def _capturing(q) -> bool:
    """q's stream is being captured in a CUDA graph."""
    return isinstance(q, torch.Tensor) and q.is_cuda and torch.cuda.is_current_stream_capturing()


def _agreed_key(dist, group, q, fields: list[int]) -> tuple:
    """_AGREED's key of a call whose _call_fields are `fields`."""
    return (_group_name(dist, group), str(q.device), *fields)


def _agreed_before(spec: dict, q, k, v, order: str, group, dist, cu_seqlens, kind: str,
                   local_check, P: int, dropout: tuple[int, int] = (0, 0)) -> tuple[None, str, int | None, int]:
    """A ring call inside a CUDA-graph capture: the capture may not read the device back, so
    the call cannot gather fingerprints; it runs on the agreement of the same call made
    eagerly before (the warm-up a capture needs anyway: NCCL's communicators, the kernels'
    compilation, the tables on the device). Every rank captures the same calls, in order, as
    NCCL requires of any captured collective."""
    name = spec["name"]
    if dropout[0]:
        raise RingError(f"{name}: a ring call with attention dropout cannot be captured in a CUDA graph "
                        f"(a graph would replay one mask); capture the model in eval mode")
    if cu_seqlens is not None:
        raise RingError(f"{name}: a packed ring call (cu_seqlens) cannot be captured in a CUDA "
                        f"graph: its offsets are read on the host; run it eagerly, or capture "
                        f"a call of fixed-length rows")
    backend = dist.get_backend(group)
    if backend != "nccl":
        raise RingError(f"{name}: a ring call is captured in a CUDA graph only over an NCCL "
                        f"process group (this one is {backend!r})")
    if order not in CHUNK_ORDERS:
        raise InputError(f"{name}: chunk_order {order!r} must be one of {CHUNK_ORDERS}")
    check_inputs(spec, q, k, v)
    if local_check is not None:
        local_check(q.shape[1])
    fields = _call_fields(spec, q, k, v, order, None, kind, rates_code(dist, group, P, q))
    hit = _AGREED.get(_agreed_key(dist, group, q, fields))
    if hit is None:
        raise RingError(f"{name}: a ring {kind} is captured in a CUDA graph only after the same "
                        f"call (shapes, dtype, chunk order) ran eagerly on every rank: the ranks "
                        f"agree on a call by an all_gather read on the host, which a capture "
                        f"cannot do; run the call once before torch.cuda.graph (the warm-up)")
    return hit


_FIELDS = ["spec", "batch", "local rows of q", "heads of q", "head_dim", "kv heads",
           "local rows of k", "local rows of v", "dtype", "chunk order", "cu_seqlens",
           "DILGEN_RING_TRANSPORT", "cost model rates", "attention dropout", "call", "DILGEN_RING_MEASURE",
           "input error"]
#: the passes a ring call agrees on: a rank in a forward never pairs with one in a backward
CALLS = ("forward", "backward")


_STREAMS: dict = {}


def _side_stream(device):
    """torch.cuda.stream(a stream kept per device) on CUDA, else a no-op context."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stream = _STREAMS.get(device.index)
    if stream is None:
        stream = _STREAMS[device.index] = torch.cuda.Stream(device)
    return torch.cuda.stream(stream)


#: DILGEN_RING_AGREE: where the fingerprints travel ("device": on the call's own group, a GPU's
#: on a side stream; "cpu": on a gloo group of the same ranks, made at the group's first call)
AGREE_CHANNELS = ("device", "cpu")


def _agreement_group(dist, group):
    """(the group the agreement's all_gather runs on, an error for the fingerprint or None).
    "cpu": a gloo group of the ranks of `group`, made once (torch.distributed.new_group with
    use_local_synchronization: only these ranks take part, as they all reach this call) and
    kept in faults.side_groups, so the Guard closes it with the group. No device work: the
    all_gather and its read-back never wait for the GPU's queue or for SMs."""
    channel = os.environ.get("DILGEN_RING_AGREE", "device")
    if channel not in AGREE_CHANNELS:
        return group, (f"DILGEN_RING_AGREE={channel!r} must be one of {AGREE_CHANNELS} "
                       f"(the same on every rank)")
    if channel == "device":
        return group, None
    key = _group_name(dist, group)
    side = side_groups.get(key)
    if side is None:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        side = side_groups[key] = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    return side, None


def _transport_code() -> int:
    forced = os.environ.get("DILGEN_RING_TRANSPORT", "auto")
    return _TRANSPORTS.index(forced) if forced in _TRANSPORTS else len(_TRANSPORTS)


def _measure_code() -> int:
    """DILGEN_RING_MEASURE as an int (ring.measure.MODES; an unknown value its own code): every
    rank must measure a spec's rate alike, or none."""
    mode = os.environ.get("DILGEN_RING_MEASURE", "auto")
    return _MEASURE.index(mode) if mode in _MEASURE else len(_MEASURE)


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
    return read_cu_seqlens(name, cu_seqlens, n_loc * P, q.device, max_seqlen)   # read now, every call


def _agree(spec: dict, q, k, v, order: str, group, P: int, me: int, dist,
           cu_seqlens=None, max_seqlen=None, local_check: Callable[[int], None] | None = None,
           kind: str = "forward", dropout: tuple[int, int] = (0, 0)) -> tuple[list[int] | None, str, int | None, int]:
    """One all_gather of a small fingerprint: bad inputs or disagreeing ranks raise the
    same error on every rank instead of hanging in a later send. With cu_seqlens (a packed
    row: q, k, v of 3 dims) every rank must pass the same offsets. local_check(local rows)
    raises InputError for what else this rank cannot run (any exception of the checks
    joins the fingerprint's error bit, so every rank refuses together). dropout: (the call's
    drop threshold, compared; this rank's seed proposal). Returns the
    offsets (or None), the call's fault key, the smallest free GPU memory of the ranks
    (None: not measured) and rank 0's dropout seed. Nothing of the collective is left pending when this returns or
    raises (faults.let_go). An all_gather that fails (the group was closed by a failure in an
    earlier call, or a rank died) raises RingAborted (faults.py)."""
    name = spec["name"]
    if _capturing(q):
        return _agreed_before(spec, q, k, v, order, group, dist, cu_seqlens, kind, local_check, P, dropout)
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
    except Exception as exc:  # noqa: BLE001 - refused on every rank, never one rank alone
        error = f"{name}: {type(exc).__name__}: " + " ".join(str(exc).split())
    if cu_seqlens is not None:   # the fingerprint reads packed rows as one batch element
        q, k, v = (t.unsqueeze(0) if isinstance(t, torch.Tensor) and t.dim() == 3 else t
                   for t in (q, k, v))
    agree_on, channel_error = _agreement_group(dist, group)
    error = error or (channel_error and f"{name}: {channel_error}")
    if dist.get_backend(agree_on) == "gloo":
        device = torch.device("cpu")
    elif isinstance(q, torch.Tensor) and q.is_cuda:
        device = q.device
    else:       # q is not a CUDA tensor: the fingerprint still travels where the peers' do
        device = torch.device("cuda", torch.cuda.current_device())
    free = -1
    if error is None and q.is_cuda and _transport_code() == 0:
        free = torch.cuda.mem_get_info(q.device)[0] // 2
    # On a GPU's group the fingerprint travels on a stream of its own: a collective on the
    # compute stream would wait for every kernel queued before it (the forward's, when the
    # backward agrees), and reading it back would leave the GPU idle until the host queued more;
    # on a gloo group (DILGEN_RING_AGREE=cpu over NCCL) it never touches the device
    with _side_stream(device):
        fields = _call_fields(spec, q, k, v, order if order in CHUNK_ORDERS else "contiguous",
                              cu if cu_seqlens is not None else None, kind, rates_code(dist, group, P, q),
                              dropout[0])
        mine = _fingerprint(fields, error, device, free, dropout[1])
        every = [torch.empty_like(mine) for _ in range(P)]
        try:
            # nothing left pending, refused or not: the process may end right after the call
            # (gloo: faults.let_go, cheap: the worker thread only waits for the GIL)
            collective(dist, agree_on, lambda: dist.all_gather(every, mine, group=agree_on), (mine, *every))
        except PeerLost as exc:
            raise refuse_closed(name, dist, group, P, me, exc) from exc.__cause__
        rows = torch.stack(every).tolist()     # one read back, not one per rank
    key, frees = fault_key(rows[0][-3]), [r[-1] for r in rows if r[-1] >= 0]
    message = _verdict(name, [r[:-3] for r in rows], error, P)
    if message is not None:
        raise RingError(message)
    agreed = cu, key, (min(frees) if frees else None), rows[0][-2]     # rank 0's seed: every rank's
    if cu is None:        # a later capture of this call runs on it (_agreed_before)
        if len(_AGREED) > 64:
            _AGREED.clear()
        _AGREED[_agreed_key(dist, group, q, fields)] = agreed
    return agreed


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
            if label == "call":
                calls = ", ".join(f"rank {r}: {CALLS[x]}" for r, x in enumerate(values))
                return (f"{name}: the ranks are in different ring calls ({calls}); every rank must "
                        f"run the same forward and backward calls in the same order (did one rank "
                        f"skip a backward?)")
            if label == "chunk order":
                orders = ", ".join(f"rank {r}: {_named(CHUNK_ORDERS, x)}" for r, x in enumerate(values))
                return (f"{name}: the ranks disagree on the chunk order ({orders}); every rank must "
                        f"pass the same chunk_order= ({' or '.join(map(repr, CHUNK_ORDERS))}), which "
                        f"decides the rows each rank holds (shard them with that order)")
            if label == "dtype":
                dtypes = ", ".join(f"rank {r}: {_named(_DTYPE_NAMES, x)}" for r, x in enumerate(values))
                return (f"{name}: the ranks disagree on the dtype of q ({dtypes}); every rank must "
                        f"pass q, k, v of the spec's dtype")
            if label == "cost model rates":
                return (f"{name}: the ranks price the ring's transports with different cost-model "
                        f"rates (digest by rank: {by_rank}; 0: none could be read), so they could "
                        f"pick different transports; calibrate every node alike (`torchrun ... -m "
                        f"dilgen calibrate` over the whole group) or remove the calibration records "
                        f"(the `calibration` folder of each node's dilgen cache)")
            if label == "attention dropout":
                return (f"{name}: the ranks disagree on attention dropout (the drop threshold by rank: "
                        f"{by_rank}; 0: none); every rank must pass the same dropout_p (train() or "
                        f"eval() on every rank alike)")
            if label == "DILGEN_RING_MEASURE":
                names = ", ".join(f"rank {r}: {(*_MEASURE, 'invalid')[x]}" for r, x in enumerate(values))
                return (f"{name}: the ranks disagree on DILGEN_RING_MEASURE ({names}); set the same "
                        f"value (auto, 1 or 0) on every rank, or none")
            if label == "DILGEN_RING_TRANSPORT":
                names = ", ".join(f"rank {r}: {(*_TRANSPORTS, 'invalid')[x]}" for r, x in enumerate(values))
                return (f"{name}: the ranks disagree on DILGEN_RING_TRANSPORT ({names}); set "
                        f"the same value (ring, allgather, heads, recut, hybrid or auto) on every rank, or none")
            hint = ("every rank must compile the same spec" if f == 0 else
                    "N must be divisible by ring_size, every rank passing N / ring_size rows"
                    if "rows" in label else "every rank must pass tensors of the same shape and dtype")
            return f"{name}: the ranks disagree on {label} ({by_rank}); {hint}"
    return None
