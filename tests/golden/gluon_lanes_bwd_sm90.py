# ---- sm90: the dK, dV and dQ per branch in Gluon (KernelConfig.gluon_lanes_bwd;
# runtime/backward.py launches them on a GPU for fixed-length rows whose every segment is whole,
# gla_bwd_dkdv and gla_bwd_dq_lanes otherwise) ----

GLUON_LBWD_STAGES = gl.constexpr(4)   # Q/dO (dK, dV) or K/V (dQ) blocks in flight


@gluon.jit
def gla_gluon_dkdv_lanes_produce(p, PACKED: gl.constexpr):
    """One warp: the tile's K and V (two boxes of 64 key lanes), then for each query head of
    the group with the tile's offset its query and dO blocks of 64 lanes from the diagonal on. PACKED:
    the lane of sequence b's segment s starting at row p0 = s0 + s*W + o is the rows
    p0 // R + j, column (p0 mod R)*H + h of the views over all the packed rows; its blocks
    end at its cnt lanes (at least the tile's own two), a block past the last lane read
    through descriptors that end there (zeros)."""
    if PACKED:
        (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
         b, kvh, s, g0, jt, N, W, R, NO, pt_smem, ds_smem, s0, cnt, Q, DO, K, V) = p
        o = (kvh * 4 + g0) % R
        p0 = s0 + s * W + o
        row0 = p0 // R
        kcol = (p0 % R) * 4 + kvh
        qcol = (p0 % R) * 16 + kvh * 4
        blocks = gl.maximum((cnt + 63) // 64, 2 * jt + 2)
    else:
        (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
         b, kvh, s, g0, jt, N, W, R, NO, pt_smem, ds_smem) = p
        row0 = b * (N // R) + s * (W // R)
        o = (kvh * 4 + g0) % R
        kcol = o * 4 + kvh
        qcol = o * 16 + kvh * 4
        blocks = W // R // 64
    mbarrier.expect(kv_bar, 4 * 64 * 128 * 2)
    for wg in gl.static_range(2):
        if PACKED:
            if row0 + gl.minimum(jt * 128 + wg * 64 + 64, cnt) > N // R:   # lanes past the views' rows
                tma_load(gla_gluon_lane_box(K, p0, kvh, cnt, R, k_desc), [jt * 128 + wg * 64, 0, 0], kv_bar,
                         k_smem.index(wg))
                tma_load(gla_gluon_lane_box(V, p0, kvh, cnt, R, v_desc), [jt * 128 + wg * 64, 0, 0], kv_bar,
                         v_smem.index(wg))
            else:
                tma_load(k_desc, [row0 + jt * 128 + wg * 64, kcol, 0], kv_bar, k_smem.index(wg))
                tma_load(v_desc, [row0 + jt * 128 + wg * 64, kcol, 0], kv_bar, v_smem.index(wg))
        else:
            tma_load(k_desc, [row0 + jt * 128 + wg * 64, kcol, 0], kv_bar, k_smem.index(wg))
            tma_load(v_desc, [row0 + jt * 128 + wg * 64, kcol, 0], kv_bar, v_smem.index(wg))
    it = jt * 0
    for g in range(g0, 4, NO):
        for j in range(2 * jt, blocks):
            st = it % GLUON_LBWD_STAGES
            mbarrier.wait(empty.index(st), ((it // GLUON_LBWD_STAGES) & 1) ^ 1)   # both consumers let go of it
            mbarrier.expect(ready.index(st), 2 * 64 * 128 * 2)
            if PACKED:      # through the lane's own boxes past its last lane or past the views' rows
                if (j + 1) * 64 > cnt or row0 + (j + 1) * 64 > N // R:
                    tma_load(gla_gluon_lane_box(Q, p0, kvh * 4 + g, cnt, R, q_desc), [j * 64, 0, 0], ready.index(st),
                             q_smem.index(st))
                    tma_load(gla_gluon_lane_box(DO, p0, kvh * 4 + g, cnt, R, do_desc), [j * 64, 0, 0],
                             ready.index(st), do_smem.index(st))
                else:
                    tma_load(q_desc, [row0 + j * 64, qcol + g, 0], ready.index(st), q_smem.index(st))
                    tma_load(do_desc, [row0 + j * 64, qcol + g, 0], ready.index(st), do_smem.index(st))
            else:
                tma_load(q_desc, [row0 + j * 64, qcol + g, 0], ready.index(st), q_smem.index(st))
                tma_load(do_desc, [row0 + j * 64, qcol + g, 0], ready.index(st), do_smem.index(st))
            it += 1


@gluon.jit
def gla_gluon_dkdv_lanes_producer(p):
    gla_gluon_dkdv_lanes_produce(p, False)


@gluon.jit
def gla_gluon_dkdv_lanes_packed_producer(p):
    gla_gluon_dkdv_lanes_produce(p, True)


@gluon.jit
def gla_gluon_dkdv_lanes_rows_block(it, at, dk, dv, k, v, q_smem, do_smem, pt_smem, ds_smem, ready, empty, Lse,
                                  Delta, s_layout: gl.constexpr, DIAGONAL: gl.constexpr, end, PACKED: gl.constexpr):
    """One query block of 64 lanes (positions `at` of head h's (B, H, N) row) against the
    warpgroup's 64 keys, queries along rows: S = Q K^T, P = exp2(S*scale*log2(e) - lse*log2(e)),
    dV += P^T dO, dP = dO V^T, dS = P (dP - Delta), dK += dS^T Q; P^T and dS^T are read from
    shared memory.
    The DIAGONAL block, of the keys' own lanes, masked to query lane >= key lane. PACKED: a query
    lane past the lane's end reads the lse and Delta of its last one (`end`): finite, and its Q
    and dO are zeros, so it adds nothing to dK and dV."""
    dtype: gl.constexpr = q_smem.dtype
    s_zero = gl.zeros([64, 64], gl.float32, layout=s_layout)
    st = it % GLUON_LBWD_STAGES
    mbarrier.wait(ready.index(st), (it // GLUON_LBWD_STAGES) & 1)
    qj = q_smem.index(st).reshape([64, 128])
    doj = do_smem.index(st).reshape([64, 128])
    s_tok = warpgroup_mma(qj, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(doj, v.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    if PACKED:
        lse = gl.expand_dims(gl.load(Lse + gl.minimum(at, end)) * 1.4426950408889634, 1)
        delta = gl.expand_dims(gl.load(Delta + gl.minimum(at, end)), 1)
    else:
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
def gla_gluon_dkdv_lanes_consume(p, WG: gl.constexpr, ACCUMULATE: gl.constexpr, CLEAR: gl.constexpr, PACKED: gl.constexpr):
    """One consumer warpgroup: key lanes k0 = jt*128 + WG*64 ... of the segment against the
    query blocks as the producer queued them (gla_gluon_dkdv_lanes_rows_block; causal: the block
    of the same lanes masked to query lane >= key lane, the one before it skipped); dK, dV added into DK, DV
    (ACCUMULATE) or written (CLEAR: and the gap keys zeroed), dK times the softmax scale. PACKED: the keys of the producer's lane, lse and Delta (H, rows) from row s0."""
    if PACKED:
        (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DK, DV, k_smem, v_smem, q_smem, do_smem, kv_bar, ready, empty,
         b, kvh, s, g0, jt, N, W, R, NO, pt_smem, ds_smem, s0, cnt, Q, DO, K, V) = p
    else:
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
    if PACKED:      # the producer's blocks; the lane's last query as a position of the sequence
        blocks = gl.maximum((cnt + 63) // 64, 2 * jt + 2)
        end = s * W + o + R * (cnt - 1)
    else:
        blocks = W // R // 64
        end = 0
    pt = pt_smem.index(WG)
    dst = ds_smem.index(WG)
    mbarrier.wait(kv_bar, 0)
    k = k_smem.index(WG).reshape([64, 128])
    v = v_smem.index(WG).reshape([64, 128])
    lanes = s * W + o + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)) * R    # a block's query positions
    it = jt * 0
    for g in range(g0, 4, NO):
        h = kvh * 4 + g
        if PACKED:
            head = h.to(gl.int64) * N + s0                          # the sequence's row 0 in head h's (H, rows) row
        else:
            head = (b * 16 + h).to(gl.int64) * N    # head h's (B, H, N) row
        if WG == 1:     # the queries of the tile's first 64 lanes precede every key of this warpgroup
            mbarrier.wait(ready.index(it % GLUON_LBWD_STAGES), (it // GLUON_LBWD_STAGES) & 1)
            mbarrier.arrive(empty.index(it % GLUON_LBWD_STAGES), count=1)
            it += 1
        at = lanes + k0 * R
        it, dk, dv = gla_gluon_dkdv_lanes_rows_block(
            it, head + at, dk, dv, k, v, q_smem, do_smem, pt, dst, ready, empty, Lse, Delta,
            s_layout, True, head + end, PACKED)
        first = k0 // 64 + 1
        for j in range(first, blocks):
            at = lanes + j * (64 * R)
            it, dk, dv = gla_gluon_dkdv_lanes_rows_block(
                it, head + at, dk, dv, k, v, q_smem, do_smem, pt, dst, ready, empty, Lse, Delta,
                s_layout, False, head + end, PACKED)
    if ACCUMULATE:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)     # the launch before has added its share (programmatic dependent launch)
    keys = s * W + o + R * (k0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout)))
    dcols = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
    if PACKED:      # the sequence's keys from row s0; lanes past the lane's end (cnt) not stored
        offs = ((s0 + gl.expand_dims(keys, 1)).to(gl.int64) * 4 + kvh) * 128 \
            + gl.expand_dims(dcols, 0)
        dk = dk * 0.08838834764831843
        real = gl.expand_dims(k0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout)) < cnt, 1)
        if ACCUMULATE:
            dk += gl.load(DK + offs, mask=real, other=0.0).to(gl.float32)
            dv += gl.load(DV + offs, mask=real, other=0.0).to(gl.float32)
        gl.store(DK + offs, dk.to(dtype), mask=real)
        gl.store(DV + offs, dv.to(dtype), mask=real)
    else:
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
    gla_gluon_dkdv_lanes_consume(p, 0, False, False, False)


@gluon.jit
def gla_gluon_dkdv_lanes_write1(p):
    gla_gluon_dkdv_lanes_consume(p, 1, False, False, False)


@gluon.jit
def gla_gluon_dkdv_lanes_add0(p):
    gla_gluon_dkdv_lanes_consume(p, 0, True, False, False)


@gluon.jit
def gla_gluon_dkdv_lanes_add1(p):
    gla_gluon_dkdv_lanes_consume(p, 1, True, False, False)


@gluon.jit
def gla_gluon_dkdv_lanes_clear0(p):
    gla_gluon_dkdv_lanes_consume(p, 0, False, True, False)


@gluon.jit
def gla_gluon_dkdv_lanes_clear1(p):
    gla_gluon_dkdv_lanes_consume(p, 1, False, True, False)


@gluon.jit
def gla_gluon_dkdv_lanes_packed_write0(p):
    gla_gluon_dkdv_lanes_consume(p, 0, False, False, True)


@gluon.jit
def gla_gluon_dkdv_lanes_packed_write1(p):
    gla_gluon_dkdv_lanes_consume(p, 1, False, False, True)


@gluon.jit
def gla_gluon_dkdv_lanes_packed_add0(p):
    gla_gluon_dkdv_lanes_consume(p, 0, True, False, True)


@gluon.jit
def gla_gluon_dkdv_lanes_packed_add1(p):
    gla_gluon_dkdv_lanes_consume(p, 1, True, False, True)


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
    if not ACCUMULATE:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
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
def gla_gluon_dkdv_lanes_packed(q_desc, do_desc, k_desc, v_desc, Q, DO, K, V, Lse, Delta, DK, DV, SeqStart, SeqLen, N,
                              W: gl.constexpr, R: gl.constexpr, NO: gl.constexpr, ACCUMULATE: gl.constexpr):
    """The dK/dV of a branch over packed rows (runtime.varlen): gla_gluon_dkdv_lanes' work for
    sequence b of the launch group, rows SeqStart[b] + [0, SeqLen[b]), its last segment maybe
    short (its lanes end early).
    q_desc ... v_desc  the views of gla_gluon_dkdv_lanes over all N packed rows (B = 1), N // R rows;
                     W need not be a multiple of R (a lane of ceil((W - o) / R) keys)
    Q, DO, K, V      q, dO, k, v (N, H or H_kv, D): a block past its lane's end or reaching past the
                     views' N // R rows (N not a multiple of R) (runtime/gluon_packed.py)
    Lse, Delta       (H, N) float32; DK, DV (N, H_kv, D): added into (ACCUMULATE) or written
    program          ((s*NO + g0)*J + jt, b*H_kv + kvh) as gla_gluon_dkdv_lanes'; a key tile past its
                     lane's end does nothing"""
    dtype: gl.constexpr = k_desc.dtype
    J: gl.constexpr = (W + 128 * R - 1) // (128 * R)     # ceil(ceil(W / R) / 128) key tiles
    jt = gl.program_id(0) % J
    g0 = (gl.program_id(0) // J) % NO
    s = gl.program_id(0) // (J * NO)
    b = gl.program_id(1) // 4
    kvh = gl.program_id(1) % 4
    if not ACCUMULATE:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    s0 = gl.load(SeqStart + b)
    n = gl.load(SeqLen + b)
    o = (kvh * 4 + g0) % R
    cnt = gl.maximum(gl.minimum(n - s * W, W) - o + R - 1, 0) // R     # the lane's keys (and queries)
    if jt * 128 >= cnt:
        return
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
         b, kvh, s, g0, jt, N, W, R, NO, pt_smem, ds_smem, s0, cnt, Q, DO, K, V)
    if ACCUMULATE:
        gl.warp_specialize([(gla_gluon_dkdv_lanes_packed_add0, (p,)), (gla_gluon_dkdv_lanes_packed_add1, (p,)),
                            (gla_gluon_dkdv_lanes_packed_producer, (p,))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(gla_gluon_dkdv_lanes_packed_write0, (p,)), (gla_gluon_dkdv_lanes_packed_write1, (p,)),
                            (gla_gluon_dkdv_lanes_packed_producer, (p,))], [4, 1], [240, 24])


