# ---- sm90: dQ in Gluon (KernelConfig.gluon_dq; runtime/backward.py launches it on a GPU for
# fixed-length rows whose every segment is whole, gb_bwd_dq otherwise) ----

GLUON_DQ_KEYS = gl.constexpr(64)        # keys per block
GLUON_DQ_STAGES = gl.constexpr(4)   # K / V blocks in flight (the shared-memory ring)


@gluon.jit
def gb_gluon_dq_load_branch(it, kd, vd, k_smem, v_smem, ready, empty, b, h, d, u0, N,
                      W: gl.constexpr, R: gl.constexpr):
    """Queue the key blocks of one branch (w = W, r = R) for a class-d query tile whose first
    row is u0, if the branch keeps the class (R | d), as the Gluon forward's producer does:
    its lane of segment s is the rows b*N/R + s*W/R + j of the (B*N/R, R*H_kv, D) view, column
    o*H_kv + h // 4 (o = h mod R)."""
    if d % R == 0:
        krow = b * (N // R) + (u0 // W) * (W // R)
        kcol = (h % R) * 4 + h // 4
        for j in range((W // R) // GLUON_DQ_KEYS):
            st = it % GLUON_DQ_STAGES
            mbarrier.wait(empty.index(st), ((it // GLUON_DQ_STAGES) & 1) ^ 1)   # both consumers let go of it
            mbarrier.expect(ready.index(st), 2 * GLUON_DQ_KEYS * 128 * 2)
            tma_load(kd, [krow + j * GLUON_DQ_KEYS, kcol, 0], ready.index(st), k_smem.index(st))
            tma_load(vd, [krow + j * GLUON_DQ_KEYS, kcol, 0], ready.index(st), v_smem.index(st))
            it += 1
    return it


@gluon.jit
def gb_gluon_dq_load_packed(it, kd, vd, K, V, k_smem, v_smem, ready, empty, h, d, u0, s0, n,
                           W: gl.constexpr, R: gl.constexpr):
    """Packed rows: gb_gluon_dq_load_branch for the sequence of n rows at row s0, its lane's keys
    as the Gluon forward's producer finds them (gb_gluon_load_packed). The lane's partial last
    block reads K and V through descriptors that end at the lane's last key: the rows past it
    are zeros (dS is 0 there and dP finite, and 0 times another sequence's non-finite value
    would not be)."""
    hb = h
    cnt = gb_gluon_lane_keys(d, u0, n, hb, W, R)
    p0 = s0 + (u0 // W) * W + hb % R
    krow = p0 // R
    kcol = (p0 % R) * 4 + h // 4
    for j in range((cnt + GLUON_DQ_KEYS - 1) // GLUON_DQ_KEYS):
        st = it % GLUON_DQ_STAGES
        mbarrier.wait(empty.index(st), ((it // GLUON_DQ_STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(st), 2 * GLUON_DQ_KEYS * 128 * 2)
        if (j + 1) * GLUON_DQ_KEYS > cnt:
            tma_load(gb_gluon_lane_box(K, p0, h // 4, cnt, R, kd), [j * GLUON_DQ_KEYS, 0, 0], ready.index(st),
                     k_smem.index(st))
            tma_load(gb_gluon_lane_box(V, p0, h // 4, cnt, R, vd), [j * GLUON_DQ_KEYS, 0, 0], ready.index(st),
                     v_smem.index(st))
        else:
            tma_load(kd, [krow + j * GLUON_DQ_KEYS, kcol, 0], ready.index(st), k_smem.index(st))
            tma_load(vd, [krow + j * GLUON_DQ_KEYS, kcol, 0], ready.index(st), v_smem.index(st))
        it += 1
    return it


@gluon.jit
def gb_gluon_dq_producer(p, PACKED: gl.constexpr):
    """One warp: both warpgroups' Q and dO tiles, then every kept branch's key blocks."""
    if PACKED:
        (q_desc, do_desc, k_descs, v_descs, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars, ready, empty,
         b, h, d, c, m0, N, s0, n, K, V) = p
        qrow, qcol = (s0 + c) // 4, ((s0 + c) % 4) * 16 + h
    else:
        (q_desc, do_desc, k_descs, v_descs, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars, ready, empty,
         b, h, d, c, m0, N) = p
        qrow, qcol = b * (N // 4), c * 16 + h
    for wg in gl.static_range(2):
        mbarrier.expect(q_bars.index(wg), 2 * 64 * 128 * 2)
        tma_load(q_desc, [qrow + m0 + wg * 64, qcol, 0], q_bars.index(wg), q_smem.index(wg))
        tma_load(do_desc, [qrow + m0 + wg * 64, qcol, 0], q_bars.index(wg), do_smem.index(wg))
    u0 = c + 4 * m0
    it = d * 0
    if PACKED:
        it = gb_gluon_dq_load_packed(it, k_descs[0], v_descs[0], K, V, k_smem, v_smem,
                                      ready, empty, h, d, u0, s0, n, 2048, 1)
    else:
        it = gb_gluon_dq_load_branch(it, k_descs[0], v_descs[0], k_smem, v_smem, ready, empty,
                                      b, h, d, u0, N, 2048, 1)  # branch 0
    if PACKED:
        it = gb_gluon_dq_load_packed(it, k_descs[1], v_descs[1], K, V, k_smem, v_smem,
                                      ready, empty, h, d, u0, s0, n, 4096, 2)
    else:
        it = gb_gluon_dq_load_branch(it, k_descs[1], v_descs[1], k_smem, v_smem, ready, empty,
                                      b, h, d, u0, N, 4096, 2)  # branch 1
    if PACKED:
        it = gb_gluon_dq_load_packed(it, k_descs[2], v_descs[2], K, V, k_smem, v_smem,
                                      ready, empty, h, d, u0, s0, n, 8192, 4)
    else:
        it = gb_gluon_dq_load_branch(it, k_descs[2], v_descs[2], k_smem, v_smem, ready, empty,
                                      b, h, d, u0, N, 8192, 4)  # branch 2


@gluon.jit
def gb_gluon_dq_consume(p, WG: gl.constexpr, PACKED: gl.constexpr):
    """One consumer warpgroup: dQ of rows m0 + WG*64 ... of the tile over the stream of key
    blocks: S = Q K^T, P = exp2(S*scale*log2(e) - lse*log2(e)), dP = dO V^T,
    dS = P (dP - Delta), dQ += dS K; written once, times the softmax scale. PACKED: rows of one
    sequence of packed rows (keys past a lane's end score -inf; rows past the sequence's end
    are not stored), lse and Delta (H, rows)."""
    if PACKED:
        (q_desc, do_desc, k_descs, v_descs, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars, ready, empty,
         b, h, d, c, m0, N, s0, n, K, V) = p
    else:
        (q_desc, do_desc, k_descs, v_descs, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars, ready, empty,
         b, h, d, c, m0, N) = p
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, GLUON_DQ_KEYS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([64, GLUON_DQ_KEYS], gl.float32, layout=s_layout)
    dq = gl.zeros([64, 128], gl.float32, layout=o_layout)
    rows = c + 4 * (m0 + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)))
    if PACKED:
        at = h.to(gl.int64) * N + s0 + rows
        lse = gl.expand_dims(gl.load(Lse + at, mask=rows < n, other=0.0) * 1.4426950408889634, 1)
        delta = gl.expand_dims(gl.load(Delta + at, mask=rows < n, other=0.0), 1)
    else:
        at = (b * 16 + h).to(gl.int64) * N + rows
        lse = gl.expand_dims(gl.load(Lse + at) * 1.4426950408889634, 1)
        delta = gl.expand_dims(gl.load(Delta + at), 1)
    mbarrier.wait(q_bars.index(WG), 0)
    q = q_smem.index(WG).reshape([64, 128])
    do = do_smem.index(WG).reshape([64, 128])
    if PACKED:
        T, last0, tail0, last1, tail1, last2, tail2 = gb_gluon_packed_blocks(d, c + 4 * m0, n, h, GLUON_DQ_KEYS)
        keys = gl.expand_dims(gl.arange(0, GLUON_DQ_KEYS, layout=gl.SliceLayout(0, s_layout)), 0)
    else:
        T = d * 0
        T += gl.where(d % 1 == 0, 2048 // GLUON_DQ_KEYS, 0)  # branch 0
        T += gl.where(d % 2 == 0, 2048 // GLUON_DQ_KEYS, 0)  # branch 1
        T += gl.where(d % 4 == 0, 2048 // GLUON_DQ_KEYS, 0)  # branch 2
    for t in range(T):
        st = t % GLUON_DQ_STAGES
        mbarrier.wait(ready.index(st), (t // GLUON_DQ_STAGES) & 1)
        kt = k_smem.index(st).reshape([GLUON_DQ_KEYS, 128])
        vt = v_smem.index(st).reshape([GLUON_DQ_KEYS, 128])
        s_tok = warpgroup_mma(q, kt.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(do, vt.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        if PACKED:      # keys past a lane's end in its partial last block: P = 0
            valid = gb_gluon_real_keys(t, last0, tail0, last1, tail1, last2, tail2, GLUON_DQ_KEYS)
            if valid < GLUON_DQ_KEYS:
                s = gl.where(keys < valid, s, float("-inf"))
        pj = gl.exp2(s * 0.12751743082459868 - lse)
        dp = warpgroup_mma_wait(0, deps=(dp_tok,))
        ds = pj * (dp - delta)
        dq_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), kt, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq_tok,))
        mbarrier.arrive(empty.index(st), count=1)
    out_rows = c + 4 * (m0 + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout)))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
    if PACKED:
        o_rows = gl.expand_dims(out_rows, 1)
        offs = ((s0 + o_rows).to(gl.int64) * 16 + h) * 128 + gl.expand_dims(cols, 0)
        gl.store(DQ + offs, (dq * 0.08838834764831843).to(dtype), mask=o_rows < n)
    else:
        offs = ((b * N + gl.expand_dims(out_rows, 1)).to(gl.int64) * 16 + h) * 128 + gl.expand_dims(cols, 0)
        gl.store(DQ + offs, (dq * 0.08838834764831843).to(dtype))


@gluon.jit
def gb_gluon_dq_consumer0(p):
    gb_gluon_dq_consume(p, 0, False)


@gluon.jit
def gb_gluon_dq_consumer1(p):
    gb_gluon_dq_consume(p, 1, False)


@gluon.jit
def gb_gluon_dq_fixed_producer(p):
    gb_gluon_dq_producer(p, False)


@gluon.jit
def gb_gluon_dq_packed_consumer0(p):
    gb_gluon_dq_consume(p, 0, True)


@gluon.jit
def gb_gluon_dq_packed_consumer1(p):
    gb_gluon_dq_consume(p, 1, True)


@gluon.jit
def gb_gluon_dq_packed_producer(p):
    gb_gluon_dq_producer(p, True)


@gluon.jit
def gb_gluon_dq(q_desc, do_desc, k0, k1, k2, v0, v1, v2, Lse, Delta, DQ, N):
    """Notation (as in gb_bwd_dq, whose work this is).
    q_desc, do_desc  q and dO as (B*N/L, L*H, D): row b*N/L + m, column c*H + h is row
                     u = c + L*m of head h (L = 4); boxes of 64 rows
    k<i>, v<i>       branch i's keys as (B*N/r, r*H_kv, D): its lane of a segment is a box
    Lse, Delta       (B, H, N) float32: the forward's lse (natural log), rowsum(dO*O) - dlse
    DQ               (B, N, H, D) contiguous, in q's dtype: every row written once
    program          (d + L*t, b*H + h): class d of the tile t of 128 lattice rows, c = (h + d) mod L;
                     the classes of a tile run side by side, as they read the same key lanes (L2)
    Two consumer warpgroups of 64 rows and one producer warp (gl.warp_specialize); the
    producer fills a ring of GLUON_DQ_STAGES K/V blocks (ready), a stage returns to it once
    both consumers arrived on its `empty`. Every segment whole (runtime/backward.py)."""
    dtype: gl.constexpr = q_desc.dtype
    m0 = (gl.program_id(0) // 4) * 128
    d = gl.program_id(0) % 4
    b = gl.program_id(1) // 16
    h = gl.program_id(1) % 16
    c = (h + d) % 4
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, 1, 128], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, 64, 1, 128], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [GLUON_DQ_STAGES, GLUON_DQ_KEYS, 1, 128], k0.layout)
    v_smem = gl.allocate_shared_memory(dtype, [GLUON_DQ_STAGES, GLUON_DQ_KEYS, 1, 128], v0.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [GLUON_DQ_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [GLUON_DQ_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(GLUON_DQ_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    p = (q_desc, do_desc, (k0, k1, k2), (v0, v1, v2), Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars,
         ready, empty, b, h, d, c, m0, N)
    gl.warp_specialize([(gb_gluon_dq_consumer0, (p,)), (gb_gluon_dq_consumer1, (p,)), (gb_gluon_dq_fixed_producer, (p,))],
                       [4, 1], [240, 24])


@gluon.jit
def gb_gluon_dq_packed(q_desc, do_desc, k0, k1, k2, v0, v1, v2, K, V, Lse, Delta, DQ, SeqStart, SeqLen, rows):
    """The dQ over packed rows (runtime.varlen): gb_gluon_dq's work for sequence b of the
    launch group, rows SeqStart[b] + [0, SeqLen[b]), its segments from its first row; views
    as gb_gluon_fwd_packed's (rows a multiple of L). K, V: k and v (rows, H_kv, D), whose lanes'
    partial last blocks are read through descriptors made here; Lse, Delta (H, rows); DQ
    (rows, H, D). A tile past the sequence's end does nothing."""
    dtype: gl.constexpr = q_desc.dtype
    m0 = (gl.program_id(0) // 4) * 128
    d = gl.program_id(0) % 4
    b = gl.program_id(1) // 16
    h = gl.program_id(1) % 16
    c = (h + d) % 4
    s0 = gl.load(SeqStart + b)
    n = gl.load(SeqLen + b)
    if c + 4 * m0 >= n:
        return
    q_smem = gl.allocate_shared_memory(dtype, [2, 64, 1, 128], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [2, 64, 1, 128], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [GLUON_DQ_STAGES, GLUON_DQ_KEYS, 1, 128], k0.layout)
    v_smem = gl.allocate_shared_memory(dtype, [GLUON_DQ_STAGES, GLUON_DQ_KEYS, 1, 128], v0.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [GLUON_DQ_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [GLUON_DQ_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(GLUON_DQ_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    fence_async_shared()
    p = (q_desc, do_desc, (k0, k1, k2), (v0, v1, v2), Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars,
         ready, empty, b, h, d, c, m0, rows, s0, n, K, V)
    gl.warp_specialize([(gb_gluon_dq_packed_consumer0, (p,)), (gb_gluon_dq_packed_consumer1, (p,)),
                        (gb_gluon_dq_packed_producer, (p,))], [4, 1], [240, 24])


attention = GeneratedAttention(SPEC, PLAN, forward_kernel=gb_fwd_kernel,
                               backward_kernels=BACKWARD_KERNELS,
                               decode_kernels=DECODE_KERNELS,
                               lane_kernel=None,
                               curve_kernel=None,
                               gluon_kernel=gb_gluon_fwd,
                               gluon_packed=gb_gluon_fwd_packed,
                               gluon_dkdv=gb_gluon_dkdv,
                               gluon_dkdv_packed=gb_gluon_dkdv_packed,
                               gluon_dq=gb_gluon_dq,
                               gluon_dq_packed=gb_gluon_dq_packed)
