# ---- sm90: the lane dq per branch in Gluon (a query tile against its segment's key lanes) ----


@gluon.jit
def gla_gluon_dq_lanes_produce(p, PACKED: gl.constexpr):
    """One warp: both warpgroups' Q and dO blocks, then the segment's K/V blocks of 64 lanes up
    to the tile's last query lane. PACKED: the lane of sequence b's segment s
    starting at row p0 = s0 + s*W + o, as gla_gluon_dkdv_lanes_produce's; a K/V block past the
    lane's last key read through descriptors that end there (zeros)."""
    if PACKED:
        (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars, ready, empty,
         b, h, s, mt, N, W, R, s0, cnt, Q, DO, K, V) = p
        p0 = s0 + s * W + h % R
        row0 = p0 // R
        qcol = (p0 % R) * 16 + h
        kcol = (p0 % R) * 4 + h // 4
    else:
        (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars, ready, empty,
         b, h, s, mt, N, W, R) = p
        row0 = b * (N // R) + s * (W // R)
        qcol = (h % R) * 16 + h
        kcol = (h % R) * 4 + h // 4
    for wg in gl.static_range(2):
        mbarrier.expect(q_bars.index(wg), 2 * 64 * 128 * 2)
        if PACKED:
            if row0 + gl.minimum(mt * 128 + wg * 64 + 64, cnt) > N // R:   # lanes past the views' rows
                tma_load(gla_gluon_lane_box(Q, p0, h, cnt, R, q_desc), [mt * 128 + wg * 64, 0, 0], q_bars.index(wg),
                         q_smem.index(wg))
                tma_load(gla_gluon_lane_box(DO, p0, h, cnt, R, do_desc), [mt * 128 + wg * 64, 0, 0], q_bars.index(wg),
                         do_smem.index(wg))
            else:
                tma_load(q_desc, [row0 + mt * 128 + wg * 64, qcol, 0], q_bars.index(wg), q_smem.index(wg))
                tma_load(do_desc, [row0 + mt * 128 + wg * 64, qcol, 0], q_bars.index(wg), do_smem.index(wg))
        else:
            tma_load(q_desc, [row0 + mt * 128 + wg * 64, qcol, 0], q_bars.index(wg), q_smem.index(wg))
            tma_load(do_desc, [row0 + mt * 128 + wg * 64, qcol, 0], q_bars.index(wg), do_smem.index(wg))
    for t in range(2 * mt + 2):
        st = t % GLUON_LBWD_STAGES
        mbarrier.wait(empty.index(st), ((t // GLUON_LBWD_STAGES) & 1) ^ 1)   # both consumers let go of it
        mbarrier.expect(ready.index(st), 2 * 64 * 128 * 2)
        if PACKED:      # through the lane's own boxes past its last key or past the views' rows
            if (t + 1) * 64 > cnt or row0 + (t + 1) * 64 > N // R:
                tma_load(gla_gluon_lane_box(K, p0, h // 4, cnt, R, k_desc), [t * 64, 0, 0], ready.index(st),
                         k_smem.index(st))
                tma_load(gla_gluon_lane_box(V, p0, h // 4, cnt, R, v_desc), [t * 64, 0, 0], ready.index(st),
                         v_smem.index(st))
            else:
                tma_load(k_desc, [row0 + t * 64, kcol, 0], ready.index(st), k_smem.index(st))
                tma_load(v_desc, [row0 + t * 64, kcol, 0], ready.index(st), v_smem.index(st))
        else:
            tma_load(k_desc, [row0 + t * 64, kcol, 0], ready.index(st), k_smem.index(st))
            tma_load(v_desc, [row0 + t * 64, kcol, 0], ready.index(st), v_smem.index(st))


@gluon.jit
def gla_gluon_dq_lanes_producer(p):
    gla_gluon_dq_lanes_produce(p, False)


@gluon.jit
def gla_gluon_dq_lanes_packed_producer(p):
    gla_gluon_dq_lanes_produce(p, True)


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
def gla_gluon_dq_lanes_consume(p, WG: gl.constexpr, ACCUMULATE: gl.constexpr, CLEAR: gl.constexpr, PACKED: gl.constexpr):
    """One consumer warpgroup: dQ of query lanes q0 = mt*128 + WG*64 ... over the segment's key
    blocks (the Gluon dQ's products; causal: up to its diagonal, the block of the same lanes
    masked to key lane <= query lane, the first warpgroup letting go of the last block
    unread), added into DQ (ACCUMULATE) or written, times the softmax scale; CLEAR: the rows
    of the span that the head's other offsets keep written 0. PACKED: the producer's lane;
    lse, Delta (H, rows) and dQ's rows from row s0, lanes past the lane's end (cnt) not stored."""
    if PACKED:
        (q_desc, do_desc, k_desc, v_desc, Lse, Delta, DQ, q_smem, do_smem, k_smem, v_smem, q_bars, ready, empty,
         b, h, s, mt, N, W, R, s0, cnt, Q, DO, K, V) = p
    else:
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
    if PACKED:
        at = h.to(gl.int64) * N + s0 + rows
        real = q0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)) < cnt
        lse = gl.expand_dims(gl.load(Lse + at, mask=real, other=0.0) * 1.4426950408889634, 1)
        delta = gl.expand_dims(gl.load(Delta + at, mask=real, other=0.0), 1)
    else:
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
    if ACCUMULATE:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)     # the launch before has added its share (programmatic dependent launch)
    out_rows = s * W + o + R * (q0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout)))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout))
    if PACKED:
        offs = ((s0 + gl.expand_dims(out_rows, 1)).to(gl.int64) * 16 + h) * 128 \
            + gl.expand_dims(cols, 0)
        dq = dq * 0.08838834764831843
        stored = gl.expand_dims(q0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout)) < cnt, 1)
        if ACCUMULATE:
            dq += gl.load(DQ + offs, mask=stored, other=0.0).to(gl.float32)
        gl.store(DQ + offs, dq.to(dtype), mask=stored)
    else:
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
    gla_gluon_dq_lanes_consume(p, 0, False, False, False)


@gluon.jit
def gla_gluon_dq_lanes_write1(p):
    gla_gluon_dq_lanes_consume(p, 1, False, False, False)


@gluon.jit
def gla_gluon_dq_lanes_add0(p):
    gla_gluon_dq_lanes_consume(p, 0, True, False, False)


@gluon.jit
def gla_gluon_dq_lanes_add1(p):
    gla_gluon_dq_lanes_consume(p, 1, True, False, False)


@gluon.jit
def gla_gluon_dq_lanes_clear0(p):
    gla_gluon_dq_lanes_consume(p, 0, False, True, False)


@gluon.jit
def gla_gluon_dq_lanes_clear1(p):
    gla_gluon_dq_lanes_consume(p, 1, False, True, False)


@gluon.jit
def gla_gluon_dq_lanes_packed_write0(p):
    gla_gluon_dq_lanes_consume(p, 0, False, False, True)


@gluon.jit
def gla_gluon_dq_lanes_packed_write1(p):
    gla_gluon_dq_lanes_consume(p, 1, False, False, True)


@gluon.jit
def gla_gluon_dq_lanes_packed_add0(p):
    gla_gluon_dq_lanes_consume(p, 0, True, False, True)


@gluon.jit
def gla_gluon_dq_lanes_packed_add1(p):
    gla_gluon_dq_lanes_consume(p, 1, True, False, True)


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
    if not ACCUMULATE:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
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


@gluon.jit
def gla_gluon_dq_lanes_packed(q_desc, do_desc, k_desc, v_desc, Q, DO, K, V, Lse, Delta, DQ, SeqStart, SeqLen, N,
                            W: gl.constexpr, R: gl.constexpr, ACCUMULATE: gl.constexpr):
    """The lane dq of a branch over packed rows (runtime.varlen): gla_gluon_dq_lanes' work for
    sequence b of the launch group, rows SeqStart[b] + [0, SeqLen[b]), its last segment maybe
    short.
    q_desc ... v_desc  the views of gla_gluon_dq_lanes over all N packed rows (B = 1), N // R rows; W need
                     not be a multiple of R
    Q, DO, K, V      q, dO, k, v (N, H or H_kv, D): a block past its lane's end or reaching past the
                     views' N // R rows (runtime/gluon_packed.py)
    Lse, Delta       (H, N) float32; DQ (N, H, D): added into (ACCUMULATE) or written
    program          (s*T + t, b*H + h) as gla_gluon_dq_lanes'; a tile past its lane's end does nothing"""
    dtype: gl.constexpr = q_desc.dtype
    T: gl.constexpr = (W + 128 * R - 1) // (128 * R)     # ceil(ceil(W / R) / 128) query tiles
    s = gl.program_id(0) // T
    mt = T - 1 - gl.program_id(0) % T
    b = gl.program_id(1) // 16
    h = gl.program_id(1) % 16
    if not ACCUMULATE:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    s0 = gl.load(SeqStart + b)
    n = gl.load(SeqLen + b)
    cnt = gl.maximum(gl.minimum(n - s * W, W) - h % R + R - 1, 0) // R     # the lane's queries
    if mt * 128 >= cnt:
        return
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
         b, h, s, mt, N, W, R, s0, cnt, Q, DO, K, V)
    if ACCUMULATE:
        gl.warp_specialize([(gla_gluon_dq_lanes_packed_add0, (p,)), (gla_gluon_dq_lanes_packed_add1, (p,)),
                            (gla_gluon_dq_lanes_packed_producer, (p,))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(gla_gluon_dq_lanes_packed_write0, (p,)), (gla_gluon_dq_lanes_packed_write1, (p,)),
                            (gla_gluon_dq_lanes_packed_producer, (p,))], [4, 1], [240, 24])


attention = GeneratedAttention(SPEC, PLAN, forward_kernel=gla_fwd_kernel,
                               backward_kernels=BACKWARD_KERNELS,
                               decode_kernels=DECODE_KERNELS,
                               lane_kernel=gla_fwd_lanes,
                               curve_kernel=None,
                               gluon_lanes=gla_gluon_lanes,
                               gluon_lanes_packed=gla_gluon_lanes_packed,
                               gluon_dkdv_lanes=gla_gluon_dkdv_lanes,
                               gluon_dkdv_lanes_packed=gla_gluon_dkdv_lanes_packed,
                               gluon_dq_lanes=gla_gluon_dq_lanes,
                               gluon_dq_lanes_packed=gla_gluon_dq_lanes_packed)
