"""The whole attention backward in one pass for Hopper GPUs (sm_90) in Gluon: FlashAttention-3's warp-specialised
layout, five tensor-core products a tile where the two passes do seven.

A program holds one key tile in two consumer warpgroups; a producer warp streams Q, dO and their (-L·log2 e, D)
pairs; a writer warp adds each tile's dQ share into a float32 sum by TMA reduce-adds. With DETERMINISTIC the adds
into each query tile go in a fixed order (each program waits for its turn on a semaphore), without it in no fixed
order (only where the caller turned determinism off, `set_deterministic_backward(False)`); with FOLD_DQ (the
deterministic kind under full masks) it also writes dQ from the sum, where an epilogue kernel does elsewhere. The
`tl` prologue and epilogue kernels (`..triton.kernels`) run before and after it.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..triton.tiles import one_pass_turn, query_tile_range, ring_last_tiles
from .common import (
    load_pair,
    mma_layout,
    paired_program_tile,
    program_tile,
    smem_tile,
    stream_buffers,
    transposed_probabilities,
)
from .compat import (
    cp_async,
    partition_barrier,
    reinterpret_smem,
    tma_add,
    tma_load,
    tma_store,
)

# dQ's shares of one query tile come from every key tile that sees it, each program adding its own. A writer warp
# makes the adds, so that the consumers never wait on them: they hand over each tile's share in a staging box.
# Without DETERMINISTIC the adds go in whatever order the programs get there, so dQ's last bits vary from run to
# run. With it, a semaphore per (batch, query head, query tile) counts the programs whose adds are done, and each
# program's writer waits for its turn; the first turn stores its shares instead of adding them, so the prologue
# zeroes only the rows of dQ's sum that no program writes (rows that see no key). The turns follow the order in
# which the programs reach the tile, so that in the steady state the turn has come before the share is ready, and a
# program only waits for programs launched before it (CUDA starts programs in launch order), so the waits cannot
# deadlock:
# - masked (causal, windows; and full masks that ROTATE cannot take): programs visit their query tiles in order,
#   key tile n reaches tile m later than key tile n + 1 does (it starts lower), so the adds go from the highest key
#   tile down, and each head's programs launch from the last key tile down (the lightest first under a causal
#   mask). Heaviest-first orders are slower: their programs reach each tile together, so every turn waits a whole
#   hop (docs/attention-kernels.md);
# - paired (causal masks, both kinds; `tiles.paired_key_program`): groups of heads that about fill the
#   SMs; even groups as the masked order, odd groups launch from key tile 0 up and visit their query tiles from the
#   last down, so key tile n - 1 (launched before n, on an SM that freed earlier) reaches each tile ahead of n and
#   the adds go from key tile 0 up (`down`). An odd group's heavy programs start as the even group's light ones
#   end, so no head's heaviest tiles are left to run alone at the end (the lightest-first order's tail);
# - ROTATE (full masks): every key tile sees every query tile, so each program starts at a different one,
#   n * stride, and wraps around; tile m's adds go in the order the programs reach it, a ring. The ring's waits
#   are on programs launched later as well, so the host takes ROTATE only where one head's programs all fit on
#   the GPU at once (at most one per SM).
# Where a program's predecessor reaches each tile only one tile before it (a ring of stride 1; 128-row query tiles
# under a mask), the writer must count each turn before it waits for the next (PASS_LATE off): counting it after
# would make the ring wait on itself (the GPU trapped) and put a masked order's programs one hop behind another.

_WAIT_TURN_ASM: gl.constexpr = gl.constexpr("""{
.reg .pred fs_ready;
.reg .u32 fs_polls;
mov.u32 fs_polls, 0;
fs_poll:
ld.acquire.gpu.global.s32 $0, [$1];
setp.ge.s32 fs_ready, $0, $2;
@fs_ready bra fs_go;
add.u32 fs_polls, fs_polls, 1;
setp.lt.u32 fs_ready, fs_polls, 67108864;
@fs_ready bra fs_poll;
trap;
fs_go:
fence.proxy.async.global;
}""")



@gluon.constexpr_function
def _adds_complete_asm(pending):
    """cp.async.bulk.wait_group without .read: this thread's adds but the last `pending` have completed, their
    writes done in global memory (tma.store_wait only waits until they have read their shared-memory source)."""
    return f"cp.async.bulk.wait_group {pending};\nfence.proxy.async.global;\nmov.u32 $0, $1;"


@gluon.jit
def _wait_turn(semaphore, turn, layout: gl.constexpr, THREADS: gl.constexpr = 32):
    """Every thread of the partition (THREADS of them, `layout` one a thread): spin until `semaphore` counts `turn`
    programs' adds (acquiring what they wrote), then order the TMA adds that follow after them. 2^26 polls without a
    turn (tens of seconds, an L2 round trip each) trap: a launch error, where a wait that never ends would hang the
    process."""
    zeros = gl.zeros([THREADS], gl.int32, layout)
    gl.inline_asm_elementwise(_WAIT_TURN_ASM, "=&r,l,r", [semaphore + zeros, turn + zeros], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _pass_turn(semaphore, PENDING: gl.constexpr, layout: gl.constexpr):
    """Once this warp's TMA adds but the last PENDING (0, 1 or 2: a tile's) have completed, count them as this
    program's turn at `semaphore` (lane 0, with release semantics), so the next program's adds go after them."""
    lane = gl.arange(0, 32, layout=layout)
    gl.inline_asm_elementwise(_adds_complete_asm(PENDING), "=r,r", [lane], dtype=gl.int32, is_pure=False, pack=1)
    partition_barrier()  # every lane's adds (the one that issued them) complete before lane 0 counts them
    gl.atomic_add(semaphore + lane * 0, lane * 0 + 1, mask=lane == 0, sem="release", scope="gpu")


@gluon.constexpr_function
def _shares(dq_alternate):
    """dQ's staging boxes per query tile: one where a single consumer computes the tile's dQ (DQ_ALTERNATE), else one
    per consumer."""
    return 1 if dq_alternate else 2


@gluon.constexpr_function
def _dq_share_start(half, block_m, dq_rows, dq_cols, dim):
    """Where consumer `half`'s share of a query tile's dQ starts along `dim` (0: rows, 1: columns): a row half where
    dq_desc's boxes hold fewer rows than the tile (128-row query tiles), else a column half."""
    by_rows = dq_rows < block_m
    if dim == 0:
        return half * dq_rows if by_rows else 0
    return 0 if by_rows else half * dq_cols


@gluon.jit
def _tile_start(i, n_m_tiles, lo, down, BLOCK_M: gl.constexpr):
    """First row of the i-th query tile of a head's visit: from row `lo` up, or with `down` (1) from the last down."""
    return lo + (i + down * (n_m_tiles - 1 - 2 * i)) * BLOCK_M


@gluon.jit
def _one_pass_tile(j, n_m_tiles, lo, rot, down, h_kv, kv_group, BLOCK_M: gl.constexpr):
    """(query head, first row) of the j-th query tile a one-pass program visits: `query_tile`'s, each head's tiles
    starting at tile `rot` (0 <= rot < n_m_tiles) and wrapping around; with `down` (1, rot 0) from the last down."""
    g = j // n_m_tiles
    i = (j - g * n_m_tiles + rot) % n_m_tiles
    return h_kv * kv_group + g, _tile_start(i, n_m_tiles, lo, down, BLOCK_M)


@gluon.jit
def _copy_pairs(LseDelta, pair_box, bar, b, n_heads, n_q, h, start_m, BLOCK_M: gl.constexpr):
    """The (-L * log2 e, D) pairs of the query tile of head h starting at row start_m (zeros past n_q) into
    `pair_box`, 2 * BLOCK_M float32s: the rows' -L * log2 e, then their D (`_pair_rows`). By cp.async, 4 bytes a
    copy (the global pairs are interleaved), from the (one-warp) caller, counted on `bar`: its phase then completes
    only once they have landed. The consumers read each half in the columns of Sᵀ they hold: loaded from global
    memory one row per thread and converted, each tile would take three warpgroup barriers (a shared-memory round
    trip per conversion)."""
    i = gl.arange(0, 2 * BLOCK_M, layout=gl.BlockedLayout([1], [32], [1], [0]))
    second = (i >= BLOCK_M).to(gl.int32)  # D's half
    rows = start_m + i - second * BLOCK_M
    pairs = LseDelta + (b * n_heads + h).to(gl.int64) * n_q * 2
    cp_async(pair_box, pairs + rows * 2 + second, mask=rows < n_q)
    async_copy.mbarrier_arrive(bar)


@gluon.jit
def _pair_rows(pair_box, BLOCK_M: gl.constexpr):
    """(-L * log2 e, D) of a query tile's rows, as two shared-memory rows of `pair_box` (`_copy_pairs`)."""
    return pair_box.slice(0, BLOCK_M), pair_box.slice(BLOCK_M, BLOCK_M)


@gluon.jit
def _one_pass_producer(q_desc, k_desc, v_desc, do_desc, LseDelta, q_smem, do_smem, pair_smem, q_bar, do_bar, k_box,
                       v_box, kv_bar, empty_bar, b, h_kv, n_heads, kv_group, n_q, start_n, lo, rot, down, n_m_tiles,
                       n_iter,
                       BLOCK_M: gl.constexpr, NBUF: gl.constexpr):
    """One warp: the program's K and V tile, then query tile j's Q, dO and (-L * log2 e, D) pairs into buffer
    j % NBUF once both consumers released tile j - NBUF (the pairs counted on Q's barrier)."""
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [b, h_kv, start_n, 0], kv_bar, k_box)
    tma_load(v_desc, [b, h_kv, start_n, 0], kv_bar, v_box)
    for j in range(n_iter):
        slot = j % NBUF
        mbarrier.wait(empty_bar.index(slot), ((j // NBUF) - 1) & 1, pred=j >= NBUF)
        h, start_m = _one_pass_tile(j, n_m_tiles, lo, rot, down, h_kv, kv_group, BLOCK_M)
        # The pairs first: their count on Q's barrier must be in before the TMA's arrival can complete its phase.
        _copy_pairs(LseDelta, pair_smem.index(slot), q_bar.index(slot), b, n_heads, n_q, h, start_m, BLOCK_M)
        load_pair(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b, h, start_m, slot, True)


@gluon.jit
def _write_shares(dq_desc, dq_stage, stage_full, first, j, b, h, start_m, STORE: gl.constexpr, BLOCK_M: gl.constexpr,
                  DQ_ROWS: gl.constexpr, DQ_COLS: gl.constexpr, NSTAGE: gl.constexpr, SHARES: gl.constexpr):
    """Tile j's dQ shares (staging boxes first, first + 1, ...), each once its consumer has staged it, into dq_desc's
    float32 sum: TMA reduce-adds, or with STORE TMA stores."""
    for half in gl.static_range(SHARES):
        mbarrier.wait(stage_full.index(first + half), (j // NSTAGE) & 1)
        coord = [b, h, start_m + _dq_share_start(half, BLOCK_M, DQ_ROWS, DQ_COLS, 0),
                 _dq_share_start(half, BLOCK_M, DQ_ROWS, DQ_COLS, 1)]
        if STORE:
            tma_store(dq_desc, coord, dq_stage.index(first + half))
        else:
            tma_add(dq_desc, coord, dq_stage.index(first + half))


@gluon.jit
def _one_pass_dq_writer(dq_desc, Sem, dq_stage, stage_full, stage_empty, b, h_kv, n_heads, kv_group, n_q, pid_n, lo,
                        rot, down, n_m_tiles, n_iter, n_k_tiles, stride, right_offset, BLOCK_M: gl.constexpr,
                        BLOCK_N: gl.constexpr, DQ_ROWS: gl.constexpr, DQ_COLS: gl.constexpr,
                        BOUND_RIGHT: gl.constexpr, DETERMINISTIC: gl.constexpr, ROTATE: gl.constexpr,
                        NSTAGE: gl.constexpr, PASS_LATE: gl.constexpr, DQ_ALTERNATE: gl.constexpr):
    """One warp: each tile's two dQ shares (one per consumer: dQ's row or column halves; with DQ_ALTERNATE its one
    share, the whole tile's) from the staging boxes (tile j's in set j % NSTAGE) into dq_desc's float32 sum by TMA
    reduce-adds, handing each set back once the adds have read it.
    With DETERMINISTIC it first waits for the program's turn at the tile (before the shares are ready, so the wait
    overlaps their products), stores the shares instead at turn 0 (the prologue zeroed only the rows no program
    visits), and counts the turn as taken once the adds (or stores) have completed: with PASS_LATE after the
    next tile's adds are issued (their completion overlaps them), else once the staging set has gone back. PASS_LATE
    needs every program's predecessor at a tile two or more tiles ahead of it: a program then waits on a turn its
    predecessor took before the tile it waits at, where one tile ahead its wait on the predecessor's wait would
    close the ring's circle (a deadlock) and chain a masked order's programs one behind another."""
    lane_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    SHARES: gl.constexpr = _shares(DQ_ALTERNATE)  # staging boxes (adds) a tile
    n_q_tiles = gl.cdiv(n_q, BLOCK_M)
    last_sem = Sem
    for j in range(n_iter):
        h, start_m = _one_pass_tile(j, n_m_tiles, lo, rot, down, h_kv, kv_group, BLOCK_M)
        turn = 1  # unordered: no share is first, every one is added (a constant: the branch below compiles away)
        if DETERMINISTIC:
            m = start_m // BLOCK_M
            sem = Sem + (b * n_heads + h).to(gl.int64) * n_q_tiles + m
            turn = one_pass_turn(m, pid_n, n_k_tiles, stride, right_offset, down, BLOCK_M, BLOCK_N, BOUND_RIGHT,
                                  ROTATE)
            _wait_turn(sem, turn, lane_layout)
        first = (j % NSTAGE) * SHARES
        if turn == 0:  # the tile's first shares: stored, so the prologue need not zero the sum
            _write_shares(dq_desc, dq_stage, stage_full, first, j, b, h, start_m, True, BLOCK_M, DQ_ROWS, DQ_COLS,
                          NSTAGE, SHARES)
        else:
            _write_shares(dq_desc, dq_stage, stage_full, first, j, b, h, start_m, False, BLOCK_M, DQ_ROWS, DQ_COLS,
                          NSTAGE, SHARES)
        if DETERMINISTIC and PASS_LATE:
            # Before the staging boxes go back: counting the turn after that delays each hop of the full masks'
            # ring.
            if j > 0:
                # the last tile's adds, with this tile's in flight
                _pass_turn(last_sem, SHARES, lane_layout)
            last_sem = sem
        tma.store_wait(0)  # the adds have read their staging boxes
        for half in gl.static_range(SHARES):
            mbarrier.arrive(stage_empty.index(first + half))
        if DETERMINISTIC and not PASS_LATE:
            _pass_turn(sem, 0, lane_layout)
    if DETERMINISTIC and PASS_LATE:
        if n_iter > 0:
            _pass_turn(last_sem, 0, lane_layout)


@gluon.jit
def _in_sum_order(dq, ROWS: gl.constexpr, COLS: gl.constexpr):
    """dQ's share (ROWS, COLS) with its rows in the float32 sum's order (`gluon.launch.dq_sum_row`): row 4h + i of
    each 8 (h < 2, i < 4) to 2i + h, the same registers relabelled, no data moved, and the staging store free of bank
    conflicts. The shape and order are literals: Triton 3.6's permute refuses them as constexpr values."""
    return gl.reshape(gl.permute(gl.reshape(dq, [ROWS // 8, 2, 4, COLS]), (0, 2, 1, 3)), [ROWS, COLS])


@gluon.jit
def _sum_row(r):
    """`gluon.launch.dq_sum_row` in a Gluon kernel."""
    return (r & ~7) | ((r & 3) << 1) | ((r >> 2) & 1)


@gluon.jit
def _dq_share(ds_box, ds_rows: gl.constexpr, k_dq, dq_zero, dv_tok, dk_tok, slot_empty, dq_stage, stage_full,
              stage_empty, j, box, NSTAGE: gl.constexpr, DQ_ROWS: gl.constexpr, DQ_COLS: gl.constexpr):
    """Issue dQ's share of tile j (dS[rows] K[:, cols]), wait for it and dV's and dK's products, release the Q/dO
    slot, and hand the share to the writer in staging box `box` once the writer has read what it held before.
    Returns (dV, dK)."""
    dq_tok = warpgroup_mma(ds_box.slice(ds_rows, DQ_ROWS, dim=1).permute((1, 0)), k_dq, dq_zero, use_acc=False,
                           is_async=True)
    dv, dk, dq = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok, dq_tok])
    mbarrier.arrive(slot_empty)
    mbarrier.wait(stage_empty.index(box), ((j // NSTAGE) & 1) ^ 1, pred=j >= NSTAGE)
    smem_tile(dq_stage.index(box), DQ_ROWS, DQ_COLS).store(_in_sum_order(dq, DQ_ROWS, DQ_COLS))
    fence_async_shared()
    partition_barrier()
    mbarrier.arrive(stage_full.index(box))
    return dv, dk


@gluon.constexpr_function
def _fold_layout(cols):
    """Registers of a (rows, cols) float32 block read and written row by row: a 16-byte vector a thread, a warp's
    lanes across the columns (all `cols` of a row where they fit), the 4 warps down the rows."""
    lanes = min(32, cols // 4)
    return gl.BlockedLayout([1, 4], [32 // lanes, lanes], [4, 1], [1, 0])


@gluon.jit
def _fold_dq(DqAcc, DQ, Sem, bh_kv, n_kv_heads, kv_group, n_q, pid_n, n_k_tiles, n_m_tiles, stride, softmax_scale,
             HALF: gl.constexpr, BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """dQ = sum * softmax_scale, in dQ's dtype, at the query tiles where key tile pid_n of (batch, K/V head) bh_kv
    took the ring's last turn (`ring_last_tiles`, each query head of the group), each once its semaphore counts
    all n_k_tiles turns (every turn is counted once its adds have completed): what the epilogue kernel does for the
    whole sum, without its launch and beside the compute-bound programs instead of after them. DQ is dense
    (B, H, Nq, D), DqAcc (B, H, Nq rounded up to 8, D) in `gluon.launch.dq_sum_row`'s order; the
    two consumers take every other tile (warpgroup HALF from tile HALF)."""
    layout: gl.constexpr = _fold_layout(HEAD_DIM)
    wait_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    m_lo, m_hi = ring_last_tiles(pid_n, n_k_tiles, n_m_tiles, stride)
    per_head = m_hi - m_lo
    b = bh_kv // n_kv_heads
    n_heads = n_kv_heads * kv_group
    n_sum = (n_q + 7) // 8 * 8  # the sum's rows a head (`gluon.launch.dq_sum_rows`)
    in_tile = rows[:, None] * HEAD_DIM + cols[None, :]
    in_sum = _sum_row(rows)[:, None] * HEAD_DIM + cols[None, :]
    for t in range(HALF, per_head * kv_group, 2):
        g = t // per_head
        m = m_lo + t - g * per_head
        bh = (b * n_heads + (bh_kv - b * n_kv_heads) * kv_group + g).to(gl.int64)
        _wait_turn(Sem + bh * gl.cdiv(n_q, BLOCK_M) + m, n_k_tiles, wait_layout, 128)
        start = m * BLOCK_M  # a multiple of 8: the tile's rows permute among themselves in the sum
        inside = (start + rows < n_q)[:, None] & (cols < HEAD_DIM)[None, :]
        # .cg: past L1, which is not coherent with the other SMs' TMA adds
        acc = gl.load(DqAcc + (bh * n_sum + start) * HEAD_DIM + in_sum, mask=inside, other=0.0, cache_modifier=".cg")
        gl.store(DQ + (bh * n_q + start) * HEAD_DIM + in_tile, (acc * softmax_scale).to(DQ.dtype.element_ty),
                 mask=inside)


@gluon.jit
def _one_pass_consumer(dk_desc, dv_desc, DqAcc, DQ, Sem, q_smem, do_smem, pair_smem, q_bar, do_bar, k_box, v_box,
                       kv_bar, empty_bar, ds_smem, ds_bar, dq_stage, stage_full, stage_empty, b, h_kv, bh_kv,
                       n_kv_heads, kv_group, n_q, start_n, lo, rot, down, full_lo, full_hi, n_m_tiles, n_iter,
                       n_k_tiles, stride, fold_lag, right_offset, left_offset, qk_scale, softmax_scale,
                       HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, HALF_N: gl.constexpr,
                       BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr,
                       NSTAGE: gl.constexpr, DQ_ROWS: gl.constexpr, DQ_COLS: gl.constexpr,
                       DQ_ALTERNATE: gl.constexpr, FOLD_DQ: gl.constexpr):
    """One warpgroup: dK and dV of key rows start_n + HALF * HALF_N on, and its share of dQ, over the query tiles
    the producer streams. Per tile as `attention_backward_dkdv` (Sᵀ and dPᵀ issued together, Pᵀ under dPᵀ, dSᵀ under
    dV's product; the tile's -L * log2 e and D read from the producer's copy in shared memory, in the columns of Sᵀ
    this thread holds), then dSᵀ into shared memory, where the two warpgroups' halves meet (ds_bar), and its half of dQ
    over all BLOCK_N keys: with 64-row query tiles its D/2 columns (DQ_COLS; dS K[:, cols], 32 registers a thread at
    D 128), with 128-row ones its 64 rows (DQ_ROWS; dS[rows] K, one product of 64 columns at D 64 where the column
    halves took two of 32). The share goes to the writer warp in this warpgroup's staging box of set j % NSTAGE
    (stage_full; stage_empty: the writer's add has read the share the set held before; with two sets the writer's
    latency has a tile's slack). With DQ_ALTERNATE the two take turns at the whole tile's dQ (warpgroup HALF at tiles
    j with j % 2 == HALF, into set HALF of two): one product a tile where there were two, and the warpgroup without
    it starts the next tile's Sᵀ and dPᵀ while the other's runs. Its shared-memory reads are those of the two halves
    at D 64 (each m64 half of a 128-row product reads all of K), 16 KB fewer at D 128 (dS read once).
    With FOLD_DQ, first, while K and V load, it writes dQ where key tile pid_n took the ring's last turn for the
    (batch, K/V head) pair fold_lag before its own, whose programs launched about two waves earlier (`_fold_dq`)."""
    s_layout: gl.constexpr = mma_layout(BLOCK_M)
    acc_layout: gl.constexpr = mma_layout(HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dq_layout: gl.constexpr = mma_layout(DQ_COLS)
    dtype: gl.constexpr = q_smem.dtype
    my_n = start_n + HALF * HALF_N
    k_all = smem_tile(k_box, 2 * HALF_N, HEAD_DIM)
    v_all = smem_tile(v_box, 2 * HALF_N, HEAD_DIM)
    k_tile = k_all.slice(HALF * HALF_N, HALF_N)
    v_tile = v_all.slice(HALF * HALF_N, HALF_N)
    # dQ's product reads this warpgroup's query rows of dS (Sᵀ's columns) and all of K, or all of dS and its columns
    # of K; with DQ_ALTERNATE all of both, at every other tile
    if DQ_ALTERNATE:
        ds_rows: gl.constexpr = 0
        k_dq = k_all
    else:
        ds_rows: gl.constexpr = _dq_share_start(HALF, BLOCK_M, DQ_ROWS, DQ_COLS, 0)
        k_dq = k_all.slice(_dq_share_start(HALF, BLOCK_M, DQ_ROWS, DQ_COLS, 1), DQ_COLS, dim=1)
    offs_n = my_n + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([HALF_N, HEAD_DIM], gl.float32, layout=acc_layout)
    dv = gl.zeros([HALF_N, HEAD_DIM], gl.float32, layout=acc_layout)
    s_zero = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, layout=dq_layout)
    pid_n = start_n // (2 * HALF_N)
    if FOLD_DQ:
        if bh_kv >= fold_lag:
            _fold_dq(DqAcc, DQ, Sem, bh_kv - fold_lag, n_kv_heads, kv_group, n_q, pid_n, n_k_tiles, n_m_tiles,
                     stride, softmax_scale, HALF, BLOCK_M, HEAD_DIM)
    mbarrier.wait(kv_bar, 0)
    # The query tile's index in its head (`_one_pass_tile`'s i) is stepped rather than divided out of j each tile,
    # which the full-mask kernels run faster with and the causal ones as fast; the windowed ones (a left bound)
    # spill more with it and keep the division (docs/attention-kernels.md §6).
    i = rot
    for j in range(n_iter):
        slot = j % NBUF
        phase = (j // NBUF) & 1
        if BOUND_LEFT:
            _, start_m = _one_pass_tile(j, n_m_tiles, lo, rot, down, h_kv, kv_group, BLOCK_M)
        else:
            start_m = _tile_start(i, n_m_tiles, lo, down, BLOCK_M)
            i = gl.where(i + 1 == n_m_tiles, 0, i + 1)
        q_tile = smem_tile(q_smem.index(slot), BLOCK_M, HEAD_DIM)
        do_tile = smem_tile(do_smem.index(slot), BLOCK_M, HEAD_DIM)
        neg_lse2, delta = _pair_rows(pair_smem.index(slot), BLOCK_M)
        mbarrier.wait(q_bar.index(slot), phase)  # Q's tile and the pairs
        p, dp_tok = transposed_probabilities(k_tile, v_tile, q_tile, do_tile, do_bar.index(slot), phase, s_zero,
                                              neg_lse2, qk_scale, offs_n, start_m, full_lo, full_hi, n_q,
                                              right_offset, left_offset, BLOCK_M, BOUND_RIGHT, BOUND_LEFT)
        dv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), op_layout), do_tile, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=[dp_tok])
        ds = (p * (dp - delta.load(col_layout)[None, :])).to(dtype)
        # dSᵀ of this warpgroup's keys into buffer j % 2. Both warpgroups drained their dQ products of tile j - 2
        # (which read it) before arriving at tile j - 1's barrier, which this one passed.
        ds_box = ds_smem.index(j % 2)
        ds_box.slice(HALF * HALF_N, HALF_N).store(ds)
        fence_async_shared()
        partition_barrier()
        mbarrier.arrive(ds_bar.index(j % 2))
        dk_tok = warpgroup_mma(gl.convert_layout(ds, op_layout), q_tile, dk, is_async=True)
        mbarrier.wait(ds_bar.index(j % 2), (j // 2) & 1)
        if DQ_ALTERNATE:
            if j % 2 == HALF:
                dv, dk = _dq_share(ds_box, ds_rows, k_dq, dq_zero, dv_tok, dk_tok, empty_bar.index(slot), dq_stage,
                                   stage_full, stage_empty, j, j % NSTAGE, NSTAGE, DQ_ROWS, DQ_COLS)
            else:
                dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
                mbarrier.arrive(empty_bar.index(slot))
        else:
            dv, dk = _dq_share(ds_box, ds_rows, k_dq, dq_zero, dv_tok, dk_tok, empty_bar.index(slot), dq_stage,
                               stage_full, stage_empty, j, (j % NSTAGE) * 2 + HALF, NSTAGE, DQ_ROWS, DQ_COLS)
    # K and V are no longer read by this warpgroup, but may be by the other one's dQ products: dK and dV go out
    # through a staging box instead, once the writer has read the last share (it reads them in order, so every
    # share before it too).
    last = n_iter - 1
    if DQ_ALTERNATE:
        # With two sets, set HALF holds only this warpgroup's shares (tiles j with j % 2 == HALF): its last one read,
        # the set (as big as two of its dK tiles) stages dK and dV. Waiting on a set the warpgroup does not fill
        # would be ambiguous: a phase's parity says nothing of phases it never saw complete.
        mine = HALF + ((last - HALF) // 2) * 2
        mbarrier.wait(stage_empty.index(HALF), (mine // 2) & 1, pred=n_iter > HALF)
        out = reinterpret_smem(dq_stage.index(HALF), dtype, [2, 1, 1, HALF_N, HEAD_DIM], dk_desc.layout).index(0)
    else:
        mbarrier.wait(stage_empty.index((last % NSTAGE) * 2 + HALF), (last // NSTAGE) & 1, pred=n_iter > 0)
        out = reinterpret_smem(dq_stage.index(HALF), dtype, [1, 1, HALF_N, HEAD_DIM], dk_desc.layout)
    smem_tile(out, HALF_N, HEAD_DIM).store((dk * softmax_scale).to(dtype))
    fence_async_shared()
    partition_barrier()
    tma_store(dk_desc, [b, h_kv, my_n, 0], out)
    tma.store_wait(0)
    partition_barrier()
    smem_tile(out, HALF_N, HEAD_DIM).store(dv.to(dtype))
    fence_async_shared()
    partition_barrier()
    tma_store(dv_desc, [b, h_kv, my_n, 0], out)
    tma.store_wait(0)


@gluon.jit
def attention_backward_one_pass(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, LseDelta, Sem, DqAcc,
                                DQ, n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, qk_scale,
                                softmax_scale, group_heads, fold_lag, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr,
                                NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr, DETERMINISTIC: gl.constexpr,
                                ROTATE: gl.constexpr, PASS_LATE: gl.constexpr, PAIRED: gl.constexpr,
                                NSTAGE: gl.constexpr = 1, DQ_ALTERNATE: gl.constexpr = False,
                                FOLD_DQ: gl.constexpr = False):
    """The whole backward in one pass: one program = a key tile of BLOCK_N rows of one (batch, K/V head), held by
    two consumer warpgroups of BLOCK_N // 2 rows each, a producer warp that streams Q and dO through NBUF buffers,
    and a writer warp that adds dQ's shares. Per query tile five products: Sᵀ, dPᵀ, dV += Pᵀ dO, dK += dSᵀ Q, and dQ's
    share dS K, added by TMA reduce-adds into dq_desc's tensor (float32, (B, H, Nq rounded up to 8, D) with its rows in
    `gluon.launch.dq_sum_row`'s order, zeroed first; unscaled), half of its rows or columns per consumer. LseDelta holds
    the (-L * log2 e, rowsum(dO * O)) pairs, written before; the producer copies each query tile's into shared memory
    beside its Q (`_copy_pairs`). k_desc and v_desc copy BLOCK_N-row boxes; dk_desc and dv_desc BLOCK_N // 2-row boxes;
    dq_desc a consumer's share, (BLOCK_M, D / 2) or (BLOCK_M / 2, D) boxes (`_one_pass_consumer`). NSTAGE sets of dQ
    staging boxes: a second set gives the writer a tile of slack, where shared memory holds it (at D 128, and with
    128-row tiles at D 64, only beside two Q/dO buffers).

    DETERMINISTIC: dQ's sums are added in a fixed order, ordered by Sem, (B, H, cdiv(Nq, BLOCK_M)) int32 zeroed
    first (see the section's comment); ROTATE (full masks, Nq / BLOCK_M >= Nk / BLOCK_N, and at most one head's
    cdiv(Nk, BLOCK_N) programs per SM) rotates each program's first query tile; PAIRED (a right bound and no left
    one, either kind) launches in `tiles.paired_key_program`'s order, group_heads heads a group, every other
    group's programs visiting their query tiles downward; PASS_LATE (only where each program's
    predecessor at a tile is two or more tiles ahead of it: `_one_pass_dq_writer`) counts a tile's turn after the
    next tile's adds are issued. Without DETERMINISTIC (Sem unread) dQ's sums run in no fixed order, so their last
    bits vary from run to run.

    DQ_ALTERNATE (with NSTAGE 2): the consumers take turns at each query tile's whole dQ product instead of each
    computing half of it (`_one_pass_consumer`); dq_desc's boxes are then the whole tile. That pays with 128-row
    query tiles at D 64; at D 128 (64-row tiles) the turn's product (m64n128k128) is twice any other and it loses.

    FOLD_DQ (with DETERMINISTIC and ROTATE): the programs write DQ (dense (B, H, Nq, D), q's dtype) = the sum *
    softmax_scale, so no epilogue kernel reads the sum back after them; DqAcc is dq_desc's tensor. The program of
    key tile n of (batch, K/V head) pair i writes, at its start while its K and V load, the query tiles where key
    tile n took the ring's last turn for pair i - fold_lag, whose programs launched fold_lag * cdiv(n_k, BLOCK_N)
    programs earlier (about two waves: done, or nearly). The grid then holds fold_lag pairs more than n_bh, whose
    programs do only that for the last fold_lag pairs: they visit no query tile, and their K/V loads and dK/dV stores
    fall past the batch, where TMA reads zeros and writes nothing (cheaper than a flag kept live through the
    consumers' loop, which spilled). Without FOLD_DQ, DqAcc, DQ and fold_lag are not read."""
    HALF_N: gl.constexpr = BLOCK_N // 2
    DQ_ROWS: gl.constexpr = dq_desc.block_type.shape[2]  # a consumer's share of dQ: rows or columns halved
    DQ_COLS: gl.constexpr = dq_desc.block_type.shape[3]
    dtype: gl.constexpr = q_desc.dtype
    n_kv_heads = n_heads // kv_group
    n_k_tiles = gl.cdiv(n_k, BLOCK_N)
    # One (batch, K/V head) after another, so that the programs running at once share one head's Q and dO in L2
    # (interleaving all the heads loses to L2 misses);
    # with DETERMINISTIC and not ROTATE each head's key tiles from the last down, so that the tiles whose adds go
    # first start first. PAIRED (a right bound and no left one): groups of group_heads heads instead
    # (`tiles.paired_key_program`), each group's programs about filling the SMs.
    if PAIRED:
        pid_n, bh_kv, b, h_kv, down = paired_program_tile(n_bh, n_kv_heads, n_k_tiles, group_heads)
    elif FOLD_DQ:
        pid_n, bh_kv, b, h_kv, _ = program_tile(n_bh + fold_lag, n_kv_heads, 1, 1, False)
        down = 0
    else:
        pid_n, bh_kv, b, h_kv, _ = program_tile(n_bh, n_kv_heads, 1, 1, DETERMINISTIC and not ROTATE)
        down = 0
    bh_kv = bh_kv.to(gl.int32)
    start_n = pid_n * BLOCK_N
    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = query_tile_range(start_n, n_q, right_offset, left_offset, BLOCK_M, BLOCK_N,
                                                 BOUND_RIGHT, BOUND_LEFT)
    n_m_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_M)
    n_iter = n_m_tiles * kv_group
    if FOLD_DQ:
        n_iter = gl.where(bh_kv < n_bh, n_iter, 0)  # the programs past the last pair only fold
    stride = gl.maximum(n_m_tiles // n_k_tiles, 1)
    if ROTATE:
        rot = pid_n * stride
    else:
        rot = 0

    k_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_smem, do_smem, q_bar, do_bar = stream_buffers(q_desc, do_desc, BLOCK_M, HEAD_DIM, NBUF)
    pair_smem = gl.allocate_shared_memory(gl.float32, [NBUF, 2 * BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    empty_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M],
                                        gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype))
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_stage = gl.allocate_shared_memory(gl.float32, [_shares(DQ_ALTERNATE) * NSTAGE, 1, 1, DQ_ROWS, DQ_COLS],
                                         dq_desc.layout)
    # One full/empty pair per staging box: 2 * NSTAGE, or NSTAGE (never below 2) where the consumers take turns.
    stage_full = gl.allocate_shared_memory(gl.int64, [_shares(DQ_ALTERNATE) * NSTAGE, 1], mbarrier.MBarrierLayout())
    stage_empty = gl.allocate_shared_memory(gl.int64, [_shares(DQ_ALTERNATE) * NSTAGE, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=2)
        mbarrier.init(stage_full.index(i), count=1)
        mbarrier.init(stage_empty.index(i), count=1)
    # The second set's in a loop of their own: moving the first set's out of the loop above makes Triton 3.6 add a
    # bar.sync to the prologue (as in the ping-pong forward's).
    for i in gl.static_range(2, _shares(DQ_ALTERNATE) * NSTAGE):
        mbarrier.init(stage_full.index(i), count=1)
        mbarrier.init(stage_empty.index(i), count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(empty_bar.index(i), count=2)
    fence_async_shared()
    gl.warp_specialize([(_one_pass_consumer, (dk_desc, dv_desc, DqAcc, DQ, Sem, q_smem, do_smem, pair_smem, q_bar,
                                              do_bar, k_box, v_box, kv_bar, empty_bar, ds_smem, ds_bar, dq_stage,
                                              stage_full, stage_empty, b, h_kv, bh_kv, n_kv_heads, kv_group,
                                              n_q, start_n, lo, rot, down, full_lo, full_hi, n_m_tiles, n_iter,
                                              n_k_tiles, stride, fold_lag, right_offset, left_offset, qk_scale,
                                              softmax_scale, 0, HEAD_DIM, BLOCK_M, HALF_N, BOUND_RIGHT,
                                              BOUND_LEFT, NBUF, NSTAGE, DQ_ROWS, DQ_COLS, DQ_ALTERNATE, FOLD_DQ)),
                        (_one_pass_consumer, (dk_desc, dv_desc, DqAcc, DQ, Sem, q_smem, do_smem, pair_smem, q_bar,
                                              do_bar, k_box, v_box, kv_bar, empty_bar, ds_smem, ds_bar, dq_stage,
                                              stage_full, stage_empty, b, h_kv, bh_kv, n_kv_heads, kv_group,
                                              n_q, start_n, lo, rot, down, full_lo, full_hi, n_m_tiles, n_iter,
                                              n_k_tiles, stride, fold_lag, right_offset, left_offset, qk_scale,
                                              softmax_scale, 1, HEAD_DIM, BLOCK_M, HALF_N, BOUND_RIGHT,
                                              BOUND_LEFT, NBUF, NSTAGE, DQ_ROWS, DQ_COLS, DQ_ALTERNATE, FOLD_DQ)),
                        (_one_pass_producer, (q_desc, k_desc, v_desc, do_desc, LseDelta, q_smem, do_smem, pair_smem,
                                              q_bar, do_bar, k_box, v_box, kv_bar, empty_bar, b, h_kv, n_heads,
                                              kv_group, n_q, start_n, lo, rot, down, n_m_tiles, n_iter, BLOCK_M,
                                              NBUF)),
                        (_one_pass_dq_writer, (dq_desc, Sem, dq_stage, stage_full, stage_empty, b, h_kv, n_heads,
                                               kv_group, n_q, pid_n, lo, rot, down, n_m_tiles, n_iter, n_k_tiles,
                                               stride, right_offset, BLOCK_M, BLOCK_N, DQ_ROWS, DQ_COLS, BOUND_RIGHT,
                                               DETERMINISTIC, ROTATE, NSTAGE, PASS_LATE, DQ_ALTERNATE))],
                       [4, 1, 1], [CONSUMER_REGS, 24, 24])
