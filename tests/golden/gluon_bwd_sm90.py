# ---- sm90: the fused dK, dV in Gluon (KernelConfig.gluon_dkdv; runtime/backward.py launches it
# on a GPU for fixed-length rows whose every segment is whole, gb_bwd_dkdv_fused otherwise) ----

GLUON_LANES = gl.constexpr(64)          # keys per consumer warpgroup (a program takes two); query lanes per block
GLUON_BWD_STAGES = gl.constexpr(4)   # Q / dO blocks in flight (the shared-memory ring)


@gluon.jit
def gb_gluon_dkdv_load_branch(it, qd, dod, q_smem, do_smem, ready, empty, b, h, c, u0, N,
                        W: gl.constexpr, R: gl.constexpr):
    """Queue the query blocks of one branch (w = W, r = R) of head h for a class-c key tile
    whose first row is u0, if the branch keeps the class (R | c - o); `it` counts the blocks
    queued before. The segment's lanes are the rows b*N/R + s*W/R + j of Q's and dO's
    (B*N/R, R*H, D) views, column o*H + h (o = h mod R)."""
    if (c - h) % R == 0:
        row0 = b * (N // R) + (u0 // W) * (W // R)
        col = (h % R) * 16 + h
        for j in range((W // R) // GLUON_LANES):
            st = it % GLUON_BWD_STAGES
            mbarrier.wait(empty.index(st), ((it // GLUON_BWD_STAGES) & 1) ^ 1)   # both consumers let go of it
            mbarrier.expect(ready.index(st), 2 * GLUON_LANES * 128 * 2)
            tma_load(qd, [row0 + j * GLUON_LANES, col, 0], ready.index(st), q_smem.index(st))
            tma_load(dod, [row0 + j * GLUON_LANES, col, 0], ready.index(st), do_smem.index(st))
            it += 1
    return it


@gluon.jit
def gb_gluon_dkdv_load_packed(it, qd, dod, Q, DO, q_smem, do_smem, ready, empty, h, c, u0, s0, n,
                             W: gl.constexpr, R: gl.constexpr):
    """Packed rows: gb_gluon_dkdv_load_branch for the sequence of n rows at row s0. Head h's
    query lanes of the segment holding u0 are the rows p0 + R*j (p0 = s0 + segment start +
    offset): the rows p0 // R + j, column (p0 mod R)*H + h of the (rows/R, R*H, D) views. A
    lane's partial last block reads Q and dO through descriptors that end at its last row
    (zeros past it: P is 0 there, and 0 times another sequence's non-finite value would not be)."""
    hb = h
    cnt = gb_gluon_lane_keys((c - hb % 4 + 4) % 4, u0, n, hb, W, R)
    p0 = s0 + (u0 // W) * W + hb % R
    row0 = p0 // R
    col = (p0 % R) * 16 + h
    for j in range((cnt + GLUON_LANES - 1) // GLUON_LANES):
        st = it % GLUON_BWD_STAGES
        mbarrier.wait(empty.index(st), ((it // GLUON_BWD_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(st), 2 * GLUON_LANES * 128 * 2)
        if (j + 1) * GLUON_LANES > cnt:
            tma_load(gb_gluon_lane_box(Q, p0, h, cnt, R, qd), [j * GLUON_LANES, 0, 0], ready.index(st),
                     q_smem.index(st))
            tma_load(gb_gluon_lane_box(DO, p0, h, cnt, R, dod), [j * GLUON_LANES, 0, 0], ready.index(st),
                     do_smem.index(st))
        else:
            tma_load(qd, [row0 + j * GLUON_LANES, col, 0], ready.index(st), q_smem.index(st))
            tma_load(dod, [row0 + j * GLUON_LANES, col, 0], ready.index(st), do_smem.index(st))
        it += 1
    return it


@gluon.jit
def gb_gluon_dkdv_producer(p, PACKED: gl.constexpr):
    """One warp: the tile's K and V, then for each query head of the kv group every kept
    branch's query blocks, in branch order."""
    if PACKED:
        (qds, dods, k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
         b, kvh, c, m0, N, s0, n, Q, DO) = p
        krow, kcol = (s0 + c) // 4, ((s0 + c) % 4) * 4 + kvh
    else:
        (qds, dods, k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
         b, kvh, c, m0, N) = p
        krow, kcol = b * (N // 4), c * 4 + kvh
    mbarrier.expect(kv_bar, 4 * GLUON_LANES * 128 * 2)
    for wg in gl.static_range(2):
        tma_load(k_desc, [krow + m0 + wg * GLUON_LANES, kcol, 0], kv_bar, k_smem.index(wg))
        tma_load(v_desc, [krow + m0 + wg * GLUON_LANES, kcol, 0], kv_bar, v_smem.index(wg))
    u0 = c + 4 * m0
    it = c * 0
    for g in range(4):
        h = kvh * 4 + g
        if PACKED:
            it = gb_gluon_dkdv_load_packed(it, qds[0], dods[0], Q, DO, q_smem, do_smem, ready,
                                           empty, h, c, u0, s0, n, 2048, 1)
        else:
            it = gb_gluon_dkdv_load_branch(it, qds[0], dods[0], q_smem, do_smem, ready, empty,
                                           b, h, c, u0, N, 2048, 1)  # branch 0
        if PACKED:
            it = gb_gluon_dkdv_load_packed(it, qds[1], dods[1], Q, DO, q_smem, do_smem, ready,
                                           empty, h, c, u0, s0, n, 4096, 2)
        else:
            it = gb_gluon_dkdv_load_branch(it, qds[1], dods[1], q_smem, do_smem, ready, empty,
                                           b, h, c, u0, N, 4096, 2)  # branch 1
        if PACKED:
            it = gb_gluon_dkdv_load_packed(it, qds[2], dods[2], Q, DO, q_smem, do_smem, ready,
                                           empty, h, c, u0, s0, n, 8192, 4)
        else:
            it = gb_gluon_dkdv_load_branch(it, qds[2], dods[2], q_smem, do_smem, ready, empty,
                                           b, h, c, u0, N, 8192, 4)  # branch 2


@gluon.jit
def gb_gluon_dkdv_stats(Lse, Delta, lanes, j, R: gl.constexpr, offs, cnt, PACKED: gl.constexpr):
    """lse and Delta of the query lanes of block j. PACKED: `lanes` is the lane's first
    position in Lse (a scalar) and `offs` the lanes' offsets from it in a block (int32: fewer
    registers held between blocks than 64-bit positions); a lane past the lane's count reads
    lse = inf and Delta = 0, so that its P^T and dS^T are 0."""
    if PACKED:
        real = offs < (cnt - j * GLUON_LANES) * R
        at = lanes + j * (GLUON_LANES * R) + offs
        return gl.load(Lse + at, mask=real, other=float("inf")), gl.load(Delta + at, mask=real, other=0.0)
    else:
        at = lanes + j * (GLUON_LANES * R)
        return gl.load(Lse + at), gl.load(Delta + at)


@gluon.jit
def gb_gluon_dkdv_branch(it, dk, dv, k, v, q_smem, do_smem, ready, empty, Lse, Delta, b, h, c, u0, N, s0, n,
                   W: gl.constexpr, R: gl.constexpr, PACKED: gl.constexpr):
    """One consumer warpgroup's 64 keys against the branch's query blocks (as the producer
    queued them): S^T = K Q^T, P^T = exp2(S^T*scale*log2(e) - lse*log2(e)), dV += P^T dO,
    dP^T = V dO^T, dS^T = P^T (dP^T - Delta), dK += dS^T Q. PACKED: the lanes of the
    sequence of n rows at row s0, lse and Delta (H, rows)."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, GLUON_LANES, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    if (c - h) % R == 0:
        s_zero = gl.zeros([GLUON_LANES, GLUON_LANES], gl.float32, layout=s_layout)
        if PACKED:
            hb = h
            cnt = gb_gluon_lane_keys((c - hb % 4 + 4) % 4, u0, n, hb, W, R)
            lanes = h.to(gl.int64) * N + s0 + (u0 // W) * W + hb % R
            offs = gl.arange(0, GLUON_LANES, layout=gl.SliceLayout(0, s_layout)) * R
            blocks = (cnt + GLUON_LANES - 1) // GLUON_LANES
        else:
            cnt, offs = 0, 0
            lanes = (b * 16 + h).to(gl.int64) * N + (u0 // W) * W + h % R \
                + gl.arange(0, GLUON_LANES, layout=gl.SliceLayout(0, s_layout)) * R
            blocks = (W // R) // GLUON_LANES
        for j in range(blocks):
            # this block's lse and Delta, in flight while the producer's stage is awaited
            lse, delta = gb_gluon_dkdv_stats(Lse, Delta, lanes, j, R, offs, cnt, PACKED)
            lse = lse * 1.4426950408889634
            st = it % GLUON_BWD_STAGES
            mbarrier.wait(ready.index(st), (it // GLUON_BWD_STAGES) & 1)
            qj = q_smem.index(st).reshape([GLUON_LANES, 128])
            doj = do_smem.index(st).reshape([GLUON_LANES, 128])
            s_tok = warpgroup_mma(k, qj.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(v, doj.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok,))
            pt = gl.exp2(s * 0.12751743082459868 - gl.expand_dims(lse, 0))
            dv_tok = warpgroup_mma(gl.convert_layout(pt.to(dtype), a_layout), doj, dv, is_async=True)
            dpt = warpgroup_mma_wait(1, deps=(dp_tok,))
            dst = pt * (dpt - gl.expand_dims(delta, 0))
            dk_tok = warpgroup_mma(gl.convert_layout(dst.to(dtype), a_layout), qj, dk, is_async=True)
            dv = warpgroup_mma_wait(1, deps=(dv_tok,))
            dk = warpgroup_mma_wait(0, deps=(dk_tok,))
            mbarrier.arrive(empty.index(st), count=1)
            it += 1
    return it, dk, dv


@gluon.jit
def gb_gluon_dkdv_consume(p, WG: gl.constexpr, PACKED: gl.constexpr):
    """One consumer warpgroup: keys m0 + WG*64 ... of the tile, dK and dV in registers over
    every kept branch of every head of the group; written once, dK times the softmax scale.
    PACKED: keys of one sequence of packed rows; keys past its end are not stored."""
    if PACKED:
        (qds, dods, k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
         b, kvh, c, m0, N, s0, n, Q, DO) = p
    else:
        (qds, dods, k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
         b, kvh, c, m0, N) = p
        s0, n = 0, 0
    dtype: gl.constexpr = q_smem.dtype
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 16])
    dk = gl.zeros([GLUON_LANES, 128], gl.float32, layout=o_layout)
    dv = gl.zeros([GLUON_LANES, 128], gl.float32, layout=o_layout)
    mbarrier.wait(kv_bar, 0)
    k = k_smem.index(WG).reshape([GLUON_LANES, 128])
    v = v_smem.index(WG).reshape([GLUON_LANES, 128])
    u0 = c + 4 * m0
    it = c * 0
    for g in range(4):
        h = kvh * 4 + g
        it, dk, dv = gb_gluon_dkdv_branch(it, dk, dv, k, v, q_smem, do_smem, ready, empty, Lse, Delta, b, h, c, u0, N,
                                          s0, n, 2048, 1, PACKED)  # branch 0
        it, dk, dv = gb_gluon_dkdv_branch(it, dk, dv, k, v, q_smem, do_smem, ready, empty, Lse, Delta, b, h, c, u0, N,
                                          s0, n, 4096, 2, PACKED)  # branch 1
        it, dk, dv = gb_gluon_dkdv_branch(it, dk, dv, k, v, q_smem, do_smem, ready, empty, Lse, Delta, b, h, c, u0, N,
                                          s0, n, 8192, 4, PACKED)  # branch 2
    keys = c + 4 * (m0 + WG * GLUON_LANES + gl.arange(0, GLUON_LANES, layout=gl.SliceLayout(1, o_layout)))
    dcols = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
    if PACKED:
        at = gl.expand_dims(keys, 1)
        offs = ((s0 + at).to(gl.int64) * 4 + kvh) * 128 + gl.expand_dims(dcols, 0)
        gl.store(DK + offs, (dk * 0.08838834764831843).to(dtype), mask=at < n)
        gl.store(DV + offs, dv.to(dtype), mask=at < n)
    else:
        offs = ((b * N + gl.expand_dims(keys, 1)).to(gl.int64) * 4 + kvh) * 128 + gl.expand_dims(dcols, 0)
        gl.store(DK + offs, (dk * 0.08838834764831843).to(dtype))
        gl.store(DV + offs, dv.to(dtype))


@gluon.jit
def gb_gluon_dkdv_consumer0(p):
    gb_gluon_dkdv_consume(p, 0, False)


@gluon.jit
def gb_gluon_dkdv_consumer1(p):
    gb_gluon_dkdv_consume(p, 1, False)


@gluon.jit
def gb_gluon_dkdv_fixed_producer(p):
    gb_gluon_dkdv_producer(p, False)


@gluon.jit
def gb_gluon_dkdv_packed_consumer0(p):
    gb_gluon_dkdv_consume(p, 0, True)


@gluon.jit
def gb_gluon_dkdv_packed_consumer1(p):
    gb_gluon_dkdv_consume(p, 1, True)


@gluon.jit
def gb_gluon_dkdv_packed_producer(p):
    gb_gluon_dkdv_producer(p, True)


@gluon.jit
def gb_gluon_dkdv(q0, q1, q2, do0, do1, do2, k_desc, v_desc, Lse, Delta, DK, DV, N):
    """Notation (as in gb_bwd_dkdv_fused, whose work this is).
    q<i>, do<i>     branch i's query lanes: q and dO as (B*N/r, r*H, D), boxes of 64 lanes
    k_desc, v_desc  k and v as (B*N/L, L*H_kv, D): row b*N/L + m, column c*H_kv + kvh is key
                    u = c + L*m of kv head kvh (L = 4); boxes of 64 keys
    Lse, Delta      (B, H, N) float32: the forward's lse (natural log), rowsum(dO*O) - dlse
    DK, DV          (B, N, H_kv, D) contiguous, in k's dtype: every row written once
    program         (c + L*t, b*H_kv + kvh): key class c of tile t (128 keys u = c + L*m); the
                    classes of a tile run side by side, as they read the same query lanes (L2)
    Two consumer warpgroups of 64 keys and one producer warp (gl.warp_specialize); the
    producer fills a ring of GLUON_BWD_STAGES Q/dO blocks (ready), a stage returns to it once
    both consumers arrived on its `empty`. Every segment whole (runtime/backward.py)."""
    dtype: gl.constexpr = k_desc.dtype
    c = gl.program_id(0) % 4
    m0 = (gl.program_id(0) // 4) * (2 * GLUON_LANES)
    b = gl.program_id(1) // 4
    kvh = gl.program_id(1) % 4
    k_smem = gl.allocate_shared_memory(dtype, [2, GLUON_LANES, 1, 128], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, GLUON_LANES, 1, 128], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [GLUON_BWD_STAGES, GLUON_LANES, 1, 128], q0.layout)
    do_smem = gl.allocate_shared_memory(dtype, [GLUON_BWD_STAGES, GLUON_LANES, 1, 128], do0.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [GLUON_BWD_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [GLUON_BWD_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(GLUON_BWD_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    p = ((q0, q1, q2), (do0, do1, do2), k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem,
         kv_bar, ready, empty, b, kvh, c, m0, N)
    gl.warp_specialize([(gb_gluon_dkdv_consumer0, (p,)), (gb_gluon_dkdv_consumer1, (p,)), (gb_gluon_dkdv_fixed_producer, (p,))],
                       [4, 1], [240, 24])


@gluon.jit
def gb_gluon_dkdv_packed(q0, q1, q2, do0, do1, do2, k_desc, v_desc, Q, DO, Lse, Delta, DK, DV, SeqStart, SeqLen, rows):
    """The dK/dV over packed rows (runtime.varlen): gb_gluon_dkdv's work for sequence b of the
    launch group, rows SeqStart[b] + [0, SeqLen[b]), its segments from its first row; views
    over all the rows as gb_gluon_fwd_packed's (rows a multiple of L). Q, DO: q and dO
    (rows, H, D), whose lanes' partial last blocks are read through descriptors made here;
    Lse, Delta (H, rows); DK, DV (rows, H_kv, D). A tile past the sequence's end does nothing."""
    dtype: gl.constexpr = k_desc.dtype
    c = gl.program_id(0) % 4
    m0 = (gl.program_id(0) // 4) * (2 * GLUON_LANES)
    b = gl.program_id(1) // 4
    kvh = gl.program_id(1) % 4
    s0 = gl.load(SeqStart + b)
    n = gl.load(SeqLen + b)
    if c + 4 * m0 >= n:
        return
    k_smem = gl.allocate_shared_memory(dtype, [2, GLUON_LANES, 1, 128], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, GLUON_LANES, 1, 128], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [GLUON_BWD_STAGES, GLUON_LANES, 1, 128], q0.layout)
    do_smem = gl.allocate_shared_memory(dtype, [GLUON_BWD_STAGES, GLUON_LANES, 1, 128], do0.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [GLUON_BWD_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [GLUON_BWD_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(GLUON_BWD_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    p = ((q0, q1, q2), (do0, do1, do2), k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem,
         kv_bar, ready, empty, b, kvh, c, m0, rows, s0, n, Q, DO)
    gl.warp_specialize([(gb_gluon_dkdv_packed_consumer0, (p,)), (gb_gluon_dkdv_packed_consumer1, (p,)),
                        (gb_gluon_dkdv_packed_producer, (p,))], [4, 1], [240, 24])

