"""Probe (issue 42): one dilated branch's forward written in Triton's Gluon dialect for sm90.

A lane of a branch (segment length w, dilation r) is the attention of the rows
s·w + o + r·j (j < L = w/r) of one head among themselves (LongNet eq. 5 for one segment s and
offset o). Because r | w, the lane rows of every segment and batch element form one strided
progression: in the contiguous (B, N, H, D) tensor viewed as (B·N/r, r·H, D), row
b·N/r + s·L + j, column o·H + h is token b, s·w + o + r·j, head h. One TMA descriptor of that
view, block [BM, 1, D], loads the dilated rows of any lane straight into shared memory.

The kernel: one program per (query tile, lane, head); head h keeps offset o = h mod r; Q by TMA; K and V through a
ring of STAGES shared buffers filled by TMA ahead of use (mbarrier per stage); S = Q Kᵀ and
O += P V by asynchronous warpgroup MMAs; online softmax in base 2 (FlashAttention-2's
rescale). PIPE = 1 issues the next block's Q Kᵀ before this block's softmax (FlashAttention-3's
intra-warpgroup overlap). Writes out (B, N, H, D) and lse (B, H, N), natural log.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                             warpgroup_mma, warpgroup_mma_init,
                                                             warpgroup_mma_wait)

LOG2E = 1.4426950408889634


@gluon.jit
def lane_fwd(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, N,
             H: gl.constexpr, R: gl.constexpr, W: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
             D: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr, num_warps: gl.constexpr):
    L: gl.constexpr = W // R
    N_K: gl.constexpr = L // BN
    dtype: gl.constexpr = q_desc.dtype
    pid_m = gl.program_id(0)
    lane = gl.program_id(1)              # b · (N / w) + segment
    h = gl.program_id(2)
    o = h % R                            # head h keeps the offsets t mod r = h mod r (SPEC §2)
    ho = o * H + h                       # the view's column
    row0 = lane * L                      # the lane's first row in the (B·N/r, r·H, D) view
    q_row = row0 + pid_m * BM

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)

    q_smem = gl.allocate_shared_memory(dtype, [BM, 1, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, 1, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, 1, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_bar.index(i), count=1)
    fence_async_shared()

    kv_bytes: gl.constexpr = 2 * BN * D * 2
    mbarrier.expect(q_bar, BM * D * 2)
    tma.async_copy_global_to_shared(q_desc, [q_row, ho, 0], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        if i < N_K:
            mbarrier.expect(kv_bar.index(i), kv_bytes)
            tma.async_copy_global_to_shared(k_desc, [row0 + i * BN, ho, 0], kv_bar.index(i), k_smem.index(i))
            tma.async_copy_global_to_shared(v_desc, [row0 + i * BN, ho, 0], kv_bar.index(i), v_smem.index(i))

    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.full([BM], 0.0, gl.float32, layout=gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros([BM, BN], gl.float32, layout=s_layout)
    o_tok = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, layout=o_layout))

    mbarrier.wait(q_bar, 0)
    q2 = q_smem.reshape([BM, D])
    mbarrier.wait(kv_bar.index(0), 0)
    s_tok = warpgroup_mma(q2, k_smem.index(0).reshape([BN, D]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
    for j in range(N_K):
        st = j % STAGES
        s, acc = warpgroup_mma_wait(0, deps=(s_tok, o_tok))
        if j > 0:
            # block j - 1's K and V are read: its stage takes block j - 1 + STAGES
            if j - 1 + STAGES < N_K:
                pst = (j - 1) % STAGES
                mbarrier.expect(kv_bar.index(pst), kv_bytes)
                tma.async_copy_global_to_shared(k_desc, [row0 + (j - 1 + STAGES) * BN, ho, 0], kv_bar.index(pst),
                                                k_smem.index(pst))
                tma.async_copy_global_to_shared(v_desc, [row0 + (j - 1 + STAGES) * BN, ho, 0], kv_bar.index(pst),
                                                v_smem.index(pst))
        if PIPE:
            if j + 1 < N_K:       # the next block's scores run on the tensor cores during the softmax
                nst = (j + 1) % STAGES
                mbarrier.wait(kv_bar.index(nst), ((j + 1) // STAGES) & 1)
                s_tok = warpgroup_mma(q2, k_smem.index(nst).reshape([BN, D]).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
        x = s * qk_scale
        m_new = gl.maximum(m_i, gl.max(x, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(x - gl.expand_dims(m_new, 1))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        m_i = m_new
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        o_tok = warpgroup_mma(p_op, v_smem.index(st).reshape([BN, D]), acc, is_async=True)
        if not PIPE:
            if j + 1 < N_K:
                nst = (j + 1) % STAGES
                mbarrier.wait(kv_bar.index(nst), ((j + 1) // STAGES) & 1)
                s_tok = warpgroup_mma(q2, k_smem.index(nst).reshape([BN, D]).permute((1, 0)), s_zero,
                                      use_acc=False, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(kv_bar.index(i))

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = (acc / gl.expand_dims(l_o, 1)).to(dtype)
    q_smem.reshape([BM, D]).store(out)       # Q's buffer holds the output tile
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, ho, 0], q_smem)

    # lse (natural log) of each query row: token b, s·w + o + r·j, head h
    seg_per_b = N // W
    b = lane // seg_per_b
    seg = lane % seg_per_b
    jj = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    tok = seg * W + o + R * jj
    gl.store(lse_ptr + (b * H + h) * N + tok, (m_i + gl.log2(l_i)) / 1.4426950408889634)
    tma.store_wait(pendings=0)


# -- warp-specialized: a producer warp and two consumer warpgroups (FlashAttention-3's shape) --
# The CTA's 128 query rows are two tiles of 64, one per consumer warpgroup; one producer warp
# fills a ring of K and V stages by TMA (k_ready / v_ready per stage) and refills a stage once
# both consumers have arrived on its kv_empty barrier.
@gluon.jit
def _ws_producer(p, H: gl.constexpr, R: gl.constexpr, W: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                 STAGES: gl.constexpr, PIPE: gl.constexpr):
    (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
     turns, row0, q_row0, ho, h, lane, qk_scale, N) = p
    N_K: gl.constexpr = (W // R) // BN
    BMW: gl.constexpr = q_desc.block_type.shape[0]
    for wg in gl.static_range(2):
        mbarrier.expect(q_bars.index(wg), BMW * D * 2)
        tma.async_copy_global_to_shared(q_desc, [q_row0 + wg * BMW, ho, 0], q_bars.index(wg), q_smem.index(wg))
    for j in range(N_K):
        st = j % STAGES
        mbarrier.wait(kv_empty.index(st), ((j // STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(st), BN * D * 2)
        tma.async_copy_global_to_shared(k_desc, [row0 + j * BN, ho, 0], k_ready.index(st), k_smem.index(st))
        mbarrier.expect(v_ready.index(st), BN * D * 2)
        tma.async_copy_global_to_shared(v_desc, [row0 + j * BN, ho, 0], v_ready.index(st), v_smem.index(st))


@gluon.jit
def _ws_consume(p, WG: gl.constexpr, H: gl.constexpr, R: gl.constexpr, W: gl.constexpr, BN: gl.constexpr,
                D: gl.constexpr, STAGES: gl.constexpr, PIPE: gl.constexpr):
    (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
     turns, row0, q_row0, ho, h, lane, qk_scale, N) = p
    N_K: gl.constexpr = (W // R) // BN
    BMW: gl.constexpr = q_desc.block_type.shape[0]
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([BMW, BN], gl.float32, layout=s_layout)
    acc = gl.zeros([BMW, D], gl.float32, layout=o_layout)

    mbarrier.wait(q_bars.index(WG), 0)
    q2 = q_smem.index(WG).reshape([BMW, D])
    # block 0's scores and softmax
    PING: gl.constexpr = (PIPE & 2) != 0
    mbarrier.wait(k_ready.index(0), 0)
    if PING:    # the two warpgroups take turns to issue their MMAs (FlashAttention-3's ping-pong)
        mbarrier.wait(turns.index(WG), 1 - WG)
    s_tok = warpgroup_mma(q2, k_smem.index(0).reshape([BN, D]).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PING:
        mbarrier.arrive(turns.index(1 - WG), count=1)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    x = s * qk_scale
    m_i = gl.max(x, axis=1)
    pj = gl.exp2(x - gl.expand_dims(m_i, 1))
    l_i = gl.sum(pj, axis=1)
    p_op = gl.convert_layout(pj.to(dtype), p_layout)
    for j in range(1, N_K):
        st = j % STAGES
        pst = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(pst), ((j - 1) // STAGES) & 1)
        if PING:
            mbarrier.wait(turns.index(WG), (j & 1) ^ (1 - WG))
        s_tok = warpgroup_mma(q2, k_smem.index(st).reshape([BN, D]).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        o_tok = warpgroup_mma(p_op, v_smem.index(pst).reshape([BN, D]), acc, is_async=True)
        if PING:
            mbarrier.arrive(turns.index(1 - WG), count=1)
        if PIPE & 1:    # block j's softmax runs while block j - 1's P V is on the tensor cores
            s = warpgroup_mma_wait(1, deps=(s_tok,))
        else:
            s = warpgroup_mma_wait(0, deps=(s_tok,))
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
    lst: gl.constexpr = (N_K - 1) % STAGES
    mbarrier.wait(v_ready.index(lst), ((N_K - 1) // STAGES) & 1)
    if PING:
        mbarrier.wait(turns.index(WG), (N_K & 1) ^ (1 - WG))
    o_tok = warpgroup_mma(p_op, v_smem.index(lst).reshape([BN, D]), acc, is_async=True)
    if PING:
        mbarrier.arrive(turns.index(1 - WG), count=1)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))
    mbarrier.arrive(kv_empty.index(lst), count=1)

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = (acc / gl.expand_dims(l_o, 1)).to(dtype)
    q_smem.index(WG).reshape([BMW, D]).store(out)      # this warpgroup's Q buffer holds its output
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row0 + WG * BMW, ho, 0], q_smem.index(WG))
    o = ho // H
    seg_per_b = N // W
    jj = (q_row0 - row0) + WG * BMW + gl.arange(0, BMW, layout=gl.SliceLayout(1, s_layout))
    tok = (lane % seg_per_b) * W + o + R * jj
    gl.store(lse_ptr + ((lane // seg_per_b) * H + h) * N + tok, (m_i + gl.log2(l_i)) / 1.4426950408889634)
    tma.store_wait(pendings=0)


@gluon.jit
def _ws_consumer0(p, H: gl.constexpr, R: gl.constexpr, W: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr, PIPE: gl.constexpr):
    _ws_consume(p, 0, H, R, W, BN, D, STAGES, PIPE)


@gluon.jit
def _ws_consumer1(p, H: gl.constexpr, R: gl.constexpr, W: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr, PIPE: gl.constexpr):
    _ws_consume(p, 1, H, R, W, BN, D, STAGES, PIPE)


@gluon.jit
def lane_fwd_ws(q_desc, k_desc, v_desc, o_desc, lse_ptr, qk_scale, N,
                H: gl.constexpr, R: gl.constexpr, W: gl.constexpr, BN: gl.constexpr, D: gl.constexpr,
                STAGES: gl.constexpr, PIPE: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr):
    L: gl.constexpr = W // R
    BMW: gl.constexpr = q_desc.block_type.shape[0]       # 64 rows per consumer warpgroup
    dtype: gl.constexpr = q_desc.dtype
    lane = gl.program_id(1)
    h = gl.program_id(2)
    ho = (h % R) * H + h
    row0 = lane * L
    q_row0 = row0 + gl.program_id(0) * (2 * BMW)

    q_smem = gl.allocate_shared_memory(dtype, [2, BMW, 1, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, 1, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BN, 1, D], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
        mbarrier.init(turns.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)     # both consumers release a stage
    fence_async_shared()

    p = (q_desc, k_desc, v_desc, o_desc, lse_ptr, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         turns, row0, q_row0, ho, h, lane, qk_scale, N)
    gl.warp_specialize([
        (_ws_consumer0, (p, H, R, W, BN, D, STAGES, PIPE)),
        (_ws_consumer1, (p, H, R, W, BN, D, STAGES, PIPE)),
        (_ws_producer, (p, H, R, W, BN, D, STAGES, PIPE)),
    ], [4, 1], [CONSUMER_REGS, 24])
