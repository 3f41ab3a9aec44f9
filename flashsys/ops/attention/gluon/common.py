"""Gluon helpers every Hopper attention kernel shares: the program's tiles and mask, the online softmax step,
TMA copies into rings of shared-memory buffers, and the layouts of wgmma tiles; and the first steps of a backward
tile on transposed scores, which the dK/dV kernel and the one-pass backward share.

The grid order, the tile ranges and the mask are the `tl` kernels' own (`..triton.tiles`, @triton.jit helpers that
Gluon calls as they are), so the Gluon and `tl` kernels cannot disagree about which scores a query sees.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..triton.tiles import key_tile_range, paired_key_program, program_start, visible
from ..triton_env import fp_fusion_by_default
from .compat import tma_load

# Where Triton does not fuse a multiply and an add by default (3.10's announced default), the scores' scale-and-shift
# is an explicit FMA: unfused, the forward's FP32 instructions roughly doubled (FFMA 444 -> FMUL 684 + FADD 812 in the
# D 64 ping-pong kernel). Where it fuses, the plain expression compiles as before.
_FMA_SCORES: gl.constexpr = gl.constexpr(not fp_fusion_by_default())


@gluon.jit
def scaled_scores(s, scale, shift, SUBTRACT: gl.constexpr = False):
    """s * scale + shift (s * scale - shift with SUBTRACT; shift broadcast over s), one FMA a score whatever Triton's
    default fusion."""
    if _FMA_SCORES:
        if SUBTRACT:
            shift = -shift
        return gl.fma(s, gl.full(s.shape, scale, s.dtype, s.type.layout), shift)
    if SUBTRACT:
        return s * scale - shift
    return s * scale + shift


@gluon.jit
def program_tile(n_bh, n_heads, kv_group, section, HEAVIEST_FIRST: gl.constexpr):
    """(tile index, flat batch*head index, batch, head, K/V head): the `tl` kernels' grid order in sections of
    `section` (batch, head) pairs (`tiles.program_start`), with batch and head as int32 for TMA coordinates."""
    pid_m, bh, b, h = program_start(n_bh, n_heads, section, HEAVIEST_FIRST)
    h = h.to(gl.int32)
    return pid_m, bh, b.to(gl.int32), h, h // kv_group


@gluon.jit
def paired_program_tile(n_bh, n_heads, n_k_tiles, group_heads):
    """(key-tile index, flat batch*head index, batch, head, down) of a one-pass program in the paired order
    (`tiles.paired_key_program`), with batch and head as int32 for TMA coordinates."""
    tile, bh, down = paired_key_program(n_bh, n_k_tiles, group_heads)
    return tile, bh, (bh // n_heads).to(gl.int32), (bh % n_heads).to(gl.int32), down


@gluon.jit
def query_program(n_bh, n_heads, kv_group, section, n_q, n_k, window_left, window_right, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """Where a program over one query tile (the forwards, dQ) starts: (flat batch*head, batch, head, K/V head, first
    query row, right offset, left offset, lo, full_lo, full_hi, hi); the grid runs `section` (batch, head) pairs at a
    time (`tiles.program_start`). Query i sees key j iff i + left_offset <= j <= i + right_offset; the key range is
    `key_tile_range`'s."""
    pid_m, bh, b, h, h_kv = program_tile(n_bh, n_heads, kv_group, section, BOUND_RIGHT)
    start_m = pid_m * BLOCK_M
    right_offset, left_offset, lo, full_lo, full_hi, hi = key_geometry(
        start_m, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
    return bh, b, h, h_kv, start_m, right_offset, left_offset, lo, full_lo, full_hi, hi


@gluon.jit
def key_geometry(start_m, n_q, n_k, window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """(right offset, left offset, lo, full_lo, full_hi, hi) of the query tile starting at start_m (see
    `query_program`)."""
    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = key_tile_range(start_m, n_k, right_offset, left_offset, BLOCK_M, BLOCK_N, BOUND_RIGHT,
                                               BOUND_LEFT)
    return right_offset, left_offset, lo, full_lo, full_hi, hi


@gluon.jit
def masked_scores(s, offs_m, kn, n_k, right_offset, left_offset, lo_full, hi_full, BLOCK_N: gl.constexpr,
                   BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """S of the key tile starting at kn, with the keys a query may not see at -inf; a tile inside
    [lo_full, hi_full) (from `key_tile_range`) is visible to every query and is returned as it is (a uniform
    branch)."""
    if partly_seen(kn, lo_full, hi_full):
        s = _hide_unseen(s, offs_m, kn, n_k, right_offset, left_offset, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
    return s


@gluon.jit
def partly_seen(start, full_lo, full_hi):
    """Whether the tile starting at `start` lies outside [full_lo, full_hi) (from `key_tile_range`): at a window edge
    or past the end, where some pairs of it are not seen and must be masked."""
    return (start < full_lo) | (start >= full_hi)


@gluon.jit
def _hide_unseen(s, offs_m, kn, n_k, right_offset, left_offset, BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr,
                 BOUND_LEFT: gl.constexpr):
    """S of the key tile starting at kn with every key a query may not see at -inf: key kn + fixed + lane
    (`split_columns`) tested by `visible` against query offs_m - kn - lane."""
    layout: gl.constexpr = s.type.layout
    fixed, lane = split_columns(BLOCK_N, layout)
    seen = visible(offs_m[:, None] - (kn + lane), fixed, fixed, (n_k - kn) - lane, right_offset, left_offset,
                   BOUND_RIGHT, BOUND_LEFT)
    return gl.where(seen, s, float("-inf"))


@gluon.jit
def split_columns(n: gl.constexpr, layout: gl.constexpr):
    """(fixed, lane), both (1, n) in `layout`, with fixed + lane = 0, 1, ..., n - 1: the bits of each column index
    that the thread's lane sets (`lane`, one value a thread) and those its register sets (`fixed`, a constant per
    register). A mask tests `fixed` against a bound less `lane` (one subtraction a row, an immediate a comparison)
    instead of the whole index: whole, the thread's 32 column indices are loop-invariant, so they were computed once
    and kept in 31 registers across the key loop, which spilled the three-warpgroup persistent forward at 160
    registers. The split is exact for any bit mask; only the registers depend on `_lane_column_bits`."""
    cols = gl.arange(0, n, layout=gl.SliceLayout(0, layout))
    lane = cols & _lane_column_bits(layout)
    return (cols - lane)[None, :], lane[None, :]


@gluon.constexpr_function
def _lane_column_bits(layout):
    """The bits of a column index that a thread's lane sets in a wgmma accumulator's layout (the four lanes of a
    quad hold columns 0, 2, 4, 6 of each 8: bits 1 and 2); 0 for any other layout (the whole index is then
    `fixed`)."""
    if isinstance(layout, gl.NVMMADistributedLayout) and layout.version[0] == 3:
        return 6
    return 0


@gluon.jit
def _fold_columns(x):
    """max(left half, right half) of each row of x, column by column. In a wgmma accumulator's layout a thread holds
    column c and c + width/2 of its rows alike, so this moves no data between threads."""
    ROWS: gl.constexpr = x.shape[0]
    HALF: gl.constexpr = x.shape[1] // 2
    left, right = x.reshape([ROWS, 2, HALF]).permute((0, 2, 1)).split()
    return gl.maximum(left, right)


@gluon.jit
def row_max(s):
    """gl.max(s, 1) of a wgmma accumulator, as a tree. A thread's own columns reduced one after the other make a
    chain of dependent max instructions (31 for a 128-column tile), whose latency every tile's softmax waits out
    before its first exponential; halving the columns four times makes the chain 5 deep. Max is exact, so the
    result is gl.max's bit for bit."""
    x = s
    for _ in gl.static_range(_column_folds(s.shape[1])):
        x = _fold_columns(x)
    return gl.convert_layout(gl.max(x, 1), gl.SliceLayout(1, s.type.layout))


@gluon.constexpr_function
def _column_folds(cols):
    """How many times `row_max` halves a tile's columns: down to 8, where each thread of a wgmma accumulator holds
    two columns of each of its rows (a pair of neighbours)."""
    folds = 0
    while cols > 8:
        cols //= 2
        folds += 1
    return folds


@gluon.jit
def softmax_step(s, m_i, l_i, qk_scale, P_DTYPE: gl.constexpr, P_LAYOUT: gl.constexpr, P_AS_OPERAND: gl.constexpr):
    """(P, new row max, alpha, new row sum) after one key tile, scores in log2 units after qk_scale. A row that has
    seen no key yet keeps m = -inf; its exponentials subtract 0 instead, so nothing is NaN.

    P_AS_OPERAND: P comes back as the P V product's operand (P_DTYPE, 16-bit, in P_LAYOUT), otherwise in float32
    (`pv_operand` converts it where the product is issued). The forward keeps P from one tile's softmax to its P V
    product at the next tile: a float32 P takes 64 registers a thread there (128-column tiles), the operand 32. With
    three consumer warpgroups (160 registers) float32 spilled 2 KB a thread; with two (240) converting at the issue
    was 2-3% faster at D 128. The row sum is taken in float32 either way."""
    m_new = gl.maximum(m_i, row_max(s) * qk_scale)
    m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(scaled_scores(s, qk_scale, m_sub[:, None], SUBTRACT=True))
    alpha = gl.exp2(m_i - m_sub)
    l_new = l_i * alpha + gl.sum(p, 1)
    if P_AS_OPERAND:
        p = pv_operand(p, P_DTYPE, P_LAYOUT)
    return p, m_new, alpha, l_new


@gluon.jit
def pv_operand(p, P_DTYPE: gl.constexpr, P_LAYOUT: gl.constexpr):
    """P as the P V product's register operand (P_DTYPE in P_LAYOUT); P as it is where it already is one."""
    return gl.convert_layout(p.to(P_DTYPE), P_LAYOUT)


@gluon.jit
def masked_softmax_step(s, m_i, l_i, qk_scale, P_DTYPE: gl.constexpr, P_LAYOUT: gl.constexpr,
                        P_AS_OPERAND: gl.constexpr, offs_m, kn, n_k, right_offset, left_offset, lo_full, hi_full,
                        BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """`softmax_step` of the key tile starting at kn, masked as `masked_scores` masks it. The softmax is written
    out in both arms of the mask's branch, so that it ends in a basic block of its own: the forward waits for its
    P V product after the softmax, and in the same block ptxas hoists that wait to the block's start, above the row
    max, so the softmax would overlap nothing. `tests/ops/kernel_compile.py` checks the SASS for it."""
    if partly_seen(kn, lo_full, hi_full):
        s = _hide_unseen(s, offs_m, kn, n_k, right_offset, left_offset, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
        p, m_new, alpha, l_new = softmax_step(s, m_i, l_i, qk_scale, P_DTYPE, P_LAYOUT, P_AS_OPERAND)
    else:
        p, m_new, alpha, l_new = softmax_step(s, m_i, l_i, qk_scale, P_DTYPE, P_LAYOUT, P_AS_OPERAND)
    return p, m_new, alpha, l_new


@gluon.jit
def load_tile(desc, smem, bar, batch, head, row, slot, pred):
    """A TMA copy of the tile at `row` of one head into buffer `slot`, signalling that buffer's barrier."""
    mbarrier.expect(bar.index(slot), desc.block_type.nbytes, pred=pred)
    tma_load(desc, [batch, head, row, 0], bar.index(slot), smem.index(slot), pred=pred)


@gluon.jit
def load_pair(a_desc, b_desc, a_smem, b_smem, a_bar, b_bar, batch, head, row, slot, pred):
    """TMA copies of the two tiles at `row` of one head (K and V; the backward's Q and dO) into buffer `slot`; each
    signals its own barrier."""
    load_tile(a_desc, a_smem, a_bar, batch, head, row, slot, pred)
    load_tile(b_desc, b_smem, b_bar, batch, head, row, slot, pred)


@gluon.jit
def stream_buffers(a_desc, b_desc, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, NBUF: gl.constexpr):
    """(a buffers, b buffers, a barriers, b barriers): NBUF shared-memory buffers for each of two tiles that stream
    through a kernel together (K and V; the dK/dV kernel's Q and dO), one barrier each, initialised (`load_pair`
    fills a slot)."""
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [NBUF, 1, 1, ROWS, HEAD_DIM], a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [NBUF, 1, 1, ROWS, HEAD_DIM], b_desc.layout)
    a_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    b_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBUF):
        mbarrier.init(a_bar.index(i), count=1)
        mbarrier.init(b_bar.index(i), count=1)
    return a_smem, b_smem, a_bar, b_bar


@gluon.jit
def invalidate_barriers(one_bar, a_bar, b_bar, NBUF: gl.constexpr):
    """Invalidate a kernel's barriers before their shared memory is reused: the single one of its resident tiles,
    and the two rings of `stream_buffers`."""
    mbarrier.invalidate(one_bar)
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(a_bar.index(i))
        mbarrier.invalidate(b_bar.index(i))


@builtin
def vector_in(x, layout, _semantic=None):
    """A per-row or per-column vector in `layout`: converted where `x` is in registers, read in it where `x` is a
    row of shared memory (no conversion, no barrier)."""
    if isinstance(x, gl.shared_memory_descriptor):
        return x.load(layout, _semantic=_semantic)
    return gl.convert_layout(x, layout, _semantic=_semantic)


@gluon.jit
def smem_tile(box, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A (1, 1, ROWS, D) TMA box in shared memory as the (ROWS, D) tile the tensor cores read."""
    return box.reshape([ROWS, HEAD_DIM])


@gluon.constexpr_function
def mma_layout(cols, warps=4):
    """The register layout of a (rows, cols) wgmma accumulator (S: cols = BLOCK_N; O: HEAD_DIM) of `warps` warps,
    stacked over the rows (8: two warpgroups, each with its own rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def v_free_barriers(nbuf):
    """Where a ping-pong kernel's V-slot-free barriers start in its slot-free barriers: NBUF with two slots, where K
    goes back to the producer once S has read it and V once P V has (otherwise tile t + 1 would load into tile
    t - 1's slot only after both consumers finished tile t - 1, and the first consumer would wait for it); 0 with
    three or more, where each slot goes back whole after P V (handing K back apart gained nothing there)."""
    return nbuf if nbuf == 2 else 0


@gluon.jit
def row_broadcast(x, acc):
    """A per-row vector (in S's layout) in the rows of `acc`'s layout, broadcast over its columns."""
    return gl.convert_layout(x, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def query_tile(j, n_m_tiles, lo, h_kv, kv_group, BLOCK_M: gl.constexpr):
    """(query head, first row) of the j-th query tile a dK/dV program visits: the tiles lo, lo + BLOCK_M, ... of
    each query head of its K/V head's group in turn."""
    g = j // n_m_tiles
    return h_kv * kv_group + g, lo + (j - g * n_m_tiles) * BLOCK_M


@gluon.jit
def lse_delta(LseDelta, b, n_heads, n_q, j, n_iter, n_m_tiles, lo, h_kv, kv_group, BLOCK_M: gl.constexpr, layout):
    """(-L * log2 e, D) of the j-th query tile's rows (zeros past n_q, and for j >= n_iter, which names a head past
    the group), one row per thread of `layout`: loaded where they are used (over the columns of Sᵀ that each
    thread holds), their pointers alone would take dozens of registers."""
    h, start_m = query_tile(j, n_m_tiles, lo, h_kv, kv_group, BLOCK_M)
    rows = start_m + gl.arange(0, BLOCK_M, layout=layout)
    pairs = LseDelta + (b * n_heads + h).to(gl.int64) * n_q * 2 + rows * 2
    inside = (rows < n_q) & (j < n_iter)
    return gl.load(pairs, mask=inside, other=0.0), gl.load(pairs + 1, mask=inside, other=0.0)


@gluon.jit
def transposed_probabilities(k_tile, v_tile, q_tile, do_tile, do_ready, phase, s_zero, neg_lse2, qk_scale, offs_n,
                              start_m, full_lo, full_hi, n_q, right_offset, left_offset, BLOCK_M: gl.constexpr,
                              BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """A dK/dV tile's first steps on transposed scores (keys x queries), once Q's tile is in (the caller waited for
    it): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ issued together, dPᵀ once dO's tile is in; wait for Sᵀ only;
    Pᵀ = exp2(Sᵀ·scale - L), masked where the query tile straddles a window edge or the end of the queries.
    neg_lse2 (-L * log2 e of the tile's rows) is in registers or a row of shared memory (`vector_in`).
    Returns (Pᵀ, dPᵀ's token): dPᵀ may still be on the tensor cores."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_zero.type.layout)  # a vector over Sᵀ's columns (queries)
    s_tok = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready, phase)
    dp_tok = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=[s_tok])  # dPᵀ may still run
    p = gl.exp2(scaled_scores(s, qk_scale, vector_in(neg_lse2, col_layout)[None, :]))
    if partly_seen(start_m, full_lo, full_hi):  # a query tile at a window edge or the end of the queries
        # The whole query index, not `split_columns`: split, the one pass spilled twice as much (D 128 causal
        # 108 -> 204 bytes, ptxas), its query tile's start changing every iteration.
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
        seen = visible(offs_m[None, :], offs_n[:, None], offs_m[None, :], n_q, right_offset, left_offset,
                       BOUND_RIGHT, BOUND_LEFT)
        p = gl.where(seen, p, 0.0)
    return p, dp_tok
