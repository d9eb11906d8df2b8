# ---- sm90: the lane branches in Gluon (KernelConfig.gluon_lanes; runtime/forward.py launches it
# on a GPU for fixed-length rows whose every segment is whole, gla_fwd_lanes otherwise) ----
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

# TMA copies: Triton 3.9 names them async_load / async_store (3.6: async_copy_*)
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

GLUON_LANE_ROWS = gl.constexpr(64)      # query lanes per consumer warpgroup; a program takes two
GLUON_LANE_KEYS = gl.constexpr(128)     # key lanes per block
GLUON_LANE_STAGES = gl.constexpr(3)   # K/V blocks in flight (the shared-memory ring)


@gluon.jit
def gla_gluon_lanes_exp2(x):
    return gl.exp2(x)


@gluon.jit
def gla_gluon_lane_box(X, p0, head, cnt, R: gl.constexpr, like):
    """A descriptor over one lane of X (rows, heads, D), head `head`: its rows p0 + R*j for
    j < cnt, in `like`'s boxes; TMA reads zeros past the lane's last row. It is written to the
    launch's global scratch, which under programmatic dependent launch may be the scratch of the
    launch before, still running: the program first waits for that launch to end."""
    gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    D: gl.constexpr = like.block_shape[2]
    heads = like.shape[1] // R
    return tma.make_tensor_descriptor(X + (p0.to(gl.int64) * heads + head) * D, [cnt, 1, D], [R * heads * D, D, 1],
                                      like.block_shape, like.layout)


@gluon.jit
def gla_gluon_lanes_produce(p, PACKED: gl.constexpr):
    """One warp: the tile's two Q blocks, then the segment's key blocks 0 ... T - 1, T the
    blocks up to the tile's last query lane (no key past it is ever needed). PACKED: the
    lanes of sequence b's segment s, starting at row p0 = s0 + s*W + o, are the rows p0 // R + j,
    column (p0 mod R)*H + h of the branch's views over all the packed rows; a block past the
    lane's last key (cnt) reads V through a descriptor that ends there (zeros: P is 0 there,
    and 0 times another sequence's non-finite value would not be)."""
    if PACKED:
        (q_desc, o_desc, k_desc, v_desc, Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, s, mt, N, W, R, s0, cnt, Q, K, V) = p
        p0 = s0 + s * W + h % R
        row0 = p0 // R
        qcol = (p0 % R) * 16 + h
        kcol = (p0 % R) * 4 + h // 4
        for wg in gl.static_range(2):
            j0 = mt * (2 * GLUON_LANE_ROWS) + wg * GLUON_LANE_ROWS
            mbarrier.expect(q_bars.index(wg), GLUON_LANE_ROWS * 128 * 2)
            if row0 + gl.minimum(j0 + GLUON_LANE_ROWS, cnt) > N // R:    # lanes past the views' N // R rows
                tma_load(gla_gluon_lane_box(Q, p0, h, cnt, R, q_desc), [j0, 0, 0], q_bars.index(wg), q_smem.index(wg))
            else:
                tma_load(q_desc, [row0 + j0, qcol, 0], q_bars.index(wg), q_smem.index(wg))
    else:
        (q_desc, o_desc, k_desc, v_desc, Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, s, mt, N, W, R) = p
        row0 = b * (N // R) + s * (W // R)
        qcol = (h % R) * 16 + h
        kcol = (h % R) * 4 + h // 4
        for wg in gl.static_range(2):
            mbarrier.expect(q_bars.index(wg), GLUON_LANE_ROWS * 128 * 2)
            tma_load(q_desc, [row0 + mt * (2 * GLUON_LANE_ROWS) + wg * GLUON_LANE_ROWS, qcol, 0], q_bars.index(wg),
                     q_smem.index(wg))
    for t in range((mt + 1) * (2 * GLUON_LANE_ROWS) // GLUON_LANE_KEYS):
        st = t % GLUON_LANE_STAGES
        mbarrier.wait(kv_empty.index(st), ((t // GLUON_LANE_STAGES) & 1) ^ 1)   # both consumers let go of it
        mbarrier.expect(k_ready.index(st), GLUON_LANE_KEYS * 128 * 2)
        if PACKED:      # through the lane's own box past its last key (V) or past the views' rows
            past = row0 + gl.minimum((t + 1) * GLUON_LANE_KEYS, cnt) > N // R
            if past:
                tma_load(gla_gluon_lane_box(K, p0, h // 4, cnt, R, k_desc), [t * GLUON_LANE_KEYS, 0, 0],
                         k_ready.index(st), k_smem.index(st))
            else:
                tma_load(k_desc, [row0 + t * GLUON_LANE_KEYS, kcol, 0], k_ready.index(st), k_smem.index(st))
            mbarrier.expect(v_ready.index(st), GLUON_LANE_KEYS * 128 * 2)
            if past or (t + 1) * GLUON_LANE_KEYS > cnt:
                tma_load(gla_gluon_lane_box(V, p0, h // 4, cnt, R, v_desc), [t * GLUON_LANE_KEYS, 0, 0],
                         v_ready.index(st), v_smem.index(st))
            else:
                tma_load(v_desc, [row0 + t * GLUON_LANE_KEYS, kcol, 0], v_ready.index(st), v_smem.index(st))
        else:
            tma_load(k_desc, [row0 + t * GLUON_LANE_KEYS, kcol, 0], k_ready.index(st), k_smem.index(st))
            mbarrier.expect(v_ready.index(st), GLUON_LANE_KEYS * 128 * 2)
            tma_load(v_desc, [row0 + t * GLUON_LANE_KEYS, kcol, 0], v_ready.index(st), v_smem.index(st))


@gluon.jit
def gla_gluon_lanes_scores(s, t, q0, s_layout: gl.constexpr, MASKED: gl.constexpr):
    """A block's raw scores q·k (the scale enters exp2's argument); in a MASKED block (the
    warpgroup's last, the one its diagonal crosses, and block 0) key lane j > query lane i is
    masked."""
    if MASKED:
        keys = t * GLUON_LANE_KEYS + gl.arange(0, GLUON_LANE_KEYS, layout=gl.SliceLayout(0, s_layout))
        lanes = q0 + gl.arange(0, GLUON_LANE_ROWS, layout=gl.SliceLayout(1, s_layout))
        s = gl.where(gl.expand_dims(keys, 0) <= gl.expand_dims(lanes, 1), s, float("-inf"))
    return s


@gluon.jit
def gla_gluon_lanes_block(t, q, acc, m_i, l_i, p_op, k_smem, v_smem, k_ready, v_ready, kv_empty, q0,
                        s_layout: gl.constexpr, o_layout: gl.constexpr, MASKED: gl.constexpr):
    """Key block t: its scores issued, then block t - 1's P·V while they run, then block t's
    online softmax (running max m_i, sum l_i; acc rescaled by exp2(m_old - m_new))."""
    dtype: gl.constexpr = k_smem.dtype
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([GLUON_LANE_ROWS, GLUON_LANE_KEYS], gl.float32, layout=s_layout)
    st = t % GLUON_LANE_STAGES
    pst = (t - 1) % GLUON_LANE_STAGES
    mbarrier.wait(k_ready.index(st), (t // GLUON_LANE_STAGES) & 1)
    s_tok = warpgroup_mma(q, k_smem.index(st).reshape([GLUON_LANE_KEYS, 128]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
    mbarrier.wait(v_ready.index(pst), ((t - 1) // GLUON_LANE_STAGES) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(pst).reshape([GLUON_LANE_KEYS, 128]), acc, is_async=True)
    x = gla_gluon_lanes_scores(warpgroup_mma_wait(1, deps=(s_tok,)), t, q0, s_layout, MASKED)
    m_new = gl.maximum(m_i, gl.max(x, axis=1) * 0.12751743082459868)
    alpha = gl.exp2(m_i - m_new)
    pj = gla_gluon_lanes_exp2(gl.fma(x, 0.12751743082459868, -gl.expand_dims(m_new, 1)))     # one multiply-add a score
    l_i = l_i * alpha + gl.sum(pj, axis=1)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))
    mbarrier.arrive(kv_empty.index(pst), count=1)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return acc, m_new, l_i, gl.convert_layout(pj.to(dtype), p_layout)


@gluon.jit
def gla_gluon_lanes_consume(p, WG: gl.constexpr, ACCUMULATE: gl.constexpr, CLEAR: gl.constexpr, PACKED: gl.constexpr):
    """One consumer warpgroup: query lanes q0 = mt*128 + WG*64 ... of the segment against the
    stream of key blocks, as the Gluon forward's consumers (block t's scores issued before
    block t - 1's P·V); key block 0 holds lane 0, so every row's running max is finite from
    the first. PACKED: lanes of a sequence's segment (the producer's), lanes past the lane's
    end (cnt) not stored; the causal mask keeps every key past it from a stored row."""
    if PACKED:
        (q_desc, o_desc, k_desc, v_desc, Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, s, mt, N, W, R, s0, cnt, Q, K, V) = p
    else:
        (q_desc, o_desc, k_desc, v_desc, Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, s, mt, N, W, R) = p
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, GLUON_LANE_KEYS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([GLUON_LANE_ROWS, GLUON_LANE_KEYS], gl.float32, layout=s_layout)
    acc = gl.zeros([GLUON_LANE_ROWS, 128], gl.float32, layout=o_layout)
    q0 = mt * (2 * GLUON_LANE_ROWS) + WG * GLUON_LANE_ROWS
    T = (q0 + GLUON_LANE_ROWS + GLUON_LANE_KEYS - 1) // GLUON_LANE_KEYS    # blocks up to its last lane

    mbarrier.wait(q_bars.index(WG), 0)
    q = q_smem.index(WG).reshape([GLUON_LANE_ROWS, 128])
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q, k_smem.index(0).reshape([GLUON_LANE_KEYS, 128]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
    x = gla_gluon_lanes_scores(warpgroup_mma_wait(0, deps=(s_tok,)), 0, q0, s_layout, True)
    m_i = gl.max(x, axis=1) * 0.12751743082459868
    pj = gla_gluon_lanes_exp2(gl.fma(x, 0.12751743082459868, -gl.expand_dims(m_i, 1)))
    l_i = gl.sum(pj, axis=1)
    p_op = gl.convert_layout(pj.to(dtype), p_layout)
    # a warpgroup's diagonal crosses exactly its last block T - 1 (64 query lanes at a
    # multiple of 64, blocks of 64 or 128 keys): blocks 1 ... T - 2 run unmasked
    for t in range(1, T - 1):
        acc, m_i, l_i, p_op = gla_gluon_lanes_block(t, q, acc, m_i, l_i, p_op, k_smem, v_smem, k_ready, v_ready,
                                                  kv_empty, q0, s_layout, o_layout, False)
    if T > 1:
        acc, m_i, l_i, p_op = gla_gluon_lanes_block(T - 1, q, acc, m_i, l_i, p_op, k_smem, v_smem, k_ready, v_ready,
                                                  kv_empty, q0, s_layout, o_layout, True)
    lst = (T - 1) % GLUON_LANE_STAGES
    mbarrier.wait(v_ready.index(lst), ((T - 1) // GLUON_LANE_STAGES) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(lst).reshape([GLUON_LANE_KEYS, 128]), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))
    mbarrier.arrive(kv_empty.index(lst), count=1)
    # blocks past its last lane (the first warpgroup's last one at 64 keys a block): let go of
    # them once their loads landed, so that the producer refills no stage a load still writes
    for t in range(T, (mt + 1) * (2 * GLUON_LANE_ROWS) // GLUON_LANE_KEYS):
        st = t % GLUON_LANE_STAGES
        mbarrier.wait(k_ready.index(st), (t // GLUON_LANE_STAGES) & 1)
        mbarrier.wait(v_ready.index(st), (t // GLUON_LANE_STAGES) & 1)
        mbarrier.arrive(kv_empty.index(st), count=1)

    rows_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    out = acc / gl.expand_dims(gl.convert_layout(l_i, rows_l), 1)
    lse = gl.convert_layout((m_i + gl.log2(l_i)) * 0.6931471805599453, rows_l)     # natural log
    rows = s * W + h % R + R * (q0 + gl.arange(0, GLUON_LANE_ROWS, layout=rows_l))
    if PACKED:      # the sequence's rows from s0, lse (H, rows); lanes past the lane's end not stored
        lse_rows = Lse + h.to(gl.int64) * N + s0 + rows
        real = q0 + gl.arange(0, GLUON_LANE_ROWS, layout=rows_l) < cnt
        offs = ((s0 + gl.expand_dims(rows, 1)).to(gl.int64) * 16 + h) * 128 \
            + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout)), 0)
    else:
        lse_rows = Lse + (b * 16 + h).to(gl.int64) * N + rows
    if ACCUMULATE:  # merge with the launches before this one (common.merge_partial)
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)     # their rows are final (programmatic dependent launch)
        if PACKED:
            lse_acc = gl.load(lse_rows, mask=real, other=float("-inf"))
        else:
            offs = ((b * N + gl.expand_dims(rows, 1)).to(gl.int64) * 16 + h) * 128 \
                + gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout)), 0)
            lse_acc = gl.load(lse_rows)
        top = gl.maximum(lse_acc, lse)              # finite: this launch's lse is
        w_acc = gl.exp(lse_acc - top)
        w_new = gl.exp(lse - top)
        total = w_acc + w_new
        kept = gl.expand_dims(w_acc > 0.0, 1)
        if PACKED:
            out_prev = gl.load(Out + offs, mask=gl.expand_dims(real, 1), other=0.0)
        else:
            out_prev = gl.load(Out + offs)
        out_acc = gl.where(kept, out_prev.to(gl.float32) * gl.expand_dims(w_acc, 1), 0.0)
        out = (out_acc + out * gl.expand_dims(w_new, 1)) / gl.expand_dims(total, 1)
        lse = top + gl.log(total)
    if PACKED:
        p0 = s0 + s * W + h % R
        if q0 + GLUON_LANE_ROWS <= cnt and p0 // R + q0 + GLUON_LANE_ROWS <= N // R:   # within the lane and the view
            q_smem.index(WG).reshape([GLUON_LANE_ROWS, 128]).store(out.to(dtype))
            fence_async_shared()
            tma_store(o_desc, [p0 // R + q0, (p0 % R) * 16 + h, 0], q_smem.index(WG))
        else:
            gl.store(Out + offs, out.to(dtype), mask=gl.expand_dims(real, 1))
        gl.store(lse_rows, lse, mask=real)
    else:
        q_smem.index(WG).reshape([GLUON_LANE_ROWS, 128]).store(out.to(dtype))   # its Q buffer holds its output
        fence_async_shared()
        tma_store(o_desc, [b * (N // R) + s * (W // R) + q0, (h % R) * 16 + h, 0],
                  q_smem.index(WG))
        gl.store(lse_rows, lse)
    if CLEAR:   # the first launch where no branch keeps every row: "no branch" (0, -inf) into
        # the rows of the tile's span that other offsets c than o keep (common.gap_rows)
        offs_d = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, o_layout)), 0)
        for c in range(1, R):
            gap = rows + ((h + c) % R - h % R)
            gl.store(Out + ((b * N + gl.expand_dims(gap, 1)).to(gl.int64) * 16 + h) * 128 + offs_d,
                     gl.zeros([GLUON_LANE_ROWS, 128], dtype, layout=o_layout))
            gl.store(Lse + (b * 16 + h).to(gl.int64) * N + gap,
                     gl.full([GLUON_LANE_ROWS], float("-inf"), gl.float32, layout=rows_l))
    tma.store_wait(pendings=0)


@gluon.jit
def gla_gluon_lanes_write0(p):
    gla_gluon_lanes_consume(p, 0, False, False, False)


@gluon.jit
def gla_gluon_lanes_write1(p):
    gla_gluon_lanes_consume(p, 1, False, False, False)


@gluon.jit
def gla_gluon_lanes_add0(p):
    gla_gluon_lanes_consume(p, 0, True, False, False)


@gluon.jit
def gla_gluon_lanes_add1(p):
    gla_gluon_lanes_consume(p, 1, True, False, False)


@gluon.jit
def gla_gluon_lanes_clear0(p):
    gla_gluon_lanes_consume(p, 0, False, True, False)


@gluon.jit
def gla_gluon_lanes_clear1(p):
    gla_gluon_lanes_consume(p, 1, False, True, False)


@gluon.jit
def gla_gluon_lanes_packed_write0(p):
    gla_gluon_lanes_consume(p, 0, False, False, True)


@gluon.jit
def gla_gluon_lanes_packed_write1(p):
    gla_gluon_lanes_consume(p, 1, False, False, True)


@gluon.jit
def gla_gluon_lanes_packed_add0(p):
    gla_gluon_lanes_consume(p, 0, True, False, True)


@gluon.jit
def gla_gluon_lanes_packed_add1(p):
    gla_gluon_lanes_consume(p, 1, True, False, True)


@gluon.jit
def gla_gluon_lanes_producer(p):
    gla_gluon_lanes_produce(p, False)


@gluon.jit
def gla_gluon_lanes_packed_producer(p):
    gla_gluon_lanes_produce(p, True)


@gluon.jit
def gla_gluon_lanes(q_desc, o_desc, k_desc, v_desc, Out, Lse, N, W: gl.constexpr, R: gl.constexpr,
                  ACCUMULATE: gl.constexpr, CLEAR: gl.constexpr):
    """Notation (as in gla_fwd_lanes, whose work this is for one branch).
    W, R             the branch's segment length and rate (W / R a multiple of 128)
    q_desc, o_desc   q and out as (B*N/R, R*H, D): rows b*N/R + s*W/R + j, column o*H + h are
                     the query lanes u = s*W + o + R*j of head h (o = h mod R); boxes of 64
    k_desc, v_desc   k and v as (B*N/R, R*H_kv, D), column o*H_kv + kv head; boxes of 128
    Out, Lse         (B, N, H, D) and (B, H, N): merged into (ACCUMULATE) or written; CLEAR
                     (a first launch whose branch does not keep every row): the tile's span's
                     rows of other offsets written "no branch" (0, -inf) too
    program          (s*T + t, b*H + h): segment s, lane tile mt = T - 1 - t of 128 lanes
                     (T = W/R/128 tiles, the longest first)
    Two consumer warpgroups of 64 query lanes and one producer warp (gl.warp_specialize), as
    the Gluon forward (gluon_fwd.py.jinja); every segment whole (runtime/forward.py)."""
    dtype: gl.constexpr = q_desc.dtype
    n_tiles: gl.constexpr = W // R // (2 * GLUON_LANE_ROWS)
    s = gl.program_id(0) // n_tiles
    mt = n_tiles - 1 - gl.program_id(0) % n_tiles
    b = gl.program_id(1) // 16
    h = gl.program_id(1) % 16
    if not ACCUMULATE:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    q_smem = gl.allocate_shared_memory(dtype, [2, GLUON_LANE_ROWS, 1, 128], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [GLUON_LANE_STAGES, GLUON_LANE_KEYS, 1, 128], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [GLUON_LANE_STAGES, GLUON_LANE_KEYS, 1, 128], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [GLUON_LANE_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [GLUON_LANE_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [GLUON_LANE_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(GLUON_LANE_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    fence_async_shared()
    p = (q_desc, o_desc, k_desc, v_desc, Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, s, mt, N, W, R)
    if ACCUMULATE:
        gl.warp_specialize([(gla_gluon_lanes_add0, (p,)), (gla_gluon_lanes_add1, (p,)),
                            (gla_gluon_lanes_producer, (p,))], [4, 1], [240, 24])
    elif CLEAR:
        gl.warp_specialize([(gla_gluon_lanes_clear0, (p,)), (gla_gluon_lanes_clear1, (p,)),
                            (gla_gluon_lanes_producer, (p,))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(gla_gluon_lanes_write0, (p,)), (gla_gluon_lanes_write1, (p,)),
                            (gla_gluon_lanes_producer, (p,))], [4, 1], [240, 24])


@gluon.jit
def gla_gluon_lanes_packed(q_desc, o_desc, k_desc, v_desc, Q, K, V, Out, Lse, SeqStart, SeqLen, N, W: gl.constexpr,
                         R: gl.constexpr, ACCUMULATE: gl.constexpr):
    """The lanes over packed rows (runtime.varlen): the same work for sequence b of the launch
    group, rows SeqStart[b] + [0, SeqLen[b]), its segments from its first row, the last one
    maybe short (SPEC 2.1: its lanes end early).
    q_desc, o_desc   q and out as (N // R, R*H, D), N all the packed rows: the lane starting at
                     row p0 is the rows p0 // R + j, column (p0 mod R)*H + h; W need not be a
                     multiple of R (LongNet's r = 6, 12: a lane then holds ceil((w - o) / R) rows)
    k_desc, v_desc   k and v as (N // R, R*H_kv, D); boxes of 128
    Q, K, V, Out     q, k, v and out (N, H or H_kv, D): blocks reaching past the views' N // R rows
                     (N not a multiple of R) read and store through them, as do a block past the
                     lane's last key (V) and the lanes of a tile past it (runtime/gluon_packed.py)
    Lse              (H, N)
    program          (s*T + t, b*H + h) as gla_gluon_lanes'; a tile past its lane's end does nothing"""
    dtype: gl.constexpr = q_desc.dtype
    n_tiles: gl.constexpr = (W + 2 * GLUON_LANE_ROWS * R - 1) // (2 * GLUON_LANE_ROWS * R)     # ceil(ceil(W / R) / 128)
    s = gl.program_id(0) // n_tiles
    mt = n_tiles - 1 - gl.program_id(0) % n_tiles
    b = gl.program_id(1) // 16
    h = gl.program_id(1) % 16
    if not ACCUMULATE:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    s0 = gl.load(SeqStart + b)
    n = gl.load(SeqLen + b)
    # the lane's keys: offset o = h mod R of the segment's min(n - s*W, W) rows
    cnt = gl.maximum(gl.minimum(n - s * W, W) - h % R + R - 1, 0) // R
    if mt * (2 * GLUON_LANE_ROWS) >= cnt:
        return
    q_smem = gl.allocate_shared_memory(dtype, [2, GLUON_LANE_ROWS, 1, 128], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [GLUON_LANE_STAGES, GLUON_LANE_KEYS, 1, 128], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [GLUON_LANE_STAGES, GLUON_LANE_KEYS, 1, 128], v_desc.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [GLUON_LANE_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [GLUON_LANE_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [GLUON_LANE_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(GLUON_LANE_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    fence_async_shared()
    p = (q_desc, o_desc, k_desc, v_desc, Out, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, s, mt, N, W, R, s0, cnt, Q, K, V)
    if ACCUMULATE:
        gl.warp_specialize([(gla_gluon_lanes_packed_add0, (p,)), (gla_gluon_lanes_packed_add1, (p,)),
                            (gla_gluon_lanes_packed_producer, (p,))], [4, 1], [240, 24])
    else:
        gl.warp_specialize([(gla_gluon_lanes_packed_write0, (p,)), (gla_gluon_lanes_packed_write1, (p,)),
                            (gla_gluon_lanes_packed_producer, (p,))], [4, 1], [240, 24])

