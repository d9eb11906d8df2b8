"""The ring (SPEC §2 "Ring", §3): one spec over the P ranks of a process group.

Files: sharding.py (which rows a rank holds), agreement.py (checks every rank passes or
fails together), executor.py (schedule, forward, backward, autograd).

Rank j holds the rows of its piece(s) of the sequence (contiguous by default; zigzag on
request). The schedule (dilgen.ir.ring_schedule, the same pure function on every rank)
lists, per offset t, the windows (query piece, key piece, branch mask) that rank j
computes with the keys of rank (j - t) mod P; offsets with nothing to do anywhere are not
in it. For each remaining offset the keys travel by `torch.distributed.batch_isend_irecv`
(NCCL on GPUs, gloo on CPUs), posted one step ahead into their own buffers so that the
transfer overlaps the kernels of the step before. A sender ships only the rows the
receiving windows keep: when every branch of a window reads in raster order with r | w,
kv head h keeps the rows = h mod g (g = gcd of the r), 1/g of the bytes.

Forward: each window's kernel merges its partial (out, lse) into an fp32 accumulator in
its epilogue: lse = log(e^lse_a + e^lse_b), out = (e^lse_a out_a + e^lse_b out_b) / e^lse
(LongNet Eq. 10 applied to partial key sets). Backward: dQ accumulates locally; the
partial dK, dV of remote keys go back to their owner along the reversed schedule and are
added there in fp32. Memory per rank is O(N / P) (plus int32 curve tables of N entries
for Hilbert-ordered specs).

Packed rows (cu_seqlens over the whole row, ring_varlen_attention): the same contiguous
chunks, sequences may span rank borders. dilgen.ir.ring_schedule_packed launches a window
for the sequences that have a segment (restarting at the sequence's first row) meeting both
its pieces; the kernels run with VARLEN, program b taking one such sequence and the
windows in positions local to it (templates/common.jinja ring_varlen_window). Keys travel
uncompacted (a branch's kept rows follow each sequence's start). Eager only: no
torch.ops op, so no torch.compile graph for packed ring calls yet.
"""
from .agreement import RingError
from .executor import RingRun, ring_attention, ring_backward, ring_forward, ring_varlen_attention
from .sharding import shard, unshard

__all__ = ["RingError", "RingRun", "ring_attention", "ring_backward", "ring_forward",
           "ring_varlen_attention", "shard", "unshard"]
