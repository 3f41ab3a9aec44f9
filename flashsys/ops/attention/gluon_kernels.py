"""The FlashAttention forward, and the backward's dK/dV kernel, for Hopper GPUs (sm_90), written in Gluon, Triton's
lower-level language.

Importing this module needs a Triton with Gluon's Hopper API (3.6 or later); `flash_gluon` imports it only
where that is so. The host side (which inputs take these kernels, the variants, tuning) is in `flash_gluon.py`.

Why Gluon: a `tl` kernel on Hopper runs each tile's softmax and its two tensor-core products one after the other
(Triton waits for each `wgmma` before its result is used). Gluon exposes FlashAttention-3's tools, and both
kernels here use its intra-warpgroup overlap:

    S_t = Q K_tᵀ (async); O += P_{t-1} V_{t-1} (async); wait for S_t only; softmax(S_t) -> P_t runs while the
    P V product is still on the tensor cores; wait for it; rescale O; refill the freed K/V buffer (TMA).

- `attention_forward`: one warpgroup per program, several programs per SM (best at D 64 and short sequences).
- `attention_forward_pingpong`: warp-specialised. A producer warp issues the TMA copies into a ring of buffers;
  two consumer warpgroups of BLOCK_M // 2 query rows share the key tiles and take turns at issuing their products
  (FlashAttention-3's inter-warpgroup ping-pong), so one's softmax runs while the other's products run.

Both write what the `tl` forward writes (O, and L in natural log) for every input it takes: grouped-query K/V
(head h reads K/V head h // kv_group), Nq != Nk, causal and sliding windows (bottom-right aligned), lengths that are
not a multiple of the tile (TMA reads zeros past the end and clips the stores), and rows that see no key
(O = 0, L = -inf). Tensors are rank-4 (B, H, N, D) TMA descriptors with their own strides: the kernels copy
(1, 1, rows, D) boxes and view them as (rows, D) tiles.

- `attention_backward_dkdv`: dK and dV with the same overlap on transposed scores (see its docstring), for the same
  inputs, after the `tl` dQ kernel. Unlike the forward it drains its products at the end of every tile: with any
  left in flight across the loop's back edge, ptxas serialises every wgmma (kernel_experiments.md, stop 29).
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon.language._core import builtin

# The tile ranges and the mask are the `tl` kernels' own (@triton.jit helpers, which Gluon calls as they are).
from .flash_triton import _key_tile_range, _query_tile_range, _visible
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

# TMA copies: Triton 3.6 names them async_copy_*; later Tritons renamed them async_load / async_store.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """TMA's reduce-add (cp.reduce.async.bulk.tensor) of a shared-memory tile into global memory. Triton 3.6's
    Gluon builds the op but has no Python name for it; later Tritons call it tma.async_atomic_add."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36


@gluon.jit
def _program_tile(n_heads, kv_group, HEAVIEST_FIRST: gl.constexpr):
    """(query-tile index, flat batch*head index, batch, head, K/V head). Causal grids run the last query tiles, which
    see the most keys, first."""
    pid_m = gl.program_id(0)
    if HEAVIEST_FIRST:
        pid_m = gl.num_programs(0) - 1 - pid_m
    bh = gl.program_id(1)
    h = bh % n_heads
    return pid_m, bh, bh // n_heads, h, h // kv_group


@gluon.jit
def _masked_scores(s, offs_m, kn, n_k, right_offset, left_offset, lo_full, hi_full, BLOCK_N: gl.constexpr,
                   BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """S of the key tile starting at kn, with the keys a query may not see at -inf; a tile inside
    [lo_full, hi_full) (from `_key_tile_range`) is visible to every query and is returned as it is (a uniform
    branch)."""
    if (kn < lo_full) | (kn >= hi_full):
        offs_n = kn + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        visible = offs_n[None, :] < n_k
        if BOUND_RIGHT:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + right_offset)
        if BOUND_LEFT:
            visible = visible & (offs_n[None, :] >= offs_m[:, None] + left_offset)
        s = gl.where(visible, s, float("-inf"))
    return s


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale):
    """(P, new row max, alpha, new row sum) after one key tile, scores in log2 units after qk_scale. A row that has
    seen no key yet keeps m = -inf; its exponentials subtract 0 instead, so nothing is NaN."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    return p, m_new, alpha, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _load_pair(a_desc, b_desc, a_smem, b_smem, a_bar, b_bar, batch, head, row, slot, pred):
    """TMA copies of the two tiles at `row` of one head (K and V; the backward's Q and dO) into buffer `slot`; each
    signals its own barrier."""
    mbarrier.expect(a_bar.index(slot), a_desc.block_type.nbytes, pred=pred)
    _tma_load(a_desc, [batch, head, row, 0], a_bar.index(slot), a_smem.index(slot), pred=pred)
    mbarrier.expect(b_bar.index(slot), b_desc.block_type.nbytes, pred=pred)
    _tma_load(b_desc, [batch, head, row, 0], b_bar.index(slot), b_smem.index(slot), pred=pred)


@gluon.jit
def _tile(box, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A (1, 1, ROWS, D) TMA box in shared memory as the (ROWS, D) tile the tensor cores read."""
    return box.reshape([ROWS, HEAD_DIM])


@gluon.constexpr_function
def _mma_layout(cols, warps=4):
    """The register layout of a (rows, cols) wgmma accumulator (S: cols = BLOCK_N; O: HEAD_DIM) of `warps` warps,
    stacked over the rows (8: two warpgroups, each with its own rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, cols, 16])


@gluon.jit
def _rows(x, acc):
    """A per-row vector (in S's layout) in the rows of `acc`'s layout, broadcast over its columns."""
    return gl.convert_layout(x, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _attend(q, offs_m, k_smem, v_smem, k_bar, v_bar, n_tiles, lo, full_lo, full_hi, n_k, right_offset, left_offset,
            qk_scale, k_desc, v_desc, b, h_kv, turn_bar, empty_bar, HALF: gl.constexpr, ROWS: gl.constexpr,
            HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr, BOUND_RIGHT: gl.constexpr,
            BOUND_LEFT: gl.constexpr, PINGPONG: gl.constexpr):
    """(O unnormalised, row max, row sum) of one warpgroup's ROWS query rows over key tiles lo, lo + BLOCK_N, ...
    (n_tiles of them), with the intra-warpgroup overlap of the module docstring.

    The plain kernel refills a freed K/V buffer itself (k_desc, v_desc, b, h_kv); a ping-pong consumer (PINGPONG)
    instead waits for its turn before issuing products and passes it on after (turn_bar, HALF), and releases a
    freed buffer to the producer (empty_bar). The arguments the other kind uses are None."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma_layout(HEAD_DIM), k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=_mma_layout(HEAD_DIM))
    if n_tiles > 0:
        # Tile 0: S and its softmax; nothing to overlap yet.
        if PINGPONG:
            mbarrier.wait(turn_bar.index(HALF), 0)
        mbarrier.wait(k_bar.index(0), 0)
        s = warpgroup_mma(q, _tile(k_smem.index(0), BLOCK_N, HEAD_DIM).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_bar.index(1 - HALF))
        s = warpgroup_mma_wait(0, deps=[s])
        s = _masked_scores(s, offs_m, lo, n_k, right_offset, left_offset, full_lo, full_hi, BLOCK_N, BOUND_RIGHT,
                           BOUND_LEFT)
        p, m_i, alpha, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        for t in range(1, n_tiles):
            slot = t % NBUF
            prev = (t - 1) % NBUF
            if PINGPONG:
                mbarrier.wait(turn_bar.index(HALF), t & 1)
            mbarrier.wait(k_bar.index(slot), (t // NBUF) & 1)
            s_tok = warpgroup_mma(q, _tile(k_smem.index(slot), BLOCK_N, HEAD_DIM).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            mbarrier.wait(v_bar.index(prev), ((t - 1) // NBUF) & 1)
            acc_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), _tile(v_smem.index(prev), BLOCK_N,
                                                                                    HEAD_DIM), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn_bar.index(1 - HALF))
            s = warpgroup_mma_wait(1, deps=[s_tok])  # S_t is done; P_{t-1} V_{t-1} may still run
            s = _masked_scores(s, offs_m, lo + t * BLOCK_N, n_k, right_offset, left_offset, full_lo, full_hi,
                               BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
            p, m_i, alpha, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            acc = warpgroup_mma_wait(0, deps=[acc_tok])
            # Buffer `prev` is free: this warpgroup's wait above covers every product of its own that read it.
            if PINGPONG:
                mbarrier.arrive(empty_bar.index(prev))
            else:
                _load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + (t - 1 + NBUF) * BLOCK_N, prev,
                         t - 1 + NBUF < n_tiles)
            acc = acc * _rows(alpha, acc)
        last = (n_tiles - 1) % NBUF
        if PINGPONG:
            mbarrier.wait(turn_bar.index(HALF), n_tiles & 1)
        mbarrier.wait(v_bar.index(last), ((n_tiles - 1) // NBUF) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), _tile(v_smem.index(last), BLOCK_N, HEAD_DIM),
                            acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_bar.index(1 - HALF))
        acc = warpgroup_mma_wait(0, deps=[acc])
        if PINGPONG:
            mbarrier.arrive(empty_bar.index(last))
    return acc, m_i, l_i


@gluon.jit
def _store_out(acc, m_i, l_i, offs_m, L, n_q, o_desc, b, h, row, staging, ROWS: gl.constexpr,
               HEAD_DIM: gl.constexpr):
    """L (natural log; -inf for a row that saw no key) and O = acc / l (0 there) of query rows row.. (offs_m). O goes
    through `staging` (the query tile's box, no longer read) by a TMA store, which clips rows past n_q."""
    seen = l_i > 0.0
    l_safe = gl.where(seen, l_i, 1.0)
    gl.store(L + offs_m, gl.where(seen, m_i * 0.6931471805599453 + gl.log(l_safe), float("-inf")), mask=offs_m < n_q)
    acc = acc / _rows(l_safe, acc)
    _tile(staging, ROWS, HEAD_DIM).store(acc.to(o_desc.dtype))
    fence_async_shared()
    _tma_store(o_desc, [b, h, row, 0], staging)
    tma.store_wait(0)


@gluon.jit
def attention_forward(q_desc, k_desc, v_desc, o_desc, L, n_heads, kv_group, n_q, n_k, window_left, window_right,
                      qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr):
    """One program (one warpgroup) = one query tile of one (batch, head); NBUF K/V buffers in flight.
    L is (B, H, Nq) float32, contiguous; window bounds as the `tl` forward takes them (-1: unbounded)."""
    dtype: gl.constexpr = q_desc.dtype

    pid_m, bh, b, h, h_kv = _program_tile(n_heads, kv_group, BOUND_RIGHT)
    start_m = pid_m * BLOCK_M
    right_offset = n_k - n_q + window_right  # query i sees key j iff i + left_offset <= j <= i + right_offset
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = _key_tile_range(start_m, n_k, right_offset, left_offset, BLOCK_M, BLOCK_N, BOUND_RIGHT,
                                               BOUND_LEFT)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)

    q_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NBUF, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NBUF, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [b, h, start_m, 0], q_bar, q_box)
    for i in gl.static_range(NBUF):
        _load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + i * BLOCK_N, i, i < n_tiles)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _mma_layout(BLOCK_N)))
    mbarrier.wait(q_bar, 0)
    acc, m_i, l_i = _attend(_tile(q_box, BLOCK_M, HEAD_DIM), offs_m, k_smem, v_smem, k_bar, v_bar, n_tiles, lo,
                            full_lo, full_hi, n_k, right_offset, left_offset, qk_scale, k_desc, v_desc, b, h_kv, None,
                            None, 0, BLOCK_M, HEAD_DIM, BLOCK_N, NBUF, BOUND_RIGHT, BOUND_LEFT, False)

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))
    _store_out(acc, m_i, l_i, offs_m, L + bh.to(gl.int64) * n_q, n_q, o_desc, b, h, start_m, q_box, BLOCK_M,
               HEAD_DIM)


@gluon.jit
def _pingpong_producer(q_desc, k_desc, v_desc, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, empty_bar, b, h, h_kv,
                       start_m, lo, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
    """One warp: both halves' queries, then K/V tile t into buffer t % NBUF once both consumers released tile
    t - NBUF."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    for half in gl.static_range(2):
        mbarrier.expect(q_bar.index(half), q_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, start_m + half * HALF_M, 0], q_bar.index(half), q_smem.index(half))
    for t in range(n_tiles):
        slot = t % NBUF
        mbarrier.wait(empty_bar.index(slot), ((t // NBUF) - 1) & 1, pred=t >= NBUF)
        _load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + t * BLOCK_N, slot, True)


@gluon.jit
def _pingpong_consumer(o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar, b, h, n_q, n_k,
                       start_m, lo, full_lo, full_hi, n_tiles, right_offset, left_offset, qk_scale, HALF: gl.constexpr,
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr,
                       BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr):
    """One warpgroup: query rows start_m + HALF * BLOCK_M // 2 on. Both warpgroups run every key tile of the
    program's range (a tile one half does not see is masked for it), so they take the same number of turns:
    turn t (parity t & 1) is this warpgroup's t-th issue of products, and passing it lets the other one issue."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    my_m = start_m + HALF * HALF_M
    q_box = q_smem.index(HALF)
    offs_m = my_m + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, _mma_layout(BLOCK_N)))
    mbarrier.wait(q_bar.index(HALF), 0)  # always: the query box is the output's staging buffer
    acc, m_i, l_i = _attend(_tile(q_box, HALF_M, HEAD_DIM), offs_m, k_smem, v_smem, k_bar, v_bar, n_tiles, lo,
                            full_lo, full_hi, n_k, right_offset, left_offset, qk_scale, None, None, None, None,
                            turn_bar, empty_bar, HALF, HALF_M, HEAD_DIM, BLOCK_N, NBUF, BOUND_RIGHT, BOUND_LEFT, True)
    _store_out(acc, m_i, l_i, offs_m, L, n_q, o_desc, b, h, my_m, q_box, HALF_M, HEAD_DIM)


@gluon.jit
def attention_forward_pingpong(q_desc, k_desc, v_desc, o_desc, L, n_heads, kv_group, n_q, n_k, window_left,
                               window_right, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr,
                               NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Warp-specialised: a producer warp (TMA) and two consumer warpgroups of BLOCK_M // 2 rows each that share the
    key tiles and ping-pong (see _pingpong_consumer). q_desc and o_desc have BLOCK_M // 2-row boxes."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_desc.dtype
    pid_m, bh, b, h, h_kv = _program_tile(n_heads, kv_group, BOUND_RIGHT)
    start_m = pid_m * BLOCK_M
    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = _key_tile_range(start_m, n_k, right_offset, left_offset, BLOCK_M, BLOCK_N, BOUND_RIGHT,
                                               BOUND_LEFT)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    L = L + bh.to(gl.int64) * n_q
    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NBUF, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NBUF, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    empty_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(turn_bar.index(i), count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=2)
    fence_async_shared()
    mbarrier.arrive(turn_bar.index(0))  # warpgroup 0 takes the first turn
    # The argument tuples are written out in the call: a tuple bound to a name first passes its constexprs on
    # wrapped twice (Triton 3.6), and arithmetic on them then fails.
    gl.warp_specialize([(_pingpong_consumer, (o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, empty_bar,
                                              turn_bar, b, h, n_q, n_k, start_m, lo, full_lo, full_hi, n_tiles,
                                              right_offset, left_offset, qk_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N,
                                              BOUND_RIGHT, BOUND_LEFT, NBUF)),
                        (_pingpong_consumer, (o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, empty_bar,
                                              turn_bar, b, h, n_q, n_k, start_m, lo, full_lo, full_hi, n_tiles,
                                              right_offset, left_offset, qk_scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N,
                                              BOUND_RIGHT, BOUND_LEFT, NBUF)),
                        (_pingpong_producer, (q_desc, k_desc, v_desc, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                                              empty_bar, b, h, h_kv, start_m, lo, n_tiles, BLOCK_M, BLOCK_N, NBUF))],
                       [4, 1], [CONSUMER_REGS, 24])


# ----------------------------------------------------------------------------------------------------
# Backward: dK and dV
# ----------------------------------------------------------------------------------------------------


@gluon.jit
def _query_tile(j, n_m_tiles, lo, h_kv, kv_group, BLOCK_M: gl.constexpr):
    """(query head, first row) of the j-th query tile a dK/dV program visits: the tiles lo, lo + BLOCK_M, ... of
    each query head of its K/V head's group in turn."""
    g = j // n_m_tiles
    return h_kv * kv_group + g, lo + (j - g * n_m_tiles) * BLOCK_M


@gluon.jit
def _lse_delta(LseDelta, b, n_heads, n_q, j, n_iter, n_m_tiles, lo, h_kv, kv_group, BLOCK_M: gl.constexpr, layout):
    """(-L * log2 e, D) of the j-th query tile's rows (zeros past n_q, and for j >= n_iter, which names a head past
    the group), one row per thread of `layout`. Loaded where they are used (over the columns of Sᵀ that each
    thread holds), their pointers alone took ~70 registers."""
    h, start_m = _query_tile(j, n_m_tiles, lo, h_kv, kv_group, BLOCK_M)
    rows = start_m + gl.arange(0, BLOCK_M, layout=layout)
    pairs = LseDelta + (b * n_heads + h).to(gl.int64) * n_q * 2 + rows * 2
    inside = (rows < n_q) & (j < n_iter)
    return gl.load(pairs, mask=inside, other=0.0), gl.load(pairs + 1, mask=inside, other=0.0)

# --- Experiment (#16, stop 32): a 2-CTA cluster that adds its two dQ shares in distributed shared memory ----------
# The pair of programs holding key tiles 2c and 2c + 1 of one head run the same query tiles; per tile, the rows of
# dQ's share that the peer reduces are stored into the peer's `fs_recv` buffer (a static shared array the PTX edit in
# flash_gluon.pair_ptx declares), a cluster barrier, then each program adds what it received to its own half and
# reduces only that half (BLOCK_M / 2 rows) into global memory: half of the float32 traffic.
# The accumulator's layout (NVMMA v3, BLOCK_M = 64, warps [4, S]), as gl.to_linear_layout gives it.
PAIR_ROWS = 32


@gluon.constexpr_function
def _pair_asm(head_dim, split, parity, send):
    """Inline PTX over all of a thread's elements of the (64, head_dim) share. send: the rows the peer reduces
    (tid bit 6 != cluster rank) go to the peer's fs_recv (mapa + st.shared::cluster); outputs are copies. Otherwise
    the rows this program reduces get what the peer stored here added in. parity picks one of two buffers."""
    # Byte offsets in fs_recv, whose rows are PAIR_ROWS rows of head_dim + 8 floats (the pad spreads a warp's
    # 8-byte stores over every bank): per register index, and per bit of the thread index.
    cols = head_dim // split
    stride = head_dim + 8
    reg = [(0, 1), (8, 0)] + [(0, 8 << k) for k in range(8) if (8 << k) < cols]
    tid = [(0, 2), (0, 4), (1, 0), (2, 0), (4, 0), (16, 0), (32, 0)] + ([(0, cols)] if split == 2 else [])
    offs = []
    for e in range(1 << len(reg)):
        r = sum(br for i, (br, bc) in enumerate(reg) if (e >> i) & 1)
        c = sum(bc for i, (br, bc) in enumerate(reg) if (e >> i) & 1)
        offs.append(((r % PAIR_ROWS) * stride + c) * 4)
    tid_bits = [(i, ((tr % PAIR_ROWS) * stride + tc) * 4) for i, (tr, tc) in enumerate(tid)]
    tid_bits = [(i, off) for i, off in tid_bits if off]
    n = len(offs)
    buf = parity * PAIR_ROWS * (head_dim + 8) * 4
    lines = ["{", ".reg .u32 fs_t, fs_b, fs_x, fs_r, fs_a;", ".reg .f32 fs_v0, fs_v1;", ".reg .pred fs_p;",
             "mov.u32 fs_t, %tid.x;", f"mov.u32 fs_b, {buf};"]
    for bit, off in tid_bits:
        lines += [f"bfe.u32 fs_x, fs_t, {bit}, 1;", f"mad.lo.u32 fs_b, fs_x, {off}, fs_b;"]
    lines += ["mov.u32 fs_r, global_smem;", "add.u32 fs_a, fs_r, fs_b;",
              "bfe.u32 fs_x, fs_t, 6, 1;", "mov.u32 fs_r, %cluster_ctarank;"]
    for e in range(n):
        lines.append(f"mov.b32 ${e}, ${n + e};")
    if send:
        lines += ["setp.ne.u32 fs_p, fs_x, fs_r;", "xor.b32 fs_r, fs_r, 1;", "mapa.shared::cluster.u32 fs_a, fs_a, fs_r;"]
        for e in range(0, n, 2):
            lines.append(f"@fs_p st.shared::cluster.v2.f32 [fs_a+{offs[e]}], {{${n + e}, ${n + e + 1}}};")
    else:
        lines.append("setp.eq.u32 fs_p, fs_x, fs_r;")
        for e in range(0, n, 2):
            lines += [f"@fs_p ld.shared.v2.f32 {{fs_v0, fs_v1}}, [fs_a+{offs[e]}];",
                      f"@fs_p add.f32 ${e}, ${e}, fs_v0;", f"@fs_p add.f32 ${e + 1}, ${e + 1}, fs_v1;"]
    lines.append("}")
    return "\n".join(lines)


@gluon.constexpr_function
def _pair_constraints(n):
    return ",".join(["=r"] * n + ["r"] * n)


@gluon.jit
def _pair_move(x, parity, HEAD_DIM: gl.constexpr, SPLIT: gl.constexpr, SEND: gl.constexpr, n: gl.constexpr):
    if parity == 0:
        y = gl.inline_asm_elementwise(_pair_asm(HEAD_DIM, SPLIT, 0, SEND), _pair_constraints(n), [x],
                                      dtype=gl.float32, is_pure=False, pack=n)
    else:
        y = gl.inline_asm_elementwise(_pair_asm(HEAD_DIM, SPLIT, 1, SEND), _pair_constraints(n), [x],
                                      dtype=gl.float32, is_pure=False, pack=n)
    return y


@gluon.jit
def _cluster_sync(WARPS: gl.constexpr):
    """barrier.cluster arrive (release) and wait (acquire), once per thread."""
    t = gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    gl.inline_asm_elementwise("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned; "
                              "mov.b32 $0, $1;", "=r,r", [t], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def attention_backward_dkdv(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LseDelta, dq_desc, n_heads, kv_group, n_q,
                            n_k, window_left, window_right, qk_scale, softmax_scale, HEAD_DIM: gl.constexpr,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr,
                            BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr, FUSED_DQ: gl.constexpr,
                            DQ_PAIR: gl.constexpr = 0):
    """One program = one key tile (BLOCK_N rows; BLOCK_N // 16 warps, each holding 16 key rows of dK and dV) of one
    (batch, K/V head): dK and dV over every query tile that sees it, in each query head of the group (no atomics).
    Q and dO tiles stream through NBUF buffers. LseDelta is what the `tl` dQ kernel wrote first: (B, H, Nq, 2)
    float32 pairs (-L * log2 e, rowsum(dO * O)).

    Per query tile, on transposed scores (keys x queries): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ issued together; wait for Sᵀ
    only; Pᵀ = exp2(Sᵀ·scale - L) runs while dPᵀ is on the tensor cores; dV += Pᵀ dO issued; wait for dPᵀ only;
    dSᵀ = Pᵀ (dPᵀ - D) runs under dV's product; dK += dSᵀ Q issued, the next tile's pairs load under it; all drain;
    the tile's buffer takes tile j + NBUF.

    FUSED_DQ (the single-pass backward): dSᵀ also goes through shared memory (two buffers, so one warpgroup may
    write the next tile's while the other still reads this one's), and this key tile's share of dQ, dS K (BLOCK_M x
    D; with two warpgroups each takes half of D), is issued beside dK's product, staged in shared memory and added
    into dq_desc's tensor ((B, H, Nq, D) float32, zeroed; unscaled) by a TMA reduce-add, which runs on while the
    next tile computes. Five products per tile instead of the two passes' seven, but the sums' order, hence dQ's
    last bits, varies from run to run. (Atomics from registers instead: as fast at D 128, 1.3x slower at D 64 with
    64 x 64 tiles; kernel_experiments.md.)
    """
    WARPS: gl.constexpr = BLOCK_N // 16
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, WARPS)
    acc_layout: gl.constexpr = _mma_layout(HEAD_DIM, WARPS)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # a vector over Sᵀ's columns (queries)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])  # one row per thread
    dtype: gl.constexpr = q_desc.dtype
    DQ_SPLIT: gl.constexpr = WARPS // 4  # warpgroups, each with its own columns of dQ
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, DQ_SPLIT],
                                                        instr_shape=[16, HEAD_DIM // DQ_SPLIT, 16])

    pid_n = gl.program_id(0)  # the first key tiles are seen by the most queries: the heaviest run first
    bh_kv = gl.program_id(1)
    kv_heads = n_heads // kv_group
    b = bh_kv // kv_heads
    h_kv = bh_kv % kv_heads
    start_n = pid_n * BLOCK_N
    right_offset = n_k - n_q + window_right  # as in the forward
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = _query_tile_range(start_n, n_q, right_offset, left_offset, BLOCK_M, BLOCK_N,
                                                 BOUND_RIGHT, BOUND_LEFT)
    if DQ_PAIR == 2:  # both programs of the pair run the union of their query tiles (masked outside their own)
        lo_p, _, _, hi_p = _query_tile_range((pid_n ^ 1) * BLOCK_N, n_q, right_offset, left_offset, BLOCK_M,
                                             BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
        big: gl.constexpr = 1 << 30
        lo_u = gl.minimum(gl.where(hi > lo, lo, big), gl.where(hi_p > lo_p, lo_p, big))
        hi_u = gl.maximum(gl.where(hi > lo, hi, 0), gl.where(hi_p > lo_p, hi_p, 0))
        lo = gl.minimum(lo_u, hi_u)
        hi = hi_u
    n_m_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_M)
    n_iter = n_m_tiles * kv_group

    k_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NBUF, 1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NBUF, 1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(do_bar.index(i), count=1)
    if FUSED_DQ:
        ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M],
                                            gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
        dq_box = gl.allocate_shared_memory(gl.float32, [1, 1, BLOCK_M, HEAD_DIM], dq_desc.layout)
        dq_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
    fence_async_shared()
    if DQ_PAIR == 2:
        _cluster_sync(WARPS)  # the peer has started before its shared memory is written
    PAIR_N: gl.constexpr = BLOCK_M * HEAD_DIM // (32 * WARPS)

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [b, h_kv, start_n, 0], kv_bar, k_box)
    _tma_load(v_desc, [b, h_kv, start_n, 0], kv_bar, v_box)
    for i in gl.static_range(NBUF):
        h_i, row_i = _query_tile(i, n_m_tiles, lo, h_kv, kv_group, BLOCK_M)
        _load_pair(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b, h_i, row_i, i, i < n_iter)

    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    k_tile = _tile(k_box, BLOCK_N, HEAD_DIM)
    v_tile = _tile(v_box, BLOCK_N, HEAD_DIM)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    neg_lse2, delta = _lse_delta(LseDelta, b, n_heads, n_q, 0, n_iter, n_m_tiles, lo, h_kv, kv_group, BLOCK_M,
                                 row_layout)
    mbarrier.wait(kv_bar, 0)
    for j in range(n_iter):
        slot = j % NBUF
        phase = (j // NBUF) & 1
        h, start_m = _query_tile(j, n_m_tiles, lo, h_kv, kv_group, BLOCK_M)
        q_tile = _tile(q_smem.index(slot), BLOCK_M, HEAD_DIM)
        do_tile = _tile(do_smem.index(slot), BLOCK_M, HEAD_DIM)
        mbarrier.wait(q_bar.index(slot), phase)
        s_tok = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(do_bar.index(slot), phase)
        dp_tok = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)

        s = warpgroup_mma_wait(1, deps=[s_tok])  # dPᵀ may still run
        p = gl.exp2(s * qk_scale + gl.convert_layout(neg_lse2, col_layout)[None, :])
        if (start_m < full_lo) | (start_m >= full_hi):  # a tile at a window edge or the end of the queries
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
            visible = _visible(offs_m[None, :], offs_n[:, None], offs_m[None, :], n_q, right_offset, left_offset,
                               BOUND_RIGHT, BOUND_LEFT)
            p = gl.where(visible, p, 0.0)
        dv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), op_layout), do_tile, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=[dp_tok])  # dV's product may still run
        ds = p * (dp - gl.convert_layout(delta, col_layout)[None, :])
        if FUSED_DQ:
            ds_box = ds_smem.index(j % 2)
            ds_box.store(ds.to(dtype))
            fence_async_shared()
            gl.thread_barrier()  # dQ's product reads every warpgroup's rows of dSᵀ
            dk_tok = warpgroup_mma(ds_box, q_tile, dk, is_async=True)
            dq_tok = warpgroup_mma(ds_box.permute((1, 0)), k_tile, dq_zero, use_acc=False, is_async=True)
        else:
            dk_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), q_tile, dk, is_async=True)
        # Under dK's product: the next tile's pairs.
        neg_lse2, delta = _lse_delta(LseDelta, b, n_heads, n_q, j + 1, n_iter, n_m_tiles, lo, h_kv, kv_group,
                                     BLOCK_M, row_layout)
        # Every product drains before the next tile: with products in flight across iterations, ptxas cannot
        # tell which ones a partial wait retires and serialises every wgmma (a second program per SM fills in).
        if FUSED_DQ:
            dv, dk, dq = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok])
            if DQ_PAIR == 2:
                dq = _pair_move(dq, j % 2, HEAD_DIM, DQ_SPLIT, True, PAIR_N)
                _cluster_sync(WARPS)
                dq = _pair_move(dq, j % 2, HEAD_DIM, DQ_SPLIT, False, PAIR_N)
            tma.store_wait(0)  # the last tile's reduce has read the staging box
            _tile(dq_box, BLOCK_M, HEAD_DIM).store(dq)
            fence_async_shared()
            gl.thread_barrier()
            if DQ_PAIR == 0:
                _tma_add(dq_desc, [b, h, start_m, 0], dq_box)  # TMA clips rows past n_q
            elif DQ_PAIR == 1:  # timing only: half the rows' traffic, the other half dropped
                _tma_add(dq_desc, [b, h, start_m, 0], dq_box.slice(0, BLOCK_M // 2, dim=2))
            else:
                if pid_n % 2 == 0:
                    _tma_add(dq_desc, [b, h, start_m, 0], dq_box.slice(0, BLOCK_M // 2, dim=2))
                else:
                    _tma_add(dq_desc, [b, h, start_m + BLOCK_M // 2, 0],
                             dq_box.slice(BLOCK_M // 2, BLOCK_M // 2, dim=2))
        else:
            dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        h_r, row_r = _query_tile(j + NBUF, n_m_tiles, lo, h_kv, kv_group, BLOCK_M)
        _load_pair(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b, h_r, row_r, slot, j + NBUF < n_iter)

    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(q_bar.index(i))
        mbarrier.invalidate(do_bar.index(i))
    # K and V are no longer read: their boxes stage the stores (TMA clips rows past n_k).
    k_tile.store((dk * softmax_scale).to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    _tma_store(dk_desc, [b, h_kv, start_n, 0], k_box)
    _tma_store(dv_desc, [b, h_kv, start_n, 0], v_box)
    tma.store_wait(0)
