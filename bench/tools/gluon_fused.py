"""Probe (issue 42): dilgen's fused dilated forward (every lattice branch of a query tile in
one program) in Triton's Gluon dialect for sm90, warp-specialized.

Query classes (docs/internals.md, "The kernels"): with every r_i | w_i and L = lcm(r_i), the
rows u = c + L·m, c = (h + d) mod L, are kept by exactly the branches with r_i | d. One
program takes 128 such rows of one head (two consumer warpgroups of 64) inside one segment of
the smallest w, and walks the keys of every branch that keeps them: branch i's lane
s_i·w_i + o_i + r_i·j (o_i = h mod r_i). LongNet's combination of the branches (eq. 10: out =
Σ_i e^(lse_i − lse) out_i, lse = log Σ_i e^(lse_i)) is the softmax over the union of the
branches' keys, so one online softmax runs over all of them: no merge pass.

Views (16-bit, contiguous (B, N, H, D) q and out; k, v (B, N, H_kv, D)): q as (B·N/L, L·H, D),
row b·N/L + m, column c·H + h; branch i's keys as (B·N/r_i, r_i·H_kv, D), row
b·N/r_i + s_i·w_i/r_i + j, column o_i·H_kv + h // G. One TMA descriptor per view.

A producer warp loads the blocks of every kept branch, in order, into a ring of STAGES K/V
buffers; the consumers see one stream of blocks (T of them) and never the branch. Block t's
softmax runs while block t − 1's P·V is on the tensor cores (FlashAttention-3's intra-
warpgroup overlap). Non-causal, one device, fixed length, every w_i a multiple of 128·L and
of BN·r_i, and a branch with r = 1 (every class keeps at least one branch)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                             warpgroup_mma, warpgroup_mma_wait)

BMW = gl.constexpr(64)          # query rows per consumer warpgroup


@gluon.jit
def _blocks(d, NB: gl.constexpr, W0: gl.constexpr, R0: gl.constexpr, W1: gl.constexpr, R1: gl.constexpr,
            W2: gl.constexpr, R2: gl.constexpr, BN: gl.constexpr):
    """Key blocks of a class-d tile: Σ over the branches with r_i | d of w_i / r_i / BN."""
    t = gl.where(d % R0 == 0, (W0 // R0) // BN, 0)
    if NB > 1:
        t += gl.where(d % R1 == 0, (W1 // R1) // BN, 0)
    if NB > 2:
        t += gl.where(d % R2 == 0, (W2 // R2) // BN, 0)
    return t


@gluon.jit
def _load_branch(it, kd, vd, k_smem, v_smem, k_ready, v_ready, kv_empty, b, h, d, u0, N,
                 W: gl.constexpr, R: gl.constexpr, HKV: gl.constexpr, G: gl.constexpr, D: gl.constexpr,
                 BN: gl.constexpr, STAGES: gl.constexpr):
    """Load one branch's key blocks for a class-d tile (if the branch keeps its rows); returns
    the ring position after them."""
    if d % R == 0:
        krow = b * (N // R) + (u0 // W) * (W // R)
        kcol = (h % R) * HKV + h // G
        for j in range((W // R) // BN):
            st = it % STAGES
            mbarrier.wait(kv_empty.index(st), ((it // STAGES) & 1) ^ 1)
            mbarrier.expect(k_ready.index(st), BN * D * 2)
            tma.async_copy_global_to_shared(kd, [krow + j * BN, kcol, 0], k_ready.index(st), k_smem.index(st))
            mbarrier.expect(v_ready.index(st), BN * D * 2)
            tma.async_copy_global_to_shared(vd, [krow + j * BN, kcol, 0], v_ready.index(st), v_smem.index(st))
            it += 1
    return it


@gluon.jit
def _producer(p, H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, NB: gl.constexpr, W0: gl.constexpr,
              R0: gl.constexpr, W1: gl.constexpr, R1: gl.constexpr, W2: gl.constexpr, R2: gl.constexpr,
              LAT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    (q_desc, o_desc, k_descs, v_descs, lse_ptr, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
     b, h, d, c, m0, N, qk_scale) = p
    G: gl.constexpr = H // HKV
    qrow = b * (N // LAT) + m0
    for wg in gl.static_range(2):
        mbarrier.expect(q_bars.index(wg), BMW * D * 2)
        tma.async_copy_global_to_shared(q_desc, [qrow + wg * BMW, c * H + h, 0], q_bars.index(wg), q_smem.index(wg))
    u0 = c + LAT * m0                       # the tile's first raster row
    it = _load_branch(d * 0, k_descs[0], v_descs[0], k_smem, v_smem, k_ready, v_ready, kv_empty, b, h, d, u0, N,
                      W0, R0, HKV, G, D, BN, STAGES)
    if NB > 1:
        it = _load_branch(it, k_descs[1], v_descs[1], k_smem, v_smem, k_ready, v_ready, kv_empty, b, h, d, u0, N,
                          W1, R1, HKV, G, D, BN, STAGES)
    if NB > 2:
        _load_branch(it, k_descs[2], v_descs[2], k_smem, v_smem, k_ready, v_ready, kv_empty, b, h, d, u0, N,
                     W2, R2, HKV, G, D, BN, STAGES)


@gluon.jit
def _consume(p, WG: gl.constexpr, H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, NB: gl.constexpr,
             W0: gl.constexpr, R0: gl.constexpr, W1: gl.constexpr, R1: gl.constexpr, W2: gl.constexpr,
             R2: gl.constexpr, LAT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    (q_desc, o_desc, k_descs, v_descs, lse_ptr, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
     b, h, d, c, m0, N, qk_scale) = p
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([BMW, BN], gl.float32, layout=s_layout)
    acc = gl.zeros([BMW, D], gl.float32, layout=o_layout)
    T = _blocks(d, NB, W0, R0, W1, R1, W2, R2, BN)

    mbarrier.wait(q_bars.index(WG), 0)
    q2 = q_smem.index(WG).reshape([BMW, D])
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q2, k_smem.index(0).reshape([BN, D]).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    x = s * qk_scale
    m_i = gl.max(x, axis=1)
    pj = gl.exp2(x - gl.expand_dims(m_i, 1))
    l_i = gl.sum(pj, axis=1)
    p_op = gl.convert_layout(pj.to(dtype), p_layout)
    for t in range(1, T):
        st = t % STAGES
        pst = (t - 1) % STAGES
        mbarrier.wait(k_ready.index(st), (t // STAGES) & 1)
        s_tok = warpgroup_mma(q2, k_smem.index(st).reshape([BN, D]).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        mbarrier.wait(v_ready.index(pst), ((t - 1) // STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(pst).reshape([BN, D]), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok,))     # block t's scores; t - 1's P V still running
        x = s * qk_scale
        m_new = gl.maximum(m_i, gl.max(x, axis=1))
        alpha = gl.exp2(m_i - m_new)
        pj = gl.exp2(x - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(pj, axis=1)
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=(o_tok,))
        mbarrier.arrive(kv_empty.index(pst), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(pj.to(dtype), p_layout)
    lst = (T - 1) % STAGES
    mbarrier.wait(v_ready.index(lst), ((T - 1) // STAGES) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(lst).reshape([BN, D]), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))
    mbarrier.arrive(kv_empty.index(lst), count=1)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = (acc / gl.expand_dims(l_o, 1)).to(dtype)
    q_smem.index(WG).reshape([BMW, D]).store(out)          # the warpgroup's Q buffer holds its output
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b * (N // LAT) + m0 + WG * BMW, c * H + h, 0], q_smem.index(WG))
    rows = c + LAT * (m0 + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_layout)))
    gl.store(lse_ptr + (b * H + h).to(gl.int64) * N + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(pendings=0)


@gluon.jit
def _consumer0(p, H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, NB: gl.constexpr, W0: gl.constexpr,
               R0: gl.constexpr, W1: gl.constexpr, R1: gl.constexpr, W2: gl.constexpr, R2: gl.constexpr,
               LAT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    _consume(p, 0, H, HKV, D, NB, W0, R0, W1, R1, W2, R2, LAT, BN, STAGES)


@gluon.jit
def _consumer1(p, H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, NB: gl.constexpr, W0: gl.constexpr,
               R0: gl.constexpr, W1: gl.constexpr, R1: gl.constexpr, W2: gl.constexpr, R2: gl.constexpr,
               LAT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    _consume(p, 1, H, HKV, D, NB, W0, R0, W1, R1, W2, R2, LAT, BN, STAGES)


@gluon.jit
def fused_fwd(q_desc, o_desc, k0, k1, k2, v0, v1, v2, lse_ptr, qk_scale, N,
              H: gl.constexpr, HKV: gl.constexpr, D: gl.constexpr, NB: gl.constexpr, W0: gl.constexpr,
              R0: gl.constexpr, W1: gl.constexpr, R1: gl.constexpr, W2: gl.constexpr, R2: gl.constexpr,
              LAT: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
              num_warps: gl.constexpr):
    """Grid (N / L / 128 tiles, B·H, L classes). Class d's programs of head h hold rows
    c + L·m, c = (h + d) mod L, m in [128·tile, 128·tile + 128)."""
    dtype: gl.constexpr = q_desc.dtype
    k_descs = (k0, k1, k2)        # one per branch (unused ones repeat a used one): Triton 3.6's
    v_descs = (v0, v1, v2)        # launcher takes no tuple of descriptors as an argument
    m0 = gl.program_id(0) * (2 * BMW)
    b = gl.program_id(1) // H
    h = gl.program_id(1) % H
    d = gl.program_id(2)
    c = (h + d) % LAT

    q_smem = gl.allocate_shared_memory(dtype, [2, BMW, 1, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, 1, D], k_descs[0].layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, 1, D], v_descs[0].layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)     # both consumers release a stage
    fence_async_shared()

    p = (q_desc, o_desc, k_descs, v_descs, lse_ptr, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, d, c, m0, N, qk_scale)
    # the argument tuples are written out: a tuple held in a variable turns its constexprs into tensors
    gl.warp_specialize([(_consumer0, (p, H, HKV, D, NB, W0, R0, W1, R1, W2, R2, LAT, BN, STAGES)),
                        (_consumer1, (p, H, HKV, D, NB, W0, R0, W1, R1, W2, R2, LAT, BN, STAGES)),
                        (_producer, (p, H, HKV, D, NB, W0, R0, W1, R1, W2, R2, LAT, BN, STAGES))],
                       [4, 1], [CONSUMER_REGS, 24])
