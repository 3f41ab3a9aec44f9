"""FlashAttention-2 in Triton: forward kernel, atomic-free backward kernels, autotune configs, autograd.Function.

Layout of this file (after Liger-Kernel): kernels, then autotune configs, then host launchers, then the
`torch.autograd.Function`. The pure-PyTorch twin of every kernel is in `flash_torch.py`. On Hopper a large call may
run Gluon kernels instead (`flash_gluon.py` says which calls and how each is chosen): the forward, and either
backward kernel where its Gluon version timed faster.

Choices that pay (each measured in benchmarks/results/kernel_experiments.md, with the ones that did not):
- Scores are computed in the log2 domain: log2(e) is folded into the softmax scale so the kernels call
  `exp2`; L is still stored in natural log, as the contract asks.
- Causal masking only costs where it must: every kernel runs an unmasked loop over tiles that are fully
  visible and a masked loop over the few tiles that straddle the diagonal or the sequence end; fully
  masked tiles are never visited.
- The backward is atomic-free: one kernel computes dQ for a query tile looping over key tiles, then another
  computes dK, dV for a key tile looping over query tiles. The dQ kernel also computes D = rowsum(dO*O)
  and hands the dK/dV kernel one interleaved (-L*log2(e), D) pair per query row: its inner loop then reads
  both with one vector load and no multiply.
- Causal grids launch the heaviest query tiles first.
- In the backward, the scale-and-subtract before each `exp2` is an explicit `tl.fma` on the stored -L: one
  instruction per score whatever a Triton version's default for fusing a multiply and an add (Triton 3.9 warns
  that 3.10 turns that fusion off). The forward uses `tl.fma` only where Triton does not fuse by default
  (`_FMA_SCORES`): the plain expression schedules better where it does.
- Any stride: rank-3 (B, N, D) and rank-4 (B, H, N, D) views and non-contiguous inputs are addressed
  by their strides, never copied; only a dO whose last stride is not 1 (a stride-0 dO) is made dense.
- Plain pointer arithmetic with masks: block pointers were removed in Triton 3.9.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton
from triton.compiler import CompiledKernel

from . import eager_plans, flash_gluon, native_launch
from .determinism import deterministic_backward
from .eager_plans import Recorded
from .triton_env import autotune_enabled, interpreter_active
from .validation import (
    MAX_HEAD_DIM,
    check_attention_inputs,
    check_varlen_inputs,
    normalize_window,
    refuse_double_backward,
)

LOG2E = 1.4426950408889634
# The kernels' copies: a @triton.jit function may only read globals that are constexpr.
_LOG2E: tl.constexpr = tl.constexpr(LOG2E)
_LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


def _fp_fusion_by_default() -> bool:
    """Whether Triton fuses a multiply and an add into one FMA where a launch does not say: its default up to 3.9
    (3.9 warns that 3.10 turns it off). Read from Triton's knobs without asking `fp_fusion_enabled`, which warns."""
    language = getattr(getattr(triton, "knobs", None), "language", None)
    if language is None or not hasattr(language, "default_fp_fusion"):
        return os.environ.get("TRITON_DEFAULT_FP_FUSION", "1") == "1"
    return bool(language.default_fp_fusion) and not getattr(language, "force_disable_fp_fusion", False)


# Where Triton does not fuse by default, the forward's scale-and-subtract is an explicit FMA (the backward's always
# is); where it does, the plain expression schedules better on Triton 3.6 (kernel_experiments.md).
_FMA_SCORES: tl.constexpr = tl.constexpr(not _fp_fusion_by_default())


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _program_start(n_bh, n_heads, HEAVIEST_LAST: tl.constexpr):
    """(tile index, flat batch*head index, batch, head) of this program.

    The grid is 1-D, one (batch, head) pair after another, its tiles in order: a 2-D grid with the pairs on y
    would refuse more than 65535 of them. Programs start in index order, so the programs running at once read the
    K/V of a few heads, which L2 holds; orders that interleave heads were slower (kernel_experiments.md). With
    HEAVIEST_LAST (causal query-tile grids, where the last query tiles see the most keys) the tile order is
    reversed, so the heaviest tiles start first and the short ones fill the tail."""
    pid = tl.program_id(0)
    n_tiles = tl.num_programs(0) // n_bh
    tile = pid % n_tiles
    bh = pid // n_tiles
    if HEAVIEST_LAST:
        tile = n_tiles - 1 - tile
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    return tile, bh, b, h


@triton.jit
def _paired_key_program(n_bh, n_k_tiles, group_heads):
    """(key-tile index, flat batch*head index, down) of a one-pass program in the paired order: the (batch, K/V
    head) pairs go in groups of `group_heads`, each group's programs key tile by key tile across its heads; even
    groups from the last key tile down (under a causal mask the lightest first) visiting their query tiles upward,
    odd groups from key tile 0 up (the heaviest first) visiting theirs downward (down = 1). With a group's
    group_heads * n_k_tiles programs about filling the SMs, an odd group's programs start as the even group's
    before it end, the lightest first, so each SM's two programs take about as long as any other's, and no head's
    heaviest tiles are left to run alone at the end (`flash_gluon.paired_heads`)."""
    pid = tl.program_id(0)
    per_group = group_heads * n_k_tiles
    group = pid // per_group
    rank = pid - group * per_group
    heads_here = tl.minimum(group_heads, n_bh - group * group_heads)
    step = rank // heads_here
    bh = group * group_heads + rank - step * heads_here
    down = group % 2
    tile = step + (1 - down) * (n_k_tiles - 1 - 2 * step)
    return tile, bh, down


@triton.jit
def _as_fp32(x):
    """A float argument as fp32. Triton types a Python float argument fp32, but Inductor's launch of a kernel it
    re-emits (torch.compile through wrap_triton) types it fp64: the scale would then promote the scores, and with
    them the loop-carried accumulators, to fp64, which Triton rejects ("Loop-carried variable acc has initial type
    fp32 but is re-assigned to fp64")."""
    return tl.cast(x, tl.float32)


@triton.jit
def _sequence_rows(first, end):
    """(first row as int64, length) of a packed sequence of a varlen batch, from CU[seq] and CU[seq + 1].

    The kernels load the offsets themselves and only under VARLEN. Inductor's mutation analysis (torch.compile
    through wrap_triton) counts a pointer handed to a helper whose result reaches a store address as written,
    but not one that only a load reads: CU passed into a helper would be taken as mutated, and for dense inputs
    (where CU is a dummy, q) functionalization would copy q back after each call, or refuse for a leaf that
    requires grad (tests/ops/inductor_writes.py checks this)."""
    start = first.to(tl.int64)
    return start, (end - first).to(tl.int32)


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
def _visible(q_idx, k_idx, streamed_idx, streamed_len, right_offset, left_offset,
             BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr):
    """Which scores of a tile count: query q_idx may see key k_idx (both broadcast to the tile's 2-D shape).

    The streamed side's index must lie inside its sequence (streamed_idx < streamed_len). The window, bottom-right
    aligned (off = Nk - Nq): with BOUND_RIGHT, k <= q + right_offset (right_offset = off + right; causal: right = 0);
    with BOUND_LEFT, k >= q + left_offset (left_offset = off - left).
    """
    visible = streamed_idx < streamed_len
    if BOUND_RIGHT:
        visible = visible & (k_idx <= q_idx + right_offset)
    if BOUND_LEFT:
        visible = visible & (k_idx >= q_idx + left_offset)
    return visible


@triton.jit
def _key_tile_range(start_m, n_k, right_offset, left_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr):
    """(lo, full_lo, full_hi, hi) for the query tile starting at start_m: key tiles in [full_lo, full_hi) are fully
    visible to every query of the tile (no mask needed); [lo, full_lo) and [full_hi, hi) straddle a window edge or
    the sequence end; keys outside [lo, hi) are seen by none of its queries and are never visited. The Gluon forward
    (gluon_kernels.py) calls it too."""
    if BOUND_RIGHT:
        hi = tl.maximum(tl.minimum(n_k, start_m + BLOCK_M + right_offset), 0)
        full_hi = tl.maximum(tl.minimum(n_k, start_m + 1 + right_offset), 0) // BLOCK_N * BLOCK_N
    else:
        hi = n_k
        full_hi = n_k // BLOCK_N * BLOCK_N
    if BOUND_LEFT:
        lo = tl.minimum(tl.maximum(start_m + left_offset, 0) // BLOCK_N * BLOCK_N, hi)
        full_lo = tl.cdiv(tl.maximum(start_m + BLOCK_M - 1 + left_offset, 0), BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    else:
        lo = 0
        full_lo = 0
    return lo, full_lo, full_hi, hi


@triton.jit
def _query_tile_range(start_n, n_q, right_offset, left_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr):
    """(lo, full_lo, full_hi, hi) for the key tile starting at start_n, the dK/dV kernels' mirror of
    `_key_tile_range`: query tiles lo, lo + BLOCK_M, ... up to hi see some of its keys; a query tile starting in
    [full_lo, full_hi) sees all of them (no mask needed), and the others straddle a window edge or the end of the
    queries. full_hi < full_lo means that no query tile sees all the keys. lo, full_lo and full_hi are multiples of
    BLOCK_M (hi need not be). The Gluon dK/dV kernel (gluon_kernels.py) calls it too."""
    if BOUND_RIGHT:
        # Queries before `lo` see none of these keys; from `full_lo` on they see all of them (right edge).
        lo = tl.maximum(start_n - right_offset, 0) // BLOCK_M * BLOCK_M
        full_lo = tl.maximum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - right_offset, 0), BLOCK_M) * BLOCK_M, lo)
    else:
        lo = 0
        full_lo = 0
    full_hi = n_q // BLOCK_M * BLOCK_M
    if BOUND_LEFT:
        # Queries from `hi` on see none of these keys; before `full_hi` they see all of them (left edge).
        hi = tl.minimum(tl.maximum(start_n + BLOCK_N - left_offset, 0), n_q)
        full_hi = tl.minimum(full_hi, tl.maximum(start_n - left_offset + 1, 0) // BLOCK_M * BLOCK_M)
        lo = tl.minimum(lo, hi)
        full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
        full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    else:
        hi = n_q
    return lo, full_lo, full_hi, hi


@triton.jit
def _one_pass_turn(m, n, n_k_tiles, stride, right_offset, down, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BOUND_RIGHT: tl.constexpr, ROTATE: tl.constexpr):
    """Key tile n's turn (0 first) among the key tiles whose dQ shares the deterministic one pass adds into query
    tile m (gluon_kernels.py says why this order): with ROTATE (full masks; program n starts at query tile
    n * stride), the ring from the key tile that starts nearest below m; otherwise from the highest key tile that
    sees m (`_query_tile_range`'s lo, inverted: the key tile of the last key that m's last row sees) down, or with
    `down` (1: the program visits its query tiles from the last down; masks without a left bound only, where every
    key tile from 0 to that highest one sees m) from key tile 0 up."""
    if ROTATE:
        first = tl.minimum(n_k_tiles - 1, m // stride)
        turn = (first - n + n_k_tiles) % n_k_tiles
    else:
        if BOUND_RIGHT:
            last = tl.minimum(n_k_tiles - 1, (m * BLOCK_M + BLOCK_M - 1 + right_offset) // BLOCK_N)
        else:
            last = n_k_tiles - 1
        turn = last - n + down * (2 * n - last)  # down: n
    return turn


@triton.jit
def _ring_last_tiles(n, n_k_tiles, n_m_tiles, stride):
    """[m_lo, m_hi): the query tiles at which key tile n takes the ring's last turn (`_one_pass_turn` with ROTATE
    gives it n_k_tiles - 1 exactly there), whose dQ sums are whole once its adds complete: with FOLD_DQ a program of
    key tile n scales and casts them into dQ (`gluon_kernels._fold_dq`), so no epilogue kernel reads the sum again.
    Tile m's first turn is key tile f = min(n_k_tiles - 1, m // stride), its last the key tile after f,
    (f + 1) % n_k_tiles: key tile n >= 1 is last where f = n - 1, key tile 0 where f = n_k_tiles - 1 (with
    n_k_tiles * stride <= n_m_tiles, as ROTATE has it)."""
    zero = (n == 0).to(tl.int32)
    m_lo = (n - 1 + zero * n_k_tiles) * stride
    m_hi = n * stride + zero * n_m_tiles
    return m_lo, m_hi


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
            visible = _visible(offs_m[:, None], cols[None, :], cols[None, :], n_k, right_offset, left_offset,
                               BOUND_RIGHT, BOUND_LEFT)
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # qk_scale > 0, so max commutes with it
            m_sub = m_new
        # One FMA per score either way (_FMA_SCORES). The explicit tl.fma read ~4% slower at D 128 on Triton 3.6,
        # with a reordered schedule, so a Triton that fuses by default gets the plain expression.
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
def _flash_fwd_kernel(
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
    qk_scale = _as_fp32(qk_scale)
    pid_m, bh, b, h = _program_start(n_bh, n_heads, HEAVIEST_LAST=BOUND_RIGHT)
    q_start, seq_q, k_start, seq_k = 0, n_q, 0, n_k  # a dense batch: all rows
    if VARLEN:  # packed sequence b: rows CU[b] to CU[b + 1]
        q_start, seq_q = _sequence_rows(tl.load(CU_Q + b), tl.load(CU_Q + b + 1))
        k_start, seq_k = _sequence_rows(tl.load(CU_K + b), tl.load(CU_K + b + 1))
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
    lo, full_lo, full_hi, hi = _key_tile_range(start_m, n_k, right_offset, left_offset, BLOCK_M, BLOCK_N,
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
    lse = tl.where(seen, m_i * _LN2 + tl.log(l_safe), float("-inf"))
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
            visible = _visible(rows[None, :], offs_n[:, None], rows[None, :], n_q, right_offset, left_offset,
                               BOUND_RIGHT, BOUND_LEFT)
            p_t = tl.where(visible, p_t, 0.0)
        dv += _dot(p_t.to(do.dtype), do, FP32_IEEE)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += _dot(ds_t.to(q.dtype), q, FP32_IEEE)
    return dk, dv


@triton.jit
def _flash_bwd_dkdv_kernel(
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
    qk_scale, softmax_scale = _as_fp32(qk_scale), _as_fp32(softmax_scale)
    pid_n, bh_kv, b, h_kv = _program_start(n_bh, n_heads // kv_group, HEAVIEST_LAST=False)
    q_start, seq_q, k_start, seq_k = 0, n_q, 0, n_k  # a dense batch: all rows
    if VARLEN:  # packed sequence b: rows CU[b] to CU[b + 1]
        q_start, seq_q = _sequence_rows(tl.load(CU_Q + b), tl.load(CU_Q + b + 1))
        k_start, seq_k = _sequence_rows(tl.load(CU_K + b), tl.load(CU_K + b + 1))
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
    lo, mid, full_end, end = _query_tile_range(start_n, n_q, right_offset, left_offset, BLOCK_M, BLOCK_N,
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
def _dq_sum_row(r):
    """`flash_gluon.dq_sum_row` in a `tl` kernel."""
    return (r & ~7) | ((r & 3) << 1) | ((r >> 2) & 1)


@triton.jit
def _one_pass_prologue_kernel(O, DO, L, LseDelta, DqAcc, Sem, stride_ob, stride_oh, stride_on, stride_od,
                              stride_dob, stride_doh, stride_don, stride_dod, n_heads, n_q, n_sum,
                              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                              ZERO_ALL: tl.constexpr):
    """Before the one-pass backward, for ROWS rows of one (batch, head): the (-L·log2 e, rowsum(dO * O)) pairs the
    dQ kernels write in the two passes (-L·log2 e = 0 for a row that sees no key, L = -inf), rows of dQ's float32
    sum zeroed, and the semaphore of this query tile (ROWS rows; the deterministic one pass's turns; the other
    ignores it) zeroed. L and LseDelta are dense over (B, H, Nq), DqAcc over (B, H, n_sum) in
    `flash_gluon.dq_sum_row`'s order; O and dO have any strides.
    With ZERO_ALL (the unordered one pass, whose adds come in no fixed order) every row of the sum is zeroed.
    Without it (the deterministic one pass) only the rows that see no key, which the forward's L marks (L = -inf
    exactly there): the first program at each query tile stores its share instead of adding it, and a tile that
    no program visits has no row that sees a key (a program visits every tile with a pair it sees, or its dK and dV
    would miss them). That saves writing the whole sum once, 4 bytes per element (128 MB at 16k tokens, 16 heads,
    D 128)."""
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
    tl.store(LseDelta + flat * 2, tl.where(sees_no_key, 0.0, lse * -_LOG2E), mask=ok)
    tl.store(LseDelta + flat * 2 + 1, tl.sum(o * do, axis=1), mask=ok)
    zero = ok if ZERO_ALL else ok & sees_no_key
    in_sum = bh * n_sum + _dq_sum_row(rows)
    tl.store(DqAcc + in_sum[:, None] * HEAD_DIM + cols[None, :], tl.zeros([ROWS, BLOCK_D], tl.float32),
             mask=zero[:, None] & (cols[None, :] < HEAD_DIM))
    tl.store(Sem + bh * tl.num_programs(0) + tl.program_id(0), 0)


@triton.jit
def _one_pass_epilogue_kernel(DqAcc, DQ, n_rows, n_q, n_sum, softmax_scale, HEAD_DIM: tl.constexpr,
                              BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """After the one-pass backward: dQ = its float32 sum * softmax_scale, in dQ's dtype. DQ is dense over n_rows =
    B * H * Nq rows; DqAcc over (B * H, n_sum) rows in `flash_gluon.dq_sum_row`'s order."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    ok = (rows[:, None] < n_rows) & (cols[None, :] < HEAD_DIM)
    bh = rows // n_q
    in_sum = bh * n_sum + _dq_sum_row(rows - bh * n_q)
    acc = tl.load(DqAcc + in_sum[:, None] * HEAD_DIM + cols[None, :], mask=ok, other=0.0)
    tl.store(DQ + rows[:, None] * HEAD_DIM + cols[None, :], (acc * softmax_scale).to(DQ.dtype.element_ty), mask=ok)


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
            visible = _visible(offs_m[:, None], cols[None, :], cols[None, :], n_k, right_offset, left_offset,
                               BOUND_RIGHT, BOUND_LEFT)
            p = tl.where(visible, p, 0.0)
        dp = _dot(do, tl.trans(v), FP32_IEEE)
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, FP32_IEEE)
    return dq


@triton.jit
def _flash_bwd_dq_kernel(
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
    qk_scale, softmax_scale = _as_fp32(qk_scale), _as_fp32(softmax_scale)
    pid_m, bh, b, h = _program_start(n_bh, n_heads, HEAVIEST_LAST=BOUND_RIGHT)
    q_start, seq_q, k_start, seq_k = 0, n_q, 0, n_k  # a dense batch: all rows
    if VARLEN:  # packed sequence b: rows CU[b] to CU[b + 1]
        q_start, seq_q = _sequence_rows(tl.load(CU_Q + b), tl.load(CU_Q + b + 1))
        k_start, seq_k = _sequence_rows(tl.load(CU_K + b), tl.load(CU_K + b + 1))
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
    neg_lse2 = tl.where(lse == float("-inf"), 0.0, lse * -_LOG2E)  # rows that see no key: every p is masked
    o = _load_tile(O, offs_m, offs_d, stride_on, stride_od, n_q, HEAD_DIM, BLOCK_D, CHECK_ROWS=True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    pair = offs_m[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(LseDelta + pair, tl.join(neg_lse2, delta), mask=row_ok[:, None])
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = _key_tile_range(start_m, n_k, right_offset, left_offset, BLOCK_M, BLOCK_N,
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


# ----------------------------------------------------------------------------------------------------
# Autotune configs
# ----------------------------------------------------------------------------------------------------
# One autotuned handle per head-dim class, so every class only tries tiles that fit it (at D=128 the
# D=64 tiles spill registers). The key adds the sequence-length bucket and the window bounds; Triton adds
# the tensors' dtypes to the key by itself. Under the interpreter (or FLASHSYS_TRITON_AUTOTUNE=0) each
# handle keeps only its first config, which is the best single choice we measured.
#
# Long sequences (N >= LONG_SEQ) at D <= 64 get a handle of their own with only the large tiles that won
# there in every sweep: with all candidates, timing noise (about 5% between runs) let the autotuner pick
# a 64x64 forward that is 5% slower than 128x64 at N = 16384.
# (BLOCK_M, BLOCK_N, num_warps, num_stages), best first. The D = 128 lists keep the candidates that were within
# ~10% of the best at N = 16384 in scripts/probe_kernel_configs.py (kernel_experiments.md, 2026-11-24).
_FWD_TILES = {
    64: [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 3),
         (64, 64, 4, 4), (128, 32, 4, 4)],
    128: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3)],
    256: [(64, 32, 4, 2), (64, 64, 8, 2), (32, 32, 4, 2)],
}
# dK/dV kernel: BLOCK_N key rows held in registers, BLOCK_M query rows streamed.
_BWD_DKDV_TILES = {
    64: [(64, 64, 4, 4), (64, 64, 4, 3), (64, 64, 4, 5), (32, 128, 4, 3), (64, 128, 8, 3), (32, 64, 4, 3),
         (16, 128, 4, 4)],
    128: [(64, 64, 4, 2), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3)],
    256: [(32, 64, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2)],
}
# dQ kernel: BLOCK_M query rows held, BLOCK_N key rows streamed.
_BWD_DQ_TILES = {
    64: [(128, 64, 8, 4), (128, 64, 8, 3), (64, 128, 4, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4)],
    128: [(128, 64, 8, 3), (128, 64, 8, 4), (128, 32, 4, 3), (64, 64, 4, 2)],
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
_AUTOTUNE_KEY = ["N_BUCKET", "HEAD_DIM", "BOUND_RIGHT", "BOUND_LEFT", "VARLEN"]


def _configs(tiles: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    chosen = tiles if autotune_enabled() else tiles[:1]
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
    return t.stride() if t.dim() == 4 else (t.stride(0), 0, t.stride(1), t.stride(2))


class _LaunchPlan(NamedTuple):
    """How to build a kernel's runtime arguments from the tensors and scalars a launcher names."""

    slots: tuple[tuple[str, int | None], ...]  # per argument: (name, None) or (tensor name, stride axis)
    named: frozenset[str]  # the names a launcher must pass
    strided: tuple[str, ...]  # the tensors whose strides are arguments
    constexprs: tuple[str, ...]  # the compile-time parameters, in signature order (they come last)
    tensors: tuple[str, ...]  # the pointer arguments: the leading ones, named in capitals (Q, LseDelta, CU_Q)


@functools.cache
def _launch_plan(kernel) -> _LaunchPlan:
    """The plan of `kernel`'s runtime arguments, in signature order: a `stride_<tensor><b|h|n|d>` argument is
    derived from that tensor, every other one is passed by name. Constexprs and N_BUCKET (appended by
    the launcher) are left out. `.fn` is the Python function under both a JITFunction and the interpreter's
    InterpretedFunction."""
    slots, constexprs = [], []
    for p in inspect.signature(kernel.fn).parameters.values():
        if "constexpr" in str(p.annotation):
            constexprs.append(p.name)
            continue
        if constexprs:  # the fast launch appends the constexprs after the runtime arguments
            raise TypeError(f"{kernel.fn.__name__}: runtime argument {p.name} follows a constexpr")
        if p.name == "N_BUCKET":
            continue
        if p.name.startswith("stride_"):
            slots.append((p.name[len("stride_"):-1].upper(), "bhnd".index(p.name[-1])))
        else:
            slots.append((p.name, None))
    named = frozenset(name for name, axis in slots if axis is None)
    strided = tuple(dict.fromkeys(name for name, axis in slots if axis is not None))
    n_pointers = next((i for i, (name, axis) in enumerate(slots) if axis is not None or not name[0].isupper()),
                      len(slots))
    tensors = tuple(name for name, _ in slots[:n_pointers])
    return _LaunchPlan(tuple(slots), named, strided, tuple(constexprs), tensors)


def _positional(kernel, named: dict) -> tuple:
    """The runtime arguments of `kernel` in its signature's order: tensors and scalars taken from `named` by name,
    every stride derived from its tensor. Nothing is placed by position at a call site, so no stride can land
    in another's slot; the result is passed positionally, the cheapest way through Triton's launcher."""
    plan = _launch_plan(kernel)
    if named.keys() != plan.named:  # a launcher out of step with its kernel: fail here, not with wrong numbers
        raise TypeError(f"{kernel.fn.__name__}: launch arguments missing {sorted(plan.named - named.keys())}, "
                        f"unexpected {sorted(named.keys() - plan.named)}")
    strides = {name: _strides4(named[name]) for name in plan.strided}
    return tuple([named[name] if axis is None else strides[name][axis] for name, axis in plan.slots])


class _Geometry(NamedTuple):
    """What the launchers derive from q and k: grid sizes, the padded head dim and the autotune keys."""

    n_heads: int  # query heads
    n_bh: int  # batch * query heads: the query-tile grids
    kv_group: int  # query heads per K/V head (grouped-query attention; 1 otherwise)
    n_bh_kv: int  # batch * K/V heads: the key-tile grid
    n_q: int
    n_k: int
    d: int
    block_d: int  # head dim padded to a power of two (at least 16)
    head_dim_class: int  # 64 (for d <= 64), 128 or 256: which tile table, and so which autotuned handle
    fp32: bool  # fp32 inputs: exact-fp32 dots and their own small tiles
    varlen: bool  # packed sequences: n_q, n_k are the packed totals, grid_q, grid_k the longest sequences
    grid_q: int  # query rows a query-tile grid covers (n_q, or the longest packed sequence)
    grid_k: int  # key rows the key-tile grid covers
    long_seq: bool  # max(Nq, Nk) rounds up to LONG_SEQ or more: the long-sequence tiles
    bucket: int | None  # sequence-length bucket of the autotune key; None for symbolic (torch.compile) lengths
    dtype: torch.dtype


def _next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _make_geometry(batch, n_heads, kv_heads, n_q, n_k, d, dtype: torch.dtype, varlen: bool = False,
                   grid_q=None, grid_k=None) -> _Geometry:
    """Under torch.compile with dynamic shapes the lengths are SymInts: they stay symbolic (the comparisons become
    guards), and only the head dim, a constexpr, is made concrete."""
    grid_q = n_q if grid_q is None else grid_q
    grid_k = n_k if grid_k is None else grid_k
    d = int(d)
    block_d = max(16, _next_power_of_2(d))
    half = LONG_SEQ // 2  # next_power_of_2(n) >= LONG_SEQ exactly when n > LONG_SEQ / 2
    long_seq = bool(grid_q > half or grid_k > half)
    concrete = type(grid_q) is int and type(grid_k) is int
    bucket = min(_next_power_of_2(max(grid_q, grid_k)), 1 << 16) if concrete else None
    return _Geometry(n_heads=n_heads, n_bh=batch * n_heads, kv_group=n_heads // kv_heads, n_bh_kv=batch * kv_heads,
                     n_q=n_q, n_k=n_k, d=d, block_d=block_d, head_dim_class=64 if block_d <= 64 else block_d,
                     fp32=dtype == torch.float32, varlen=varlen, grid_q=grid_q, grid_k=grid_k, long_seq=long_seq,
                     bucket=bucket, dtype=dtype)


def _geometry_of(q_shape, k_shape, dtype: torch.dtype) -> _Geometry:
    """The geometry of dense (B, N, D) or (B, H, N, D) q, k shapes."""
    rank4 = len(q_shape) == 4
    return _make_geometry(q_shape[0], q_shape[1] if rank4 else 1, k_shape[1] if rank4 else 1, q_shape[-2],
                          k_shape[-2], q_shape[-1], dtype)


# Eager calls look the geometry up by shape: computing it costs more host time than a short kernel's launch.
_cached_geometry = functools.lru_cache(maxsize=4096)(_geometry_of)


class LaunchKey(NamedTuple):
    """Everything the autotuner's own key depends on (Triton adds the dtype to N_BUCKET, HEAD_DIM and the bounds)."""

    kernel: str  # "fwd", "dq" or "dkdv"
    head_dim_class: int
    fp32: bool
    bucket: int
    head_dim: int
    bound_right: bool  # causal, or a right window bound
    bound_left: bool  # a left window bound (sliding window)
    varlen: bool
    dtype: torch.dtype


# After the autotuner has chosen a config for a key, later calls launch the JIT kernel with it directly:
# Triton's Autotuner.run rebuilds its key from every argument on each call, which costs more host time per
# launch than a short kernel takes (kernel_experiments.md). This reads two attributes of Triton's Autotuner
# that are not documented API: `.fn` (the JITFunction it wraps) and `.best_config` (set by its run); a Triton
# that renames them fails on the first launch, loudly.
_chosen_configs: dict[LaunchKey, dict] = {}


def chosen_configs() -> dict[LaunchKey, dict]:
    """{LaunchKey: launch config (BLOCK_M, BLOCK_N, num_warps, num_stages)} chosen so far."""
    return dict(_chosen_configs)


class _Launch(NamedTuple):
    """One launch, prepared: the autotuned handle, its runtime arguments (N_BUCKET last), constexprs, key."""

    handle: object
    args: tuple
    constexprs: dict
    key: LaunchKey | None  # None for symbolic lengths (no bucket)


def _prepare(kernel: str, handles: dict, g: _Geometry, window: tuple[int, int], named: dict) -> _Launch:
    handle = handles.get((g.head_dim_class, g.fp32, g.long_seq)) or handles[(g.head_dim_class, g.fp32, False)]
    # N_BUCKET is only the autotuner's key; a symbolic length stands in for it under dynamic shapes.
    args = (*_positional(handle.fn, named), g.bucket if g.bucket is not None else g.grid_q)
    bound_left, bound_right = window[0] >= 0, window[1] >= 0
    constexprs = dict(HEAD_DIM=g.d, BLOCK_D=g.block_d, BOUND_RIGHT=bound_right, BOUND_LEFT=bound_left,
                      VARLEN=g.varlen, FP32_IEEE=g.fp32)
    key = None if g.bucket is None else LaunchKey(kernel, g.head_dim_class, g.fp32, g.bucket, g.d, bound_right,
                                                  bound_left, g.varlen, g.dtype)
    return _Launch(handle, args, constexprs, key)


# Compiled kernels by their exact launch signature, so that repeated calls skip Triton's JITFunction.run:
# it re-binds and re-specialises every argument on each launch (about 60 µs of host time for ~35 arguments,
# more than a short kernel runs). Triton specialises a kernel on its constexprs, its tensors' dtypes and
# 16-byte alignment, and its integers' values (== 1, divisible by 16, 32 or 64 bits): the signature below
# holds all of those, so a hit is the kernel JITFunction.run would pick. `CompiledKernel[grid](*args)` is
# Triton's own launch of a compiled kernel (all parameters in signature order, constexprs included).
_fast_launches: dict[tuple, tuple] = {}
_FAST_LAUNCHES_MAX = 4096


def _launch_signature(prepared: _Launch, device_index: int, grid_xyz: tuple[int, int, int]) -> tuple:
    # The grid is part of it: the arguments do not fix it (the batch size, or a varlen batch's longest sequence,
    # is no kernel argument), and a cached launch replays its grid.
    return (prepared.key, device_index, grid_xyz,
            *[a.data_ptr() % 16 == 0 if isinstance(a, Tensor) else a for a in prepared.args])


def _launch_eager(kernel: str, handles: dict, g: _Geometry, window: tuple[int, int], grid, named: dict
                  ) -> Recorded | None:
    """Launch one of the three kernels on real tensors: through Triton's autotuner on the first call of a key,
    then the JIT kernel with the chosen config, then (same signature) the compiled kernel directly. Returns the
    launch as eager_plans records it, or None where the autotuner ran it."""
    prepared = _prepare(kernel, handles, g, window, named)
    handle, args, constexprs, key = prepared
    meta = _chosen_configs.get(key)
    if meta is None:
        handle[grid](*args, **constexprs)
        best = handle.best_config
        _chosen_configs[key] = {**best.kwargs, "num_warps": best.num_warps, "num_stages": best.num_stages}
        return None
    device = named["Q"].device
    grid_xyz = (*grid(meta), 1, 1)[:3]  # a compiled kernel's launcher takes all three grid dims
    signature = _launch_signature(prepared, device.index, grid_xyz) if device.type == "cuda" else None
    fast = _fast_launches.get(signature)
    if fast is not None:
        fast[0](*args, *fast[1])
    else:
        compiled = handle.fn[grid_xyz](*args, **constexprs, **meta)
        fast = _fast_launch(handle.fn, compiled, grid_xyz, args, {**constexprs, **meta})
        if fast is None:
            return None
        if signature is not None:
            if len(_fast_launches) >= _FAST_LAUNCHES_MAX:
                _fast_launches.clear()
            _fast_launches[signature] = fast
    n_tensors = len(_launch_plan(handle.fn).tensors)
    return Recorded(fast[0], args[:n_tensors], (*args[n_tensors:], *fast[1]), fast[2], grid_xyz)


def _fast_launch(fn, compiled, grid_xyz: tuple[int, int, int], args: tuple, constexprs: dict) -> tuple | None:
    """(launcher of `compiled` for the grid, the constexpr values in signature order, the compiled kernel or None),
    or None. On a GPU the launcher is Triton's own launch of a compiled kernel; under the interpreter (CPU
    tensors), which compiles nothing, it interprets the kernel again."""
    n_tensors = len(_launch_plan(fn).tensors)
    if not all(isinstance(a, Tensor) for a in args[:n_tensors]) or any(isinstance(a, Tensor) for a in args[n_tensors:]):
        raise TypeError(f"{fn.fn.__name__}: its pointer arguments must come first, before the strides")
    trailing = tuple(constexprs[name] for name in _launch_plan(fn).constexprs)
    if isinstance(compiled, CompiledKernel):
        return compiled[grid_xyz], trailing, compiled
    if args[0].device.type == "cpu":
        return functools.partial(_interpreted_launch, fn, grid_xyz), trailing, None
    return None


def _interpreted_launch(fn, grid_xyz: tuple[int, int, int], *args, stream=None) -> None:
    fn[grid_xyz](*args)


def _launch_traced(kernel: str, handles: dict, g: _Geometry, window: tuple[int, int], grid, named: dict) -> None:
    """Launch inside a torch.library.triton_op: under torch.compile, Inductor sees the kernel through
    `wrap_triton` and emits the launch itself (no Python at run time; CUDA graphs capture it).

    Where eager calls have already chosen a config for this key, the compiled graph uses that config, so
    compiled and eager results are equal bit for bit; otherwise Inductor autotunes over the same candidates."""
    handle, args, constexprs, key = _prepare(kernel, handles, g, window, named)
    meta = _chosen_configs.get(key) if key is not None else None
    if meta is None:
        wrap_triton(handle)[grid](*args, **constexprs)
    else:
        wrap_triton(handle.fn)[grid(meta)](*args, **constexprs, **meta)


def _sizes(g: _Geometry, window: tuple[int, int]) -> dict:
    """The size and window arguments every kernel takes."""
    return dict(n_heads=g.n_heads, kv_group=g.kv_group, n_q=g.n_q, n_k=g.n_k, window_left=window[0],
                window_right=window[1])


def _tile_grid(n: int, block: str, n_bh: int):
    """The 1-D grid of a kernel with one program per `block`-sized tile of n rows, per (batch, head); the kernel
    takes n_bh to split its index (`_program_start`)."""
    return lambda meta: (triton.cdiv(n, meta[block]) * n_bh,)


def flash_forward_triton(
    q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int], scale: float, traced: bool = False
) -> tuple[Tensor, Tensor]:
    """Launch the forward kernel. Returns (O like q, L float32 of shape q.shape[:-1]).

    `window` is (left, right), -1 unbounded (causal: (-1, 0)); k, v may have fewer heads than q (grouped-query).
    `traced=True` inside the triton_op (torch.compile); eager calls use the cached fast launch."""
    o, lse, _ = _planned_forward(q, k, v, window, scale, traced)
    return o, lse


def _planned_forward(q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int], scale: float, traced: bool = False
                     ) -> tuple[Tensor, Tensor, eager_plans.ForwardPlan | None]:
    """flash_forward_triton, and the plan that replays it (None until compiled kernels ran it, and when traced).
    Where the Gluon forward takes the call (Hopper, flash_gluon.takes) it runs instead; its plan replays it."""
    o = torch.empty_like(q, memory_format=torch.contiguous_format)  # empty_like: the cheapest allocation call
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    if not traced and flash_gluon.takes(q, k, v, window) and (
            launched := flash_gluon.forward(q, k, v, o, lse, window, scale)).ran:
        recorded = [launched.recorded]
    else:
        g = _geometry_of(q.shape, k.shape, q.dtype) if traced else _cached_geometry(q.shape, k.shape, q.dtype)
        recorded = _launch_forward(g, q, k, v, o, lse, q, k, window, scale, traced)
    replays = None if traced else eager_plans.replays(recorded, (q, k, v, o, lse))
    plan = None if replays is None else eager_plans.ForwardPlan(window, scale, tuple(lse.shape), replays)
    return o, lse, plan


def forward_arguments(g: _Geometry, q, k, v, o, lse, cu_q, cu_k, window, scale) -> dict:
    """The forward kernel's runtime arguments by name (strides excepted): cu_q, cu_k are the varlen offsets,
    or any tensors (q, k) for a dense batch, whose kernels never read them."""
    return dict(Q=q, K=k, V=v, O=o, L=lse, CU_Q=cu_q, CU_K=cu_k, n_bh=g.n_bh, **_sizes(g, window),
                qk_scale=scale * LOG2E)


def _launch_forward(g: _Geometry, q, k, v, o, lse, cu_q, cu_k, window, scale, traced) -> list[Recorded | None]:
    launch = _launch_traced if traced else _launch_eager
    return [launch("fwd", _fwd_kernels, g, window, _tile_grid(g.grid_q, "BLOCK_M", g.n_bh),
                   forward_arguments(g, q, k, v, o, lse, cu_q, cu_k, window, scale))]


def flash_backward_triton(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window: tuple[int, int], scale: float,
    traced: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Launch the dQ kernel (which also writes the (-L*log2e, D) pairs), then the dK/dV kernel.

    dO may have any strides, stride 0 included.
    """
    dq, dk, dv, _ = _planned_backward(q, k, v, o, lse, _dense_do(do, q.dtype), window, scale, traced)
    return dq, dk, dv


def _planned_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window: tuple[int, int],
                      scale: float, traced: bool = False
                      ) -> tuple[Tensor, Tensor, Tensor, eager_plans.BackwardPlan | None]:
    """flash_backward_triton for a dense dO, and the plan that replays it (as `_planned_forward`). Where the Gluon
    backward kernels take the call (Hopper, flash_gluon.takes_backward), each runs where it is the choice, and
    the one pass where it is."""
    g = _geometry_of(q.shape, k.shape, q.dtype) if traced else _cached_geometry(q.shape, k.shape, q.dtype)
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    lse_delta = torch.empty((*q.shape[:-1], 2), dtype=torch.float32, device=q.device)
    gluon = not traced and flash_gluon.takes_backward(q, k, v, o, do, window)
    recorded, scratch = _launch_backward(g, q, k, v, o, lse, do, dq, dk, dv, lse_delta, q, k, window, scale, traced,
                                         gluon)
    replays = None if traced else eager_plans.replays(recorded, (q, k, v, o, lse, do, dq, dk, dv, lse_delta,
                                                                 *scratch))
    plan = None if replays is None else eager_plans.BackwardPlan(
        tuple(lse_delta.shape), replays, tuple((tuple(t.shape), t.dtype) for t in scratch))
    return dq, dk, dv, plan


def _dense_do(do: Tensor, dtype: torch.dtype) -> Tensor:
    if do.dtype != dtype:
        do = do.to(dtype)
    if do.stride(-1) != 1:
        # `o.sum().backward()` hands over a stride-0 dO. The kernels read it correctly, but with scalar
        # instead of vector loads; one dense copy costs far less than that.
        do = do.contiguous()
    return do


def backward_arguments(g: _Geometry, q, k, v, o, lse, do, dq, dk, dv, lse_delta, cu_q, cu_k, window, scale
                       ) -> tuple[dict, dict]:
    """The dQ kernel's and the dK/dV kernel's runtime arguments by name (strides excepted); cu_q, cu_k as in
    `forward_arguments`."""
    shared = dict(Q=q, K=k, V=v, DO=do, LseDelta=lse_delta, CU_Q=cu_q, CU_K=cu_k, **_sizes(g, window),
                  qk_scale=scale * LOG2E, softmax_scale=scale)
    return dict(shared, L=lse, DQ=dq, O=o, n_bh=g.n_bh), dict(shared, DK=dk, DV=dv, n_bh=g.n_bh_kv)


class _BackwardLaunches(NamedTuple):
    """A backward's launches as eager_plans records them, and the scratch tensors they use beyond the call's
    gradients and (L, D) pairs (the one pass's dQ sum and semaphores), which a replay allocates anew."""

    recorded: list[Recorded | None]
    scratch: tuple[Tensor, ...] = ()


def _launch_backward(g: _Geometry, q, k, v, o, lse, do, dq, dk, dv, lse_delta, cu_q, cu_k, window, scale,
                     traced, gluon: bool = False) -> _BackwardLaunches:
    dq_named, dkdv_named = backward_arguments(g, q, k, v, o, lse, do, dq, dk, dv, lse_delta, cu_q, cu_k, window,
                                              scale)
    launch = _launch_traced if traced else _launch_eager

    def launch_dq():
        return launch("dq", _bwd_dq_kernels, g, window, _tile_grid(g.grid_q, "BLOCK_M", g.n_bh), dq_named)

    def two_passes() -> _BackwardLaunches:
        # dQ first: it writes the (-L*log2e, D) pairs that the dK/dV kernel reads.
        if gluon and (launched := flash_gluon.backward_dq(q, k, v, do, o, dq, lse, lse_delta, window, scale,
                                                          launch_dq)).ran:
            dq_launch = launched.recorded
        else:
            dq_launch = launch_dq()
        if gluon and (launched := flash_gluon.backward_dkdv(q, k, v, do, lse_delta, dk, dv, window, scale)).ran:
            return _BackwardLaunches([dq_launch, launched.recorded])
        # One dK/dV program per key tile and K/V head: it sums the query heads of its group itself.
        dkdv_launch = launch("dkdv", _bwd_dkdv_kernels, g, window, _tile_grid(g.grid_k, "BLOCK_N", g.n_bh_kv),
                             dkdv_named)
        return _BackwardLaunches([dq_launch, dkdv_launch])

    if gluon:
        # The plan of this call records which kind ran. No plan of the unordered one pass replays where determinism
        # is asked for: changing flashsys's switch drops every plan, and the plans key on torch's
        # (`_planned_eager_backward`).
        one_pass = flash_gluon.choose_one_pass(
            q, k, window, lambda variant: _one_pass_backward(variant, q, k, v, o, lse, do, dq, dk, dv, lse_delta,
                                                             window, scale), two_passes, deterministic_backward())
        if one_pass is not None:
            return _one_pass_backward(one_pass, q, k, v, o, lse, do, dq, dk, dv, lse_delta, window, scale)
    return two_passes()


def _one_pass_backward(variant: flash_gluon.Variant, q, k, v, o, lse, do, dq, dk, dv, lse_delta, window, scale
                       ) -> _BackwardLaunches:
    """The one-pass backward on rank-3/4 tensors (Hopper, `flash_gluon.choose_one_pass`): the prologue kernel
    writes the (L, D) pairs and zeroes the semaphores and dQ's float32 sum (rows in `flash_gluon.dq_sum_row`'s
    order, padded to `dq_sum_rows`; the deterministic kind: only the rows that see no key, as its first share at each
    tile is stored), the Gluon kernel adds into the sum, the epilogue scales and casts it into dq (or, where
    `flash_gluon.folds_dq`, the kernel itself: no epilogue). Rank-3 tensors
    go to the `tl` kernels as they are (`_strides4`)."""
    q4 = flash_gluon._rank4(q)
    batch, n_heads, n_q, d = q4.shape
    dq_acc = torch.empty(flash_gluon.dq_sum_shape(q4), dtype=torch.float32, device=q.device)
    n_sum = dq_acc.shape[2]
    n_tiles = triton.cdiv(n_q, variant.block_m)  # one prologue program per query tile: it zeroes its semaphore
    semaphores = torch.empty(batch * n_heads * n_tiles, dtype=torch.int32, device=q.device)
    block_d = triton.next_power_of_2(d)
    prologue = _launch_helper(_one_pass_prologue_kernel, (n_tiles, batch * n_heads, 1),
                              dict(O=o, DO=do, L=lse, LseDelta=lse_delta, DqAcc=dq_acc, Sem=semaphores,
                                   n_heads=n_heads, n_q=n_q, n_sum=n_sum),
                              dict(HEAD_DIM=d, BLOCK_D=block_d, ROWS=variant.block_m,
                                   ZERO_ALL=variant.kind != "one_pass_det"))
    launched = flash_gluon.backward_one_pass(variant, q, k, v, do, dk, dv, dq_acc, lse_delta, semaphores, dq,
                                             window, scale)
    if flash_gluon.folds_dq(variant, q4, flash_gluon._rank4(k), window):
        return _BackwardLaunches([prologue, launched.recorded], (dq_acc, semaphores))
    n_rows = batch * n_heads * n_q
    epilogue = _launch_helper(_one_pass_epilogue_kernel, (triton.cdiv(n_rows, 64), 1, 1),
                              dict(DqAcc=dq_acc, DQ=dq, n_rows=n_rows, n_q=n_q, n_sum=n_sum, softmax_scale=scale),
                              dict(HEAD_DIM=d, BLOCK_D=block_d, ROWS=64))
    return _BackwardLaunches([prologue, launched.recorded, epilogue], (dq_acc, semaphores))


def _launch_helper(kernel, grid_xyz: tuple[int, int, int], named: dict, constexprs: dict) -> Recorded | None:
    """Launch one of the one pass's `tl` helper kernels (no autotuning) and return the launch as eager_plans
    records it, or None where it cannot be replayed (inside a CUDA graph capture)."""
    args = _positional(kernel, named)
    compiled = kernel[grid_xyz](*args, **constexprs)
    if args[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    fast = _fast_launch(kernel, compiled, grid_xyz, args, constexprs)
    if fast is None:
        return None
    n_tensors = len(_launch_plan(kernel).tensors)
    return Recorded(fast[0], args[:n_tensors], (*args[n_tensors:], *fast[1]), fast[2], grid_xyz)


def _packed_view(t: Tensor, n_seqs: int) -> Tensor:
    """A packed (total, H, D) tensor as the kernels' (sequences, H, total, D), batch stride 0: each sequence's
    program finds its rows through cu_seqlens, so every 'batch entry' is the same packed tensor."""
    return t.transpose(0, 1).unsqueeze(0).expand(n_seqs, -1, -1, -1)


def _varlen_geometry(q: Tensor, k: Tensor, cu_q: Tensor, max_q: int, max_k: int) -> _Geometry:
    return _make_geometry(cu_q.numel() - 1, q.shape[1], k.shape[1], q.shape[0], k.shape[0], q.shape[-1], q.dtype,
                          varlen=True, grid_q=max_q, grid_k=max_k)


def flash_varlen_forward_triton(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, window: tuple[int, int],
    scale: float,
) -> tuple[Tensor, Tensor]:
    """Packed sequences: q (total_q, Hq, D), k, v (total_k, Hkv, D). Returns (O like q, L float32 (Hq, total_q))."""
    g = _varlen_geometry(q, k, cu_q, max_q, max_k)
    n = cu_q.numel() - 1
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    views = [_packed_view(t, n) for t in (q, k, v, o)]
    _launch_forward(g, *views, lse, cu_q, cu_k, window, scale, traced=False)
    return o, lse


def flash_varlen_backward_triton(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int,
    max_k: int, window: tuple[int, int], scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """The packed twin of `flash_backward_triton`; lse is (Hq, total_q) as the varlen forward wrote it."""
    g = _varlen_geometry(q, k, cu_q, max_q, max_k)
    n = cu_q.numel() - 1
    do = _dense_do(do, q.dtype)
    dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
    lse_delta = torch.empty((q.shape[1], q.shape[0], 2), dtype=torch.float32, device=q.device)
    views = [_packed_view(t, n) for t in (q, k, v, o)]
    grads = [_packed_view(t, n) for t in (dq, dk, dv)]
    _launch_backward(g, *views, lse, _packed_view(do, n), *grads, lse_delta, cu_q, cu_k, window, scale, traced=False)
    return dq, dk, dv


def _check_device(q: Tensor, op: str) -> None:
    if q.device.type == "cuda":
        return
    if q.device.type == "cpu" and interpreter_active():
        return
    raise ValueError(
        f"{op}: inputs are on {q.device}, but the Triton kernels need CUDA tensors "
        "(or CPU tensors with TRITON_INTERPRET=1 set before flashsys is imported); "
        "use FlashAttention2Torch or flash_attention(..., backend='torch') on this device"
    )


def _interpreter_upcast(*tensors: Tensor) -> tuple[Tensor, ...]:
    # Triton's interpreter computes bf16 arithmetic wrongly (it has no bf16 support): run those in fp32.
    # Only CPU tensors can be interpreted, so CUDA calls skip the environment lookup.
    if tensors[0].device.type != "cpu" or not interpreter_active():
        return tensors
    return tuple(t.float() if t.dtype == torch.bfloat16 else t for t in tensors)


def _same_dtype(outputs: tuple[Tensor, ...], like: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(o if o.dtype == x.dtype else o.to(x.dtype) for o, x in zip(outputs, like))


def _forward(q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int], softmax_scale: float,
             traced: bool = False) -> tuple[Tensor, Tensor]:
    o, lse = flash_forward_triton(*_interpreter_upcast(q, k, v), window, softmax_scale, traced=traced)
    return _same_dtype((o,), (q,))[0], lse


def _backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window: tuple[int, int],
              softmax_scale: float, traced: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    up_q, up_k, up_v, up_o, up_do = _interpreter_upcast(q, k, v, o, do)
    grads = flash_backward_triton(up_q, up_k, up_v, up_o, lse, up_do, window, softmax_scale, traced=traced)
    return _same_dtype(grads, (q, k, v))


# Under torch.compile the kernels run through these ops. A `triton_op` body is traced, not hidden: each
# `wrap_triton` launch becomes a node that Inductor compiles and launches from its generated code, with the
# kernel's source (and the @triton.jit helpers it calls) re-emitted. Triton's CPU interpreter has no compiled
# kernel to hand over, so interpreted (CPU) calls go through opaque ops instead. Eager calls skip the op
# dispatch (it costs host time per call, kernel_experiments.md "Host-side choices") and launch directly.


@triton_op("flashsys::flash_attention_forward", mutates_args=())
def flash_attention_forward_op(q: Tensor, k: Tensor, v: Tensor, window_left: int, window_right: int,
                               softmax_scale: float) -> tuple[Tensor, Tensor]:
    return _forward(q, k, v, (window_left, window_right), softmax_scale, traced=True)


@triton_op("flashsys::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window_left: int, window_right: int,
    softmax_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return _backward(q, k, v, o, lse, do, (window_left, window_right), softmax_scale, traced=True)


# On Hopper the compiled graph's forward is the Gluon kernel where it takes the inputs. Inductor cannot re-emit a
# Gluon kernel as it does a `tl` one, so it runs through an opaque op; its body checks what a traced call
# cannot (the tensors' addresses) and runs the `tl` forward where the Gluon one does not take the call.
# The graph calls an opaque op with one signature every step, so its body replays a plan as a repeated eager call
# does (eager_plans): the full path's checks, TMA descriptors and Triton's dispatch cost 150-290 µs a Gluon launch.


def _opaque_forward(q: Tensor, k: Tensor, v: Tensor, window_left: int, window_right: int, softmax_scale: float
                    ) -> tuple[Tensor, Tensor]:
    """An opaque forward op's body (its schema's arguments): replay this signature's plan, or take the full path and
    make one."""
    window, scale = (window_left, window_right), softmax_scale
    key = eager_plans.signature_key(window, scale, q, k, v) if _plannable(q) else None
    plan = eager_plans.op_forward_plans.get(key)
    if plan is not None and eager_plans.on_current_device(q):
        return plan.launch(q, k, v)
    with _on_current_device(q):
        if key is None:
            return _forward(q, k, v, window, scale)
        o, lse, plan = _planned_forward(q, k, v, window, scale)
    eager_plans.op_forward_plans.remember(key, plan)
    return o, lse


def _opaque_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, window_left: int,
                     window_right: int, softmax_scale: float) -> tuple[Tensor, Tensor, Tensor]:
    """An opaque backward op's body (its schema's arguments): replay this signature's plan (the eager backward's
    table), or make one."""
    window, scale = (window_left, window_right), softmax_scale
    grads = _planned_eager_backward(q, k, v, o, lse, _dense_do(do, q.dtype), window, scale) if _plannable(q) else None
    if grads is not None:
        return grads
    with _on_current_device(q):
        return _backward(q, k, v, o, lse, do, window, scale)


# The four opaque ops are defined on a torch.library.Library rather than by torch.library.custom_op: a custom_op's
# call passes through a Python autograd kernel and wrappers before its body, which cost a compiled graph 28-61 µs a
# call on an H100's host (benchmarks/results/host_cost/opaque_ops_library_h100.md). The ops are called inside the
# autograd.Function's forward and backward and never differentiated, so they need no autograd kernel.
# CompositeExplicitAutograd serves CPU and CUDA alike; the fake kernels give torch.compile the output shapes.
_OPAQUE_OPS = torch.library.Library("flashsys", "FRAGMENT")
_FORWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, int window_left, int window_right, float softmax_scale) "
                   "-> (Tensor, Tensor)")
_BACKWARD_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, int window_left, "
                    "int window_right, float softmax_scale) -> (Tensor, Tensor, Tensor)")


def _forward_fake(q, k, v, window_left, window_right, softmax_scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _backward_fake(q, k, v, o, lse, do, window_left, window_right, softmax_scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _define_opaque_op(name: str, schema: str, body, fake):
    """Define flashsys::`name` with this body (CPU and CUDA) and fake kernel; return its OpOverload."""
    _OPAQUE_OPS.define(name + schema)
    _OPAQUE_OPS.impl(name, body, "CompositeExplicitAutograd")
    torch.library.register_fake(f"flashsys::{name}", fake, lib=_OPAQUE_OPS)
    return getattr(torch.ops.flashsys, name).default


_gluon_forward_op = _define_opaque_op("flash_attention_forward_gluon", _FORWARD_SCHEMA, _opaque_forward,
                                      _forward_fake)
_interpreted_forward_op = _define_opaque_op("flash_attention_forward_interpreted", _FORWARD_SCHEMA, _opaque_forward,
                                            _forward_fake)
_gluon_backward_op = _define_opaque_op("flash_attention_backward_gluon", _BACKWARD_SCHEMA, _opaque_backward,
                                       _backward_fake)
_interpreted_backward_op = _define_opaque_op("flash_attention_backward_interpreted", _BACKWARD_SCHEMA,
                                             _opaque_backward, _backward_fake)


def _traced_forward(q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int]):
    """The op a traced (torch.compile) forward call runs."""
    if q.device.type != "cuda":
        return _interpreted_forward_op
    return _gluon_forward_op if flash_gluon.problem(q, k, v, window) is None else flash_attention_forward_op


def _traced_backward(q: Tensor, k: Tensor, v: Tensor, window: tuple[int, int]):
    """The op a traced backward runs: as `_traced_forward`, for the Gluon backward kernels (the Gluon op's body checks
    O, dO and the addresses, and runs the `tl` kernels where they fail)."""
    if q.device.type != "cuda":
        return _interpreted_backward_op
    return _gluon_backward_op if flash_gluon.backward_problem(q, k, v, window) is None else flash_attention_backward_op


def _eager(*tensors: Tensor) -> bool:
    """True for plain tensors outside torch.compile; traced (fake, functional) tensors need the ops."""
    return not torch.compiler.is_compiling() and all(type(t) in (Tensor, torch.nn.Parameter) for t in tensors)


def _plannable(q: Tensor) -> bool:
    """Eager calls are planned (eager_plans) on CUDA, and on the CPU (interpreter) where no bf16 upcast is needed."""
    return q.device.type == "cuda" or q.dtype != torch.bfloat16


def _on_current_device(q: Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: switch to q's device when it is another one."""
    return contextlib.nullcontext() if eager_plans.on_current_device(q) else torch.cuda.device(q.device)


def _planned_eager_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
                            window: tuple[int, int], scale: float) -> tuple[Tensor, Tensor, Tensor] | None:
    """The backward of an eager forward on the planned path (with or without a plan of its own), or an opaque
    backward op's, for a dense dO: replay the backward's plan, or make one (and offer it to the native launcher);
    None where no plan applies (not eager now)."""
    key = eager_plans.signature_key(window, scale, q, k, v, o, lse, do)
    if key is None:
        return None
    # Which one pass a plan replays depends on the setting (flash_gluon.choose_one_pass). Changing our switch drops
    # every plan; torch.use_deterministic_algorithms does not, so it is in the key (native_launch's too).
    key = (torch.are_deterministic_algorithms_enabled(), *key)
    plan = eager_plans.backward_plans.get(key)
    if plan is not None and eager_plans.on_current_device(q):
        grads = plan.launch(q, k, v, o, lse, do)
    else:
        with _on_current_device(q):
            *grads, plan = _planned_backward(q, k, v, o, lse, do, window, scale)
        eager_plans.backward_plans.remember(key, plan)
    native_launch.offer_backward(plan, window, scale, q, k, v, o, lse, do)
    return tuple(grads)


def _native_backward_fallback(q, k, v, o, lse, do, window_left, window_right, scale):
    """The backward of a native forward whose backward has no native plan yet (dO is already dense)."""
    grads = _planned_eager_backward(q, k, v, o, lse, do, (window_left, window_right), scale)
    if grads is None:
        with _on_current_device(q):
            grads = _backward(q, k, v, o, lse, do, (window_left, window_right), scale)
    return grads


native_launch.set_backward_fallback(_native_backward_fallback)


class _FlashAttention2TritonFunction(torch.autograd.Function):
    """The Python path of `FlashAttention2Triton` (first calls of a signature, traced calls, and every call the
    native launcher does not take): validation, autotuning, eager plans, the ops Inductor launches."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, softmax_scale: float | None = None,
                window_size: tuple[int, int] | None = None) -> Tensor:
        """Returns O, shaped and typed like q."""
        key = eager_plans.forward_key(q, k, v, is_causal, softmax_scale, window_size)
        plan = eager_plans.forward_plans.get(key)
        if plan is not None and eager_plans.on_current_device(q):  # a repeated eager call: allocate and launch
            o, lse = plan.launch(q, k, v)
            native_launch.offer_forward(plan, q, k, v, is_causal, softmax_scale, window_size)
            ctx.save_for_backward(q, k, v, o, lse)
            ctx.window, ctx.scale, ctx.planned = plan.window, plan.scale, True
            return o
        op = "FlashAttention2Triton"
        scale = check_attention_inputs(q, k, v, is_causal, softmax_scale, op=op, max_head_dim=MAX_HEAD_DIM)
        window = normalize_window(window_size, bool(is_causal), op)
        _check_device(q, op)
        eager = _eager(q, k, v)
        planned_path = eager and _plannable(q)
        if planned_path:
            with _on_current_device(q):
                o, lse, plan = _planned_forward(q, k, v, window, scale)
            eager_plans.forward_plans.remember(key, plan)
            if plan is not None and q.device.type == "cuda":
                native_launch.start_build()  # once per process; until it is ready, plans are offered on replay
            native_launch.offer_forward(plan, q, k, v, is_causal, softmax_scale, window_size)
        elif eager:
            o, lse = _forward(q, k, v, window, scale)
        else:
            o, lse = _traced_forward(q, k, v, window)(q, k, v, *window, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        # The backward has plans of its own: it replays one even where this forward has none (the Gluon forward,
        # or a first call that autotuned), so an eager Gluon forward's backward does not take the full path.
        ctx.window, ctx.scale, ctx.planned = window, scale, planned_path
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        """(dQ, dK, dV, None, None, None) from the dQ kernel, then the dK/dV kernel; dO may have any strides."""
        refuse_double_backward("FlashAttention2Triton")
        q, k, v, o, lse = ctx.saved_tensors
        if ctx.planned:  # an eager forward on the planned path: replay a backward plan, or make one
            grads = _planned_eager_backward(q, k, v, o, lse, _dense_do(do, q.dtype), ctx.window, ctx.scale)
            if grads is not None:
                return (*grads, None, None, None)
        if _eager(q, do):
            with _on_current_device(q):
                dq, dk, dv = _backward(q, k, v, o, lse, do, ctx.window, ctx.scale)
        else:
            dq, dk, dv = _traced_backward(q, k, v, ctx.window)(q, k, v, o, lse, do, *ctx.window, ctx.scale)
        return dq, dk, dv, None, None, None


class FlashAttention2Triton(_FlashAttention2TritonFunction):
    """FlashAttention-2 with Triton forward and backward kernels (CUDA; CPU under TRITON_INTERPRET=1).

    `FlashAttention2Triton.apply(q, k, v, is_causal=False, softmax_scale=None, window_size=None)`; arguments,
    masks, grouped-query K/V and errors as in `flashsys.ops.flash_attention`, head_dim up to 256. Saves q, k, v, O
    and the float32 natural-log logsumexp L. `torch.compile(FlashAttention2Triton.apply)` works: under compile the
    kernels run through triton_ops that Inductor launches itself. Repeated eager calls of a signature run from C++
    (native_launch) once its extension is built; the first calls, and every call it cannot take, run in Python.
    """

    @classmethod
    def apply(cls, q: Tensor, k: Tensor, v: Tensor, is_causal: bool = False, softmax_scale: float | None = None,
              window_size: tuple[int, int] | None = None) -> Tensor:
        # Dynamo takes `X.apply` in traced code for autograd.Function.apply and does not run this; where it traces
        # this frame itself (torch.compile(FlashAttention2Triton.apply)) it reaches the Function's apply through
        # the base class by name (not super(), which it cannot follow here).
        if not torch.compiler.is_compiling():
            o = native_launch.forward(q, k, v, is_causal, softmax_scale, window_size)
            if o is not None:
                return o
        return _FlashAttention2TritonFunction.apply(q, k, v, is_causal, softmax_scale, window_size)


class FlashAttentionVarlenTriton(torch.autograd.Function):
    """Packed variable-length FlashAttention-2 with the Triton kernels: one program grid over every sequence's tiles
    (no padding, no per-sequence launches).

    `FlashAttentionVarlenTriton.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    is_causal=False, softmax_scale=None, window_size=None)`, as `flashsys.ops.flash_attention_varlen`. Saves q, k, v,
    O, the logsumexp L (Hq, total_q) float32 (flash-attn's varlen layout) and the two offset tensors. Eager only:
    under torch.compile, `flash_attention_varlen` runs outside the graph.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, is_causal: bool = False, softmax_scale: float | None = None,
                window_size: tuple[int, int] | None = None) -> Tensor:
        """Returns O (total_q, Hq, D), typed like q."""
        op = "FlashAttentionVarlenTriton"
        scale = check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                    softmax_scale, op=op, max_head_dim=MAX_HEAD_DIM)
        window = normalize_window(window_size, bool(is_causal), op)
        _check_device(q, op)
        lengths = (max_seqlen_q, max_seqlen_k)
        with _on_current_device(q):
            o, lse = flash_varlen_forward_triton(*_interpreter_upcast(q, k, v), cu_seqlens_q, cu_seqlens_k, *lengths,
                                                 window, scale)
        o = _same_dtype((o,), (q,))[0]
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.lengths, ctx.window, ctx.scale = lengths, window, scale
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        """Gradients for q, k, v from the dQ, then the dK/dV kernel; None for the rest."""
        refuse_double_backward("FlashAttentionVarlenTriton")
        q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
        up_q, up_k, up_v, up_o, up_do = _interpreter_upcast(q, k, v, o, do)
        with _on_current_device(q):
            grads = flash_varlen_backward_triton(up_q, up_k, up_v, up_o, lse, up_do, cu_q, cu_k, *ctx.lengths,
                                                 ctx.window, ctx.scale)
        dq, dk, dv = _same_dtype(grads, (q, k, v))
        return dq, dk, dv, None, None, None, None, None, None, None
