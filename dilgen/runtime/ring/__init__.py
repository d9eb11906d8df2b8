"""The ring (SPEC §2 "Ring", §3): one spec over the P ranks of a process group.

Rank j holds the rows of its piece(s) of the sequence (contiguous, or zigzag on request).
The schedule (dilgen.schedule) lists, per offset t, the windows rank j computes with the
keys of rank (j - t) mod P; the keys travel by batch_isend_irecv (NCCL, gloo) one step
ahead, or by one all-gather when the cost model says so. A sender ships only the rows the
receiving windows keep (kv head h keeps rows = h mod g, g = gcd of the rates, when every
branch reads in raster order with r | w). Memory per rank is O(N / P).

    sharding.py   which rows a rank holds (shard, unshard)
    agreement.py  every rank checks its inputs, and all pass or all fail together
    faults.py     a rank that fails mid-call makes every rank raise (RingAborted), never wait
    run.py        one call: pieces, schedule, transport, transfers, windows (RingRun)
    dropout.py    attention dropout: the refusal, the seed's proposal, a part-call's Counter
    heads.py      the transports that run the single-device kernels: local, heads (all-to-all)
    recut.py      the recut transport: rank borders moved onto segment borders, rows there and back
    executor.py   the forward and backward passes over a RingRun
    op.py         the doors: ring_attention, ring_varlen_attention (torch ops, autograd)

Packed rows (cu_seqlens over the whole row) use the same pieces; sequences may span rank
borders, and each window launches for the sequences with a segment meeting both pieces.
"""
from .faults import RingAborted, RingError
from .executor import ring_backward, ring_forward
from .op import ring_attention, ring_varlen_attention
from .run import RingRun
from .sharding import shard, unshard

__all__ = ["RingAborted", "RingError", "RingRun", "ring_attention", "ring_backward", "ring_forward",
           "ring_varlen_attention", "shard", "unshard"]
