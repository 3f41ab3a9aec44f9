"""The FlashAttention forward for Hopper GPUs (sm_90) in Gluon, Triton's lower-level language: three kernels that
write what the `tl` forward writes (O, and L in natural log) for every input they take.

Why Gluon: a `tl` kernel on Hopper runs each tile's softmax and its two tensor-core products one after the other
(Triton waits for each `wgmma` before its result is used). Gluon exposes FlashAttention-3's tools: asynchronous
wgmma with an explicit wait depth, TMA copies into rings of buffers signalled by mbarriers, and warp specialisation
with per-partition register budgets. Each kernel issues

    S_t = Q K_tᵀ (async); O += P_{t-1} V_{t-1} (async); wait for S_t only; softmax(S_t) -> P_t; wait for P V;
    rescale O; hand the freed K/V buffers back (or refill them, TMA).

so that S_t's softmax runs while the tensor cores finish P_{t-1} V_{t-1}. That needs the softmax in a basic block of
its own (`masked_softmax_step`): ptxas moves a wait to the start of its block, and with the softmax in the P V
wait's block every exponential waited for P V. The ping-pong kernels add the other overlap, one warpgroup's softmax
under the other's products (docs/attention-kernels.md).

- `attention_forward`: one warpgroup per program, several programs per SM (best at D 64 and short sequences).
- `attention_forward_pingpong`: warp-specialised. A producer warp issues the TMA copies into a ring of buffers; two
  or three consumer warpgroups of BLOCK_M // WGS query rows share the key tiles and take turns at issuing their
  products (FlashAttention-3's inter-warpgroup ping-pong), so one's softmax runs while the others' products run.
  The turns and the buffers handed back to the producer are named hardware barriers (`named_barriers`).
- `attention_forward_persistent`: the ping-pong kernel with one program per SM, each over pairs of query tiles, so
  that one tile's start and end overlap the previous tile's work (best below N 16384 and under causal masks).

Every input the `tl` forward takes works: grouped-query K/V (head h reads K/V head h // kv_group), Nq != Nk, causal
and sliding windows (bottom-right aligned), lengths that are not a multiple of the tile (TMA reads zeros past the end
and clips the stores), and rows that see no key (O = 0, L = -inf). Tensors are rank-4 (B, H, N, D) TMA descriptors
with their own strides: the kernels copy (1, 1, rows, D) boxes and view them as (rows, D) tiles.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .common import (
    invalidate_barriers,
    key_geometry,
    load_pair,
    load_tile,
    masked_scores,
    masked_softmax_step,
    mma_layout,
    pv_operand,
    query_program,
    row_broadcast,
    smem_tile,
    softmax_step,
    stream_buffers,
    v_free_barriers,
)
from .compat import tma_load, tma_store
from .named_barriers import pass_turn, release_slot, slot_barriers_fit, wait_for_slot, wait_turn


@gluon.jit
def _attend(q, offs_m, k_smem, v_smem, k_bar, v_bar, n_tiles, lo, full_lo, full_hi, n_k, right_offset, left_offset,
            qk_scale, k_desc, v_desc, b, h_kv, streamed, WG: gl.constexpr, ROWS: gl.constexpr,
            HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr, BOUND_RIGHT: gl.constexpr,
            BOUND_LEFT: gl.constexpr, PINGPONG: gl.constexpr, WGS: gl.constexpr = 2):
    """(O unnormalised, row max, row sum) of one warpgroup's ROWS query rows over key tiles lo, lo + BLOCK_N, ...
    (n_tiles of them), with the intra-warpgroup overlap of the module docstring.

    The plain kernel refills a freed K/V buffer itself (k_desc, v_desc, b, h_kv); ping-pong consumer WG of WGS
    (PINGPONG) instead waits for its turn before issuing products and passes it to consumer WG + 1 (round the ring)
    after, and hands each freed buffer back to the producer (`named_barriers`): with two slots K's as soon as S has
    read it (slot barrier `slot`) and V's after P V (NBUF + slot), so that the next K tile loads while this tile's
    P V and softmax run; with more, both after P V (`slot`; `v_free_barriers`). The arguments the other kind uses
    are None. `streamed`: the key tiles this program streamed through its ring before (0, or a persistent program's
    earlier query tiles), which fix each buffer's slot and each load barrier's phase."""
    s_layout: gl.constexpr = mma_layout(BLOCK_N)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout(HEAD_DIM), k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    V_FREE: gl.constexpr = v_free_barriers(NBUF)
    P_AS_OPERAND: gl.constexpr = WGS == 3  # `softmax_step`: P carried in 16 bits where registers are short
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=mma_layout(HEAD_DIM))
    if n_tiles > 0:
        # Tile 0: S and its softmax; nothing to overlap yet.
        first = streamed % NBUF
        if PINGPONG:
            wait_turn(WG)
        mbarrier.wait(k_bar.index(first), (streamed // NBUF) & 1)
        s = warpgroup_mma(q, smem_tile(k_smem.index(first), BLOCK_N, HEAD_DIM).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        if PINGPONG:
            pass_turn(WG, WGS)
        s = warpgroup_mma_wait(0, deps=[s])
        if PINGPONG and V_FREE > 0:
            release_slot(first, WGS)
        s = masked_scores(s, offs_m, lo, n_k, right_offset, left_offset, full_lo, full_hi, BLOCK_N, BOUND_RIGHT,
                           BOUND_LEFT)
        p, m_i, alpha, l_i = softmax_step(s, m_i, l_i, qk_scale, dtype, p_layout, P_AS_OPERAND)
        for t in range(1, n_tiles):
            slot = (streamed + t) % NBUF
            prev = (streamed + t - 1) % NBUF
            if PINGPONG:
                wait_turn(WG)
            mbarrier.wait(k_bar.index(slot), ((streamed + t) // NBUF) & 1)
            s_tok = warpgroup_mma(q, smem_tile(k_smem.index(slot), BLOCK_N, HEAD_DIM).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            mbarrier.wait(v_bar.index(prev), ((streamed + t - 1) // NBUF) & 1)
            acc_tok = warpgroup_mma(pv_operand(p, dtype, p_layout), smem_tile(v_smem.index(prev), BLOCK_N, HEAD_DIM),
                                    acc, is_async=True)
            if PINGPONG:
                pass_turn(WG, WGS)
            s = warpgroup_mma_wait(1, deps=[s_tok])  # S_t is done; P_{t-1} V_{t-1} may still run
            if PINGPONG and V_FREE > 0:
                release_slot(slot, WGS)
            p, m_i, alpha, l_i = masked_softmax_step(s, m_i, l_i, qk_scale, dtype, p_layout, P_AS_OPERAND, offs_m,
                                                     lo + t * BLOCK_N, n_k, right_offset, left_offset, full_lo,
                                                     full_hi, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
            acc = warpgroup_mma_wait(0, deps=[acc_tok])
            # Buffer `prev` is free: this warpgroup's wait above covers every product of its own that read it.
            if PINGPONG:
                release_slot(V_FREE + prev, WGS)
            else:
                load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + (t - 1 + NBUF) * BLOCK_N, prev,
                           t - 1 + NBUF < n_tiles)
            acc = acc * row_broadcast(alpha, acc)
        last = (streamed + n_tiles - 1) % NBUF
        if PINGPONG:
            wait_turn(WG)
        mbarrier.wait(v_bar.index(last), ((streamed + n_tiles - 1) // NBUF) & 1)
        acc = warpgroup_mma(pv_operand(p, dtype, p_layout), smem_tile(v_smem.index(last), BLOCK_N, HEAD_DIM), acc,
                            is_async=True)
        if PINGPONG:
            pass_turn(WG, WGS)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if PINGPONG:
            release_slot(V_FREE + last, WGS)
    return acc, m_i, l_i


@gluon.jit
def _store_out(acc, m_i, l_i, offs_m, L, n_q, o_desc, b, h, row, staging, ROWS: gl.constexpr,
               HEAD_DIM: gl.constexpr, DRAIN: gl.constexpr = True):
    """L (natural log; -inf for a row that saw no key) and O = acc / l (0 there) of query rows row.. (offs_m). O goes
    through `staging` (the query tile's box, no longer read; a persistent program's own buffer) by a TMA store, which
    clips rows past n_q. DRAIN: wait for the store to complete; without it the caller waits before `staging` is
    written again (a persistent program's next query tile)."""
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    gl.store(L + offs_m, gl.where(seen, m_i * 0.6931471805599453 + gl.log(l_safe), float("-inf")), mask=offs_m < n_q)
    acc = acc / row_broadcast(l_safe, acc)
    smem_tile(staging, ROWS, HEAD_DIM).store(acc.to(o_desc.dtype))
    fence_async_shared()
    tma_store(o_desc, [b, h, row, 0], staging)
    if DRAIN:
        tma.store_wait(0)


@gluon.jit
def attention_forward(q_desc, k_desc, v_desc, o_desc, L, n_bh, n_heads, kv_group, section, n_q, n_k, window_left,
                      window_right, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr):
    """One program (one warpgroup) = one query tile of one (batch, head); NBUF K/V buffers in flight; the grid runs
    `section` (batch, head) pairs at a time (`tiles.program_start`). L is (B, H, Nq) float32, contiguous; window
    bounds as the `tl` forward takes them (-1: unbounded)."""
    dtype: gl.constexpr = q_desc.dtype

    bh, b, h, h_kv, start_m, right_offset, left_offset, lo, full_lo, full_hi, hi = query_program(
        n_bh, n_heads, kv_group, section, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT,
        BOUND_LEFT)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)

    q_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_smem, v_smem, k_bar, v_bar = stream_buffers(k_desc, v_desc, BLOCK_N, HEAD_DIM, NBUF)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, [b, h, start_m, 0], q_bar, q_box)
    for i in gl.static_range(NBUF):
        load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + i * BLOCK_N, i, i < n_tiles)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, mma_layout(BLOCK_N)))
    mbarrier.wait(q_bar, 0)
    acc, m_i, l_i = _attend(smem_tile(q_box, BLOCK_M, HEAD_DIM), offs_m, k_smem, v_smem, k_bar, v_bar, n_tiles, lo,
                            full_lo, full_hi, n_k, right_offset, left_offset, qk_scale, k_desc, v_desc, b, h_kv, 0, 0,
                            BLOCK_M, HEAD_DIM, BLOCK_N, NBUF, BOUND_RIGHT, BOUND_LEFT, False)

    invalidate_barriers(q_bar, k_bar, v_bar, NBUF)
    _store_out(acc, m_i, l_i, offs_m, L + bh.to(gl.int64) * n_q, n_q, o_desc, b, h, start_m, q_box, BLOCK_M,
               HEAD_DIM)


@gluon.jit
def _produce_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, row, g, NBUF: gl.constexpr,
                     WGS: gl.constexpr):
    """A ping-pong producer's copy of the K and V tiles at `row`, the g-th tile it streams, into buffer g % NBUF:
    each once all WGS consumers have handed back the tile that slot held (tile g - NBUF, where there was one;
    `named_barriers`), K's and V's apart with two slots (`v_free_barriers`)."""
    V_FREE: gl.constexpr = v_free_barriers(NBUF)
    slot = g % NBUF
    reused = g >= NBUF
    if reused:
        wait_for_slot(slot, WGS)
    load_tile(k_desc, k_smem, k_bar, b, h_kv, row, slot, True)
    if V_FREE > 0:
        if reused:
            wait_for_slot(V_FREE + slot, WGS)
    load_tile(v_desc, v_smem, v_bar, b, h_kv, row, slot, True)


@gluon.jit
def _pingpong_producer(q_desc, k_desc, v_desc, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, b, h, h_kv,
                       start_m, lo, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
                       WGS: gl.constexpr):
    """One warp: every consumer's queries, then K tile t into buffer t % NBUF once all WGS consumers' S products
    have read K tile t - NBUF (with more than two slots: their P V products V tile t - NBUF), and V tile t once their
    P V products have read V tile t - NBUF (`v_free_barriers`)."""
    WG_M: gl.constexpr = BLOCK_M // WGS
    for wg in gl.static_range(WGS):
        mbarrier.expect(q_bar.index(wg), q_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, start_m + wg * WG_M, 0], q_bar.index(wg), q_smem.index(wg))
    for t in range(n_tiles):
        _produce_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + t * BLOCK_N, t, NBUF, WGS)


@gluon.jit
def _pingpong_consumer(o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, b, h, n_q, n_k,
                       start_m, lo, full_lo, full_hi, n_tiles, right_offset, left_offset, qk_scale, WG: gl.constexpr,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr,
                       BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr, WGS: gl.constexpr):
    """Consumer warpgroup WG of WGS: query rows start_m + WG * BLOCK_M // WGS on. Every consumer runs every key
    tile of the program's range (a tile its rows do not see is masked for them), so they take the same number of
    turns at issuing products, round the ring (`named_barriers`)."""
    WG_M: gl.constexpr = BLOCK_M // WGS
    my_m = start_m + WG * WG_M
    q_box = q_smem.index(WG)
    offs_m = my_m + gl.arange(0, WG_M, layout=gl.SliceLayout(1, mma_layout(BLOCK_N)))
    if WG == 0:
        pass_turn(WGS - 1, WGS)
    mbarrier.wait(q_bar.index(WG), 0)  # always: the query box is the output's staging buffer
    acc, m_i, l_i = _attend(smem_tile(q_box, WG_M, HEAD_DIM), offs_m, k_smem, v_smem, k_bar, v_bar, n_tiles, lo,
                            full_lo, full_hi, n_k, right_offset, left_offset, qk_scale, None, None, None, None,
                            0, WG, WG_M, HEAD_DIM, BLOCK_N, NBUF, BOUND_RIGHT, BOUND_LEFT, True, WGS)
    _store_out(acc, m_i, l_i, offs_m, L, n_q, o_desc, b, h, my_m, q_box, WG_M, HEAD_DIM)


@gluon.constexpr_function
def _query_boxes(persistent):
    """Query boxes per warpgroup: two in a persistent program, so that the producer loads a tile's queries while the
    tile before it still runs (with one, they were loaded only once that tile's last product had read its box, and
    each tile's first products waited for the load); one in the ping-pong kernel, which loads its queries once."""
    return 2 if persistent else 1


@gluon.jit
def _pingpong_buffers(q_desc, k_desc, v_desc, o_desc, WG_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_N: gl.constexpr, NBUF: gl.constexpr, PERSISTENT: gl.constexpr, WGS: gl.constexpr):
    """The ping-pong kernels' shared memory and mbarriers, initialised: (query boxes (warpgroup h's at h * QBUF +
    slot, `_query_boxes`), K ring, V ring, query barriers (likewise), K and V load barriers), and with PERSISTENT
    after them O's own staging boxes and the query-box-free barriers (the ping-pong kernel stores O through the
    query box and loads its queries once). The consumers' turns and the slots they hand back are named barriers,
    which take no memory (`named_barriers`)."""
    gl.static_assert(WGS == 2 or WGS == 3, "the ping-pong kernels take two or three consumer warpgroups")
    gl.static_assert(slot_barriers_fit(v_free_barriers(NBUF) + NBUF), "more K/V slots than named barriers")
    dtype: gl.constexpr = q_desc.dtype
    QBUF: gl.constexpr = _query_boxes(PERSISTENT)
    q_smem = gl.allocate_shared_memory(dtype, [WGS * QBUF, 1, 1, WG_M, HEAD_DIM], q_desc.layout)
    if PERSISTENT:
        o_smem = gl.allocate_shared_memory(dtype, [WGS, 1, 1, WG_M, HEAD_DIM], o_desc.layout)
    k_smem, v_smem, k_bar, v_bar = stream_buffers(k_desc, v_desc, BLOCK_N, HEAD_DIM, NBUF)
    q_bar = gl.allocate_shared_memory(gl.int64, [WGS * QBUF, 1], mbarrier.MBarrierLayout())
    if PERSISTENT:
        q_empty = gl.allocate_shared_memory(gl.int64, [WGS * QBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(WGS):
        for slot in gl.static_range(QBUF):
            mbarrier.init(q_bar.index(i * QBUF + slot), count=1)
            if PERSISTENT:
                mbarrier.init(q_empty.index(i * QBUF + slot), count=1)
    fence_async_shared()
    if PERSISTENT:
        return q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, o_smem, q_empty
    else:
        return q_smem, k_smem, v_smem, q_bar, k_bar, v_bar


@gluon.jit
def attention_forward_pingpong(q_desc, k_desc, v_desc, o_desc, L, n_bh, n_heads, kv_group, section, n_q, n_k,
                               window_left, window_right, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr,
                               NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr, WGS: gl.constexpr):
    """Warp-specialised: a producer warp (TMA) and WGS (2 or 3) consumer warpgroups of BLOCK_M // WGS rows each that
    share the key tiles and take turns at issuing their products (see _pingpong_consumer). q_desc and o_desc have
    BLOCK_M // WGS-row boxes; the grid as `attention_forward`'s."""
    WG_M: gl.constexpr = BLOCK_M // WGS
    bh, b, h, h_kv, start_m, right_offset, left_offset, lo, full_lo, full_hi, hi = query_program(
        n_bh, n_heads, kv_group, section, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT,
        BOUND_LEFT)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    L = L + bh.to(gl.int64) * n_q
    q_smem, k_smem, v_smem, q_bar, k_bar, v_bar = _pingpong_buffers(
        q_desc, k_desc, v_desc, o_desc, WG_M, HEAD_DIM, BLOCK_N, NBUF, False, WGS)
    # The argument tuples are written out in each call: a tuple bound to a name first passes its constexprs on
    # wrapped twice (Triton 3.6), and arithmetic on them then fails.
    if WGS == 2:
        gl.warp_specialize([(_pingpong_consumer, (o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                                                  b, h, n_q, n_k, start_m, lo, full_lo, full_hi, n_tiles,
                                                  right_offset, left_offset, qk_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N,
                                                  BOUND_RIGHT, BOUND_LEFT, NBUF, WGS)),
                            (_pingpong_consumer, (o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                                                  b, h, n_q, n_k, start_m, lo, full_lo, full_hi, n_tiles,
                                                  right_offset, left_offset, qk_scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N,
                                                  BOUND_RIGHT, BOUND_LEFT, NBUF, WGS)),
                            (_pingpong_producer, (q_desc, k_desc, v_desc, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                                                  b, h, h_kv, start_m, lo, n_tiles, BLOCK_M, BLOCK_N, NBUF,
                                                  WGS))],
                           [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([(_pingpong_consumer, (o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                                                  b, h, n_q, n_k, start_m, lo, full_lo, full_hi, n_tiles,
                                                  right_offset, left_offset, qk_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N,
                                                  BOUND_RIGHT, BOUND_LEFT, NBUF, WGS)),
                            (_pingpong_consumer, (o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                                                  b, h, n_q, n_k, start_m, lo, full_lo, full_hi, n_tiles,
                                                  right_offset, left_offset, qk_scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N,
                                                  BOUND_RIGHT, BOUND_LEFT, NBUF, WGS)),
                            (_pingpong_consumer, (o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                                                  b, h, n_q, n_k, start_m, lo, full_lo, full_hi, n_tiles,
                                                  right_offset, left_offset, qk_scale, 2, HEAD_DIM, BLOCK_M, BLOCK_N,
                                                  BOUND_RIGHT, BOUND_LEFT, NBUF, WGS)),
                            (_pingpong_producer, (q_desc, k_desc, v_desc, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                                                  b, h, h_kv, start_m, lo, n_tiles, BLOCK_M, BLOCK_N, NBUF,
                                                  WGS))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])


@gluon.jit
def _persistent_tile(j, n_m_tiles, n_heads, kv_group, n_q, n_k, window_left, window_right, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """A persistent program's j-th query tile: whether it has one (`valid`), then `query_program`'s values for it.
    The program runs units program_id, program_id + num_programs, ...; a unit is a pair of one (batch, head)'s query
    tiles, the k-th from the end and the k-th from the start (one tile in the middle of an odd count), units of one
    head after another. Why pairs: under a causal mask the pair's key tiles add up to the same count in every unit,
    so the programs' loads come out even; tiles handed round one by one (tile program_id + i * num_programs) leave
    some programs far more work than others when a head's tile count and the program count share no rhythm."""
    half = (n_m_tiles + 1) // 2
    unit = gl.program_id(0) + (j // 2) * gl.num_programs(0)
    k = unit % half
    bh = unit // half
    pid_m = gl.where(j % 2 == 0, n_m_tiles - 1 - k, k)
    valid = (j % 2 == 0) | (pid_m != n_m_tiles - 1 - k)
    h = (bh % n_heads).to(gl.int32)
    start_m = pid_m * BLOCK_M
    right_offset, left_offset, lo, full_lo, full_hi, hi = key_geometry(
        start_m, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
    return valid, bh, (bh // n_heads).to(gl.int32), h, h // kv_group, start_m, right_offset, left_offset, lo, \
        full_lo, full_hi, hi


@gluon.jit
def _persistent_steps(n_m_tiles, n_bh):
    """How many query tiles (`_persistent_tile`'s j) this persistent program steps through, invalid ones included."""
    n_units = (n_m_tiles + 1) // 2 * n_bh
    return 2 * gl.cdiv(gl.maximum(n_units - gl.program_id(0), 0), gl.num_programs(0))


@gluon.jit
def _persistent_producer(q_desc, k_desc, v_desc, q_smem, q_bar, q_empty, k_smem, v_smem, k_bar, v_bar,
                         n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, n_m_tiles,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr,
                         BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr, WGS: gl.constexpr):
    """One warp: for each of the program's query tiles, every consumer's queries into the boxes it freed
    QBUF tiles before (q_empty), then its K/V tiles through the ring, as `_pingpong_producer`; the ring's slots and
    phases run on across query tiles, so the next tile's queries and K/V stream in while this one's last products
    run."""
    WG_M: gl.constexpr = BLOCK_M // WGS
    QBUF: gl.constexpr = _query_boxes(True)
    streamed = 0
    i = 0
    for j in range(_persistent_steps(n_m_tiles, n_bh)):
        valid, _, b, h, h_kv, start_m, _, _, lo, _, _, hi = _persistent_tile(
            j, n_m_tiles, n_heads, kv_group, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT,
            BOUND_LEFT)
        if valid:
            for wg in gl.static_range(WGS):
                box = wg * QBUF + i % QBUF
                mbarrier.wait(q_empty.index(box), ((i // QBUF) - 1) & 1, pred=i >= QBUF)
                mbarrier.expect(q_bar.index(box), q_desc.block_type.nbytes)
                tma_load(q_desc, [b, h, start_m + wg * WG_M, 0], q_bar.index(box), q_smem.index(box))
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            for t in range(n_tiles):
                _produce_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + t * BLOCK_N,
                                 streamed + t, NBUF, WGS)
            streamed += n_tiles
            i += 1


@gluon.jit
def _persistent_consumer(o_desc, L, q_smem, q_bar, q_empty, o_smem, k_smem, v_smem, k_bar, v_bar,
                         n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, n_m_tiles, qk_scale,
                         WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr, WGS: gl.constexpr):
    """One warpgroup of a persistent program: `_pingpong_consumer` over each of the program's query tiles in turn. It
    hands its query box back to the producer as soon as its last product has read it, and writes O through a box of
    its own without waiting for the store (it waits before writing the box again), so the next tile's queries load
    and its first products issue while this tile's output is still on its way out."""
    WG_M: gl.constexpr = BLOCK_M // WGS
    QBUF: gl.constexpr = _query_boxes(True)
    staging = o_smem.index(WG)
    streamed = 0
    i = 0
    if WG == 0:
        pass_turn(WGS - 1, WGS)
    for j in range(_persistent_steps(n_m_tiles, n_bh)):
        valid, bh, b, h, _, start_m, right_offset, left_offset, lo, full_lo, full_hi, hi = _persistent_tile(
            j, n_m_tiles, n_heads, kv_group, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT,
            BOUND_LEFT)
        if valid:
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            my_m = start_m + WG * WG_M
            offs_m = my_m + gl.arange(0, WG_M, layout=gl.SliceLayout(1, mma_layout(BLOCK_N)))
            box = WG * QBUF + i % QBUF
            mbarrier.wait(q_bar.index(box), (i // QBUF) & 1)
            acc, m_i, l_i = _attend(smem_tile(q_smem.index(box), WG_M, HEAD_DIM), offs_m, k_smem, v_smem, k_bar, v_bar,
                                    n_tiles, lo, full_lo, full_hi, n_k, right_offset, left_offset, qk_scale, None,
                                    None, None, None, streamed, WG, WG_M, HEAD_DIM, BLOCK_N, NBUF,
                                    BOUND_RIGHT, BOUND_LEFT, True, WGS)
            mbarrier.arrive(q_empty.index(box))  # every product that read the queries has completed
            tma.store_wait(0)  # the last tile's output has left the staging box
            _store_out(acc, m_i, l_i, offs_m, L + bh.to(gl.int64) * n_q, n_q, o_desc, b, h, my_m, staging, WG_M,
                       HEAD_DIM, False)
            streamed += n_tiles
            i += 1
    tma.store_wait(0)


@gluon.jit
def attention_forward_persistent(q_desc, k_desc, v_desc, o_desc, L, n_bh, n_heads, kv_group, n_q, n_k,
                                 window_left, window_right, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                 BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr,
                                 NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr, WGS: gl.constexpr):
    """`attention_forward_pingpong` as a persistent kernel: each program (one per SM) runs its share of the query
    tiles one after another, in pairs (`_persistent_tile`). What a program of that kernel does once per query tile
    (launch, load the queries, wait for the first K/V tiles, store the output) overlaps the previous tile's work here
    (FlashAttention-3's persistent schedule). O has its own staging boxes (BLOCK_M // WGS rows each), and each
    warpgroup two query boxes, so that the next tile's queries are loaded before this tile ends (it fits sm_90's
    shared memory at D 128 with two 128-row K/V buffers)."""
    WG_M: gl.constexpr = BLOCK_M // WGS
    n_m_tiles = gl.cdiv(n_q, BLOCK_M)
    q_smem, k_smem, v_smem, q_bar, k_bar, v_bar, o_smem, q_empty = _pingpong_buffers(
        q_desc, k_desc, v_desc, o_desc, WG_M, HEAD_DIM, BLOCK_N, NBUF, True, WGS)
    if WGS == 2:
        gl.warp_specialize([(_persistent_consumer, (o_desc, L, q_smem, q_bar, q_empty, o_smem, k_smem, v_smem, k_bar,
                                                    v_bar, n_bh, n_heads, kv_group, n_q, n_k,
                                                    window_left, window_right, n_m_tiles, qk_scale, 0, HEAD_DIM,
                                                    BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT, NBUF, WGS)),
                            (_persistent_consumer, (o_desc, L, q_smem, q_bar, q_empty, o_smem, k_smem, v_smem, k_bar,
                                                    v_bar, n_bh, n_heads, kv_group, n_q, n_k,
                                                    window_left, window_right, n_m_tiles, qk_scale, 1, HEAD_DIM,
                                                    BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT, NBUF, WGS)),
                            (_persistent_producer, (q_desc, k_desc, v_desc, q_smem, q_bar, q_empty, k_smem, v_smem,
                                                    k_bar, v_bar, n_bh, n_heads, kv_group, n_q, n_k,
                                                    window_left, window_right, n_m_tiles, BLOCK_M, BLOCK_N,
                                                    BOUND_RIGHT, BOUND_LEFT, NBUF, WGS))],
                           [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize([(_persistent_consumer, (o_desc, L, q_smem, q_bar, q_empty, o_smem, k_smem, v_smem, k_bar,
                                                    v_bar, n_bh, n_heads, kv_group, n_q, n_k,
                                                    window_left, window_right, n_m_tiles, qk_scale, 0, HEAD_DIM,
                                                    BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT, NBUF, WGS)),
                            (_persistent_consumer, (o_desc, L, q_smem, q_bar, q_empty, o_smem, k_smem, v_smem, k_bar,
                                                    v_bar, n_bh, n_heads, kv_group, n_q, n_k,
                                                    window_left, window_right, n_m_tiles, qk_scale, 1, HEAD_DIM,
                                                    BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT, NBUF, WGS)),
                            (_persistent_consumer, (o_desc, L, q_smem, q_bar, q_empty, o_smem, k_smem, v_smem, k_bar,
                                                    v_bar, n_bh, n_heads, kv_group, n_q, n_k,
                                                    window_left, window_right, n_m_tiles, qk_scale, 2, HEAD_DIM,
                                                    BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT, NBUF, WGS)),
                            (_persistent_producer, (q_desc, k_desc, v_desc, q_smem, q_bar, q_empty, k_smem, v_smem,
                                                    k_bar, v_bar, n_bh, n_heads, kv_group, n_q, n_k,
                                                    window_left, window_right, n_m_tiles, BLOCK_M, BLOCK_N,
                                                    BOUND_RIGHT, BOUND_LEFT, NBUF, WGS))],
                           [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
