# ---- sm90: the dK, dV and dQ per branch in Gluon (KernelConfig.gluon_lanes_bwd;
# runtime/backward.py launches them on a GPU for fixed-length rows whose every segment is whole,
# gla_bwd_dkdv and gla_bwd_dq_lanes otherwise) ----

GLUON_LBWD_STAGES = gl.constexpr(4)   # Q/dO (dK, dV) or K/V (dQ) blocks in flight


@gluon.jit
def gla_gluon_dkdv_lanes_producer(p):
    """One warp: the tile's K and V (two boxes of 64 key lanes), then for each query head of
    the group with the tile's offset its query and dO blocks of 64 lanes from the diagonal on."""
    (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
     b, kvh, s, g0, jt, N, W, R, NO, pt_smem, ds_smem) = p
    row0 = b * (N // R) + s * (W // R)
    o = (kvh * 4 + g0) % R
    mbarrier.expect(kv_bar, 4 * 64 * 128 * 2)
    for wg in gl.static_range(2):
        tma_load(k_desc, [row0 + jt * 128 + wg * 64, o * 4 + kvh, 0], kv_bar, k_smem.index(wg))
        tma_load(v_desc, [row0 + jt * 128 + wg * 64, o * 4 + kvh, 0], kv_bar, v_smem.index(wg))
    it = jt * 0
    for g in range(g0, 4, NO):
        for j in range(2 * jt, W // R // 64):
            st = it % GLUON_LBWD_STAGES
            mbarrier.wait(empty.index(st), ((it // GLUON_LBWD_STAGES) & 1) ^ 1)   # both consumers let go of it
            mbarrier.expect(ready.index(st), 2 * 64 * 128 * 2)
            tma_load(q_desc, [row0 + j * 64, o * 16 + kvh * 4 + g, 0], ready.index(st),
                     q_smem.index(st))
            tma_load(do_desc, [row0 + j * 64, o * 16 + kvh * 4 + g, 0], ready.index(st),
                     do_smem.index(st))
            it += 1


@gluon.jit
def gla_gluon_dkdv_lanes_rows_block(it, at, dk, dv, k, v, q_smem, do_smem, pt_smem, ds_smem, ready, empty, Lse,
                                  Delta, s_layout: gl.constexpr, DIAGONAL: gl.constexpr):
    """One query block of 64 lanes (positions `at` of head h's (B, H, N) row) against the
    warpgroup's 64 keys, queries along rows: S = Q K^T, P = exp2(S*scale*log2(e) - lse*log2(e)),
    dV += P^T dO, dP = dO V^T, dS = P (dP - Delta), dK += dS^T Q; P^T and dS^T are read from
    shared memory.
    The DIAGONAL block, of the keys' own lanes, masked to query lane >= key lane."""
    dtype: gl.constexpr = q_smem.dtype
    s_zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
    st = it % GLUON_LBWD_STAGES
    mbarrier.wait(ready.index(st), (it // GLUON_LBWD_STAGES) & 1)
    qj = q_smem.index(st).reshape([64, 128])
    doj = do_smem.index(st).reshape([64, 128])
    s_tok = warpgroup_mma(qj, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(doj, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    lse = gl.expand_dims(gl.load(Lse + at) * 1.4426950408889634, 1)
    delta = gl.expand_dims(gl.load(Delta + at), 1)
    scores = warpgroup_mma_wait(1, deps=(s_tok,))
    if DIAGONAL:
        keep_causal = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)), 1) >= \
            gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout)), 0)
        scores = gl.where(keep_causal, scores, float("-inf"))
    pj = gl.exp2(scores * 0.12751743082459868 - lse)
    pt_smem.store(pj.to(dtype))
    fence_async_shared()
    dv_tok = warpgroup_mma(pt_smem.permute((1, 0)), doj, dv, is_async=True)
    dp = warpgroup_mma_wait(1, deps=(dp_tok,))
    ds = pj * (dp - delta)
    ds_smem.store(ds.to(dtype))
    fence_async_shared()
    dk_tok = warpgroup_mma(ds_smem.permute((1, 0)), qj, dk, is_async=True)
    dv = warpgroup_mma_wait(1, deps=(dv_tok,))
    dk = warpgroup_mma_wait(0, deps=(dk_tok,))
    mbarrier.arrive(empty.index(st), count=1)
    return it + 1, dk, dv


@gluon.jit
def gla_gluon_dkdv_lanes_consume(p, WG: gl.constexpr, ACCUMULATE: gl.constexpr, CLEAR: gl.constexpr):
    """One consumer warpgroup: key lanes k0 = jt*128 + WG*64 ... of the segment against the
    query blocks as the producer queued them (gla_gluon_dkdv_lanes_rows_block; causal: the block
    of the same lanes masked to query lane >= key lane, the one before it skipped); dK, dV added into DK, DV
    (ACCUMULATE) or written (CLEAR: and the gap keys zeroed), dK times the softmax scale."""
    (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
     b, kvh, s, g0, jt, N, W, R, NO, pt_smem, ds_smem) = p
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 16])
    dk = gl.zeros([64, 128], gl.float32, layout=o_layout)
    dv = gl.zeros([64, 128], gl.float32, layout=o_layout)
    o = (kvh * 4 + g0) % R
    k0 = jt * 128 + WG * 64
    blocks = W // R // 64
    pt = pt_smem.index(WG)
    dst = ds_smem.index(WG)
    mbarrier.wait(kv_bar, 0)
    k = k_smem.index(WG).reshape([64, 128])
    v = v_smem.index(WG).reshape([64, 128])
    lanes = s * W + o + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)) * R    # a block's query positions
    it = jt * 0
    for g in range(g0, 4, NO):
        h = kvh * 4 + g
        head = (b * 16 + h).to(gl.int64) * N    # head h's (B, H, N) row
        if WG == 1:     # the queries of the tile's first 64 lanes precede every key of this warpgroup
            mbarrier.wait(ready.index(it % GLUON_LBWD_STAGES), (it // GLUON_LBWD_STAGES) & 1)
            mbarrier.arrive(empty.index(it % GLUON_LBWD_STAGES), count=1)
            it += 1
        at = lanes + k0 * R
        it, dk, dv = gla_gluon_dkdv_lanes_rows_block(
            it, head + at, dk, dv, k, v, q_smem, do_smem, pt, dst, ready, empty, Lse, Delta,
            s_layout, True)
        first = k0 // 64 + 1
        for j in range(first, blocks):
            at = lanes + j * (64 * R)
            it, dk, dv = gla_gluon_dkdv_lanes_rows_block(
                it, head + at, dk, dv, k, v, q_smem, do_smem, pt, dst, ready, empty, Lse, Delta,
                s_layout, False)
    keys = s * W + o + R * (k0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout)))
    dcols = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
    offs = ((b * N + gl.expand_dims(keys, 1)).to(gl.int64) * 4 + kvh) * 128 \
        + gl.expand_dims(dcols, 0)
    dk = dk * 0.08838834764831843
    if ACCUMULATE:
        dk += gl.load(DK + offs).to(gl.float32)
        dv += gl.load(DV + offs).to(gl.float32)
    gl.store(DK + offs, dk.to(dtype))
    gl.store(DV + offs, dv.to(dtype))
    if CLEAR:
        for c in range(NO + g0, R, NO):
            gap = offs + (((o + c) % R - o) * 512).to(gl.int64)
            gl.store(DK + gap, gl.zeros([64, 128], dtype, layout=o_layout))
            gl.store(DV + gap, gl.zeros([64, 128], dtype, layout=o_layout))


@gluon.jit
def gla_gluon_dkdv_lanes_write0(p):
    gla_gluon_dkdv_lanes_consume(p, 0, False, False)


@gluon.jit
def gla_gluon_dkdv_lanes_write1(p):
    gla_gluon_dkdv_lanes_consume(p, 1, False, False)


@gluon.jit
def gla_gluon_dkdv_lanes_add0(p):
    gla_gluon_dkdv_lanes_consume(p, 0, True, False)


@gluon.jit
def gla_gluon_dkdv_lanes_add1(p):
    gla_gluon_dkdv_lanes_consume(p, 1, True, False)


@gluon.jit
def gla_gluon_dkdv_lanes_clear0(p):
    gla_gluon_dkdv_lanes_consume(p, 0, False, True)


@gluon.jit
def gla_gluon_dkdv_lanes_clear1(p):
    gla_gluon_dkdv_lanes_consume(p, 1, False, True)


@gluon.jit
def gla_gluon_dkdv_lanes(q_desc, do_desc, k_desc, v_desc, Lse, Delta, DK, DV, N, W: gl.constexpr, R: gl.constexpr,
                       NO: gl.constexpr, ACCUMULATE: gl.constexpr, CLEAR: gl.constexpr):
    """Notation (as in gla_bwd_dkdv, whose work this is for one branch).
    W, R, NO         the branch's segment length and rate (W / R a multiple of 128), NO = min(4, R)
    q_desc, do_desc  q and dO as (B*N/R, R*H, D), column o*H + h: boxes of 64 query lanes
    k_desc, v_desc   k and v as (B*N/R, R*H_kv, D), column o*H_kv + kvh: boxes of 64 key lanes
    Lse, Delta       (B, H, N) float32: the forward's lse (natural log), rowsum(dO*O) - dlse
    DK, DV           (B, N, H_kv, D) contiguous, in k's dtype: added into (ACCUMULATE) or written;
                     CLEAR (a first launch of r > NO): the keys no head of the group keeps written 0
    program          ((s*NO + g0)*J + jt, b*H_kv + kvh): segment s, key tile jt of 128 lanes
                     (J = W/R/128, the longest first) of offset o = (kvh*4 + g0) mod R,
                     kept by the group's heads g0, g0 + NO, ... (o = their offset mod R)
    Two consumer warpgroups of 64 keys and one producer warp (gl.warp_specialize), as the
    Gluon dK/dV; every segment whole (runtime/backward.py)."""
    dtype: gl.constexpr = k_desc.dtype
    J: gl.constexpr = W // R // 128
    jt = gl.program_id(0) % J
    g0 = (gl.program_id(0) // J) % NO
    s = gl.program_id(0) // (J * NO)
    b = gl.program_id(1) // 4
    kvh = gl.program_id(1) % 4
    k_smem = gl.allocate_shared_memory(dtype, [2, 64, 1, 128], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [2, 64, 1, 128], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [GLUON_LBWD_STAGES, 64, 1, 128], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [GLUON_LBWD_STAGES, 64, 1, 128], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [GLUON_LBWD_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [GLUON_LBWD_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(GLUON_LBWD_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    # each consumer's P^T and dS^T of a block, the A operands of its dV and dK products
    ps_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    pt_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], ps_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [2, 64, 64], ps_layout)
    fence_async_shared()
    p = (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
         b, kvh, s, g0, jt, N, W, R, NO, pt_smem, ds_smem)
    if ACCUMULATE:
        gl.warp_specialize([(gla_gluon_dkdv_lanes_add0, (p,)), (gla_gluon_dkdv_lanes_add1, (p,)),
                            (gla_gluon_dkdv_lanes_producer, (p,))], [4, 1], [240, 24])
    elif CLEAR:
        gl.warp_specialize([(gla_gluon_dkdv_lanes_clear0, (p,)), (gla_gluon_dkdv_lanes_clear1, (p,)),
                            (gla_gluon_dkdv_lanes_producer, (p,))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(gla_gluon_dkdv_lanes_write0, (p,)), (gla_gluon_dkdv_lanes_write1, (p,)),
                            (gla_gluon_dkdv_lanes_producer, (p,))], [4, 1], [240, 24])


@gluon.jit
def gla_gluon_dq_lanes_producer(p):
    """One warp: both warpgroups' Q and dO blocks, then the segment's K/V blocks of 64 lanes up
    to the tile's last query lane."""
    (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars, ready, empty,
     b, h, s, mt, N, W, R) = p
    row0 = b * (N // R) + s * (W // R)
    for wg in gl.static_range(2):
        mbarrier.expect(q_bars.index(wg), 2 * 64 * 128 * 2)
        tma_load(q_desc, [row0 + mt * 128 + wg * 64, (h % R) * 16 + h, 0],
                 q_bars.index(wg), q_smem.index(wg))
        tma_load(do_desc, [row0 + mt * 128 + wg * 64, (h % R) * 16 + h, 0],
                 q_bars.index(wg), do_smem.index(wg))
    kcol = (h % R) * 4 + h // 4
    for t in range(2 * mt + 2):
        st = t % GLUON_LBWD_STAGES
        mbarrier.wait(empty.index(st), ((t // GLUON_LBWD_STAGES) & 1) ^ 1)   # both consumers let go of it
        mbarrier.expect(ready.index(st), 2 * 64 * 128 * 2)
        tma_load(k_desc, [row0 + t * 64, kcol, 0], ready.index(st), k_smem.index(st))
        tma_load(v_desc, [row0 + t * 64, kcol, 0], ready.index(st), v_smem.index(st))


@gluon.jit
def gla_gluon_dq_lanes_block(t, dq, q, do, k_smem, v_smem, ready, empty, lse, delta, s_layout: gl.constexpr,
                           DIAGONAL: gl.constexpr):
    """Key block t of 64 lanes against the warpgroup's queries (the Gluon dQ's products:
    S = Q K^T, P, dP = dO V^T, dS = P (dP - Delta), dQ += dS K); the DIAGONAL block, of the
    queries' own lanes, masked to key lane <= query lane."""
    dtype: gl.constexpr = k_smem.dtype
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
    st = t % GLUON_LBWD_STAGES
    mbarrier.wait(ready.index(st), (t // GLUON_LBWD_STAGES) & 1)
    kt = k_smem.index(st).reshape([64, 128])
    vt = v_smem.index(st).reshape([64, 128])
    s_tok = warpgroup_mma(q, kt.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do, vt.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    scores = warpgroup_mma_wait(1, deps=(s_tok,))
    if DIAGONAL:
        keep = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, s_layout)), 0) <= \
            gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)), 1)
        scores = gl.where(keep, scores, float("-inf"))
    pj = gl.exp2(scores * 0.12751743082459868 - lse)
    dp = warpgroup_mma_wait(0, deps=(dp_tok,))
    ds = pj * (dp - delta)
    dq_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), kt, dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq_tok,))
    mbarrier.arrive(empty.index(st), count=1)
    return dq


@gluon.jit
def gla_gluon_dq_lanes_consume(p, WG: gl.constexpr, ACCUMULATE: gl.constexpr, CLEAR: gl.constexpr):
    """One consumer warpgroup: dQ of query lanes q0 = mt*128 + WG*64 ... over the segment's key
    blocks (the Gluon dQ's products; causal: up to its diagonal, the block of the same lanes
    masked to key lane <= query lane, the first warpgroup letting go of the last block
    unread), added into DQ (ACCUMULATE) or written, times the softmax scale; CLEAR: the rows
    of the span that the head's other offsets keep written 0."""
    (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars, ready, empty,
     b, h, s, mt, N, W, R) = p
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 16])
    dq = gl.zeros([64, 128], gl.float32, layout=o_layout)
    q0 = mt * 128 + WG * 64
    o = h % R
    rows = s * W + o + R * (q0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)))
    at = (b * 16 + h).to(gl.int64) * N + rows
    lse = gl.expand_dims(gl.load(Lse + at) * 1.4426950408889634, 1)
    delta = gl.expand_dims(gl.load(Delta + at), 1)
    mbarrier.wait(q_bars.index(WG), 0)
    q = q_smem.index(WG).reshape([64, 128])
    do = do_smem.index(WG).reshape([64, 128])
    for t in range(q0 // 64):
        dq = gla_gluon_dq_lanes_block(t, dq, q, do, k_smem, v_smem, ready, empty, lse, delta, s_layout, False)
    dq = gla_gluon_dq_lanes_block(q0 // 64, dq, q, do, k_smem, v_smem, ready, empty, lse, delta, s_layout, True)
    if WG == 0:     # the tile's last block lies past this warpgroup's lanes
        st = (2 * mt + 1) % GLUON_LBWD_STAGES
        mbarrier.wait(ready.index(st), ((2 * mt + 1) // GLUON_LBWD_STAGES) & 1)
        mbarrier.arrive(empty.index(st), count=1)
    out_rows = s * W + o + R * (q0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout)))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
    offs = ((b * N + gl.expand_dims(out_rows, 1)).to(gl.int64) * 16 + h) * 128 \
        + gl.expand_dims(cols, 0)
    dq = dq * 0.08838834764831843
    if ACCUMULATE:
        dq += gl.load(DQ + offs).to(gl.float32)
    gl.store(DQ + offs, dq.to(dtype))
    if CLEAR:
        for c in range(1, R):
            gap = offs + (((h + c) % R - o) * 2048).to(gl.int64)
            gl.store(DQ + gap, gl.zeros([64, 128], dtype, layout=o_layout))


@gluon.jit
def gla_gluon_dq_lanes_write0(p):
    gla_gluon_dq_lanes_consume(p, 0, False, False)


@gluon.jit
def gla_gluon_dq_lanes_write1(p):
    gla_gluon_dq_lanes_consume(p, 1, False, False)


@gluon.jit
def gla_gluon_dq_lanes_add0(p):
    gla_gluon_dq_lanes_consume(p, 0, True, False)


@gluon.jit
def gla_gluon_dq_lanes_add1(p):
    gla_gluon_dq_lanes_consume(p, 1, True, False)


@gluon.jit
def gla_gluon_dq_lanes_clear0(p):
    gla_gluon_dq_lanes_consume(p, 0, False, True)


@gluon.jit
def gla_gluon_dq_lanes_clear1(p):
    gla_gluon_dq_lanes_consume(p, 1, False, True)


@gluon.jit
def gla_gluon_dq_lanes(q_desc, do_desc, k_desc, v_desc, Lse, Delta, DQ, N, W: gl.constexpr, R: gl.constexpr,
                     ACCUMULATE: gl.constexpr, CLEAR: gl.constexpr):
    """Notation (as in gla_bwd_dq_lanes, whose work this is for one branch).
    W, R             the branch's segment length and rate (W / R a multiple of 128)
    q_desc, do_desc  q and dO as (B*N/R, R*H, D), column o*H + h (o = h mod R): boxes of 64
    k_desc, v_desc   k and v as (B*N/R, R*H_kv, D), column o*H_kv + kv head: boxes of 64
    Lse, Delta       (B, H, N) float32, as in gla_gluon_dkdv_lanes
    DQ               (B, N, H, D) contiguous, in q's dtype: added into (ACCUMULATE) or written;
                     CLEAR (the first lane launch, r > 1): the rows of the other offsets written 0
    program          (s*T + t, b*H + h): segment s, query tile mt = T - 1 - t of 128 lanes
                     (T = W/R/128, the longest first)
    Two consumer warpgroups of 64 query lanes and one producer warp (gl.warp_specialize), as
    the Gluon dQ; every segment whole (runtime/backward.py)."""
    dtype: gl.constexpr = q_desc.dtype
    T: gl.constexpr = W // R // 128
    s = gl.program_id(0) // T
    mt = T - 1 - gl.program_id(0) % T
    b = gl.program_id(1) // 16
    h = gl.program_id(1) % 16
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, 1, 128], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, 64, 1, 128], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [GLUON_LBWD_STAGES, 64, 1, 128], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [GLUON_LBWD_STAGES, 64, 1, 128], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [GLUON_LBWD_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [GLUON_LBWD_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(GLUON_LBWD_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    p = (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars, ready, empty,
         b, h, s, mt, N, W, R)
    if ACCUMULATE:
        gl.warp_specialize([(gla_gluon_dq_lanes_add0, (p,)), (gla_gluon_dq_lanes_add1, (p,)),
                            (gla_gluon_dq_lanes_producer, (p,))], [4, 1], [240, 24])
    elif CLEAR:
        gl.warp_specialize([(gla_gluon_dq_lanes_clear0, (p,)), (gla_gluon_dq_lanes_clear1, (p,)),
                            (gla_gluon_dq_lanes_producer, (p,))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(gla_gluon_dq_lanes_write0, (p,)), (gla_gluon_dq_lanes_write1, (p,)),
                            (gla_gluon_dq_lanes_producer, (p,))], [4, 1], [240, 24])


attention = GeneratedAttention(SPEC, PLAN, forward_kernel=gla_fwd_kernel,
                               backward_kernels=BACKWARD_KERNELS,
                               decode_kernels=DECODE_KERNELS,
                               lane_kernel=gla_fwd_lanes,
                               curve_kernel=None,
                               gluon_lanes=gla_gluon_lanes,
                               gluon_lanes_packed=gla_gluon_lanes_packed,
                               gluon_dkdv_lanes=gla_gluon_dkdv_lanes,
                               gluon_dq_lanes=gla_gluon_dq_lanes)
