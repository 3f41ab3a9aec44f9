"""Tile bookkeeping shared by every attention kernel, `tl` and Gluon alike: which program runs which tile, which
key tiles a query tile visits (and the reverse), which scores of a tile are visible, and the deterministic one
pass's order of dQ adds.

These are `@triton.jit` functions over scalars and index vectors: Gluon kernels call them as they are, so the `tl`
kernels and the Gluon kernels can never disagree about a mask or a tile range.

Masks are flash-attn's, bottom-right aligned: query i sees key j iff i + left_offset <= j <= i + right_offset, with
right_offset = Nk - Nq + right and left_offset = Nk - Nq - left; BOUND_RIGHT / BOUND_LEFT say whether each bound
exists (causal is right = 0).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# The kernels' copies: a @triton.jit function may only read globals that are constexpr.
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)
LN2_C: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def program_start(n_bh, n_heads, section, HEAVIEST_LAST: tl.constexpr):
    """(tile index, flat batch*head index, batch, head) of this program.

    The grid is 1-D: a 2-D grid with the (batch, head) pairs on y would refuse more than 65535 of them. The pairs go
    in sections of `section` (the last may be short), a section's programs tile by tile across its pairs; with
    sections of one pair, one pair after another, its tiles in order. Programs start in index order, so the programs
    running at once read the K/V of one section's heads: the host sizes a section to what L2 holds (orders that
    interleave all heads lose to L2 misses). With HEAVIEST_LAST (causal query-tile grids, where the last query tiles
    see the most keys) the tile order is reversed, so the heaviest tiles start first and the short ones fill the
    tail: across a section's heads, the grid's last programs are its lightest tiles (FlashAttention-3's and -4's
    longest-processing-time-first order), where with sections of one pair they are the last head's heaviest."""
    pid = tl.program_id(0)
    n_tiles = tl.num_programs(0) // n_bh
    first = pid // (section * n_tiles) * section  # the section's first pair
    pairs = tl.minimum(section, n_bh - first)
    within = pid - first * n_tiles
    tile = within // pairs
    bh = first + within % pairs
    if HEAVIEST_LAST:
        tile = n_tiles - 1 - tile
    b = (bh // n_heads).to(tl.int64)
    h = (bh % n_heads).to(tl.int64)
    return tile, bh, b, h


@triton.jit
def paired_key_program(n_bh, n_k_tiles, group_heads):
    """(key-tile index, flat batch*head index, down) of a one-pass program in the paired order: the (batch, K/V
    head) pairs go in groups of `group_heads`, each group's programs key tile by key tile across its heads; even
    groups from the last key tile down (under a causal mask the lightest first) visiting their query tiles upward,
    odd groups from key tile 0 up (the heaviest first) visiting theirs downward (down = 1). With a group's
    group_heads * n_k_tiles programs about filling the SMs, an odd group's programs start as the even group's
    before it end, the lightest first, so each SM's two programs take about as long as any other's, and no head's
    heaviest tiles are left to run alone at the end (`gluon.launch.paired_heads`)."""
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
def as_fp32(x):
    """A float argument as fp32. Triton types a Python float argument fp32, but Inductor's launch of a kernel it
    re-emits (torch.compile through wrap_triton) types it fp64: the scale would then promote the scores, and with
    them the loop-carried accumulators, to fp64, which Triton rejects ("Loop-carried variable acc has initial type
    fp32 but is re-assigned to fp64")."""
    return tl.cast(x, tl.float32)


@triton.jit
def sequence_rows(first, end):
    """(first row as int64, length) of a packed sequence of a varlen batch, from CU[seq] and CU[seq + 1].

    The kernels load the offsets themselves and only under VARLEN. Inductor's mutation analysis (torch.compile
    through wrap_triton) counts a pointer handed to a helper whose result reaches a store address as written,
    but not one that only a load reads: CU passed into a helper would be taken as mutated, and for dense inputs
    (where CU is a dummy, q) functionalization would copy q back after each call, or refuse for a leaf that
    requires grad (tests/ops/inductor_writes.py checks this)."""
    start = first.to(tl.int64)
    return start, (end - first).to(tl.int32)


@triton.jit
def visible(q_idx, k_idx, streamed_idx, streamed_len, right_offset, left_offset,
            BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr):
    """Which scores of a tile count: query q_idx may see key k_idx (both broadcast to the tile's 2-D shape).

    The streamed side's index must lie inside its sequence (streamed_idx < streamed_len). The window, bottom-right
    aligned (off = Nk - Nq): with BOUND_RIGHT, k <= q + right_offset (right_offset = off + right; causal: right = 0);
    with BOUND_LEFT, k >= q + left_offset (left_offset = off - left).
    """
    seen = streamed_idx < streamed_len
    if BOUND_RIGHT:
        seen = seen & (k_idx <= q_idx + right_offset)
    if BOUND_LEFT:
        seen = seen & (k_idx >= q_idx + left_offset)
    return seen


@triton.jit
def key_tile_range(start_m, n_k, right_offset, left_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr):
    """(lo, full_lo, full_hi, hi) for the query tile starting at start_m: key tiles in [full_lo, full_hi) are fully
    visible to every query of the tile (no mask needed); [lo, full_lo) and [full_hi, hi) straddle a window edge or
    the sequence end; keys outside [lo, hi) are seen by none of its queries and are never visited."""
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
def query_tile_range(start_n, n_q, right_offset, left_offset, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr):
    """(lo, full_lo, full_hi, hi) for the key tile starting at start_n, the dK/dV kernels' mirror of
    `key_tile_range`: query tiles lo, lo + BLOCK_M, ... up to hi see some of its keys; a query tile starting in
    [full_lo, full_hi) sees all of them (no mask needed), and the others straddle a window edge or the end of the
    queries. full_hi < full_lo means that no query tile sees all the keys. lo, full_lo and full_hi are multiples of
    BLOCK_M (hi need not be)."""
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
def one_pass_turn(m, n, n_k_tiles, stride, right_offset, down, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BOUND_RIGHT: tl.constexpr, ROTATE: tl.constexpr):
    """Key tile n's turn (0 first) among the key tiles whose dQ shares the deterministic one pass adds into query
    tile m (`gluon/one_pass.py` says why this order): with ROTATE (full masks; program n starts at query tile
    n * stride), the ring from the key tile that starts nearest below m; otherwise from the highest key tile that
    sees m (`query_tile_range`'s lo, inverted: the key tile of the last key that m's last row sees) down, or with
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
def ring_last_tiles(n, n_k_tiles, n_m_tiles, stride):
    """[m_lo, m_hi): the query tiles at which key tile n takes the ring's last turn (`one_pass_turn` with ROTATE
    gives it n_k_tiles - 1 exactly there), whose dQ sums are whole once its adds complete: with FOLD_DQ a program of
    key tile n scales and casts them into dQ (`gluon/one_pass.py`'s `_fold_dq`), so no epilogue kernel reads the sum
    again. Tile m's first turn is key tile f = min(n_k_tiles - 1, m // stride), its last the key tile after f,
    (f + 1) % n_k_tiles: key tile n >= 1 is last where f = n - 1, key tile 0 where f = n_k_tiles - 1 (with
    n_k_tiles * stride <= n_m_tiles, as ROTATE has it)."""
    zero = (n == 0).to(tl.int32)
    m_lo = (n - 1 + zero * n_k_tiles) * stride
    m_hi = n * stride + zero * n_m_tiles
    return m_lo, m_hi


@triton.jit
def dq_sum_row(r):
    """Where query row r lies in the one pass's float32 dQ sum (`gluon.launch.dq_sum_row`, the host's copy)."""
    return (r & ~7) | ((r & 3) << 1) | ((r >> 2) & 1)
