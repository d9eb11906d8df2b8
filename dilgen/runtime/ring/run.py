"""One ring call (RingRun): the group, the pieces each rank holds, the schedule
(dilgen.schedule.ring_schedule, the same pure function on every rank), the transport the
cost model picks, the key transfers of each step and the windows each launch covers.
executor.py runs the forward and backward passes over it. Every transfer goes through
faults.transfer / faults.collective, so that a peer that stopped raises PeerLost."""
from __future__ import annotations

import math
import os

import torch

from ...calibration import rates_for
from ...knobs import flag
from ...schedule import pick_transport, ring_schedule, ring_schedule_packed
from ..checks import InputError, check_positions
from ..interpreter import interpreting
from ..tables import table_tensors
from ..varlen import Packing, packed_tables
from .agreement import _agree, _group_info
from ..dropout_call import bad_p, cut_and_scale, dropout_twin, model_streams, seed_tensor, valid_p
from .dropout import Counter, dropout_proposal, dropout_refusal
from .faults import Guard, collective, post_transfers, remember, transfer
from .costs import call_costs
from .heads import heads_refusal
from .hybrid import hybrid_parts, hybrid_refusal
from .measure import with_spec_rate
from .recut import recut_refusal, recut_targets


def _compact(x: torch.Tensor, g: int) -> torch.Tensor:
    """(B, n, Hkv, D) -> (B, n/g, Hkv, D): kv head h keeps rows h mod g (contiguous)."""
    if g == 1:
        return x.contiguous()
    B, n, hk, D = x.shape
    x5 = x.reshape(B, n // g, g, hk, D)
    heads = torch.arange(hk, device=x.device)
    return x5[:, :, heads % g, heads, :]


def _uncompact_add(dst: torch.Tensor, part: torch.Tensor, g: int) -> None:
    """dst (B, n, Hkv, D) += part compacted with stride g (inverse of _compact)."""
    if g == 1:
        dst += part
        return
    B, n, hk, D = dst.shape
    d5 = dst.view(B, n // g, g, hk, D)
    heads = torch.arange(hk, device=dst.device)
    d5[:, :, heads % g, heads, :] += part


class _Exchange:
    """Posted P2P transfers of one step (batch_isend_irecv) and their buffers."""

    def __init__(self, dist, ops, recv, keep):
        self.works = post_transfers(dist, ops)
        self.recv = recv
        self._keep = keep

    def wait(self):
        for w in self.works:
            transfer(w.wait)
        self.works = []
        return self.recv


def _check_geometry(attn, n_loc: int, P: int, order: str, packed: bool) -> None:
    """What this rank's call cannot run besides its inputs (before the agreement, so that
    every rank refuses together, never one rank alone after the others began to send)."""
    name, forced = attn.spec["name"], _forced_transport()
    refusal = {"heads": lambda: heads_refusal(attn, P, packed),
               "hybrid": lambda: hybrid_refusal(attn, ring_schedule(attn.plan["ring"], n_loc * P, order), packed),
               "recut": lambda: recut_refusal(attn, n_loc * P, order, packed)}.get(forced)
    why = refusal and refusal()
    if why is not None:
        raise InputError(f"{name}: DILGEN_RING_TRANSPORT={forced} cannot run this call: {why}; "
                         f"use ring, allgather or auto")
    check_positions(attn.spec, n_loc * P, ranks=P)
    if order == "zigzag" and (n_loc * P) % (2 * P):
        raise InputError(f"{name}: {n_loc} local rows cannot be cut into the two zigzag halves; "
                         f"pass an even number of rows per rank")
    curve = attn.plan["ring"].get("curve")
    if curve is not None and n_loc * P != curve[0] * curve[1]:
        raise InputError(f"{name}: hilbert scope 'sequence' with grid {list(curve)} needs "
                         f"{curve[0] * curve[1]} tokens in all ({curve[0] * curve[1] // P} per "
                         f"rank), got {n_loc} per rank; shard with "
                         f"dilgen.runtime.ring.shard(x, {P}, rank, spec=spec)")
    if curve is not None and order != "contiguous":
        raise InputError(f"{name}: hilbert scope 'sequence' shards runs of the curve: "
                         f"chunk_order must be 'contiguous', got {order!r}")


def _forced_transport() -> str:
    """DILGEN_RING_TRANSPORT: ring, allgather, heads, recut, hybrid or auto."""
    forced = os.environ.get("DILGEN_RING_TRANSPORT", "auto")
    if forced not in ("ring", "allgather", "heads", "recut", "hybrid", "auto"):
        raise InputError(f"DILGEN_RING_TRANSPORT={forced!r}: use ring, allgather, heads, recut, hybrid or auto")
    return forced


class RingRun:
    """One ring call's geometry: group, pieces, schedule, kernels and launch helpers."""

    def __init__(self, attn, q, k, v, group, order: str, cu_seqlens=None, max_seqlen=None,
                 kind: str = "forward", dropout_p: float = 0.0, counter: Counter | None = None,
                 dropout_seed: int | None = None):
        """cu_seqlens: a packed row: q (N/P, H, D), k, v (N/P, H_kv, D) hold the rank's rows
        and cu_seqlens the offsets of the sequences over the whole row, the same on every
        rank; ring_forward / ring_backward then take (1, N/P, heads, D) views of them.
        dropout_p > 0: attention dropout with rank 0's seed (dropout_args), every transport
        drawing one device's coins at global positions and heads: the call runs the spec's
        dropout plan (self.attn becomes its module; self.main is the spec's own). counter:
        the call is part of a larger one, whose mask it draws (ring.dropout.Counter).
        dropout_seed: a backward's run of its own (the traced backward op), with the seed its
        forward agreed."""
        spec = attn.spec
        self.attn, self.main, self.group, self.order = attn, attn, group, order
        self.P, self.me, self.dist = _group_info(spec, group)
        self.packed = cu_seqlens is not None
        self._agreed = (cu_seqlens, max_seqlen)
        # "heads" under autograd: the forward's head-sharded q, k, v, out, lse per chunk, on
        # which the backward runs (it then exchanges only dO); heads.twin_forward fills it
        self.keep_heads, self.kept = False, None
        self.dropout_p, self.dropout_args, self.counter = dropout_p, None, counter
        if dropout_seed is not None:
            self._keep_seed(dropout_seed, q.device)
        cu = self.agree(q, k, v, kind)
        if dropout_p:
            self.attn = dropout_twin(attn, q.device)     # built by the agreement's local check
        with Guard(self, "call", "setup"):      # past the agreement, no rank fails alone
            self._setup(q, k, v, cu)

    def agree(self, q, k, v, kind: str = "forward"):
        """Every rank checks its inputs and the call (agreement._agree): all run it, or all
        raise the same RingError. The backward of a call agrees again (kind "backward"), so
        a rank that skipped it, or is in another call, is refused with the others."""
        cu_seqlens, max_seqlen = self._agreed
        proposal = (0, 0) if not self.dropout_p else dropout_proposal(self.dropout_p, self.dropout_args,
                                                                      self.counter)

        def local_check(n_loc):
            _check_geometry(self.attn, n_loc, self.P, self.order, self.packed)
            self.lane_windows = flag("DILGEN_RING_LANE_WINDOWS", False)     # ring/lane_windows.py
            if self.dropout_p and not valid_p(self.dropout_p):
                raise bad_p(self.attn.spec["name"], self.dropout_p)
            if self.dropout_p:
                dropout_refusal(self.main)
                dropout_twin(self.main, q.device)           # a plan that refuses, refused on every rank
        cu, self.fault_key, self.free_bytes, seed = _agree(
            self.attn.spec, q, k, v, self.order, self.group, self.P, self.me, self.dist,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, kind=kind, local_check=local_check,
            dropout=proposal)
        if self.dropout_p and self.dropout_args is None:     # the forward's: its backward reuses them
            self._keep_seed(seed, q.device)
        remember(self.dist, self.group, self.fault_key)
        return cu

    def _keep_seed(self, seed: int, device) -> None:
        """The call's agreed seed: dropout_args (seed, drop_cut, drop_scale) and the seed the
        kernels read on the device."""
        self.dropout_args = (seed, *cut_and_scale(self.dropout_p))
        self.seed_on_device = seed_tensor(seed, device)

    def drop_args(self, pos0: int = 0, head0: int = 0) -> tuple:
        """The kernels' dropout arguments (common.dropout_rows) on rows whose row 0 is position
        pos0 of the whole sequence and on the call's heads from head0 (a window: global
        positions, all heads), () without dropout."""
        if self.dropout_args is None:
            return ()
        if self.counter is None:
            n, row0 = self.N, 0
            streams = model_streams(self.H, len(self.attn.plan["branches"]), self.seed_on_device.device)
        else:
            n, row0, streams = self.counter.n, self.counter.row0, self.counter.streams
        return (self.seed_on_device, *self.dropout_args[1:], n, row0 + pos0, streams[head0:])

    def _setup(self, q, k, v, cu) -> None:
        attn, group, order = self.attn, self.group, self.order
        if self.packed:         # (N/P, heads, D) rows: one batch element of the kernels' views
            q, k, v = (t.unsqueeze(0) for t in (q, k, v))
        B, n_loc = q.shape[0], q.shape[1]
        self.B, self.n_loc, self.N = B, n_loc, n_loc * self.P
        self.H, self.Hkv, self.D = q.shape[2], k.shape[2], q.shape[3]
        cache = attn.__dict__.setdefault("_ring_schedules", {})
        key = (self.N, order) if cu is None else (self.N, order, tuple(cu))
        if key not in cache:
            if len(cache) > 32:
                cache.clear()
            cache[key] = (ring_schedule(attn.plan["ring"], self.N, order) if cu is None
                          else ring_schedule_packed(attn.plan["ring"], cu, order))
        self.sched = cache[key]
        self.cu = cu
        self.pieces = self.sched["pieces"]
        self.rows0 = []                      # local row of each of my pieces
        row = 0
        for _, ln in self.pieces[self.me]:
            self.rows0.append(row)
            row += ln
        self.peer = (lambda r: r) if group is None else (lambda r: self.dist.get_global_rank(group, r))
        self.interpret = q.device.type == "cpu"
        plan = attn.plan
        self.class_order, _ = attn._launch_tensors(n_loc, q.device)
        self.tables = []
        if cu is None:
            for t in plan["tables"]:
                self.tables.extend(table_tensors(t, self.N, q.device))
        elif plan["tables"]:     # every sequence's own tables, at its rows of the packed row
            starts = torch.tensor(cu[:-1], dtype=torch.int32)
            lens = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])], dtype=torch.int32)
            self.tables = packed_tables(plan, Packing(starts, lens, int(lens.max()), True),
                                        self.N, q.device)
        if cu is not None:
            self.seq_start = torch.tensor(cu[:-1], dtype=torch.int32, device=q.device)
            self.seq_len = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])],
                                        dtype=torch.int32, device=q.device)
            self._windows = {}
        self.lattice = plan["query"]["lattice"]
        self.transport = attn.last_ring_transport = self.main.last_ring_transport = self._transport(q, k, v)
        self.targets = recut_targets(attn, self.sched) if self.transport == "recut" else None
        if self.transport == "hybrid":       # the windows run the branches that cross the pieces
            self.local_branches = self.sched["local_only"]
            self.sched = hybrid_parts(attn, self.sched)[2]
        self.gathered = None

    def _transport(self, q, k, v) -> str:
        """"local" (every branch inside a rank: the single-device kernels on my rows), else the
        cheapest by the cost model (schedule.transport_costs) of "ring" (P2P steps overlapped
        with the window kernels), "allgather" (LongNet §3.1: every rank gathers the sparse
        rows first), "heads" (all-to-all to head shards, the single-device kernels) and
        "recut" (rank borders moved onto segment borders, the single-device kernels) and
        "hybrid" (the branches inside the pieces in the single-device kernels, the others in
        the windows); DILGEN_RING_TRANSPORT overrides the model. Where the choice is not
        "local", the first call of a spec measures its own rate (measure.with_spec_rate)."""
        forced = _forced_transport()
        if forced != "auto":
            return forced
        costs = self.costs(q)
        if "local" not in costs and not self.packed:
            rates = rates_for(self.P, self.dist.get_backend(self.group), q.device)
            if with_spec_rate(self, q, k, v, rates) is not rates:
                costs = self.costs(q)
        return pick_transport(costs, self.gather_bytes(q), self.free_bytes)

    def costs(self, q) -> dict:
        """The cost model's {transport: {fwd_s, fwd_bwd_s}} of this call (the same on every
        rank: the schedule, shapes, dtype and the rates' digest are agreed), kept per shape
        and rates."""
        cache = self.sched.setdefault("_costs", {})
        rates = rates_for(self.P, self.dist.get_backend(self.group), q.device)
        shape = (self.B, self.H, self.Hkv, self.D, q.element_size())
        key = (shape, rates.key())
        if key not in cache:
            cache[key] = call_costs(self.attn, self.sched, *shape, packed=self.packed, rates=rates)
        return cache[key]

    def gather_bytes(self, q) -> int:
        """Bytes of the all-gather transport's gathered key rows on one rank."""
        g = self.gather_stride()
        return (self.N // g) * 2 * self.B * self.Hkv * self.D * q.element_size()

    # all-gather transport ---------------------------------------------------------------
    def gather_stride(self) -> int:
        """One compaction for every remote window: gcd of their strides (a superset of the
        rows each window keeps)."""
        g = 0
        for st in self.sched["steps"]:
            if st["offset"]:
                for r in st["ranks"]:
                    if r["recv"]:
                        for x in r["stride"]:
                            g = math.gcd(g, x)
        return g or 1

    def gather_keys(self, tensors):
        """All-gather my compacted key pieces: [rank][piece] -> (k, v) buffers."""
        g = self.gather_stride()
        self.gathered_stride = g
        per_tensor = []
        for x in tensors:
            local = torch.cat([_compact(self.piece(x, i), g) for i in range(len(self.pieces[self.me]))], dim=1)
            local = local.contiguous()
            every = [torch.empty_like(local) for _ in range(self.P)]
            collective(self.dist, self.group, lambda: self.dist.all_gather(every, local, group=self.group),
                       (local, *every))
            per_tensor.append(every)
        out = []
        for rank in range(self.P):
            row, pieces = 0, []
            for _, ln in self.pieces[rank]:
                pieces.append(tuple(t[rank].narrow(1, row, ln // g) for t in per_tensor))
                row += ln // g
            out.append(pieces)
        self.gathered = out
        return out

    def scatter_partials(self, partials_by_rank, dk, dv):
        """Backward of the all-gather: sum every rank's partial dK, dV of my keys."""
        g = self.gathered_stride
        for which, dst in ((0, dk), (1, dv)):
            stacked = []
            for rank in range(self.P):
                parts = partials_by_rank.get(rank)
                if parts is None:
                    rows = sum(ln // g for _, ln in self.pieces[rank])
                    stacked.append(torch.zeros((self.B, rows, self.Hkv, self.D), dtype=torch.float32, device=dk.device))
                else:
                    stacked.append(torch.cat([p[which] for p in parts], dim=1))
            mine = torch.empty_like(stacked[self.me])
            if self.dist.get_backend(self.group) == "gloo":     # gloo has no reduce_scatter
                total = torch.stack(stacked)
                collective(self.dist, self.group, lambda: self.dist.all_reduce(total, group=self.group),
                           (total,))
                mine = total[self.me]
            else:
                collective(self.dist, self.group,
                           lambda: self.dist.reduce_scatter(mine, stacked, group=self.group), ())
            row = 0
            for i, (_, ln) in enumerate(self.pieces[self.me]):
                _uncompact_add(self.piece(dst, i), mine.narrow(1, row, ln // g), g)
                row += ln // g

    # P2P -------------------------------------------------------------------------------
    def piece(self, x: torch.Tensor, i: int) -> torch.Tensor:
        return x.narrow(1, self.rows0[i], self.pieces[self.me][i][1])

    def post_keys(self, step, tensors: tuple[torch.Tensor, ...]) -> _Exchange | None:
        """Send my key pieces to (me + t), receive (me - t)'s, compacted per the schedule."""
        t = step["offset"]
        if t == 0:
            return None
        mine = step["ranks"][self.me]
        dist, ops, keep, recv = self.dist, [], [], []
        if mine["send"]:
            dst = (self.me + t) % self.P
            for i, g in enumerate(step["ranks"][dst]["stride"]):
                for x in tensors:
                    buf = _compact(self.piece(x, i), g)
                    keep.append(buf)
                    ops.append(dist.P2POp(dist.isend, buf, self.peer(dst), self.group))
        if mine["recv"]:
            src = (self.me - t) % self.P
            for (_, ln), g in zip(self.pieces[src], mine["stride"]):
                bufs = []
                for x in tensors:
                    buf = torch.empty((x.shape[0], ln // g, *x.shape[2:]), dtype=x.dtype, device=x.device)
                    ops.append(dist.P2POp(dist.irecv, buf, self.peer(src), self.group))
                    bufs.append(buf)
                recv.append(bufs)
        return _Exchange(dist, ops, recv, keep)

    def post_returns(self, step, partials: list[list[torch.Tensor]] | None,
                     like: torch.Tensor) -> _Exchange | None:
        """Backward: send the partial dK, dV of (me - t)'s keys home; receive the partials
        of my keys computed by (me + t)."""
        t = step["offset"]
        mine = step["ranks"][self.me]
        dist, ops, recv = self.dist, [], []
        if mine["recv"]:
            src = (self.me - t) % self.P
            for bufs in partials:
                for buf in bufs:
                    ops.append(dist.P2POp(dist.isend, buf, self.peer(src), self.group))
        if mine["send"]:
            dst = (self.me + t) % self.P
            for i, g in enumerate(step["ranks"][dst]["stride"]):
                ln = self.pieces[self.me][i][1]
                bufs = []
                for _ in range(2):
                    buf = torch.empty((like.shape[0], ln // g, *like.shape[2:]),
                                      dtype=torch.float32, device=like.device)
                    ops.append(dist.P2POp(dist.irecv, buf, self.peer(dst), self.group))
                    bufs.append(buf)
                recv.append((i, g, bufs))
        if not ops:
            return None
        return _Exchange(dist, ops, recv, partials)

    # kernels ---------------------------------------------------------------------------
    def run(self, fn):
        if self.interpret:
            with interpreting():
                return fn()
        return fn()

    def launches_of(self, step):
        return step["ranks"][self.me]["launches"]

    def classes(self, bits: int, full: bool) -> torch.Tensor:
        """Query classes a window launches, longest first: all of them (full), or only
        those some branch of the mask keeps (r | d; every class for row membership), so
        a remote window of an r = 32 branch launches 1/32 of the programs."""
        if full:
            return self.class_order
        dev = self.class_order.device
        key = (self.n_loc, "ring classes", bits, str(dev))     # kept: no copy per call
        hit = self.attn._device_tensors.get(key)
        if hit is None:
            order = self.attn.plan["query"]["class_order"]
            mine = [br for br in self.attn.plan["branches"] if bits >> br["index"] & 1]
            keep = [d for d in order
                    if any(br["membership"] == "row" or d % br["r"] == 0 for br in mine)]
            hit = self.attn._keep(key, torch.tensor(keep or order[:1], dtype=torch.int32, device=dev))
        return hit

    def key_window(self, step, ki: int):
        """(k_off, n_k, stride) of key piece ki at this step."""
        src = (self.me - step["offset"]) % self.P
        k_off, n_k = self.pieces[src][ki]
        if self.transport == "allgather":
            return k_off, n_k, self.gathered_stride
        g = step["ranks"][self.me]["stride"][ki]
        return k_off, n_k, g

    def bstride(self, t: torch.Tensor) -> int:
        """Batch stride the kernels take: 0 for a packed row (program b is sequence b)."""
        return 0 if self.packed else t.stride(0)

    def window(self, step, li: int) -> dict:
        """What launch li of a step runs over: (SeqStart, SeqLen) arguments, the number of
        grid batch rows and the longest query part (grid size); for a packed row also each
        launched sequence's (start, length, query part, key part), positions local to it."""
        if not self.packed:
            qi = self.launches_of(step)[li][0]
            return {"args": (self.class_order, self.class_order), "count": self.B,
                    "n_q": self.pieces[self.me][qi][1], "parts": None}
        key = (step["offset"], li)
        hit = self._windows.get(key)
        if hit is None:
            qi, ki, _ = self.launches_of(step)[li]
            seqs = step["ranks"][self.me]["seqs"][li]
            qp = self.pieces[self.me][qi]
            kp = self.pieces[(self.me - step["offset"]) % self.P][ki]
            parts = []
            for i in seqs:
                s0, n = self.cu[i], self.cu[i + 1] - self.cu[i]
                qa, qe = max(qp[0], s0) - s0, min(qp[0] + qp[1], s0 + n) - s0
                ka, ke = max(kp[0], s0) - s0, min(kp[0] + kp[1], s0 + n) - s0
                parts.append((n, qa, qe, ka, ke))
            idx = torch.tensor(seqs, dtype=torch.long).to(self.seq_start.device)
            hit = self._windows[key] = {
                "args": (self.seq_start[idx].contiguous(), self.seq_len[idx].contiguous()),
                "count": len(seqs), "n_q": max(qe - qa for _, qa, qe, _, _ in parts),
                "parts": parts}
        return hit

    def dkdv_grid(self, win: dict, br: dict, k_off: int, n_k: int) -> tuple[int, int]:
        """(segments, key lanes) a per-branch dkdv launch covers: the longest over the
        launched sequences of a packed row."""
        w, r = br["w"], br["r"]
        plain = br.get("order") is None and self.attn.plan["query"]["order"] is None

        def one(N, k_off, n_k):
            n_seg = min((k_off + n_k - 1) // w, (N - 1) // w) - k_off // w + 1
            lanes = math.ceil(min(w, N) / r)
            if plain:
                lanes = min(lanes, math.ceil(n_k / r))
            return n_seg, lanes

        if win["parts"] is None:
            return one(self.N, k_off, n_k)
        grids = [one(N, ka, ke - ka) for N, _, _, ka, ke in win["parts"]]
        return max(g[0] for g in grids), max(g[1] for g in grids)

    def step_keys(self, step):
        """The received key pieces of a remote step (all-gather transport)."""
        return self.gathered[(self.me - step["offset"]) % self.P]
