"""The ring's schedule (SPEC §2 "Ring"), as pure functions of the ring IR (ir.RingIR's
JSON) and a sequence length: which rows each rank holds (`ring_pieces`), which windows
(query piece, key piece, branch mask) each rank computes at each offset
(`ring_schedule`, `ring_schedule_packed` for packed rows), and the transport cost model
(`step_flops`, `transport_times`, `choose_transport`). Every rank computes the same value;
the runtime's ring executes it.
"""
from __future__ import annotations

import itertools
import math

from .stats import forward_flops

CHUNK_ORDERS = ("contiguous", "zigzag")


def ring_pieces(n: int, ring_size: int, order: str = "contiguous") -> list[list[tuple[int, int]]]:
    """Rows of each rank as (start, length) pieces of the sequence, in local order.

    contiguous (SPEC): rank j holds [j*N/P, (j+1)*N/P). zigzag (causal balance): the
    sequence is cut into 2P chunks and rank j holds chunks j and 2P-1-j, so that every
    rank has as many early as late queries."""
    if order not in CHUNK_ORDERS:
        raise ValueError(f"chunk order {order!r}: must be one of {CHUNK_ORDERS}")
    if order == "contiguous":
        c = n // ring_size
        return [[(j * c, c)] for j in range(ring_size)]
    c = n // (2 * ring_size)
    return [[(j * c, c), ((2 * ring_size - 1 - j) * c, c)] for j in range(ring_size)]


def _meets(w: int, a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Does one segment [s*w, (s+1)*w) touch both intervals a and b?"""
    (a0, al), (b0, bl) = sorted([a, b])
    if a0 + al > b0:                       # overlapping pieces (the same piece)
        return True
    return (a0 + al - 1) // w == b0 // w   # the segment of a's last row reaches b's first


def ring_schedule(ring: dict, n: int, order: str = "contiguous") -> dict:
    """Instantiate the ring schedule for a sequence of n tokens (every rank computes the
    same value). Returns JSON data:

      pieces[j]            rank j's (start, length) pieces, local order
      steps[t]             offset t = 0..P-1 that has work somewhere (t = 0: local keys);
                           at offset t rank j computes with the keys of rank (j - t) mod P
        ranks[j].launches  [q piece, k piece, branch mask] windows to compute
        ranks[j].recv      True if rank j receives from (j - t) mod P
        ranks[j].send      True if rank j sends to (j + t) mod P
        ranks[j].stride    per k piece of the sender: rows kept 1 in `stride` (compaction)
      local_only           branches whose every segment stays inside one piece
      bytes_fraction       sent key bytes / (P-1 full chunks), a measure of the savings
    """
    P = ring["ring_size"]
    pieces = ring_pieces(n, P, order)
    branches = ring["branches"]
    causal = ring["causal"]

    def mask(qp, kp) -> int:
        if causal and kp[0] >= qp[0] + qp[1]:
            return 0                        # every key after every query
        bits = 0
        for br in branches:
            if _meets(br["w"], qp, kp):
                bits |= 1 << br["index"]
        return bits

    def stride(bits: int, kp) -> int:
        """Kept rows of a window are one residue class mod g per kv head when every
        branch in it reads in raster order with r | w (then kv head h keeps rows = h
        mod g, g = gcd of their r); else send every row."""
        if not bits or not ring["one_kv_head_per_query_head"]:
            return 1
        g = 0
        for br in branches:
            if bits >> br["index"] & 1:
                if not br["raster"] or br["w"] % br["r"]:
                    return 1
                g = math.gcd(g, br["r"])
        return g if kp[0] % g == 0 and kp[1] % g == 0 else 1

    steps = []
    full_rows = sent_rows = 0
    for t in range(P):
        ranks = []
        for j in range(P):
            src = (j - t) % P
            launches = [[qi, ki, mask(qp, kp)]
                        for qi, qp in enumerate(pieces[j]) for ki, kp in enumerate(pieces[src])]
            launches = [x for x in launches if x[2]]
            strides = []
            for ki, kp in enumerate(pieces[src]):
                union = 0
                for _, k2, bits in launches:
                    if k2 == ki:
                        union |= bits
                strides.append(stride(union, kp) if t else 1)
            ranks.append({"launches": launches, "stride": strides})
        for j in range(P):
            dst = (j + t) % P
            ranks[j]["recv"] = bool(t) and bool(ranks[j]["launches"])
            ranks[j]["send"] = bool(t) and bool(ranks[dst]["launches"])
            if t and ranks[j]["recv"]:
                src = (j - t) % P
                full_rows += sum(kp[1] for kp in pieces[src])
                sent_rows += sum(kp[1] // g for kp, g in zip(pieces[src], ranks[j]["stride"]))
        if t == 0 or any(r["launches"] for r in ranks):
            steps.append({"offset": t, "ranks": ranks})
    local_only = [br["index"] for br in branches
                  if all(p[0] % br["w"] == 0 and ((p[0] + p[1]) % br["w"] == 0 or p[0] + p[1] == n)
                         for rank in pieces for p in rank)]
    return {"n": n, "ring_size": P, "order": order, "pieces": pieces, "steps": steps,
            "local_only": local_only,
            "bytes_fraction": (sent_rows / full_rows) if full_rows else 0.0}


def recut_pieces(ring: dict, n: int, order: str = "contiguous") -> list[list[tuple[int, int]]] | None:
    """The "recut" transport's rows of each rank: ring_pieces with every border between two
    ranks moved to a multiple of L = lcm of the segment lengths, so that every segment of
    every branch lies inside one rank's piece and each rank runs the single-device kernels
    on its pieces (the rows between a border and its multiple of L travel there and back).
    A border goes down or up to its neighbouring multiple, whichever of the choices (all of
    them for up to 10 borders, the nearest otherwise) leaves the least rows on the busiest
    rank, then the fewest rows moving in or out of a rank. Pieces in ascending order per
    rank, empty ones dropped; None when L >= n (a segment longer than the sequence, or no
    common multiple inside it)."""
    P = ring["ring_size"]
    L = 1
    for br in ring["branches"]:
        L = math.lcm(L, br["w"])
        if L >= n:
            return None
    runs = []                               # (start, end, rank), adjacent pieces of a rank merged
    for start, ln, j in sorted((s, ln, j) for j, rank in enumerate(ring_pieces(n, P, order)) for s, ln in rank):
        if runs and runs[-1][2] == j and runs[-1][1] == start:
            runs[-1] = (runs[-1][0], start + ln, j)
        else:
            runs.append((start, start + ln, j))
    borders = [end for _, end, _ in runs[:-1]]
    options = [sorted({b // L * L, min(-(-b // L) * L, n)}) for b in borders]
    if len(borders) > 10:
        options = [[min(o, key=lambda x, b=b: (abs(x - b), x))] for o, b in zip(options, borders)]

    def cut(choice):
        edges, out = [0], [[] for _ in range(P)]
        for c in list(choice) + [n]:
            edges.append(max(c, edges[-1]))
        for (_, _, j), a, b in zip(runs, edges, edges[1:]):
            if b > a:
                out[j].append((a, b - a))
        busiest = max(sum(ln for _, ln in rank) for rank in out)
        return busiest, max(recut_moved_rows(pieces, out)), out

    pieces = ring_pieces(n, P, order)
    return min((cut(c) for c in itertools.product(*options)), key=lambda x: x[:2])[2]


def packed_window_mask(ring: dict, seq: tuple[int, int], qp: tuple[int, int],
                       kp: tuple[int, int]) -> int:
    """Branch mask of one packed sequence (start, length) in the window (query piece qp,
    key piece kp): the branches with a segment of the sequence (segments restart at its
    first row) holding a query of qp and a key of kp; causal drops keys after every query."""
    s0, n = seq
    qa, qe = max(qp[0], s0), min(qp[0] + qp[1], s0 + n)
    ka, ke = max(kp[0], s0), min(kp[0] + kp[1], s0 + n)
    if qe <= qa or ke <= ka:
        return 0
    if ring["causal"] and ka >= qe:
        return 0
    bits = 0
    for br in ring["branches"]:
        if _meets(br["w"], (qa - s0, qe - qa), (ka - s0, ke - ka)):
            bits |= 1 << br["index"]
    return bits


def ring_schedule_packed(ring: dict, cu: list[int], order: str = "contiguous") -> dict:
    """ring_schedule for a packed row (SPEC §3 "Variable-length batches" on a ring): cu holds
    the offsets of the sequences over the whole row (n = cu[-1] rows, split in contiguous
    chunks). A window is launched when some sequence has a segment meeting both its pieces;
    ranks[j].seqs lists, per launch, the sequences that do (only they are launched), and
    the launch mask is the union of theirs. Packed rows travel uncompacted (stride 1): the
    rows a branch keeps are a residue class of each sequence's own start."""
    if order != "contiguous":
        raise ValueError("packed rows on a ring take contiguous chunks only")
    import bisect
    n, P = cu[-1], ring["ring_size"]
    pieces = ring_pieces(n, P, order)
    seqs = [(cu[i], cu[i + 1] - cu[i]) for i in range(len(cu) - 1)]
    nonempty = [i for i, (_, ln) in enumerate(seqs) if ln > 0]
    starts = [seqs[i][0] for i in nonempty]

    def meeting(p):     # non-empty sequences that hold a row of piece p, in order
        lo = max(bisect.bisect_right(starts, p[0]) - 1, 0)
        hi = bisect.bisect_left(starts, p[0] + p[1])
        return [i for i in nonempty[lo:hi] if seqs[i][0] + seqs[i][1] > p[0]]

    steps = []
    full_rows = sent_rows = 0
    used = 0
    for t in range(P):
        ranks = []
        for j in range(P):
            src = (j - t) % P
            launches, lseqs = [], []
            for qi, qp in enumerate(pieces[j]):
                cand = meeting(qp)
                for ki, kp in enumerate(pieces[src]):
                    bits, who = 0, []
                    for i in cand:
                        m = packed_window_mask(ring, seqs[i], qp, kp)
                        if m:
                            bits |= m
                            who.append(i)
                    if bits:
                        launches.append([qi, ki, bits])
                        lseqs.append(who)
                        if t:
                            used |= bits
            ranks.append({"launches": launches, "seqs": lseqs, "stride": [1] * len(pieces[src])})
        for j in range(P):
            dst = (j + t) % P
            ranks[j]["recv"] = bool(t) and bool(ranks[j]["launches"])
            ranks[j]["send"] = bool(t) and bool(ranks[dst]["launches"])
            if t and ranks[j]["recv"]:
                rows = sum(kp[1] for kp in pieces[(j - t) % P])
                full_rows += rows
                sent_rows += rows
        if t == 0 or any(r["launches"] for r in ranks):
            steps.append({"offset": t, "ranks": ranks})
    local_only = [br["index"] for br in ring["branches"] if not used >> br["index"] & 1]
    return {"n": n, "ring_size": P, "order": order, "pieces": pieces, "steps": steps,
            "local_only": local_only, "packed": True,
            "bytes_fraction": (sent_rows / full_rows) if full_rows else 0.0}


def step_flops(ring: dict, schedule: dict, batch: int, heads: int, head_dim: int,
               part: str = "all") -> list[float]:
    """Per step, the FLOPs the kernels of the rank with the most run: a launch of a query
    piece of n_q rows runs, per branch (w, r) of its mask, 4·B·H·D·n_q·min(w, n_q)/r² (causal:
    half of it against its own piece's keys). A branch read through a curve table (not
    raster) keeps rows, not lattice classes, so every row of a tile runs (x r) against every
    lane of its segment (min(w, N) / r keys, not only the window's). part: "raster" or
    "table" counts only those branches. The slowest rank sets a step's time, and every rank
    computes the same list."""
    n = schedule["n"]
    out = []
    for st in schedule["steps"]:
        worst = 0.0
        for j, rank in enumerate(st["ranks"]):
            flops = 0.0
            for qi, ki, bits in rank["launches"]:
                n_q = schedule["pieces"][j][qi][1]
                # causal: a piece against its own keys keeps half (later pieces: none, dropped)
                half = 0.5 if ring["causal"] and st["offset"] == 0 and qi == ki else 1.0
                for br in ring["branches"]:
                    if bits >> br["index"] & 1 and part in ("all", "raster" if br["raster"] else "table"):
                        w, r = br["w"], br["r"]
                        keys = min(w, n_q) / r if br["raster"] else min(w, n)
                        flops += half * 4 * batch * heads * head_dim * n_q * keys / r
            worst = max(worst, flops)
        out.append(worst)
    return out


def work_of(spec) -> dict:
    """{causal, branches: [{w, r}]}, the work useful_flops and single_device_times count, of a
    dilgen.Spec or its JSON dict."""
    get = spec.get if isinstance(spec, dict) else lambda name: getattr(spec, name)
    return {"causal": bool(get("causal")),
            "branches": [{"w": w, "r": r} for w, r in zip(get("segment_lengths"), get("dilation_rates"))]}


def useful_flops(ring: dict, n: int, batch: int, heads: int, head_dim: int) -> float:
    """Σ_i 4·B·H·(N/w_i)·(min(w_i, N)/r_i)²·D, halved when causal (the work of one device)."""
    return forward_flops([b["w"] for b in ring["branches"]], [b["r"] for b in ring["branches"]], heads, head_dim,
                         ring["causal"], n, batch)


def single_device_times(ring: dict, n: int, batch: int, heads: int, head_dim: int,
                        lanes: bool, rates, spec_rate: tuple[float, float] | None = None) -> tuple[float, float]:
    """(forward s, backward s) of the single-device kernels on the whole problem: useful_flops
    at the fused rate, or the lanes rate (lanes: causal or Hilbert segment specs); `rates` a
    dilgen.calibration.Rates. spec_rate: the spec's own (forward TFLOP/s, backward over
    forward), measured by `dilgen calibrate --spec`, in place of the family's."""
    flops = useful_flops(ring, n, batch, heads, head_dim)
    if spec_rate is not None:
        return flops / (spec_rate[0] * 1e12), flops / (spec_rate[0] * 1e12) * spec_rate[1]
    fwd = flops / ((rates.twin_lanes_tflops if lanes else rates.twin_fused_tflops) * 1e12)
    return fwd, fwd * (rates.twin_causal_bwd if ring["causal"] and lanes else rates.twin_bwd)


def transport_costs(ring: dict, schedule: dict, *, batch: int, heads: int, kv_heads: int,
                    head_dim: int, itemsize: int, lanes: bool, heads_ok: bool,
                    local_ok: bool, rates, recut: list | None = None, hybrid: tuple | None = None,
                    spec_rate: tuple[float, float] | None = None) -> dict:
    """The cost model's {transport: {"fwd_s", "fwd_bwd_s"}} of one call (every rank gets the
    same), priced by `rates` (a dilgen.calibration.Rates: this machine's calibration or the
    committed profile): "ring" and "allgather" run the window kernels (step_flops at the window rate,
    transfers by transport_times); "heads" runs the single-device kernels on H/P heads of
    the whole sequence (useful_flops / P at the fused or the lanes rate) plus its
    all-to-alls ((P-1)/P of the rank's q, k, v, out forward; q, k, v, out, dO in and dq, dk,
    dv out backward); "local" (every branch inside a rank) the single-device kernels alone;
    "recut" (recut_pieces, given as `recut` where it can run) the single-device kernels on the
    busiest rank's rows plus the rows that move there and back (recut_moved_rows: q, k, v
    there and out, lse back forward; q, k, v, out, dO, lse there and dq, dk, dv back backward);
    "hybrid" (given as `hybrid` = (the ring IR of the branches inside the pieces, of the others,
    the others' schedule)) the single-device kernels on the first plus the ring windows of the
    others. No transport but "local" is priced below the time its host takes to issue one call
    (Rates.*_call_fwd_ms, *_call_ms; "hybrid" and "allgather" the ring's). heads_ok / local_ok:
    whether those can run this call. spec_rate: the spec's measured single-device
    rate (single_device_times), for every transport that runs those kernels."""
    P, n = ring["ring_size"], schedule["n"]
    lat = rates.step_latency_us * 1e-6
    shape = dict(batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize, rates=rates)
    costs = window_costs(ring, schedule, **shape)
    twin_f, twin_b = (t / P for t in single_device_times(ring, n, batch, heads, head_dim, lanes, rates, spec_rate))
    if hybrid is not None and P > 1:
        ring_l, ring_r, sched_r = hybrid
        loc_f, loc_b = (t / P for t in single_device_times(ring_l, n, batch, heads, head_dim, lanes, rates,
                                                             spec_rate))
        win = window_costs(ring_r, sched_r, **shape)["ring"]
        costs["hybrid"] = {"fwd_s": loc_f + win["fwd_s"], "fwd_bwd_s": loc_f + loc_b + win["fwd_bwd_s"]}
    if heads_ok and P > 1:
        row = batch * head_dim * itemsize * (n // P) * (P - 1) / P     # bytes of one head moved
        a2a = rates.alltoall_gbytes_s * 1e9
        fwd_bytes = row * (2 * heads + 2 * kv_heads)
        bwd_bytes = row * (heads + heads + 2 * kv_heads)   # dO to the heads (the forward's shards
        slow = rates.heads_lanes_slowdown if lanes else rates.heads_fused_slowdown    # kept); dq, dk, dv back
        costs["heads"] = {"fwd_s": slow * twin_f + fwd_bytes / a2a + 4 * lat,
                          "fwd_bwd_s": slow * (twin_f + twin_b) + (fwd_bytes + bwd_bytes) / a2a + 8 * lat}
    if local_ok:
        costs["local"] = {"fwd_s": twin_f, "fwd_bwd_s": twin_f + twin_b}
    if recut is not None and P > 1:
        busiest = max(sum(ln for _, ln in rank) for rank in recut) * P / n
        moved = max(recut_moved_rows(schedule["pieces"], recut))
        row = batch * head_dim * itemsize
        fwd_bytes = moved * (row * (2 * heads + 2 * kv_heads) + 4 * batch * heads)
        bwd_bytes = moved * (row * (4 * heads + 4 * kv_heads) + 8 * batch * heads)
        link = rates.link_gbytes_s * 1e9
        costs["recut"] = {"fwd_s": busiest * twin_f + fwd_bytes / link + 2 * lat,
                          "fwd_bwd_s": busiest * (twin_f + twin_b) + (fwd_bytes + bwd_bytes) / link + 4 * lat}
    for name, cost in costs.items():      # no call is faster than its host can issue it
        host = name if name in ("heads", "recut") else "ring"
        if name != "local":
            cost["fwd_s"] = max(cost["fwd_s"], getattr(rates, f"{host}_call_fwd_ms") * 1e-3)
            cost["fwd_bwd_s"] = max(cost["fwd_bwd_s"], getattr(rates, f"{host}_call_ms") * 1e-3)
    return costs


def window_costs(ring: dict, schedule: dict, *, batch: int, heads: int, kv_heads: int, head_dim: int,
                 itemsize: int, rates) -> dict:
    """{"ring", "allgather": {"fwd_s", "fwd_bwd_s"}}: the window kernels (step_flops at the window
    rate over ring_overhead) and their key transfers (transport_times)."""
    rate = rates.window_tflops * 1e12 / rates.ring_overhead
    raster, table = (step_flops(ring, schedule, batch, heads, head_dim, part) for part in ("raster", "table"))
    comp = [(a + b) / rate for a, b in zip(raster, table)]
    kv_row = 2 * batch * kv_heads * head_dim * itemsize
    ring_f, gather_f, _ = transport_times(ring, schedule, bytes_per_row=kv_row, step_compute_s=comp, rates=rates)
    # backward: the dK/dV kernels walk kept lanes only, so table windows cost less over their
    # forward; keys travel again and fp32 dK, dV go home: 3x the bytes
    up = rates.causal_window_bwd if ring["causal"] else rates.window_bwd
    bwd = [(a * up + b * rates.table_window_bwd) / rate for a, b in zip(raster, table)]
    ring_b, gather_b, _ = transport_times(ring, schedule, bytes_per_row=3 * kv_row, step_compute_s=bwd, rates=rates)
    return {"ring": {"fwd_s": ring_f, "fwd_bwd_s": ring_f + ring_b},
            "allgather": {"fwd_s": gather_f, "fwd_bwd_s": gather_f + gather_b}}


def recut_moved_rows(pieces: list, targets: list) -> list[int]:
    """Per rank, the rows that move in or out of it between its pieces and its targets."""
    def overlap(a: list, b: list) -> int:
        return sum(max(0, min(s + ln, t + m) - max(s, t)) for s, ln in a for t, m in b)
    return [sum(ln for _, ln in p) + sum(m for _, m in t) - 2 * overlap(p, t) for p, t in zip(pieces, targets)]


def transport_times(ring: dict, schedule: dict, *, bytes_per_row: int,
                    step_compute_s: list[float], rates) -> tuple[float, float, list[int]]:
    """The cost model's (ring pass s, all-gather pass s, bytes of each remote step): a ring
    pass overlaps each step's transfer with the previous step's kernels (time ~ sum
    max(compute, bytes / link) + a latency per step); LongNet's all-gather moves all the
    sparse rows first (time ~ bytes / all-gather rate + latency + compute)."""
    comp = step_compute_s + [0.0] * (len(schedule["steps"]) - len(step_compute_s))
    remote = [s for s in schedule["steps"] if s["offset"]]
    if not remote:
        return comp[0], comp[0], []
    lat = rates.step_latency_us * 1e-6
    per_step_bytes = []
    for s in remote:        # the most rows a receiving rank takes in the step
        rows = max((sum(kp[1] // g for kp, g in zip(schedule["pieces"][(j - s["offset"]) % ring["ring_size"]],
                                                     r["stride"]))
                    for j, r in enumerate(s["ranks"]) if r["recv"]), default=0)
        per_step_bytes.append(rows * bytes_per_row)
    ring_t = comp[0] + sum(max(c, b / (rates.link_gbytes_s * 1e9)) + lat
                           for c, b in zip(comp[1:], per_step_bytes))
    gather_t = sum(per_step_bytes) / (rates.allgather_gbytes_s * 1e9) + lat + sum(comp)
    return ring_t, gather_t, per_step_bytes


def choose_transport(ring: dict, schedule: dict, *, bytes_per_row: int,
                     step_compute_s: list[float], rates, free_bytes: int | None = None) -> str:
    """Cost model (transport_times): "allgather" when it is faster and the gathered rows
    fit in free_bytes, else "ring"."""
    if not any(s["offset"] for s in schedule["steps"]):
        return "ring"
    ring_t, gather_t, per_step = transport_times(ring, schedule, bytes_per_row=bytes_per_row,
                                                 step_compute_s=step_compute_s, rates=rates)
    if free_bytes is not None and sum(per_step) > free_bytes:
        return "ring"
    return "allgather" if gather_t < ring_t else "ring"


def pick_transport(costs: dict, gather_bytes: int | None = None, free_bytes: int | None = None) -> str:
    """The transport of transport_costs with the least fwd+bwd time: "local" whenever it can
    run (no transfer at all); "allgather" only where its gathered rows fit in free_bytes."""
    if "local" in costs:
        return "local"
    fits = free_bytes is None or gather_bytes is None or gather_bytes <= free_bytes
    names = [t for t in costs if t != "allgather" or fits]
    return min(names, key=lambda t: (costs[t]["fwd_bwd_s"], t))
