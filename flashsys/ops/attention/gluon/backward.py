"""The two-pass backward's kernels for Hopper GPUs (sm_90) in Gluon: dK/dV and dQ, each with the forward's overlap
of softmax work under tensor-core products. They take the same inputs as the `tl` kernels and write the same
gradients; `..dispatch` times each against its `tl` twin where neither wins every shape.

- `attention_backward_dkdv`: dK and dV on transposed scores (see its docstring), after a dQ kernel wrote the
  (-L·log2 e, D) pairs. Unlike the forward it drains its products at the end of every tile: with any left in flight
  across the loop's back edge, ptxas serialises every wgmma.
- `attention_backward_dq`: dQ with the same overlap (S and dP issued together, P under dP, drained per tile); it
  writes the (-L·log2 e, D) pairs the dK/dV kernels read, as the `tl` dQ kernel does.
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

from ..triton.tiles import query_tile_range
from .common import (
    invalidate_barriers,
    load_pair,
    lse_delta,
    masked_scores,
    mma_layout,
    program_tile,
    query_program,
    query_tile,
    scaled_scores,
    smem_tile,
    stream_buffers,
    transposed_probabilities,
)
from .compat import tma_load, tma_store


@gluon.jit
def attention_backward_dkdv(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, LseDelta, n_bh, n_heads,
                            kv_group, n_q, n_k, window_left, window_right, qk_scale, softmax_scale,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr):
    """One program = one key tile (BLOCK_N rows; BLOCK_N // 16 warps, each holding 16 key rows of dK and dV) of one
    (batch, K/V head): dK and dV over every query tile that sees it, in each query head of the group (no atomics).
    Q and dO tiles stream through NBUF buffers. LseDelta is what the `tl` dQ kernel wrote first: (B, H, Nq, 2)
    float32 pairs (-L * log2 e, rowsum(dO * O)).

    Per query tile, on transposed scores (keys x queries): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ issued together; wait for Sᵀ
    only; Pᵀ = exp2(Sᵀ·scale - L) runs while dPᵀ is on the tensor cores; dV += Pᵀ dO issued; wait for dPᵀ only;
    dSᵀ = Pᵀ (dPᵀ - D) runs under dV's product; dK += dSᵀ Q issued, the next tile's pairs load under it; all drain;
    the tile's buffer takes tile j + NBUF.
    """
    WARPS: gl.constexpr = BLOCK_N // 16
    s_layout: gl.constexpr = mma_layout(BLOCK_M, WARPS)
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM, WARPS)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # a vector over Sᵀ's columns (queries)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])  # one row per thread
    dtype: gl.constexpr = q_desc.dtype

    # The first key tiles are seen by the most queries: the grid's order already runs the heaviest first.
    pid_n, bh_kv, b, h_kv, _ = program_tile(n_bh, n_heads // kv_group, 1, 1, False)
    start_n = pid_n * BLOCK_N
    right_offset = n_k - n_q + window_right  # as in `query_program`
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = query_tile_range(start_n, n_q, right_offset, left_offset, BLOCK_M, BLOCK_N,
                                                 BOUND_RIGHT, BOUND_LEFT)
    n_m_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_M)
    n_iter = n_m_tiles * kv_group

    k_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    q_smem, do_smem, q_bar, do_bar = stream_buffers(q_desc, do_desc, BLOCK_M, HEAD_DIM, NBUF)
    fence_async_shared()

    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [b, h_kv, start_n, 0], kv_bar, k_box)
    tma_load(v_desc, [b, h_kv, start_n, 0], kv_bar, v_box)
    for i in gl.static_range(NBUF):
        h_i, row_i = query_tile(i, n_m_tiles, lo, h_kv, kv_group, BLOCK_M)
        load_pair(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b, h_i, row_i, i, i < n_iter)

    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    k_tile = smem_tile(k_box, BLOCK_N, HEAD_DIM)
    v_tile = smem_tile(v_box, BLOCK_N, HEAD_DIM)
    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    neg_lse2, delta = lse_delta(LseDelta, b, n_heads, n_q, 0, n_iter, n_m_tiles, lo, h_kv, kv_group, BLOCK_M,
                                 row_layout)
    mbarrier.wait(kv_bar, 0)
    for j in range(n_iter):
        slot = j % NBUF
        phase = (j // NBUF) & 1
        h, start_m = query_tile(j, n_m_tiles, lo, h_kv, kv_group, BLOCK_M)
        q_tile = smem_tile(q_smem.index(slot), BLOCK_M, HEAD_DIM)
        do_tile = smem_tile(do_smem.index(slot), BLOCK_M, HEAD_DIM)
        mbarrier.wait(q_bar.index(slot), phase)
        p, dp_tok = transposed_probabilities(k_tile, v_tile, q_tile, do_tile, do_bar.index(slot), phase, s_zero,
                                              neg_lse2, qk_scale, offs_n, start_m, full_lo, full_hi, n_q,
                                              right_offset, left_offset, BLOCK_M, BOUND_RIGHT, BOUND_LEFT)
        dv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), op_layout), do_tile, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=[dp_tok])  # dV's product may still run
        ds = p * (dp - gl.convert_layout(delta, col_layout)[None, :])
        dk_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), q_tile, dk, is_async=True)
        # Under dK's product: the next tile's pairs.
        neg_lse2, delta = lse_delta(LseDelta, b, n_heads, n_q, j + 1, n_iter, n_m_tiles, lo, h_kv, kv_group,
                                     BLOCK_M, row_layout)
        # Every product drains before the next tile: with products in flight across iterations, ptxas cannot
        # tell which ones a partial wait retires and serialises every wgmma (a second program per SM fills in).
        dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        h_r, row_r = query_tile(j + NBUF, n_m_tiles, lo, h_kv, kv_group, BLOCK_M)
        load_pair(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b, h_r, row_r, slot, j + NBUF < n_iter)

    invalidate_barriers(kv_bar, q_bar, do_bar, NBUF)
    # K and V are no longer read: their boxes stage the stores (TMA clips rows past n_k).
    k_tile.store((dk * softmax_scale).to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    tma_store(dk_desc, [b, h_kv, start_n, 0], k_box)
    tma_store(dv_desc, [b, h_kv, start_n, 0], v_box)
    tma.store_wait(0)


@gluon.jit
def attention_backward_dq(q_desc, k_desc, v_desc, do_desc, o_desc, dq_desc, L, LseDelta, n_bh, n_heads, kv_group,
                          n_q, n_k, window_left, window_right, qk_scale, softmax_scale, HEAD_DIM: gl.constexpr,
                          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr,
                          BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr):
    """One program = one query tile (BLOCK_M rows; BLOCK_M // 16 warps) of one (batch, head): dQ over the key tiles
    it sees, which stream through NBUF K/V buffers. It also writes LseDelta[row] = (-L * log2 e, rowsum(dO * O)),
    (B, H, Nq, 2) float32, which the dK/dV kernel reads after it: the `tl` dQ kernel's contract.

    Per key tile: S = Q Kᵀ and dP = dO Vᵀ issued together; wait for S only; P = exp2(S·scale - L) runs while dP is
    on the tensor cores; wait for dP; dS = P (dP - D); dQ += dS K issued and drained (nothing may stay in flight
    across the loop's back edge, see the dK/dV kernel); the tile's buffers take tile t + NBUF.
    """
    WARPS: gl.constexpr = BLOCK_M // 16
    s_layout: gl.constexpr = mma_layout(BLOCK_N, WARPS)
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM, WARPS)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    dtype: gl.constexpr = q_desc.dtype

    bh, b, h, h_kv, start_m, right_offset, left_offset, lo, full_lo, full_hi, hi = query_program(
        n_bh, n_heads, kv_group, 1, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
    n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

    q_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
    o_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], o_desc.layout)
    qo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qo_bar, count=1)
    k_smem, v_smem, k_bar, v_bar = stream_buffers(k_desc, v_desc, BLOCK_N, HEAD_DIM, NBUF)
    fence_async_shared()

    mbarrier.expect(qo_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes + o_desc.block_type.nbytes)
    tma_load(q_desc, [b, h, start_m, 0], qo_bar, q_box)
    tma_load(do_desc, [b, h, start_m, 0], qo_bar, do_box)
    tma_load(o_desc, [b, h, start_m, 0], qo_bar, o_box)
    for i in gl.static_range(NBUF):
        load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + i * BLOCK_N, i, i < n_tiles)

    # L and D of this tile's rows, and the pairs for the dK/dV kernel (rows past n_q: L = 0, D = 0, not stored).
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=rows_layout)
    row_ok = offs_m < n_q
    lse = gl.load(L + bh.to(gl.int64) * n_q + offs_m, mask=row_ok, other=0.0)
    neg_lse2 = gl.where(lse == float("-inf"), 0.0, lse * -1.4426950408889634)  # a row that sees no key: all masked
    q_tile = smem_tile(q_box, BLOCK_M, HEAD_DIM)
    do_tile = smem_tile(do_box, BLOCK_M, HEAD_DIM)
    mbarrier.wait(qo_bar, 0)
    o = smem_tile(o_box, BLOCK_M, HEAD_DIM).load(io_layout).to(gl.float32)
    delta = gl.convert_layout(gl.sum(o * do_tile.load(io_layout).to(gl.float32), axis=1), rows_layout)
    pairs = LseDelta + (bh.to(gl.int64) * n_q + offs_m) * 2
    gl.store(pairs, neg_lse2, mask=row_ok)
    gl.store(pairs + 1, delta, mask=row_ok)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout)
    for t in range(n_tiles):
        slot = t % NBUF
        phase = (t // NBUF) & 1
        k_tile = smem_tile(k_smem.index(slot), BLOCK_N, HEAD_DIM)
        v_tile = smem_tile(v_smem.index(slot), BLOCK_N, HEAD_DIM)
        mbarrier.wait(k_bar.index(slot), phase)
        s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(slot), phase)
        dp_tok = warpgroup_mma(do_tile, v_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])  # dP may still run
        s = masked_scores(s, offs_m, lo + t * BLOCK_N, n_k, right_offset, left_offset, full_lo, full_hi, BLOCK_N,
                           BOUND_RIGHT, BOUND_LEFT)
        p = gl.exp2(scaled_scores(s, qk_scale, neg_lse2[:, None]))
        dp = warpgroup_mma_wait(0, deps=[dp_tok])
        ds = p * (dp - delta[:, None])
        dq_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), k_tile, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + (t + NBUF) * BLOCK_N, slot,
                   t + NBUF < n_tiles)

    invalidate_barriers(qo_bar, k_bar, v_bar, NBUF)
    # Q is no longer read: its box stages the store (TMA clips rows past n_q).
    q_tile.store((dq * softmax_scale).to(dtype))
    fence_async_shared()
    tma_store(dq_desc, [b, h, start_m, 0], q_box)
    tma.store_wait(0)
