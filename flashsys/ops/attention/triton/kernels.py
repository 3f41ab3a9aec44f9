"""The FlashAttention-2 kernels in Triton's `tl` language: the forward, the atomic-free backward's dQ and dK/dV
passes, and the prologue and epilogue kernels of the Gluon one-pass backward. They run on any GPU Triton supports and,
under TRITON_INTERPRET=1, on a CPU; on Hopper the Gluon kernels (`..gluon`) take the large calls `..dispatch` gives
them. The pure-PyTorch twin of every kernel is `..flash_torch`.

Why they look as they do:
- Scores are computed in the log2 domain: log2(e) is folded into the softmax scale so the kernels call `exp2`; L is
  still stored in natural log, as the op's contract asks.
- Causal masking only costs where it must: every kernel runs an unmasked loop over tiles that are fully visible and
  a masked loop over the few tiles that straddle the diagonal, a window edge or the sequence end; fully masked tiles
  are never visited (`tiles.key_tile_range`, `tiles.query_tile_range`).
- The backward is atomic-free: one kernel computes dQ for a query tile looping over key tiles, then another computes
  dK, dV for a key tile looping over query tiles and over the query heads of its K/V group. The dQ kernel also
  computes D = rowsum(dO * O) and hands the dK/dV kernel one interleaved (-L * log2 e, D) pair per query row: its
  inner loop then reads both with one vector load and no multiply or negation.
- In the backward, the scale-and-subtract before each `exp2` is an explicit `tl.fma` on the stored -L: one instruction
  per score whatever a Triton version's default for fusing a multiply and an add. The forward uses `tl.fma` only where
  Triton does not fuse by default (`_FMA_SCORES`): the plain expression schedules better where it does.
- Any stride: rank-3 (B, N, D) and rank-4 (B, H, N, D) views and non-contiguous inputs are addressed by their
  strides, never copied.
- Plain pointer arithmetic with masks: block pointers were removed in Triton 3.9.

Each kernel's runtime arguments are its tensors first (named in capitals), then `stride_<tensor><b|h|n|d>` strides,
then sizes and scalars, then N_BUCKET (the autotuner's key only), then constexprs: `launch.positional` builds them by
name from that convention.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..triton_env import fp_fusion_by_default
from .tiles import (
    LN2_C,
    LOG2E_C,
    as_fp32,
    dq_sum_row,
    key_tile_range,
    program_start,
    query_tile_range,
    sequence_rows,
    visible,
)


# Where Triton does not fuse a multiply and an add by default, the forward's scale-and-subtract is an explicit FMA.
_FMA_SCORES: tl.constexpr = tl.constexpr(not fp_fusion_by_default())


@triton.jit
def _load_tile(base, rows, offs_d, stride_n, stride_d, n_rows,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load the (rows, BLOCK_D) tile of a (seq, head_dim) matrix at `base`.

    Rows at or past n_rows are masked only with CHECK_ROWS (tiles wholly inside the sequence skip that
    compare); head-dim padding (HEAD_DIM < BLOCK_D) is always masked. Masked entries read as 0."""
    ptrs = base + rows[:, None] * stride_n + offs_d[None, :] * stride_d
    if CHECK_ROWS:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    else:
        if HEAD_DIM == BLOCK_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def _store_tile(base, rows, offs_d, stride_n, stride_d, n_rows, x, HEAD_DIM: tl.constexpr):
    """Store x (float32) into the (rows, head_dim) tile at `base`, in the output's dtype, rows < n_rows only."""
    mask = (rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    tl.store(base + rows[:, None] * stride_n + offs_d[None, :] * stride_d, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _dot(a, b, FP32_IEEE: tl.constexpr):
    """fp32 inputs get true fp32 products (as PyTorch's default matmul); fp16/bf16 use the tensor cores."""
    if FP32_IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n, offs_d, lo, hi, n_k, right_offset, left_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr, FP32_IEEE: tl.constexpr,
):
    """Online-softmax update of one query tile over key tiles [lo, hi) (scores in the log2 domain).

    m_i stays -inf for a row that has seen no key yet (a masked loop may run before the unmasked one): the
    exponentials then subtract 0 instead, so nothing is NaN and a later tile still sets the row's true maximum."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_tile(K, cols, offs_d, stride_kn, stride_kd, n_k, HEAD_DIM, BLOCK_D, CHECK_ROWS=MASKED)
        v = _load_tile(V, cols, offs_d, stride_vn, stride_vd, n_k, HEAD_DIM, BLOCK_D, CHECK_ROWS=MASKED)
        qk = _dot(q, tl.trans(k), FP32_IEEE)
        if MASKED:
            seen = visible(offs_m[:, None], cols[None, :], cols[None, :], n_k, right_offset, left_offset,
                           BOUND_RIGHT, BOUND_LEFT)
            qk = tl.where(seen, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # qk_scale > 0, so max commutes with it
            m_sub = m_new
        # One FMA per score either way (_FMA_SCORES): where Triton fuses by default the plain expression schedules
        # better than an explicit tl.fma (docs/attention-kernels.md).
        if _FMA_SCORES:
            p = tl.math.exp2(tl.fma(qk, qk_scale, -m_sub[:, None]))
        else:
            p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_fwd_kernel(
    Q, K, V, O, L, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, qk_scale, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr,
    VARLEN: tl.constexpr, FP32_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one query tile of one (batch, query head). Writes O and L (natural log). The K/V head is
    h // kv_group (grouped-query attention; kv_group = 1 otherwise).

    With VARLEN the batch index is a packed sequence: its rows are CU_Q[b]..CU_Q[b+1] of Q (and CU_K for K, V),
    the batch strides are 0, n_q is the packed total, and L is (heads, total)."""
    qk_scale = as_fp32(qk_scale)
    # Sections of one (batch, head) pair: grouping heads made the `tl` kernels no faster (attention-kernels.md §8).
    pid_m, bh, b, h = program_start(n_bh, n_heads, 1, HEAVIEST_LAST=BOUND_RIGHT)
    q_start, seq_q, k_start, seq_k = 0, n_q, 0, n_k  # a dense batch: all rows
    if VARLEN:  # packed sequence b: rows CU[b] to CU[b + 1]
        q_start, seq_q = sequence_rows(tl.load(CU_Q + b), tl.load(CU_Q + b + 1))
        k_start, seq_k = sequence_rows(tl.load(CU_K + b), tl.load(CU_K + b + 1))
    start_m = pid_m * BLOCK_M
    if VARLEN:
        if start_m >= seq_q:  # the grid covers the longest sequence; this one is shorter
            return
        L += h * n_q + q_start
    else:
        L += bh.to(tl.int64) * n_q
    n_q, n_k = seq_q, seq_k
    Q += b * stride_qb + h * stride_qh + q_start * stride_qn
    K += b * stride_kb + (h // kv_group) * stride_kh + k_start * stride_kn
    V += b * stride_vb + (h // kv_group) * stride_vh + k_start * stride_vn
    O += b * stride_ob + h * stride_oh + q_start * stride_on

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q, offs_m, offs_d, stride_qn, stride_qd, n_q, HEAD_DIM, BLOCK_D, CHECK_ROWS=True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Query i sees key j iff i + left_offset <= j <= i + right_offset (bottom-right aligned, per bound flag).
    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = key_tile_range(start_m, n_k, right_offset, left_offset, BLOCK_M, BLOCK_N,
                                               BOUND_RIGHT, BOUND_LEFT)
    if BOUND_LEFT:  # the tiles that straddle the window's left edge
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                                   offs_m, offs_n, offs_d, lo, full_lo, n_k, right_offset, left_offset, qk_scale,
                                   HEAD_DIM, BLOCK_D, BLOCK_N, MASKED=True, BOUND_RIGHT=BOUND_RIGHT,
                                   BOUND_LEFT=BOUND_LEFT, FP32_IEEE=FP32_IEEE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_n, offs_d, full_lo, full_hi, n_k, right_offset, left_offset, qk_scale,
                               HEAD_DIM, BLOCK_D, BLOCK_N, MASKED=False, BOUND_RIGHT=BOUND_RIGHT,
                               BOUND_LEFT=BOUND_LEFT, FP32_IEEE=FP32_IEEE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_n, offs_d, full_hi, hi, n_k, right_offset, left_offset, qk_scale,
                               HEAD_DIM, BLOCK_D, BLOCK_N, MASKED=True, BOUND_RIGHT=BOUND_RIGHT,
                               BOUND_LEFT=BOUND_LEFT, FP32_IEEE=FP32_IEEE)

    seen = l_i > 0.0  # False only for queries that see no key (Nq > Nk, or a window off the keys)
    l_safe = tl.where(seen, l_i, 1.0)
    lse = tl.where(seen, m_i * LN2_C + tl.log(l_safe), float("-inf"))
    tl.store(L + offs_m, lse, mask=offs_m < n_q)
    _store_tile(O, offs_m, offs_d, stride_on, stride_od, n_q, acc / l_safe[:, None], HEAD_DIM)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, Q, DO, LseDelta, stride_qn, stride_qd, stride_don, stride_dod,
    offs_n, offs_m_base, offs_d, lo, hi, n_q, right_offset, left_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr, FP32_IEEE: tl.constexpr,
):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi). Works on transposed scores (keys x queries).

    LseDelta holds (-L in log2 units, D) per query row, interleaved, as the dQ kernel wrote them: one vector
    load per tile, where two 1-D loads would be replicated across the threads; -L is the FMA's addend as it is.
    """
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m_base
        q = _load_tile(Q, rows, offs_d, stride_qn, stride_qd, n_q, HEAD_DIM, BLOCK_D, CHECK_ROWS=MASKED)
        do = _load_tile(DO, rows, offs_d, stride_don, stride_dod, n_q, HEAD_DIM, BLOCK_D, CHECK_ROWS=MASKED)
        pair = rows[:, None] * 2 + tl.arange(0, 2)[None, :]
        if MASKED:
            neg_lse2, delta = tl.split(tl.load(LseDelta + pair, mask=rows[:, None] < n_q, other=0.0))
        else:
            neg_lse2, delta = tl.split(tl.load(LseDelta + pair))
        s_t = _dot(k, tl.trans(q), FP32_IEEE)  # (BLOCK_N, BLOCK_M), unscaled
        # dP^T does not depend on P: issued before the exponentials, the tensor cores work while exp2 runs.
        dp_t = _dot(v, tl.trans(do), FP32_IEEE)
        p_t = tl.math.exp2(tl.fma(s_t, qk_scale, neg_lse2[None, :]))
        if MASKED:
            seen = visible(rows[None, :], offs_n[:, None], rows[None, :], n_q, right_offset, left_offset,
                           BOUND_RIGHT, BOUND_LEFT)
            p_t = tl.where(seen, p_t, 0.0)
        dv += _dot(p_t.to(do.dtype), do, FP32_IEEE)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, FP32_IEEE)
    return dk, dv


@triton.jit
def flash_bwd_dkdv_kernel(
    Q, K, V, DO, LseDelta, DK, DV, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, qk_scale, softmax_scale, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr,
    VARLEN: tl.constexpr, FP32_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one key tile of one (batch, K/V head): dK and dV, looping over the query tiles that see it in
    each of the kv_group query heads that share the K/V head. Summing the group here needs no atomics.
    VARLEN as in the forward kernel."""
    # The first key tiles are seen by the most queries: the natural order already runs the heaviest first.
    qk_scale, softmax_scale = as_fp32(qk_scale), as_fp32(softmax_scale)
    pid_n, bh_kv, b, h_kv = program_start(n_bh, n_heads // kv_group, 1, HEAVIEST_LAST=False)
    q_start, seq_q, k_start, seq_k = 0, n_q, 0, n_k  # a dense batch: all rows
    if VARLEN:  # packed sequence b: rows CU[b] to CU[b + 1]
        q_start, seq_q = sequence_rows(tl.load(CU_Q + b), tl.load(CU_Q + b + 1))
        k_start, seq_k = sequence_rows(tl.load(CU_K + b), tl.load(CU_K + b + 1))
    start_n = pid_n * BLOCK_N
    lse_rows = n_q  # the rows of LseDelta per head: the batch's length, or the packed total (VARLEN)
    if VARLEN:
        if start_n >= seq_k:
            return
    n_q, n_k = seq_q, seq_k
    K += b * stride_kb + h_kv * stride_kh + k_start * stride_kn
    V += b * stride_vb + h_kv * stride_vh + k_start * stride_vn
    DK += b * stride_dkb + h_kv * stride_dkh + k_start * stride_dkn
    DV += b * stride_dvb + h_kv * stride_dvh + k_start * stride_dvn

    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m_base = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(K, offs_n, offs_d, stride_kn, stride_kd, n_k, HEAD_DIM, BLOCK_D, CHECK_ROWS=True)
    v = _load_tile(V, offs_n, offs_d, stride_vn, stride_vd, n_k, HEAD_DIM, BLOCK_D, CHECK_ROWS=True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo, mid, full_end, end = query_tile_range(start_n, n_q, right_offset, left_offset, BLOCK_M, BLOCK_N,
                                               BOUND_RIGHT, BOUND_LEFT)
    first_end = tl.minimum(mid, end)
    last_start = tl.maximum(mid, full_end)
    for g in range(kv_group):
        h = h_kv * kv_group + g
        Qh = Q + b * stride_qb + h * stride_qh + q_start * stride_qn
        DOh = DO + b * stride_dob + h * stride_doh + q_start * stride_don
        if VARLEN:
            LseDeltaH = LseDelta + (h * lse_rows + q_start) * 2
        else:
            LseDeltaH = LseDelta + (b * n_heads + h) * lse_rows * 2
        # Three ranges: the tiles at the right edge (masked), the fully visible ones, the tiles at the left edge
        # and the ragged end of the queries (masked).
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LseDeltaH, stride_qn, stride_qd, stride_don, stride_dod,
                                 offs_n, offs_m_base, offs_d, lo, first_end, n_q, right_offset, left_offset, qk_scale,
                                 HEAD_DIM, BLOCK_D, BLOCK_M, MASKED=True, BOUND_RIGHT=BOUND_RIGHT,
                                 BOUND_LEFT=BOUND_LEFT, FP32_IEEE=FP32_IEEE)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LseDeltaH, stride_qn, stride_qd, stride_don, stride_dod,
                                 offs_n, offs_m_base, offs_d, mid, full_end, n_q, right_offset, left_offset, qk_scale,
                                 HEAD_DIM, BLOCK_D, BLOCK_M, MASKED=False, BOUND_RIGHT=BOUND_RIGHT,
                                 BOUND_LEFT=BOUND_LEFT, FP32_IEEE=FP32_IEEE)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Qh, DOh, LseDeltaH, stride_qn, stride_qd, stride_don, stride_dod,
                                 offs_n, offs_m_base, offs_d, last_start, end, n_q, right_offset, left_offset, qk_scale,
                                 HEAD_DIM, BLOCK_D, BLOCK_M, MASKED=True, BOUND_RIGHT=BOUND_RIGHT,
                                 BOUND_LEFT=BOUND_LEFT, FP32_IEEE=FP32_IEEE)
    _store_tile(DK, offs_n, offs_d, stride_dkn, stride_dkd, n_k, dk * softmax_scale, HEAD_DIM)
    _store_tile(DV, offs_n, offs_d, stride_dvn, stride_dvd, n_k, dv, HEAD_DIM)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, neg_lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n_base, offs_d, lo, hi, n_k, right_offset, left_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr, FP32_IEEE: tl.constexpr,
):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n_base
        k = _load_tile(K, cols, offs_d, stride_kn, stride_kd, n_k, HEAD_DIM, BLOCK_D, CHECK_ROWS=MASKED)
        v = _load_tile(V, cols, offs_d, stride_vn, stride_vd, n_k, HEAD_DIM, BLOCK_D, CHECK_ROWS=MASKED)
        s = _dot(q, tl.trans(k), FP32_IEEE)
        p = tl.math.exp2(tl.fma(s, qk_scale, neg_lse2[:, None]))
        if MASKED:
            seen = visible(offs_m[:, None], cols[None, :], cols[None, :], n_k, right_offset, left_offset,
                           BOUND_RIGHT, BOUND_LEFT)
            p = tl.where(seen, p, 0.0)
        dp = _dot(do, tl.trans(v), FP32_IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, FP32_IEEE)
    return dq


@triton.jit
def flash_bwd_dq_kernel(
    Q, K, V, DO, L, LseDelta, DQ, O, CU_Q, CU_K,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    stride_ob, stride_oh, stride_on, stride_od,
    n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, qk_scale, softmax_scale, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr,
    VARLEN: tl.constexpr, FP32_IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one query tile of one (batch, query head): dQ, looping over the key tiles it sees (K/V head
    h // kv_group). VARLEN as in the forward kernel.

    On the way it writes LseDelta[row] = (-L * log2(e), rowsum(dO * O)) for the dK/dV kernel, which runs
    after it: no separate preprocess kernel, and no multiply, negation or second load in the dK/dV inner loop.
    """
    qk_scale, softmax_scale = as_fp32(qk_scale), as_fp32(softmax_scale)
    pid_m, bh, b, h = program_start(n_bh, n_heads, 1, HEAVIEST_LAST=BOUND_RIGHT)
    q_start, seq_q, k_start, seq_k = 0, n_q, 0, n_k  # a dense batch: all rows
    if VARLEN:  # packed sequence b: rows CU[b] to CU[b + 1]
        q_start, seq_q = sequence_rows(tl.load(CU_Q + b), tl.load(CU_Q + b + 1))
        k_start, seq_k = sequence_rows(tl.load(CU_K + b), tl.load(CU_K + b + 1))
    start_m = pid_m * BLOCK_M
    if VARLEN:
        if start_m >= seq_q:
            return
        L += h * n_q + q_start
        LseDelta += (h * n_q + q_start) * 2
    else:
        L += bh.to(tl.int64) * n_q
        LseDelta += bh.to(tl.int64) * n_q * 2
    n_q, n_k = seq_q, seq_k
    Q += b * stride_qb + h * stride_qh + q_start * stride_qn
    K += b * stride_kb + (h // kv_group) * stride_kh + k_start * stride_kn
    V += b * stride_vb + (h // kv_group) * stride_vh + k_start * stride_vn
    DO += b * stride_dob + h * stride_doh + q_start * stride_don
    DQ += b * stride_dqb + h * stride_dqh + q_start * stride_dqn
    O += b * stride_ob + h * stride_oh + q_start * stride_on

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n_base = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q, offs_m, offs_d, stride_qn, stride_qd, n_q, HEAD_DIM, BLOCK_D, CHECK_ROWS=True)
    do = _load_tile(DO, offs_m, offs_d, stride_don, stride_dod, n_q, HEAD_DIM, BLOCK_D, CHECK_ROWS=True)
    row_ok = offs_m < n_q
    lse = tl.load(L + offs_m, mask=row_ok, other=0.0)
    neg_lse2 = tl.where(lse == float("-inf"), 0.0, lse * -LOG2E_C)  # rows that see no key: every p is masked
    o = _load_tile(O, offs_m, offs_d, stride_on, stride_od, n_q, HEAD_DIM, BLOCK_D, CHECK_ROWS=True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    pair = offs_m[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(LseDelta + pair, tl.join(neg_lse2, delta), mask=row_ok[:, None])
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = key_tile_range(start_m, n_k, right_offset, left_offset, BLOCK_M, BLOCK_N,
                                               BOUND_RIGHT, BOUND_LEFT)
    if BOUND_LEFT:
        dq = _bwd_dq_inner(dq, q, do, neg_lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                           offs_m, offs_n_base, offs_d, lo, full_lo, n_k, right_offset, left_offset, qk_scale,
                           HEAD_DIM, BLOCK_D, BLOCK_N, MASKED=True, BOUND_RIGHT=BOUND_RIGHT, BOUND_LEFT=BOUND_LEFT,
                           FP32_IEEE=FP32_IEEE)
    dq = _bwd_dq_inner(dq, q, do, neg_lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, offs_n_base, offs_d, full_lo, full_hi, n_k, right_offset, left_offset, qk_scale,
                       HEAD_DIM, BLOCK_D, BLOCK_N, MASKED=False, BOUND_RIGHT=BOUND_RIGHT, BOUND_LEFT=BOUND_LEFT,
                       FP32_IEEE=FP32_IEEE)
    dq = _bwd_dq_inner(dq, q, do, neg_lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, offs_n_base, offs_d, full_hi, hi, n_k, right_offset, left_offset, qk_scale,
                       HEAD_DIM, BLOCK_D, BLOCK_N, MASKED=True, BOUND_RIGHT=BOUND_RIGHT, BOUND_LEFT=BOUND_LEFT,
                       FP32_IEEE=FP32_IEEE)
    _store_tile(DQ, offs_m, offs_d, stride_dqn, stride_dqd, n_q, dq * softmax_scale, HEAD_DIM)


@triton.jit
def one_pass_prologue_kernel(O, DO, L, LseDelta, DqAcc, Sem, stride_ob, stride_oh, stride_on, stride_od,
                              stride_dob, stride_doh, stride_don, stride_dod, n_heads, n_q, n_sum,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                              ZERO_ALL: tl.constexpr):
    """Before the one-pass backward, for ROWS rows of one (batch, head): the (-L·log2 e, rowsum(dO * O)) pairs the
    dQ kernels write in the two passes (-L·log2 e = 0 for a row that sees no key, L = -inf), rows of dQ's float32
    sum zeroed, and the semaphore of this query tile (ROWS rows; the deterministic one pass's turns; the other
    ignores it) zeroed. L and LseDelta are dense over (B, H, Nq), DqAcc over (B, H, n_sum) in
    `dq_sum_row`'s order; O and dO have any strides.
    With ZERO_ALL (the unordered one pass, whose adds come in no fixed order) every row of the sum is zeroed.
    Without it (the deterministic one pass) only the rows that see no key, which the forward's L marks (L = -inf
    exactly there): the first program at each query tile stores its share instead of adding it, and a tile that
    no program visits has no row that sees a key (a program visits every tile with a pair it sees, or its dK and dV
    would miss them). That saves writing the whole sum once, 4 bytes per element."""
    bh = tl.program_id(1).to(tl.int64)  # 64-bit offsets: (B, N, H, D) strides times long sequences pass 2^31
    b = bh // n_heads
    h = bh % n_heads
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    ok = rows < n_q
    tile_ok = ok[:, None] & (cols[None, :] < HEAD_DIM)
    o = tl.load(O + b * stride_ob + h * stride_oh + rows[:, None] * stride_on + cols[None, :] * stride_od,
                mask=tile_ok, other=0.0).to(tl.float32)
    do = tl.load(DO + b * stride_dob + h * stride_doh + rows[:, None] * stride_don + cols[None, :] * stride_dod,
                 mask=tile_ok, other=0.0).to(tl.float32)
    flat = bh * n_q + rows
    lse = tl.load(L + flat, mask=ok, other=0.0)
    sees_no_key = lse == float("-inf")
    tl.store(LseDelta + flat * 2, tl.where(sees_no_key, 0.0, lse * -LOG2E_C), mask=ok)
    tl.store(LseDelta + flat * 2 + 1, tl.sum(o * do, axis=1), mask=ok)
    zero = ok if ZERO_ALL else ok & sees_no_key
    in_sum = bh * n_sum + dq_sum_row(rows)
    tl.store(DqAcc + in_sum[:, None] * HEAD_DIM + cols[None, :], tl.zeros([ROWS, BLOCK_D], tl.float32),
             mask=zero[:, None] & (cols[None, :] < HEAD_DIM))
    tl.store(Sem + bh * tl.num_programs(0) + tl.program_id(0), 0)


@triton.jit
def one_pass_epilogue_kernel(DqAcc, DQ, stride_dqb, stride_dqh, stride_dqn, stride_dqd, n_rows, n_heads, n_q, n_sum,
                              softmax_scale, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """After the one-pass backward: dQ = its float32 sum * softmax_scale, in dQ's dtype. n_rows = B * H * Nq rows,
    DQ with any strides; DqAcc over (B * H, n_sum) rows in `dq_sum_row`'s order."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    bh = rows // n_q
    n = rows - bh * n_q
    in_sum = bh * n_sum + dq_sum_row(n)
    acc = tl.load(DqAcc + in_sum[:, None] * HEAD_DIM + cols[None, :], mask=ok, other=0.0)
    out = (bh // n_heads) * stride_dqb + (bh % n_heads) * stride_dqh + n * stride_dqn
    tl.store(DQ + out[:, None] + cols[None, :] * stride_dqd, (acc * softmax_scale).to(DQ.dtype.element_ty), mask=ok)

