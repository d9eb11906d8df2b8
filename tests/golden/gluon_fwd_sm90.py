# ---- sm90: the same forward in Gluon (KernelConfig.gluon_fwd; runtime/forward.py launches it
# on a GPU for fixed-length rows whose every segment is whole, the kernel above otherwise) ----
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: E402
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

# TMA copies: Triton 3.9 names them async_load / async_store (3.6: async_copy_*)
tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global

GLUON_ROWS = gl.constexpr(64)       # query rows per consumer warpgroup; a program takes two
GLUON_KEYS = gl.constexpr(128)      # keys per block
GLUON_STAGES = gl.constexpr(3)    # K/V blocks in flight (the shared-memory ring)


@gluon.jit
def gx_gluon_exp2(x):
    return gl.exp2(x)


@gluon.jit
def gx_gluon_lane_keys(d, u0, n, hb, W: gl.constexpr, R: gl.constexpr):
    """The keys of branch (w = W, r = R) a class-d query at u0 reads: its lane (offset hb mod R)
    of the segment holding u0; 0 where the branch does not keep the class."""
    keep = (d % R == 0).to(gl.int32)
    return keep * ((gl.minimum(n - (u0 // W) * W, W) - hb % R + R - 1) // R)


@gluon.jit
def gx_gluon_packed_blocks(d, u0, n, hb, BN: gl.constexpr):
    """The tile's blocks of BN keys T, then per branch the index of its lane's last block where
    that block is partial (else -1) and the keys of it that are real."""
    T = d * 0
    cnt = gx_gluon_lane_keys(d, u0, n, hb, 2048, 1)  # branch 0
    T += (cnt + BN - 1) // BN
    last0 = gl.where(cnt % BN != 0, T - 1, -1)   # the lane's last block, if partial
    tail0 = cnt % BN                             # its real keys
    cnt = gx_gluon_lane_keys(d, u0, n, hb, 4096, 2)  # branch 1
    T += (cnt + BN - 1) // BN
    last1 = gl.where(cnt % BN != 0, T - 1, -1)   # the lane's last block, if partial
    tail1 = cnt % BN                             # its real keys
    cnt = gx_gluon_lane_keys(d, u0, n, hb, 8192, 4)  # branch 2
    T += (cnt + BN - 1) // BN
    last2 = gl.where(cnt % BN != 0, T - 1, -1)   # the lane's last block, if partial
    tail2 = cnt % BN                             # its real keys
    return T, last0, tail0, last1, tail1, last2, tail2


@gluon.jit
def gx_gluon_real_keys(t, last0, tail0, last1, tail1, last2, tail2, BN: gl.constexpr):
    """The real keys of block t: BN, but in a lane's partial last block."""
    valid = t * 0 + BN
    valid = gl.where(t == last0, tail0, valid)
    valid = gl.where(t == last1, tail1, valid)
    valid = gl.where(t == last2, tail2, valid)
    return valid


@gluon.jit
def gx_gluon_lane_box(X, p0, head, cnt, R: gl.constexpr, like):
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
def gx_gluon_blocks(d):
    """Key blocks of a class-d tile: w / r / GLUON_KEYS for each branch with r | d."""
    t = gl.where(d % 1 == 0, 16, 0)  # branch 0: w = 2048, r = 1
    t += gl.where(d % 2 == 0, 16, 0)  # branch 1: w = 4096, r = 2
    t += gl.where(d % 4 == 0, 16, 0)  # branch 2: w = 8192, r = 4
    return t


@gluon.jit
def gx_gluon_load_packed(it, kd, vd, V, k_smem, v_smem, k_ready, v_ready, kv_empty, h, d, u0, s0, n,
                        W: gl.constexpr, R: gl.constexpr):
    """Packed rows: gx_gluon_load_branch for the sequence of n rows at row s0. Its lane's keys are
    the rows p0 + R*j (p0 = s0 + segment start + offset), the rows p0 // R + j, column
    (p0 mod R)*H_kv + h // 4 of the (rows/R, R*H_kv, D) view over all the packed rows. The
    lane's last block, when partial, reads V through a descriptor that ends at the lane's last
    key, so that the rows past it are zeros (P is 0 there, and 0 times another sequence's
    non-finite value would not be)."""
    hb = h
    cnt = gx_gluon_lane_keys(d, u0, n, hb, W, R)
    p0 = s0 + (u0 // W) * W + hb % R
    krow = p0 // R
    kcol = (p0 % R) * 4 + h // 4
    for j in range((cnt + GLUON_KEYS - 1) // GLUON_KEYS):
        st = it % GLUON_STAGES
        mbarrier.wait(kv_empty.index(st), ((it // GLUON_STAGES) & 1) ^ 1)
        mbarrier.expect(k_ready.index(st), GLUON_KEYS * 128 * 2)
        tma_load(kd, [krow + j * GLUON_KEYS, kcol, 0], k_ready.index(st), k_smem.index(st))
        mbarrier.expect(v_ready.index(st), GLUON_KEYS * 128 * 2)
        if (j + 1) * GLUON_KEYS > cnt:
            tail = gx_gluon_lane_box(V, p0, h // 4, cnt, R, vd)
            tma_load(tail, [j * GLUON_KEYS, 0, 0], v_ready.index(st), v_smem.index(st))
        else:
            tma_load(vd, [krow + j * GLUON_KEYS, kcol, 0], v_ready.index(st), v_smem.index(st))
        it += 1
    return it


@gluon.jit
def gx_gluon_load_branch(it, kd, vd, k_smem, v_smem, k_ready, v_ready, kv_empty, b, h, d, u0, N,
                        W: gl.constexpr, R: gl.constexpr):
    """Queue the key blocks of one branch (w = W, r = R) for a class-d tile whose first row is
    u0, if the branch keeps the class; `it` counts the blocks queued before. Its lane of
    segment s is the rows b*N/R + s*W/R + j of the (B*N/R, R*H_kv, D) view, column
    o*H_kv + h // 4 (o = h mod R): one TMA box per block."""
    if d % R == 0:
        krow = b * (N // R) + (u0 // W) * (W // R)
        kcol = (h % R) * 4 + h // 4
        for j in range((W // R) // GLUON_KEYS):
            st = it % GLUON_STAGES
            mbarrier.wait(kv_empty.index(st), ((it // GLUON_STAGES) & 1) ^ 1)   # both consumers let go of it
            mbarrier.expect(k_ready.index(st), GLUON_KEYS * 128 * 2)
            tma_load(kd, [krow + j * GLUON_KEYS, kcol, 0], k_ready.index(st), k_smem.index(st))
            mbarrier.expect(v_ready.index(st), GLUON_KEYS * 128 * 2)
            tma_load(vd, [krow + j * GLUON_KEYS, kcol, 0], v_ready.index(st), v_smem.index(st))
            it += 1
    return it


@gluon.jit
def gx_gluon_producer(p, PACKED: gl.constexpr):
    """One warp: both Q tiles, then every kept branch's key blocks in branch order."""
    if PACKED:
        (q_desc, o_desc, k_descs, v_descs, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, d, c, m0, N, s0, n, V, Out) = p
        qrow, qcol = (s0 + c) // 4, ((s0 + c) % 4) * 16 + h
    else:
        (q_desc, o_desc, k_descs, v_descs, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, d, c, m0, N) = p
        qrow, qcol = b * (N // 4), c * 16 + h
    for wg in gl.static_range(2):
        mbarrier.expect(q_bars.index(wg), GLUON_ROWS * 128 * 2)
        tma_load(q_desc, [qrow + m0 + wg * GLUON_ROWS, qcol, 0], q_bars.index(wg), q_smem.index(wg))
    u0 = c + 4 * m0
    it = d * 0
    if PACKED:
        it = gx_gluon_load_packed(it, k_descs[0], v_descs[0], V, k_smem, v_smem, k_ready,
                                   v_ready, kv_empty, h, d, u0, s0, n, 2048, 1)
    else:
        it = gx_gluon_load_branch(it, k_descs[0], v_descs[0], k_smem, v_smem, k_ready, v_ready,
                                   kv_empty, b, h, d, u0, N, 2048, 1)  # branch 0
    if PACKED:
        it = gx_gluon_load_packed(it, k_descs[1], v_descs[1], V, k_smem, v_smem, k_ready,
                                   v_ready, kv_empty, h, d, u0, s0, n, 4096, 2)
    else:
        it = gx_gluon_load_branch(it, k_descs[1], v_descs[1], k_smem, v_smem, k_ready, v_ready,
                                   kv_empty, b, h, d, u0, N, 4096, 2)  # branch 1
    if PACKED:
        it = gx_gluon_load_packed(it, k_descs[2], v_descs[2], V, k_smem, v_smem, k_ready,
                                   v_ready, kv_empty, h, d, u0, s0, n, 8192, 4)
    else:
        it = gx_gluon_load_branch(it, k_descs[2], v_descs[2], k_smem, v_smem, k_ready, v_ready,
                                   kv_empty, b, h, d, u0, N, 8192, 4)  # branch 2


@gluon.jit
def gx_gluon_consume(p, WG: gl.constexpr, PACKED: gl.constexpr):
    """One consumer warpgroup: rows m0 + WG*64 ... of the tile against the stream of key
    blocks (it never sees the branches). Block t's scores are issued before block t - 1's
    P·V, and block t's softmax runs while that P·V is on the tensor cores. PACKED: rows of
    one sequence of packed rows, whose lanes may end in a partial block (keys past the lane's
    end score -inf) and whose last tile may pass the sequence's end (rows past it not stored)."""
    if PACKED:
        (q_desc, o_desc, k_descs, v_descs, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, d, c, m0, N, s0, n, V, Out) = p
    else:
        (q_desc, o_desc, k_descs, v_descs, Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty,
         b, h, d, c, m0, N) = p
    dtype: gl.constexpr = q_desc.dtype
    D: gl.constexpr = 128
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, GLUON_KEYS, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = gl.zeros([GLUON_ROWS, GLUON_KEYS], gl.float32, layout=s_layout)
    acc = gl.zeros([GLUON_ROWS, D], gl.float32, layout=o_layout)
    if PACKED:
        u0 = c + 4 * m0
        T, last0, tail0, last1, tail1, last2, tail2 = gx_gluon_packed_blocks(d, u0, n, h, GLUON_KEYS)
        keys = gl.expand_dims(gl.arange(0, GLUON_KEYS, layout=gl.SliceLayout(0, s_layout)), 0)
    else:
        T = gx_gluon_blocks(d)            # at least one: a branch with r = 1 keeps every class

    mbarrier.wait(q_bars.index(WG), 0)
    q = q_smem.index(WG).reshape([GLUON_ROWS, D])
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q, k_smem.index(0).reshape([GLUON_KEYS, D]).permute((1, 0)), s_zero,
                          use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    if PACKED:      # keys past a lane's end in its partial last block score -inf
        valid = gx_gluon_real_keys(0, last0, tail0, last1, tail1, last2, tail2, GLUON_KEYS)
        if valid < GLUON_KEYS:
            s = gl.where(keys < valid, s, float("-inf"))
    m_i = gl.max(s, axis=1) * 0.12751743082459868
    pj = gx_gluon_exp2(gl.fma(s, 0.12751743082459868, -gl.expand_dims(m_i, 1)))
    l_i = gl.sum(pj, axis=1)
    p_op = gl.convert_layout(pj.to(dtype), p_layout)
    for t in range(1, T):
        st = t % GLUON_STAGES
        pst = (t - 1) % GLUON_STAGES
        mbarrier.wait(k_ready.index(st), (t // GLUON_STAGES) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(st).reshape([GLUON_KEYS, D]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(pst), ((t - 1) // GLUON_STAGES) & 1)
        o_tok = warpgroup_mma(p_op, v_smem.index(pst).reshape([GLUON_KEYS, D]), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok,))          # block t's scores; t - 1's P V still runs
        if PACKED:
            valid = gx_gluon_real_keys(t, last0, tail0, last1, tail1, last2, tail2, GLUON_KEYS)
            if valid < GLUON_KEYS:
                s = gl.where(keys < valid, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * 0.12751743082459868)
        alpha = gl.exp2(m_i - m_new)
        pj = gx_gluon_exp2(gl.fma(s, 0.12751743082459868, -gl.expand_dims(m_new, 1)))     # one multiply-add a score
        l_i = l_i * alpha + gl.sum(pj, axis=1)
        m_i = m_new
        acc = warpgroup_mma_wait(0, deps=(o_tok,))
        mbarrier.arrive(kv_empty.index(pst), count=1)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_op = gl.convert_layout(pj.to(dtype), p_layout)
    lst = (T - 1) % GLUON_STAGES
    mbarrier.wait(v_ready.index(lst), ((T - 1) // GLUON_STAGES) & 1)
    o_tok = warpgroup_mma(p_op, v_smem.index(lst).reshape([GLUON_KEYS, D]), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(o_tok,))
    mbarrier.arrive(kv_empty.index(lst), count=1)

    out = (acc / gl.expand_dims(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout)), 1)).to(dtype)
    if PACKED:      # lse is (H, rows); a tile past the sequence's end stores its rows one by one
        rows = c + 4 * (m0 + WG * GLUON_ROWS + gl.arange(0, GLUON_ROWS, layout=gl.SliceLayout(1, s_layout)))
        if c + 4 * (m0 + WG * GLUON_ROWS + GLUON_ROWS - 1) < n:
            q_smem.index(WG).reshape([GLUON_ROWS, D]).store(out)
            fence_async_shared()
            tma_store(o_desc, [(s0 + c) // 4 + m0 + WG * GLUON_ROWS,
                               ((s0 + c) % 4) * 16 + h, 0], q_smem.index(WG))
        else:
            o_rows = gl.expand_dims(gl.convert_layout(rows, gl.SliceLayout(1, o_layout)), 1)
            o_cols = gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, o_layout)), 0)
            gl.store(Out + ((s0 + o_rows).to(gl.int64) * 16 + h) * D + o_cols, out, mask=o_rows < n)
        gl.store(Lse + h.to(gl.int64) * N + s0 + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=rows < n)
    else:
        q_smem.index(WG).reshape([GLUON_ROWS, D]).store(out)    # the warpgroup's Q buffer holds its output
        fence_async_shared()
        tma_store(o_desc, [b * (N // 4) + m0 + WG * GLUON_ROWS, c * 16 + h, 0],
                                        q_smem.index(WG))
        rows = c + 4 * (m0 + WG * GLUON_ROWS + gl.arange(0, GLUON_ROWS, layout=gl.SliceLayout(1, s_layout)))
        gl.store(Lse + (b * 16 + h).to(gl.int64) * N + rows, (m_i + gl.log2(l_i)) * 0.6931471805599453)
    tma.store_wait(pendings=0)


@gluon.jit
def gx_gluon_consumer0(p):
    gx_gluon_consume(p, 0, False)


@gluon.jit
def gx_gluon_consumer1(p):
    gx_gluon_consume(p, 1, False)


@gluon.jit
def gx_gluon_fixed_producer(p):
    gx_gluon_producer(p, False)


@gluon.jit
def gx_gluon_packed_consumer0(p):
    gx_gluon_consume(p, 0, True)


@gluon.jit
def gx_gluon_packed_consumer1(p):
    gx_gluon_consume(p, 1, True)


@gluon.jit
def gx_gluon_packed_producer(p):
    gx_gluon_producer(p, True)


@gluon.jit
def gx_gluon_fwd(q_desc, o_desc, k0, k1, k2, v0, v1, v2, Lse, N):
    """Notation (as in gx_fwd_kernel, whose work this is).
    q_desc, o_desc   q and out as (B*N/L, L*H, D): row b*N/L + m, column c*H + h is row
                     u = c + L*m of head h (L = 4); boxes of 64 rows
    k<i>, v<i>       branch i's keys as (B*N/r, r*H_kv, D): its lane of a segment is a box
    program          (d + L*t, b*H + h): class d of the tile t of 128 lattice rows, c = (h + d) mod L;
                     the classes of a tile run side by side, as they read the same key lanes (L2)
    Two consumer warpgroups of 64 rows and one producer warp (gl.warp_specialize); the
    producer fills a ring of GLUON_STAGES K/V blocks (k_ready / v_ready), a stage returns to
    it once both consumers arrived on its kv_empty. Every segment whole (runtime/forward.py)."""
    dtype: gl.constexpr = q_desc.dtype
    m0 = (gl.program_id(0) // 4) * (2 * GLUON_ROWS)
    d = gl.program_id(0) % 4
    b = gl.program_id(1) // 16
    h = gl.program_id(1) % 16
    c = (h + d) % 4
    q_smem = gl.allocate_shared_memory(dtype, [2, GLUON_ROWS, 1, 128], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [GLUON_STAGES, GLUON_KEYS, 1, 128], k0.layout)
    v_smem = gl.allocate_shared_memory(dtype, [GLUON_STAGES, GLUON_KEYS, 1, 128], v0.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [GLUON_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [GLUON_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [GLUON_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(GLUON_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    fence_async_shared()
    p = (q_desc, o_desc, (k0, k1, k2), (v0, v1, v2),
         Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty, b, h, d, c, m0, N)
    gl.warp_specialize([(gx_gluon_consumer0, (p,)), (gx_gluon_consumer1, (p,)), (gx_gluon_fixed_producer, (p,))],
                       [4, 1], [240, 24])


@gluon.jit
def gx_gluon_fwd_packed(q_desc, o_desc, k0, k1, k2, v0, v1, v2, V, Out, Lse, SeqStart, SeqLen, rows):
    """The forward over packed rows (runtime.varlen): the same work for sequence b of the
    launch group, rows SeqStart[b] + [0, SeqLen[b]), its segments from its first row.
    q_desc, o_desc   q and out as (rows/L, L*H, D): row u of the sequence is row (s0 + u) // L,
                     column ((s0 + u) mod L)*H + h (rows a multiple of L)
    k<i>, v<i>       branch i's keys as (rows/r, r*H_kv, D), as the fixed-length kernel's
    V, Out           v and out (rows, H_kv or H, D): a lane's partial last block of V, a tile's
                     rows past its sequence's end (runtime/gluon_packed.py gluon_packed_launch)
    Lse              (H, rows)
    program          (d + L*t, b*H + h) as gx_gluon_fwd's; a tile past the sequence's end does nothing"""
    dtype: gl.constexpr = q_desc.dtype
    m0 = (gl.program_id(0) // 4) * (2 * GLUON_ROWS)
    d = gl.program_id(0) % 4
    b = gl.program_id(1) // 16
    h = gl.program_id(1) % 16
    c = (h + d) % 4
    s0 = gl.load(SeqStart + b)
    n = gl.load(SeqLen + b)
    if c + 4 * m0 >= n:
        return
    q_smem = gl.allocate_shared_memory(dtype, [2, GLUON_ROWS, 1, 128], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [GLUON_STAGES, GLUON_KEYS, 1, 128], k0.layout)
    v_smem = gl.allocate_shared_memory(dtype, [GLUON_STAGES, GLUON_KEYS, 1, 128], v0.layout)
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [GLUON_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [GLUON_STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [GLUON_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    for i in gl.static_range(GLUON_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)
    fence_async_shared()
    p = (q_desc, o_desc, (k0, k1, k2), (v0, v1, v2),
         Lse, q_smem, k_smem, v_smem, q_bars, k_ready, v_ready, kv_empty, b, h, d, c, m0, rows, s0, n, V, Out)
    gl.warp_specialize([(gx_gluon_packed_consumer0, (p,)), (gx_gluon_packed_consumer1, (p,)),
                        (gx_gluon_packed_producer, (p,))], [4, 1], [240, 24])


attention = GeneratedAttention(SPEC, PLAN, forward_kernel=gx_fwd_kernel,
                               backward_kernels=BACKWARD_KERNELS,
                               decode_kernels=DECODE_KERNELS,
                               lane_kernel=None,
                               curve_kernel=None,
                               gluon_kernel=gx_gluon_fwd,
                               gluon_packed=gx_gluon_fwd_packed)
