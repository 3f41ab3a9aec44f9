"""FlashAttention-2 in Triton: forward kernel, atomic-free backward kernels, autotune configs, autograd.Function.

Layout of this file (after Liger-Kernel): kernels, then autotune configs, then host launchers, then the
`torch.autograd.Function`. The pure-PyTorch twin of every kernel is in `flash_torch.py`.

Choices that pay (measured in benchmarks/results/leaderboard.md):
- Scores are computed in the log2 domain: log2(e) is folded into the softmax scale so the kernels call
  `exp2`; L is still stored in natural log, as the contract asks.
- Causal masking only costs where it must: every kernel runs an unmasked loop over tiles that are fully
  visible and a masked loop over the few tiles that straddle the diagonal or the sequence end; fully
  masked tiles are never visited.
- The backward is atomic-free: one kernel computes dQ for a query tile looping over key tiles, then another
  computes dK, dV for a key tile looping over query tiles. The dQ kernel also computes D = rowsum(dO*O)
  and hands the dK/dV kernel one interleaved (L*log2(e), D) pair per query row: its inner loop then reads
  both with one vector load and no multiply (dK/dV kernel 2.02 -> 1.77 ms at the leaderboard shape).
- Causal grids launch the heaviest query tiles first.
- Any stride: rank-3 (B, N, D) and rank-4 (B, H, N, D) views and non-contiguous inputs are addressed
  by their strides, never copied; only a dO whose last stride is not 1 (a stride-0 dO) is made dense.
- Plain pointer arithmetic with masks: block pointers were removed in Triton 3.9.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .validation import check_attention_inputs

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
# The kernels' copies: a @triton.jit function may only read globals that are constexpr.
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


def interpreter_active() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _load_rows(ptrs, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """Load a (rows, BLOCK_D) tile; mask rows past n_rows only when asked, head-dim padding always."""
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
    offs_m, offs_n, offs_d, lo, hi, n_k, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, FP32_IEEE: tl.constexpr,
):
    """Online-softmax update of one query tile over key tiles [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = _load_rows(K + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, cols, n_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        v = _load_rows(V + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, cols, n_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        qk = _dot(q, tl.trans(k), FP32_IEEE)
        if MASKED:
            visible = cols[None, :] < n_k
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # qk_scale > 0, so max commutes with it
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])  # one FMA per score
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32_IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _flash_fwd_kernel(
    Q, K, V, O, L,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od,
    n_heads, n_q, n_k, qk_scale, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one query tile of one (batch, head). Writes O and L (natural log)."""
    pid_m = tl.program_id(0)
    if IS_CAUSAL:  # heaviest tiles (last queries see the most keys) first
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh
    L += bh.to(tl.int64) * n_q

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, offs_m, n_q, offs_d,
                   HEAD_DIM, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    causal_offset = n_k - n_q  # query i sees key j <= i + causal_offset (bottom-right aligned)
    if IS_CAUSAL:
        hi = tl.maximum(tl.minimum(n_k, start_m + BLOCK_M + causal_offset), 0)
        full_hi = tl.maximum(tl.minimum(n_k, start_m + 1 + causal_offset), 0) // BLOCK_N * BLOCK_N
    else:
        hi = n_k
        full_hi = n_k // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_n, offs_d, 0, full_hi, n_k, causal_offset, qk_scale,
                               HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL, FP32_IEEE)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_n, offs_d, full_hi, hi, n_k, causal_offset, qk_scale,
                               HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, FP32_IEEE)

    seen = l_i > 0.0  # False only for queries that see no key (causal, Nq > Nk)
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, m_i * _LN2 + tl.log(l_safe), float("-inf"))
    row_ok = offs_m < n_q
    tl.store(L + offs_m, lse, mask=row_ok)
    o_mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    tl.store(O + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od, out.to(O.dtype.element_ty), mask=o_mask)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, Q, DO, LseDelta, stride_qn, stride_qd, stride_don, stride_dod,
    offs_n, offs_m_base, offs_d, lo, hi, n_q, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, FP32_IEEE: tl.constexpr,
):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi). Works on transposed scores.

    LseDelta holds (L in log2 units, D) per query row, interleaved, as the dQ kernel wrote them.
    """
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m_base
        q = _load_rows(Q + rows[:, None] * stride_qn + offs_d[None, :] * stride_qd, rows, n_q, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        do = _load_rows(DO + rows[:, None] * stride_don + offs_d[None, :] * stride_dod, rows, n_q, offs_d,
                        HEAD_DIM, BLOCK_D, MASKED)
        pair = rows[:, None] * 2 + tl.arange(0, 2)[None, :]
        if MASKED:
            lse2, delta = tl.split(tl.load(LseDelta + pair, mask=rows[:, None] < n_q, other=0.0))
        else:
            lse2, delta = tl.split(tl.load(LseDelta + pair))
        s_t = _dot(k, tl.trans(q), FP32_IEEE) * qk_scale  # (BLOCK_N, BLOCK_M)
        # dP^T does not depend on P: issued before the exponentials, the tensor cores work while exp2
        # runs (dK/dV kernel 2.15 instead of 2.3 ms at the leaderboard shape; the dQ kernel got slower).
        dp_t = _dot(v, tl.trans(do), FP32_IEEE)
        p_t = tl.math.exp2(s_t - lse2[None, :])
        if MASKED:
            visible = rows[None, :] < n_q
            if IS_CAUSAL:
                visible = visible & (offs_n[:, None] <= rows[None, :] + causal_offset)
            p_t = tl.where(visible, p_t, 0.0)
        dv += _dot(p_t.to(do.dtype), do, FP32_IEEE)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, FP32_IEEE)
    return dk, dv


@triton.jit
def _flash_bwd_dkdv_kernel(
    Q, K, V, DO, LseDelta, DK, DV,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    n_heads, n_q, n_k, qk_scale, softmax_scale, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one key tile of one (batch, head): dK and dV, looping over the query tiles that see it."""
    pid_n = tl.program_id(0)  # the first key tiles are seen by the most queries: natural order is heaviest first
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DK += b * stride_dkb + h * stride_dkh
    DV += b * stride_dvb + h * stride_dvh
    LseDelta += bh.to(tl.int64) * n_q * 2

    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m_base = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_rows(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, offs_n, n_k, offs_d,
                   HEAD_DIM, BLOCK_D, True)
    v = _load_rows(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, offs_n, n_k, offs_d,
                   HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    causal_offset = n_k - n_q
    if IS_CAUSAL:
        # Queries before `lo` see none of these keys; from `mid` on they see all of them.
        lo = tl.maximum(start_n - causal_offset, 0) // BLOCK_M * BLOCK_M
        mid = tl.maximum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - causal_offset, 0), BLOCK_M) * BLOCK_M, lo)
    else:
        lo = 0
        mid = 0
    full_end = n_q // BLOCK_M * BLOCK_M
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LseDelta, stride_qn, stride_qd, stride_don, stride_dod,
                             offs_n, offs_m_base, offs_d, lo, tl.minimum(mid, n_q), n_q, causal_offset, qk_scale,
                             HEAD_DIM, BLOCK_D, BLOCK_M, True, IS_CAUSAL, FP32_IEEE)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LseDelta, stride_qn, stride_qd, stride_don, stride_dod,
                             offs_n, offs_m_base, offs_d, mid, full_end, n_q, causal_offset, qk_scale,
                             HEAD_DIM, BLOCK_D, BLOCK_M, False, IS_CAUSAL, FP32_IEEE)
    dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LseDelta, stride_qn, stride_qd, stride_don, stride_dod,
                             offs_n, offs_m_base, offs_d, tl.maximum(mid, full_end), n_q, n_q, causal_offset,
                             qk_scale, HEAD_DIM, BLOCK_D, BLOCK_M, True, IS_CAUSAL, FP32_IEEE)
    dk *= softmax_scale
    mask = (offs_n[:, None] < n_k) & (offs_d[None, :] < HEAD_DIM)
    tl.store(DK + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty), mask=mask)
    tl.store(DV + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd, dv.to(DV.dtype.element_ty), mask=mask)


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_m, offs_n_base, offs_d, lo, hi, n_k, causal_offset, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, FP32_IEEE: tl.constexpr,
):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n_base
        k = _load_rows(K + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, cols, n_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        v = _load_rows(V + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, cols, n_k, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)
        s = _dot(q, tl.trans(k), FP32_IEEE) * qk_scale
        p = tl.math.exp2(s - lse2[:, None])
        if MASKED:
            visible = cols[None, :] < n_k
            if IS_CAUSAL:
                visible = visible & (cols[None, :] <= offs_m[:, None] + causal_offset)
            p = tl.where(visible, p, 0.0)
        dp = _dot(do, tl.trans(v), FP32_IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, FP32_IEEE)
    return dq


@triton.jit
def _flash_bwd_dq_kernel(
    Q, K, V, DO, L, LseDelta, DQ, O,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_don, stride_dod,
    stride_dqb, stride_dqh, stride_dqn, stride_dqd,
    stride_ob, stride_oh, stride_on, stride_od,
    n_heads, n_q, n_k, qk_scale, softmax_scale, N_BUCKET,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, IS_CAUSAL: tl.constexpr, FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One program = one query tile of one (batch, head): dQ, looping over the key tiles it sees.

    On the way it writes LseDelta[row] = (L * log2(e), rowsum(dO * O)) for the dK/dV kernel, which runs
    after it. Two separate float loads per query tile, and the multiply, in the dK/dV inner loop cost 64
    of its 354 sm_90 instructions per tile (Triton replicates such 1-D loads across the threads).
    """
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_dob + h * stride_doh
    DQ += b * stride_dqb + h * stride_dqh
    O += b * stride_ob + h * stride_oh
    L += bh.to(tl.int64) * n_q
    LseDelta += bh.to(tl.int64) * n_q * 2

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n_base = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(Q + offs_m[:, None] * stride_qn + offs_d[None, :] * stride_qd, offs_m, n_q, offs_d,
                   HEAD_DIM, BLOCK_D, True)
    do = _load_rows(DO + offs_m[:, None] * stride_don + offs_d[None, :] * stride_dod, offs_m, n_q, offs_d,
                    HEAD_DIM, BLOCK_D, True)
    row_ok = offs_m < n_q
    lse = tl.load(L + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * _LOG2E)  # rows that see no key: every p is masked anyway
    o = _load_rows(O + offs_m[:, None] * stride_on + offs_d[None, :] * stride_od, offs_m, n_q, offs_d,
                   HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    pair = offs_m[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(LseDelta + pair, tl.join(lse2, delta), mask=row_ok[:, None])
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    causal_offset = n_k - n_q
    if IS_CAUSAL:
        hi = tl.maximum(tl.minimum(n_k, start_m + BLOCK_M + causal_offset), 0)
        full_hi = tl.maximum(tl.minimum(n_k, start_m + 1 + causal_offset), 0) // BLOCK_N * BLOCK_N
    else:
        hi = n_k
        full_hi = n_k // BLOCK_N * BLOCK_N
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, offs_n_base, offs_d, 0, full_hi, n_k, causal_offset, qk_scale,
                       HEAD_DIM, BLOCK_D, BLOCK_N, False, IS_CAUSAL, FP32_IEEE)
    dq = _bwd_dq_inner(dq, q, do, lse2, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                       offs_m, offs_n_base, offs_d, full_hi, hi, n_k, causal_offset, qk_scale,
                       HEAD_DIM, BLOCK_D, BLOCK_N, True, IS_CAUSAL, FP32_IEEE)
    dq *= softmax_scale
    mask = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    tl.store(DQ + offs_m[:, None] * stride_dqn + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------
# Autotune configs
# ----------------------------------------------------------------------------------------------------
# One autotuned handle per head-dim class, so every class only tries tiles that fit it (at D=128 the
# D=64 tiles spill registers). The key adds the sequence-length bucket and the causal flag; Triton adds
# the tensors' dtypes to the key by itself. Under the interpreter (or FLASHSYS_TRITON_AUTOTUNE=0) each
# handle keeps only its first config, which is the best single choice we measured.
#
# Long sequences (N >= LONG_SEQ) at D <= 64 get a handle of their own with only the large tiles that won
# there in every sweep: with all candidates, timing noise (about 5% between runs) let the autotuner pick
# a 64x64 forward that is 5% slower than 128x64 at N = 16384.
# (BLOCK_M, BLOCK_N, num_warps, num_stages), best first.
_FWD_TILES = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 3),
         (64, 64, 4, 4), (128, 32, 4, 4)],
    128: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 2)],
    256: [(64, 32, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2)],
}
# dK/dV kernel: BLOCK_N key rows held in registers, BLOCK_M query rows streamed.
_BWD_DKDV_TILES = {
    64: [(64, 64, 4, 4), (64, 64, 4, 3), (64, 64, 4, 5), (32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3),
         (16, 128, 4, 4)],
    128: [(32, 128, 8, 2), (64, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2)],
    256: [(32, 64, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2)],
}
# dQ kernel: BLOCK_M query rows held, BLOCK_N key rows streamed.
_BWD_DQ_TILES = {
    64: [(128, 64, 8, 4), (128, 64, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4)],
    128: [(128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (128, 64, 8, 2)],
    256: [(64, 32, 4, 2), (64, 16, 4, 2), (32, 32, 4, 2)],
}
# fp32 inputs are the accuracy path, not the speed path: fp32 tiles take twice the shared memory and
# registers, and the fp16/bf16 tiles above make ptxas crawl or run out of resources. Small tiles for all.
_FP32_TILES = {64: [(32, 32, 4, 2), (64, 32, 4, 2)], 128: [(32, 32, 4, 2)], 256: [(16, 32, 4, 1)]}
# {head-dim class: tiles} for N >= LONG_SEQ, per kernel (same tuple layout as above).
LONG_SEQ = 8192
_FWD_TILES_LONG = {64: [(128, 64, 8, 3), (128, 64, 8, 4)]}
_BWD_DKDV_TILES_LONG = {64: [(64, 64, 4, 4), (64, 64, 4, 3), (64, 64, 4, 5)]}
_BWD_DQ_TILES_LONG = {64: [(128, 64, 8, 4), (128, 64, 8, 3)]}
_AUTOTUNE_KEY = ["N_BUCKET", "HEAD_DIM", "IS_CAUSAL"]


def _autotune_enabled() -> bool:
    return not interpreter_active() and os.environ.get("FLASHSYS_TRITON_AUTOTUNE", "1") != "0"


def _configs(tiles: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    chosen = tiles if _autotune_enabled() else tiles[:1]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in chosen]


def _tuned(kernel, table, long_table):
    """{(head-dim class, is_fp32, long_seq): autotuned kernel}; long_seq handles exist only where listed."""
    handles = {}
    for d in table:
        for fp32, tiles in ((False, table[d]), (True, _FP32_TILES[d])):
            handles[d, fp32, False] = triton.autotune(configs=_configs(tiles), key=_AUTOTUNE_KEY)(kernel)
        if d in long_table:
            handles[d, False, True] = triton.autotune(configs=_configs(long_table[d]), key=_AUTOTUNE_KEY)(kernel)
    return handles


_fwd_kernels = _tuned(_flash_fwd_kernel, _FWD_TILES, _FWD_TILES_LONG)
_bwd_dkdv_kernels = _tuned(_flash_bwd_dkdv_kernel, _BWD_DKDV_TILES, _BWD_DKDV_TILES_LONG)
_bwd_dq_kernels = _tuned(_flash_bwd_dq_kernel, _BWD_DQ_TILES, _BWD_DQ_TILES_LONG)


# ----------------------------------------------------------------------------------------------------
# Host launchers
# ----------------------------------------------------------------------------------------------------


def _strides4(t: Tensor) -> tuple[int, int, int, int]:
    """(batch, head, seq, dim) strides; a rank-3 tensor is one head per batch entry."""
    if t.dim() == 4:
        return tuple(t.stride())  # type: ignore[return-value]
    return (t.stride(0), 0, t.stride(1), t.stride(2))


class _Geometry(NamedTuple):
    """What the launchers derive from q and k: grid sizes, the padded head dim and the autotune keys."""

    n_heads: int
    n_bh: int
    n_q: int
    n_k: int
    d: int
    block_d: int  # head dim padded to a power of two (at least 16)
    hd: tuple[int, bool]  # (head-dim class, fp32 inputs): picks the autotuned handle
    bucket: int  # sequence-length bucket of the autotune key
    dtype: torch.dtype


def _geometry(q: Tensor, k: Tensor) -> _Geometry:
    n_heads = q.shape[1] if q.dim() == 4 else 1
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    block_d = max(16, triton.next_power_of_2(d))
    head_dim_class = 64 if block_d <= 64 else block_d
    bucket = min(triton.next_power_of_2(max(n_q, n_k)), 1 << 16)
    return _Geometry(n_heads, q.shape[0] * n_heads, n_q, n_k, d, block_d,
                     (head_dim_class, q.dtype == torch.float32), bucket, q.dtype)


class LaunchKey(NamedTuple):
    """Everything the autotuner's own key depends on (Triton adds the dtype to N_BUCKET, HEAD_DIM, IS_CAUSAL)."""

    kernel: str  # "fwd", "dq" or "dkdv"
    hd: tuple[int, bool]
    bucket: int
    head_dim: int
    causal: bool
    dtype: torch.dtype


# After the autotuner has chosen a config for a key, later calls launch the JIT kernel with it directly:
# Triton's Autotuner.run rebuilds its key from every argument on each call, which cost about 45 us of
# host time per launch on an H100 machine, more than the whole forward kernel takes at N = 1024.
_chosen_configs: dict[LaunchKey, dict] = {}


def chosen_configs() -> dict[LaunchKey, dict]:
    """{LaunchKey: launch config (BLOCK_M, BLOCK_N, num_warps, num_stages)} chosen so far."""
    return dict(_chosen_configs)


def _launch(kernel: str, handles: dict, g: _Geometry, causal: bool, grid, args: tuple) -> None:
    """Launch one of the three kernels: its autotuned handle for this geometry on the first call of a key,
    the JIT kernel with the chosen config after that."""
    key = LaunchKey(kernel, g.hd, g.bucket, g.d, causal, g.dtype)
    constexprs = dict(HEAD_DIM=g.d, BLOCK_D=g.block_d, IS_CAUSAL=causal, FP32_IEEE=g.hd[1])
    handle = handles.get((*g.hd, g.bucket >= LONG_SEQ)) or handles[(*g.hd, False)]
    meta = _chosen_configs.get(key)
    if meta is None:
        handle[grid](*args, **constexprs)
        best = handle.best_config
        _chosen_configs[key] = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
    else:
        handle.fn[grid(meta)](*args, **constexprs, **meta)


def flash_forward_triton(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel. Returns (O like q, L float32 of shape q.shape[:-1])."""
    g = _geometry(q, k)
    o = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    _launch(
        "fwd", _fwd_kernels, g, causal, lambda meta: (triton.cdiv(g.n_q, meta["BLOCK_M"]), g.n_bh),
        (q, k, v, o, lse, *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(o),
         g.n_heads, g.n_q, g.n_k, scale * LOG2E, g.bucket),
    )
    return o, lse


def flash_backward_triton(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the dQ kernel (which also writes the (L*log2e, D) pairs), then the dK/dV kernel.

    dO may have any strides, stride 0 included.
    """
    g = _geometry(q, k)
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    if do.stride(-1) != 1:
        # `o.sum().backward()` hands over a stride-0 dO. The kernels read it correctly, but with scalar
        # instead of vector loads; one dense copy costs far less than that.
        do = do.contiguous()
    lse_delta = torch.empty((*q.shape[:-1], 2), dtype=torch.float32, device=q.device)
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    qkv_do = (*_strides4(q), *_strides4(k), *_strides4(v), *_strides4(do))
    scalars = (g.n_heads, g.n_q, g.n_k, scale * LOG2E, scale, g.bucket)
    # dQ first: it writes the (L*log2e, D) pairs that the dK/dV kernel reads.
    _launch(
        "dq", _bwd_dq_kernels, g, causal, lambda meta: (triton.cdiv(g.n_q, meta["BLOCK_M"]), g.n_bh),
        (q, k, v, do, lse, lse_delta, dq, o, *qkv_do, *_strides4(dq), *_strides4(o), *scalars),
    )
    _launch(
        "dkdv", _bwd_dkdv_kernels, g, causal, lambda meta: (triton.cdiv(g.n_k, meta["BLOCK_N"]), g.n_bh),
        (q, k, v, do, lse_delta, dk, dv, *qkv_do, *_strides4(dk), *_strides4(dv), *scalars),
    )
    return dq, dk, dv


def _check_device(q: Tensor) -> None:
    if q.device.type == "cuda":
        return
    if q.device.type == "cpu" and interpreter_active():
        return
    raise ValueError(
        f"FlashAttention2Triton: inputs are on {q.device}, but the Triton kernels need CUDA tensors "
        "(or CPU tensors with TRITON_INTERPRET=1 set before flashsys is imported); "
        "use FlashAttention2Torch or flash_attention(..., backend='torch') on this device"
    )


def _interpreter_upcast(t: Tensor) -> Tensor:
    # Triton's interpreter computes bf16 arithmetic wrongly (it has no bf16 support): run those in fp32.
    return t.float() if interpreter_active() and t.dtype == torch.bfloat16 else t


# The launchers are registered as custom ops so that torch.compile treats them as opaque calls and
# launches the same eager Triton kernels (with Triton's own autotuner) instead of re-emitting their
# source through Inductor, which breaks on kernels that call other @triton.jit helpers. In eager mode
# the Function calls the launchers directly: the custom-op dispatch cost 40-70 us of host time per call.


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, softmax_scale: float) -> tuple[Tensor, Tensor]:
    up = _interpreter_upcast
    o, lse = flash_forward_triton(up(q), up(k), up(v), is_causal, softmax_scale)
    return o.to(q.dtype), lse


def _backward_impl(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, is_causal: bool, softmax_scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    up = _interpreter_upcast
    dq, dk, dv = flash_backward_triton(up(q), up(k), up(v), up(o), lse, up(do), is_causal, softmax_scale)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@torch.library.custom_op("flashsys::flash_attention_forward", mutates_args=())
def flash_attention_forward_op(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, softmax_scale: float) -> tuple[Tensor, Tensor]:
    return _forward_impl(q, k, v, is_causal, softmax_scale)


@flash_attention_forward_op.register_fake
def _(q, k, v, is_causal, softmax_scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("flashsys::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, is_causal: bool, softmax_scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return _backward_impl(q, k, v, o, lse, do, is_causal, softmax_scale)


@flash_attention_backward_op.register_fake
def _(q, k, v, o, lse, do, is_causal, softmax_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _eager(*tensors: Tensor) -> bool:
    """True for plain tensors outside torch.compile; traced (fake, functional) tensors need the custom ops."""
    return not torch.compiler.is_compiling() and all(type(t) in (Tensor, torch.nn.Parameter) for t in tensors)


class FlashAttention2Triton(torch.autograd.Function):
    """FlashAttention-2 with Triton forward and backward kernels (CUDA; CPU under TRITON_INTERPRET=1)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, softmax_scale: float | None = None) -> Tensor:
        scale = check_attention_inputs(q, k, v, is_causal, softmax_scale, op="FlashAttention2Triton",
                                       max_head_dim=MAX_HEAD_DIM)
        _check_device(q)
        forward = _forward_impl if _eager(q, k, v) else flash_attention_forward_op
        o, lse = forward(q, k, v, bool(is_causal), scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal, ctx.scale = bool(is_causal), scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        backward = _backward_impl if _eager(q, do) else flash_attention_backward_op
        dq, dk, dv = backward(q, k, v, o, lse, do, ctx.is_causal, ctx.scale)
        return dq, dk, dv, None, None
