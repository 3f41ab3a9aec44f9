"""The FlashAttention forward, and the backward's dQ and dK/dV kernels, for Hopper GPUs (sm_90), written in Gluon,
Triton's lower-level language.

Importing this module needs a Triton with Gluon's Hopper API (3.6 or later); `flash_gluon` imports it only
where that is so. The host side (which inputs take these kernels, the variants, tuning) is in `flash_gluon.py`.

Why Gluon: a `tl` kernel on Hopper runs each tile's softmax and its two tensor-core products one after the other
(Triton waits for each `wgmma` before its result is used). Gluon exposes FlashAttention-3's tools. The forward
kernels are written with its intra-warpgroup overlap:

    S_t = Q K_tᵀ (async); O += P_{t-1} V_{t-1} (async); wait for S_t only; softmax(S_t) -> P_t; wait for P V;
    rescale O; hand the freed K/V buffers back (or refill them, TMA).

but ptxas moves the wait for P V (which reads P from registers) up to just after the row max, so the exponentials
run after it. Pinning them under P V made the 128x128 kernels 12-16% slower (kernel_experiments.md, stop 43): the
overlap that pays is the ping-pong kernels', one warpgroup's softmax under the other's products.

- `attention_forward`: one warpgroup per program, several programs per SM (best at D 64 and short sequences).
- `attention_forward_pingpong`: warp-specialised. A producer warp issues the TMA copies into a ring of buffers;
  two consumer warpgroups of BLOCK_M // 2 query rows share the key tiles and take turns at issuing their products
  (FlashAttention-3's inter-warpgroup ping-pong), so one's softmax runs while the other's products run.
- `attention_forward_persistent`: the ping-pong kernel with one program per SM, each over pairs of query tiles, so
  that one tile's start and end overlap the previous tile's work (best below N 16384 and under causal masks).

Both write what the `tl` forward writes (O, and L in natural log) for every input it takes: grouped-query K/V
(head h reads K/V head h // kv_group), Nq != Nk, causal and sliding windows (bottom-right aligned), lengths that are
not a multiple of the tile (TMA reads zeros past the end and clips the stores), and rows that see no key
(O = 0, L = -inf). Tensors are rank-4 (B, H, N, D) TMA descriptors with their own strides: the kernels copy
(1, 1, rows, D) boxes and view them as (rows, D) tiles.

- `attention_backward_dkdv`: dK and dV with the same overlap on transposed scores (see its docstring), for the same
  inputs, after the `tl` dQ kernel. Unlike the forward it drains its products at the end of every tile: with any
  left in flight across the loop's back edge, ptxas serialises every wgmma (kernel_experiments.md, stop 29).
- `attention_backward_dq`: dQ with the same overlap (S and dP issued together, P under dP, drained per tile); it
  writes the (-L·log2 e, D) pairs the dK/dV kernels read, as the `tl` dQ kernel does (kernel_experiments.md, stop 31).
- `attention_backward_one_pass`: the whole backward in one pass, five products a tile where the two passes do seven,
  warp-specialised as FlashAttention-3's: a writer warp adds dQ's shares into a float32 sum by TMA reduce-adds,
  with DETERMINISTIC in a fixed order (each program waits for its turn at a query tile), without it in no fixed
  order (only where the caller turned determinism off, `set_deterministic_backward(False)`); with FOLD_DQ (the
  deterministic kind under full masks) it also writes dQ from the sum, where an epilogue kernel does elsewhere.
"""

from __future__ import annotations

from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon.language._core import builtin

# The grid order, the tile ranges and the mask are the `tl` kernels' own (@triton.jit helpers, which Gluon calls
# as they are).
from .flash_triton import (_key_tile_range, _one_pass_turn, _paired_key_program, _program_start, _query_tile_range,
                           _ring_last_tiles, _visible)
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
from triton.experimental.gluon.language.nvidia.ampere import async_copy

# TMA copies: Triton 3.6 names them async_copy_*; later Tritons renamed them async_load / async_store.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# cp.async copies (global to shared, per thread): Triton 3.6 names them async_copy_global_to_shared, later Tritons
# async_load.
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared


@builtin
def _tma_reduce_add_36(tensor_desc, coord, src, _semantic=None):
    """TMA's reduce-add (cp.reduce.async.bulk.tensor) of a shared-memory tile into global memory. Triton 3.6's
    Gluon builds the op but has no Python name for it; later Tritons call it tma.async_atomic_add."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


_tma_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36
# A barrier over the calling partition's threads: Triton 3.6 calls it thread_barrier, later Tritons barrier.
_barrier = getattr(gl, "thread_barrier", None) or gl.barrier


@builtin
def _reinterpret(smem, dtype, shape, layout, _semantic=None):
    """`smem` viewed as another dtype, shape and layout (Triton 3.6 names the method _reinterpret, later Tritons
    reinterpret)."""
    method = getattr(smem, "reinterpret", None) or smem._reinterpret
    return method(dtype, shape, layout, _semantic=_semantic)


@gluon.jit
def _program_tile(n_bh, n_heads, kv_group, HEAVIEST_FIRST: gl.constexpr):
    """(query-tile index, flat batch*head index, batch, head, K/V head): the `tl` kernels' grid order
    (`flash_triton._program_start`), with batch and head as int32 for TMA coordinates."""
    pid_m, bh, b, h = _program_start(n_bh, n_heads, HEAVIEST_FIRST)
    h = h.to(gl.int32)
    return pid_m, bh, b.to(gl.int32), h, h // kv_group


@gluon.jit
def _paired_program_tile(n_bh, n_heads, n_k_tiles, group_heads):
    """(key-tile index, flat batch*head index, batch, head, down) of a one-pass program in the paired order
    (`flash_triton._paired_key_program`), with batch and head as int32 for TMA coordinates."""
    tile, bh, down = _paired_key_program(n_bh, n_k_tiles, group_heads)
    return tile, bh, (bh // n_heads).to(gl.int32), (bh % n_heads).to(gl.int32), down


@gluon.jit
def _query_program(n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """Where a program over one query tile (the forwards, dQ) starts: (flat batch*head, batch, head, K/V head, first
    query row, right offset, left offset, lo, full_lo, full_hi, hi). Query i sees key j iff
    i + left_offset <= j <= i + right_offset; the key range is `_key_tile_range`'s."""
    pid_m, bh, b, h, h_kv = _program_tile(n_bh, n_heads, kv_group, BOUND_RIGHT)
    start_m = pid_m * BLOCK_M
    right_offset, left_offset, lo, full_lo, full_hi, hi = _key_geometry(
        start_m, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
    return bh, b, h, h_kv, start_m, right_offset, left_offset, lo, full_lo, full_hi, hi


@gluon.jit
def _key_geometry(start_m, n_q, n_k, window_left, window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """(right offset, left offset, lo, full_lo, full_hi, hi) of the query tile starting at start_m (see
    `_query_program`)."""
    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = _key_tile_range(start_m, n_k, right_offset, left_offset, BLOCK_M, BLOCK_N, BOUND_RIGHT,
                                               BOUND_LEFT)
    return right_offset, left_offset, lo, full_lo, full_hi, hi


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
def _load_tile(desc, smem, bar, batch, head, row, slot, pred):
    """A TMA copy of the tile at `row` of one head into buffer `slot`, signalling that buffer's barrier."""
    mbarrier.expect(bar.index(slot), desc.block_type.nbytes, pred=pred)
    _tma_load(desc, [batch, head, row, 0], bar.index(slot), smem.index(slot), pred=pred)


@gluon.jit
def _load_pair(a_desc, b_desc, a_smem, b_smem, a_bar, b_bar, batch, head, row, slot, pred):
    """TMA copies of the two tiles at `row` of one head (K and V; the backward's Q and dO) into buffer `slot`; each
    signals its own barrier."""
    _load_tile(a_desc, a_smem, a_bar, batch, head, row, slot, pred)
    _load_tile(b_desc, b_smem, b_bar, batch, head, row, slot, pred)


@gluon.jit
def _stream_buffers(a_desc, b_desc, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, NBUF: gl.constexpr):
    """(a buffers, b buffers, a barriers, b barriers): NBUF shared-memory buffers for each of two tiles that stream
    through a kernel together (K and V; the dK/dV kernel's Q and dO), one barrier each, initialised (`_load_pair`
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
def _invalidate_barriers(one_bar, a_bar, b_bar, NBUF: gl.constexpr):
    """Invalidate a kernel's barriers before their shared memory is reused: the single one of its resident tiles,
    and the two rings of `_stream_buffers`."""
    mbarrier.invalidate(one_bar)
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(a_bar.index(i))
        mbarrier.invalidate(b_bar.index(i))


@builtin
def _vector_in(x, layout, _semantic=None):
    """A per-row or per-column vector in `layout`: converted where `x` is in registers, read in it where `x` is a
    row of shared memory (no conversion, no barrier)."""
    if isinstance(x, gl.shared_memory_descriptor):
        return x.load(layout, _semantic=_semantic)
    return gl.convert_layout(x, layout, _semantic=_semantic)


@gluon.jit
def _tile(box, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A (1, 1, ROWS, D) TMA box in shared memory as the (ROWS, D) tile the tensor cores read."""
    return box.reshape([ROWS, HEAD_DIM])


@gluon.constexpr_function
def _mma_layout(cols, warps=4):
    """The register layout of a (rows, cols) wgmma accumulator (S: cols = BLOCK_N; O: HEAD_DIM) of `warps` warps,
    stacked over the rows (8: two warpgroups, each with its own rows)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, cols, 16])


@gluon.constexpr_function
def _v_free_barriers(nbuf):
    """Where a ping-pong kernel's V-slot-free barriers start in its slot-free barriers: NBUF with two slots, where K
    goes back to the producer once S has read it and V once P V has (8-15% off the D 128 128x128 kernels: tile t + 1
    loaded into tile t - 1's slot only after both consumers finished tile t - 1, and the first waited for it); 0
    with three or more, where each slot goes back whole after P V (the D 64 and 4-buffer kernels, where handing K
    back apart measured -0.5% to +1.7%; kernel_experiments.md, stop 43)."""
    return nbuf if nbuf == 2 else 0


@gluon.jit
def _rows(x, acc):
    """A per-row vector (in S's layout) in the rows of `acc`'s layout, broadcast over its columns."""
    return gl.convert_layout(x, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _attend(q, offs_m, k_smem, v_smem, k_bar, v_bar, n_tiles, lo, full_lo, full_hi, n_k, right_offset, left_offset,
            qk_scale, k_desc, v_desc, b, h_kv, turn_bar, empty_bar, streamed, turns, HALF: gl.constexpr,
            ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
            BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr, PINGPONG: gl.constexpr):
    """(O unnormalised, row max, row sum) of one warpgroup's ROWS query rows over key tiles lo, lo + BLOCK_N, ...
    (n_tiles of them), with the intra-warpgroup overlap of the module docstring.

    The plain kernel refills a freed K/V buffer itself (k_desc, v_desc, b, h_kv); a ping-pong consumer (PINGPONG)
    instead waits for its turn before issuing products and passes it on after (turn_bar, HALF), and releases each
    freed buffer to the producer (empty_bar): with two slots K's as soon as S has read it (slot) and V's after P V
    (NBUF + slot), so that the next K tile loads while this tile's P V and softmax run; with more, both after P V
    (slot; `_v_free_barriers`). The arguments the other kind uses are None. `streamed` and `turns`:
    the key tiles this program streamed through its ring and the turns this warpgroup took before (0, or a
    persistent program's earlier query tiles), which fix each buffer's slot and each barrier's phase."""
    s_layout: gl.constexpr = _mma_layout(BLOCK_N)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=_mma_layout(HEAD_DIM), k_width=2)
    dtype: gl.constexpr = k_smem.dtype
    V_FREE: gl.constexpr = _v_free_barriers(NBUF)
    s_zero = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, layout=_mma_layout(HEAD_DIM))
    if n_tiles > 0:
        # Tile 0: S and its softmax; nothing to overlap yet.
        first = streamed % NBUF
        if PINGPONG:
            mbarrier.wait(turn_bar.index(HALF), turns & 1)
        mbarrier.wait(k_bar.index(first), (streamed // NBUF) & 1)
        s = warpgroup_mma(q, _tile(k_smem.index(first), BLOCK_N, HEAD_DIM).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_bar.index(1 - HALF))
        s = warpgroup_mma_wait(0, deps=[s])
        if PINGPONG and V_FREE > 0:
            mbarrier.arrive(empty_bar.index(first))
        s = _masked_scores(s, offs_m, lo, n_k, right_offset, left_offset, full_lo, full_hi, BLOCK_N, BOUND_RIGHT,
                           BOUND_LEFT)
        p, m_i, alpha, l_i = _softmax_step(s, m_i, l_i, qk_scale)
        for t in range(1, n_tiles):
            slot = (streamed + t) % NBUF
            prev = (streamed + t - 1) % NBUF
            if PINGPONG:
                mbarrier.wait(turn_bar.index(HALF), (turns + t) & 1)
            mbarrier.wait(k_bar.index(slot), ((streamed + t) // NBUF) & 1)
            s_tok = warpgroup_mma(q, _tile(k_smem.index(slot), BLOCK_N, HEAD_DIM).permute((1, 0)), s_zero,
                                  use_acc=False, is_async=True)
            mbarrier.wait(v_bar.index(prev), ((streamed + t - 1) // NBUF) & 1)
            acc_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), _tile(v_smem.index(prev), BLOCK_N,
                                                                                    HEAD_DIM), acc, is_async=True)
            if PINGPONG:
                mbarrier.arrive(turn_bar.index(1 - HALF))
            s = warpgroup_mma_wait(1, deps=[s_tok])  # S_t is done; P_{t-1} V_{t-1} may still run
            if PINGPONG and V_FREE > 0:
                mbarrier.arrive(empty_bar.index(slot))
            s = _masked_scores(s, offs_m, lo + t * BLOCK_N, n_k, right_offset, left_offset, full_lo, full_hi,
                               BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
            p, m_i, alpha, l_i = _softmax_step(s, m_i, l_i, qk_scale)
            acc = warpgroup_mma_wait(0, deps=[acc_tok])
            # Buffer `prev` is free: this warpgroup's wait above covers every product of its own that read it.
            if PINGPONG:
                mbarrier.arrive(empty_bar.index(V_FREE + prev))
            else:
                _load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + (t - 1 + NBUF) * BLOCK_N, prev,
                           t - 1 + NBUF < n_tiles)
            acc = acc * _rows(alpha, acc)
        last = (streamed + n_tiles - 1) % NBUF
        if PINGPONG:
            mbarrier.wait(turn_bar.index(HALF), (turns + n_tiles) & 1)
        mbarrier.wait(v_bar.index(last), ((streamed + n_tiles - 1) // NBUF) & 1)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), _tile(v_smem.index(last), BLOCK_N, HEAD_DIM),
                            acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn_bar.index(1 - HALF))
        acc = warpgroup_mma_wait(0, deps=[acc])
        if PINGPONG:
            mbarrier.arrive(empty_bar.index(V_FREE + last))
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
    acc = acc / _rows(l_safe, acc)
    _tile(staging, ROWS, HEAD_DIM).store(acc.to(o_desc.dtype))
    fence_async_shared()
    _tma_store(o_desc, [b, h, row, 0], staging)
    if DRAIN:
        tma.store_wait(0)


@gluon.jit
def attention_forward(q_desc, k_desc, v_desc, o_desc, L, n_bh, n_heads, kv_group, n_q, n_k, window_left,
                      window_right, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr):
    """One program (one warpgroup) = one query tile of one (batch, head); NBUF K/V buffers in flight.
    L is (B, H, Nq) float32, contiguous; window bounds as the `tl` forward takes them (-1: unbounded)."""
    dtype: gl.constexpr = q_desc.dtype

    bh, b, h, h_kv, start_m, right_offset, left_offset, lo, full_lo, full_hi, hi = _query_program(
        n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)

    q_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    k_smem, v_smem, k_bar, v_bar = _stream_buffers(k_desc, v_desc, BLOCK_N, HEAD_DIM, NBUF)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [b, h, start_m, 0], q_bar, q_box)
    for i in gl.static_range(NBUF):
        _load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + i * BLOCK_N, i, i < n_tiles)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _mma_layout(BLOCK_N)))
    mbarrier.wait(q_bar, 0)
    acc, m_i, l_i = _attend(_tile(q_box, BLOCK_M, HEAD_DIM), offs_m, k_smem, v_smem, k_bar, v_bar, n_tiles, lo,
                            full_lo, full_hi, n_k, right_offset, left_offset, qk_scale, k_desc, v_desc, b, h_kv, None,
                            None, 0, 0, 0, BLOCK_M, HEAD_DIM, BLOCK_N, NBUF, BOUND_RIGHT, BOUND_LEFT, False)

    _invalidate_barriers(q_bar, k_bar, v_bar, NBUF)
    _store_out(acc, m_i, l_i, offs_m, L + bh.to(gl.int64) * n_q, n_q, o_desc, b, h, start_m, q_box, BLOCK_M,
               HEAD_DIM)


@gluon.jit
def _produce_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, empty_bar, b, h_kv, row, g, NBUF: gl.constexpr):
    """A ping-pong producer's copy of the K and V tiles at `row`, the g-th tile it streams, into buffer g % NBUF:
    each once both consumers have handed back the tile that slot held (tile g - NBUF, where there was one), K's and
    V's apart with two slots (`_v_free_barriers`)."""
    V_FREE: gl.constexpr = _v_free_barriers(NBUF)
    slot = g % NBUF
    phase = ((g // NBUF) - 1) & 1
    reused = g >= NBUF
    mbarrier.wait(empty_bar.index(slot), phase, pred=reused)
    _load_tile(k_desc, k_smem, k_bar, b, h_kv, row, slot, True)
    if V_FREE > 0:
        mbarrier.wait(empty_bar.index(V_FREE + slot), phase, pred=reused)
    _load_tile(v_desc, v_smem, v_bar, b, h_kv, row, slot, True)


@gluon.jit
def _pingpong_producer(q_desc, k_desc, v_desc, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, empty_bar, b, h, h_kv,
                       start_m, lo, n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
    """One warp: both halves' queries, then K tile t into buffer t % NBUF once both consumers' S products have read
    K tile t - NBUF (with more than two slots: their P V products V tile t - NBUF), and V tile t once their P V
    products have read V tile t - NBUF (`_v_free_barriers`)."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    for half in gl.static_range(2):
        mbarrier.expect(q_bar.index(half), q_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, start_m + half * HALF_M, 0], q_bar.index(half), q_smem.index(half))
    for t in range(n_tiles):
        _produce_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, empty_bar, b, h_kv, lo + t * BLOCK_N, t, NBUF)


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
                            turn_bar, empty_bar, 0, 0, HALF, HALF_M, HEAD_DIM, BLOCK_N, NBUF, BOUND_RIGHT, BOUND_LEFT,
                            True)
    _store_out(acc, m_i, l_i, offs_m, L, n_q, o_desc, b, h, my_m, q_box, HALF_M, HEAD_DIM)


@gluon.constexpr_function
def _query_boxes(persistent):
    """Query boxes per warpgroup: two in a persistent program, so that the producer loads a tile's queries while the
    tile before it still runs (with one, they were loaded only once that tile's last product had read its box, and
    each tile's first products waited for the load); one in the ping-pong kernel, which loads its queries once."""
    return 2 if persistent else 1


@gluon.jit
def _pingpong_buffers(q_desc, k_desc, v_desc, o_desc, HALF_M: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_N: gl.constexpr, NBUF: gl.constexpr, PERSISTENT: gl.constexpr):
    """The ping-pong kernels' shared memory and barriers, initialised, warpgroup 0 holding the first turn: (query
    boxes (warpgroup h's at h * QBUF + slot, `_query_boxes`), K ring, V ring, query barriers (likewise), turn barriers,
    K, V and slot-free barriers: slot i's (K's with two slots) at i, with two slots V slot i's at NBUF + i,
    `_v_free_barriers`), and with PERSISTENT after them O's own staging boxes and the query-box-free barriers (the
    ping-pong kernel stores O through the query box and loads its queries once).

    Their own K/V ring, not `_stream_buffers`: the slots' free barriers are initialised in the same loop, and moving
    them after the ring's reorders the prologue (Triton 3.6 then adds a bar.sync; kernel_experiments.md, stop 35).
    The persistent kernel's two extra allocations sit where it measured them (its PTX is unchanged by this
    helper)."""
    dtype: gl.constexpr = q_desc.dtype
    QBUF: gl.constexpr = _query_boxes(PERSISTENT)
    q_smem = gl.allocate_shared_memory(dtype, [2 * QBUF, 1, 1, HALF_M, HEAD_DIM], q_desc.layout)
    if PERSISTENT:
        o_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, HALF_M, HEAD_DIM], o_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NBUF, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NBUF, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2 * QBUF, 1], mbarrier.MBarrierLayout())
    if PERSISTENT:
        q_empty = gl.allocate_shared_memory(gl.int64, [2 * QBUF, 1], mbarrier.MBarrierLayout())
    turn_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    V_FREE: gl.constexpr = _v_free_barriers(NBUF)
    empty_bar = gl.allocate_shared_memory(gl.int64, [V_FREE + NBUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        for slot in gl.static_range(QBUF):
            mbarrier.init(q_bar.index(i * QBUF + slot), count=1)
            if PERSISTENT:
                mbarrier.init(q_empty.index(i * QBUF + slot), count=1)
        mbarrier.init(turn_bar.index(i), count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
        mbarrier.init(empty_bar.index(i), count=2)
        if V_FREE > 0:
            mbarrier.init(empty_bar.index(V_FREE + i), count=2)
    fence_async_shared()
    mbarrier.arrive(turn_bar.index(0))  # warpgroup 0 takes the first turn
    if PERSISTENT:
        return q_smem, k_smem, v_smem, q_bar, turn_bar, k_bar, v_bar, empty_bar, o_smem, q_empty
    else:
        return q_smem, k_smem, v_smem, q_bar, turn_bar, k_bar, v_bar, empty_bar


@gluon.jit
def attention_forward_pingpong(q_desc, k_desc, v_desc, o_desc, L, n_bh, n_heads, kv_group, n_q, n_k,
                               window_left, window_right, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr,
                               NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Warp-specialised: a producer warp (TMA) and two consumer warpgroups of BLOCK_M // 2 rows each that share the
    key tiles and ping-pong (see _pingpong_consumer). q_desc and o_desc have BLOCK_M // 2-row boxes."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    bh, b, h, h_kv, start_m, right_offset, left_offset, lo, full_lo, full_hi, hi = _query_program(
        n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    L = L + bh.to(gl.int64) * n_q
    q_smem, k_smem, v_smem, q_bar, turn_bar, k_bar, v_bar, empty_bar = _pingpong_buffers(
        q_desc, k_desc, v_desc, o_desc, HALF_M, HEAD_DIM, BLOCK_N, NBUF, False)
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


@gluon.jit
def _persistent_tile(j, n_m_tiles, n_heads, kv_group, n_q, n_k, window_left, window_right, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """A persistent program's j-th query tile: whether it has one (`valid`), then `_query_program`'s values for it.
    The program runs units program_id, program_id + num_programs, ...; a unit is a pair of one (batch, head)'s query
    tiles, the k-th from the end and the k-th from the start (one tile in the middle of an odd count), units of one
    head after another. Why pairs: under a causal mask the pair's key tiles add up to the same count in every unit,
    so the programs' loads come out even. Tiles handed round one by one (tile program_id + i * num_programs) gave
    one program 1.6x another's work at 128 tiles a head on 132 SMs."""
    half = (n_m_tiles + 1) // 2
    unit = gl.program_id(0) + (j // 2) * gl.num_programs(0)
    k = unit % half
    bh = unit // half
    pid_m = gl.where(j % 2 == 0, n_m_tiles - 1 - k, k)
    valid = (j % 2 == 0) | (pid_m != n_m_tiles - 1 - k)
    h = (bh % n_heads).to(gl.int32)
    start_m = pid_m * BLOCK_M
    right_offset, left_offset, lo, full_lo, full_hi, hi = _key_geometry(
        start_m, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
    return valid, bh, (bh // n_heads).to(gl.int32), h, h // kv_group, start_m, right_offset, left_offset, lo, \
        full_lo, full_hi, hi


@gluon.jit
def _persistent_steps(n_m_tiles, n_bh):
    """How many query tiles (`_persistent_tile`'s j) this persistent program steps through, invalid ones included."""
    n_units = (n_m_tiles + 1) // 2 * n_bh
    return 2 * gl.cdiv(gl.maximum(n_units - gl.program_id(0), 0), gl.num_programs(0))


@gluon.jit
def _persistent_producer(q_desc, k_desc, v_desc, q_smem, q_bar, q_empty, k_smem, v_smem, k_bar, v_bar, empty_bar,
                         n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, n_m_tiles,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr,
                         BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr):
    """One warp: for each of the program's query tiles, both halves' queries into the boxes their warpgroups freed
    QBUF tiles before (q_empty), then its K/V tiles through the ring, as `_pingpong_producer`; the ring's slots and
    phases run on across query tiles, so the next tile's queries and K/V stream in while this one's last products
    run."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    QBUF: gl.constexpr = _query_boxes(True)
    streamed = 0
    i = 0
    for j in range(_persistent_steps(n_m_tiles, n_bh)):
        valid, _, b, h, h_kv, start_m, _, _, lo, _, _, hi = _persistent_tile(
            j, n_m_tiles, n_heads, kv_group, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT,
            BOUND_LEFT)
        if valid:
            for half in gl.static_range(2):
                box = half * QBUF + i % QBUF
                mbarrier.wait(q_empty.index(box), ((i // QBUF) - 1) & 1, pred=i >= QBUF)
                mbarrier.expect(q_bar.index(box), q_desc.block_type.nbytes)
                _tma_load(q_desc, [b, h, start_m + half * HALF_M, 0], q_bar.index(box), q_smem.index(box))
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            for t in range(n_tiles):
                _produce_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, empty_bar, b, h_kv, lo + t * BLOCK_N,
                                 streamed + t, NBUF)
            streamed += n_tiles
            i += 1


@gluon.jit
def _persistent_consumer(o_desc, L, q_smem, q_bar, q_empty, o_smem, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar,
                         n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, n_m_tiles, qk_scale,
                         HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                         BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr, NBUF: gl.constexpr):
    """One warpgroup of a persistent program: `_pingpong_consumer` over each of the program's query tiles in turn. It
    hands its query box back to the producer as soon as its last product has read it, and writes O through a box of
    its own without waiting for the store (it waits before writing the box again), so the next tile's queries load
    and its first products issue while this tile's output is still on its way out."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    QBUF: gl.constexpr = _query_boxes(True)
    staging = o_smem.index(HALF)
    streamed = 0
    turns = 0
    i = 0
    for j in range(_persistent_steps(n_m_tiles, n_bh)):
        valid, bh, b, h, _, start_m, right_offset, left_offset, lo, full_lo, full_hi, hi = _persistent_tile(
            j, n_m_tiles, n_heads, kv_group, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT,
            BOUND_LEFT)
        if valid:
            n_tiles = gl.cdiv(hi - lo, BLOCK_N)
            my_m = start_m + HALF * HALF_M
            offs_m = my_m + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, _mma_layout(BLOCK_N)))
            box = HALF * QBUF + i % QBUF
            mbarrier.wait(q_bar.index(box), (i // QBUF) & 1)
            acc, m_i, l_i = _attend(_tile(q_smem.index(box), HALF_M, HEAD_DIM), offs_m, k_smem, v_smem, k_bar, v_bar,
                                    n_tiles, lo, full_lo, full_hi, n_k, right_offset, left_offset, qk_scale, None,
                                    None, None, None, turn_bar, empty_bar, streamed, turns, HALF, HALF_M, HEAD_DIM,
                                    BLOCK_N, NBUF, BOUND_RIGHT, BOUND_LEFT, True)
            mbarrier.arrive(q_empty.index(box))  # every product that read the queries has completed
            tma.store_wait(0)  # the last tile's output has left the staging box
            _store_out(acc, m_i, l_i, offs_m, L + bh.to(gl.int64) * n_q, n_q, o_desc, b, h, my_m, staging, HALF_M,
                       HEAD_DIM, False)
            streamed += n_tiles
            turns += gl.where(n_tiles > 0, n_tiles + 1, 0)
            i += 1
    tma.store_wait(0)


@gluon.jit
def attention_forward_persistent(q_desc, k_desc, v_desc, o_desc, L, n_bh, n_heads, kv_group, n_q, n_k,
                                 window_left, window_right, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                 BLOCK_N: gl.constexpr, BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr,
                                 NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """`attention_forward_pingpong` as a persistent kernel: each program (one per SM) runs its share of the query
    tiles one after another, in pairs (`_persistent_tile`). What a program of that kernel does once per query tile
    (launch, load the queries, wait for the first K/V tiles, store the output) overlaps the previous tile's work here
    (FlashAttention-3's persistent schedule). O has its own staging boxes (HALF_M rows each), and each warpgroup two
    query boxes, so that the next tile's queries are loaded before this tile ends (0.2-5% faster than one in 18 of
    24 variant-cells on an H100, the most at N 1024: kernel_experiments.md, stop 49; 229,816 bytes of shared memory
    at D 128 with two 128-row K/V buffers)."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    n_m_tiles = gl.cdiv(n_q, BLOCK_M)
    q_smem, k_smem, v_smem, q_bar, turn_bar, k_bar, v_bar, empty_bar, o_smem, q_empty = _pingpong_buffers(
        q_desc, k_desc, v_desc, o_desc, HALF_M, HEAD_DIM, BLOCK_N, NBUF, True)
    gl.warp_specialize([(_persistent_consumer, (o_desc, L, q_smem, q_bar, q_empty, o_smem, k_smem, v_smem, k_bar, v_bar,
                                                empty_bar, turn_bar, n_bh, n_heads, kv_group, n_q, n_k,
                                                window_left, window_right, n_m_tiles, qk_scale, 0, HEAD_DIM, BLOCK_M,
                                                BLOCK_N, BOUND_RIGHT, BOUND_LEFT, NBUF)),
                        (_persistent_consumer, (o_desc, L, q_smem, q_bar, q_empty, o_smem, k_smem, v_smem, k_bar, v_bar,
                                                empty_bar, turn_bar, n_bh, n_heads, kv_group, n_q, n_k,
                                                window_left, window_right, n_m_tiles, qk_scale, 1, HEAD_DIM, BLOCK_M,
                                                BLOCK_N, BOUND_RIGHT, BOUND_LEFT, NBUF)),
                        (_persistent_producer, (q_desc, k_desc, v_desc, q_smem, q_bar, q_empty, k_smem, v_smem, k_bar,
                                                v_bar, empty_bar, n_bh, n_heads, kv_group, n_q, n_k,
                                                window_left, window_right, n_m_tiles, BLOCK_M, BLOCK_N, BOUND_RIGHT,
                                                BOUND_LEFT, NBUF))],
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


@gluon.jit
def _transposed_probabilities(k_tile, v_tile, q_tile, do_tile, do_ready, phase, s_zero, neg_lse2, qk_scale, offs_n,
                              start_m, full_lo, full_hi, n_q, right_offset, left_offset, BLOCK_M: gl.constexpr,
                              BOUND_RIGHT: gl.constexpr, BOUND_LEFT: gl.constexpr):
    """A dK/dV tile's first steps on transposed scores (keys x queries), once Q's tile is in (the caller waited for
    it): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ issued together, dPᵀ once dO's tile is in; wait for Sᵀ only;
    Pᵀ = exp2(Sᵀ·scale - L), masked where the query tile straddles a window edge or the end of the queries.
    neg_lse2 (-L * log2 e of the tile's rows) is in registers or a row of shared memory (`_vector_in`).
    Returns (Pᵀ, dPᵀ's token): dPᵀ may still be on the tensor cores."""
    col_layout: gl.constexpr = gl.SliceLayout(0, s_zero.type.layout)  # a vector over Sᵀ's columns (queries)
    s_tok = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.wait(do_ready, phase)
    dp_tok = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=[s_tok])  # dPᵀ may still run
    p = gl.exp2(s * qk_scale + _vector_in(neg_lse2, col_layout)[None, :])
    if (start_m < full_lo) | (start_m >= full_hi):  # a tile at a window edge or the end of the queries
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=col_layout)
        visible = _visible(offs_m[None, :], offs_n[:, None], offs_m[None, :], n_q, right_offset, left_offset,
                           BOUND_RIGHT, BOUND_LEFT)
        p = gl.where(visible, p, 0.0)
    return p, dp_tok


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
    s_layout: gl.constexpr = _mma_layout(BLOCK_M, WARPS)
    acc_layout: gl.constexpr = _mma_layout(HEAD_DIM, WARPS)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)  # a vector over Sᵀ's columns (queries)
    row_layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])  # one row per thread
    dtype: gl.constexpr = q_desc.dtype

    # The first key tiles are seen by the most queries: the grid's order already runs the heaviest first.
    pid_n, bh_kv, b, h_kv, _ = _program_tile(n_bh, n_heads // kv_group, 1, False)
    start_n = pid_n * BLOCK_N
    right_offset = n_k - n_q + window_right  # as in `_query_program`
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = _query_tile_range(start_n, n_q, right_offset, left_offset, BLOCK_M, BLOCK_N,
                                                 BOUND_RIGHT, BOUND_LEFT)
    n_m_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_M)
    n_iter = n_m_tiles * kv_group

    k_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    q_smem, do_smem, q_bar, do_bar = _stream_buffers(q_desc, do_desc, BLOCK_M, HEAD_DIM, NBUF)
    fence_async_shared()

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
        p, dp_tok = _transposed_probabilities(k_tile, v_tile, q_tile, do_tile, do_bar.index(slot), phase, s_zero,
                                              neg_lse2, qk_scale, offs_n, start_m, full_lo, full_hi, n_q,
                                              right_offset, left_offset, BLOCK_M, BOUND_RIGHT, BOUND_LEFT)
        dv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), op_layout), do_tile, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=[dp_tok])  # dV's product may still run
        ds = p * (dp - gl.convert_layout(delta, col_layout)[None, :])
        dk_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), q_tile, dk, is_async=True)
        # Under dK's product: the next tile's pairs.
        neg_lse2, delta = _lse_delta(LseDelta, b, n_heads, n_q, j + 1, n_iter, n_m_tiles, lo, h_kv, kv_group,
                                     BLOCK_M, row_layout)
        # Every product drains before the next tile: with products in flight across iterations, ptxas cannot
        # tell which ones a partial wait retires and serialises every wgmma (a second program per SM fills in).
        dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        h_r, row_r = _query_tile(j + NBUF, n_m_tiles, lo, h_kv, kv_group, BLOCK_M)
        _load_pair(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b, h_r, row_r, slot, j + NBUF < n_iter)

    _invalidate_barriers(kv_bar, q_bar, do_bar, NBUF)
    # K and V are no longer read: their boxes stage the stores (TMA clips rows past n_k).
    k_tile.store((dk * softmax_scale).to(dtype))
    v_tile.store(dv.to(dtype))
    fence_async_shared()
    _tma_store(dk_desc, [b, h_kv, start_n, 0], k_box)
    _tma_store(dv_desc, [b, h_kv, start_n, 0], v_box)
    tma.store_wait(0)


# ----------------------------------------------------------------------------------------------------
# Backward: dQ
# ----------------------------------------------------------------------------------------------------


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
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, WARPS)
    acc_layout: gl.constexpr = _mma_layout(HEAD_DIM, WARPS)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    dtype: gl.constexpr = q_desc.dtype

    bh, b, h, h_kv, start_m, right_offset, left_offset, lo, full_lo, full_hi, hi = _query_program(
        n_bh, n_heads, kv_group, n_q, n_k, window_left, window_right, BLOCK_M, BLOCK_N, BOUND_RIGHT, BOUND_LEFT)
    n_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

    q_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], do_desc.layout)
    o_box = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], o_desc.layout)
    qo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(qo_bar, count=1)
    k_smem, v_smem, k_bar, v_bar = _stream_buffers(k_desc, v_desc, BLOCK_N, HEAD_DIM, NBUF)
    fence_async_shared()

    mbarrier.expect(qo_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes + o_desc.block_type.nbytes)
    _tma_load(q_desc, [b, h, start_m, 0], qo_bar, q_box)
    _tma_load(do_desc, [b, h, start_m, 0], qo_bar, do_box)
    _tma_load(o_desc, [b, h, start_m, 0], qo_bar, o_box)
    for i in gl.static_range(NBUF):
        _load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + i * BLOCK_N, i, i < n_tiles)

    # L and D of this tile's rows, and the pairs for the dK/dV kernel (rows past n_q: L = 0, D = 0, not stored).
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=rows_layout)
    row_ok = offs_m < n_q
    lse = gl.load(L + bh.to(gl.int64) * n_q + offs_m, mask=row_ok, other=0.0)
    neg_lse2 = gl.where(lse == float("-inf"), 0.0, lse * -1.4426950408889634)  # a row that sees no key: all masked
    q_tile = _tile(q_box, BLOCK_M, HEAD_DIM)
    do_tile = _tile(do_box, BLOCK_M, HEAD_DIM)
    mbarrier.wait(qo_bar, 0)
    o = _tile(o_box, BLOCK_M, HEAD_DIM).load(io_layout).to(gl.float32)
    delta = gl.convert_layout(gl.sum(o * do_tile.load(io_layout).to(gl.float32), axis=1), rows_layout)
    pairs = LseDelta + (bh.to(gl.int64) * n_q + offs_m) * 2
    gl.store(pairs, neg_lse2, mask=row_ok)
    gl.store(pairs + 1, delta, mask=row_ok)

    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=acc_layout)
    for t in range(n_tiles):
        slot = t % NBUF
        phase = (t // NBUF) & 1
        k_tile = _tile(k_smem.index(slot), BLOCK_N, HEAD_DIM)
        v_tile = _tile(v_smem.index(slot), BLOCK_N, HEAD_DIM)
        mbarrier.wait(k_bar.index(slot), phase)
        s_tok = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(slot), phase)
        dp_tok = warpgroup_mma(do_tile, v_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])  # dP may still run
        s = _masked_scores(s, offs_m, lo + t * BLOCK_N, n_k, right_offset, left_offset, full_lo, full_hi, BLOCK_N,
                           BOUND_RIGHT, BOUND_LEFT)
        p = gl.exp2(s * qk_scale + neg_lse2[:, None])
        dp = warpgroup_mma_wait(0, deps=[dp_tok])
        ds = p * (dp - delta[:, None])
        dq_tok = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), k_tile, dq, is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        _load_pair(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, h_kv, lo + (t + NBUF) * BLOCK_N, slot,
                   t + NBUF < n_tiles)

    _invalidate_barriers(qo_bar, k_bar, v_bar, NBUF)
    # Q is no longer read: its box stages the store (TMA clips rows past n_q).
    q_tile.store((dq * softmax_scale).to(dtype))
    fence_async_shared()
    _tma_store(dq_desc, [b, h, start_m, 0], q_box)
    tma.store_wait(0)


# ----------------------------------------------------------------------------------------------------
# Backward in one pass: FlashAttention-3's warp-specialised layout
# ----------------------------------------------------------------------------------------------------
#
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
#   mask). Two heaviest-first orders were 1.4-1.6x slower at N 16384: their programs reach each tile together,
#   so every turn waits a whole hop (kernel_experiments.md, stop 41);
# - paired (causal masks, both kinds; `flash_triton._paired_key_program`): groups of heads that about fill the
#   SMs; even groups as the masked order, odd groups launch from key tile 0 up and visit their query tiles from the
#   last down, so key tile n - 1 (launched before n, on an SM that freed earlier) reaches each tile ahead of n and
#   the adds go from key tile 0 up (`down`). An odd group's heavy programs start as the even group's light ones
#   end, so no head's heaviest tiles are left to run alone at the end: the lightest-first order's tail, 5-7% of
#   the D 128 causal backward at N 8192-16384 (kernel_experiments.md, stop 52);
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
    _barrier()  # every lane's adds (the one that issued them) complete before lane 0 counts them
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
def _one_pass_tile(j, n_m_tiles, lo, rot, down, h_kv, kv_group, BLOCK_M: gl.constexpr):
    """(query head, first row) of the j-th query tile a one-pass program visits: `_query_tile`'s, each head's tiles
    starting at tile `rot` (0 <= rot < n_m_tiles) and wrapping around; with `down` (1, rot 0) from the last down."""
    g = j // n_m_tiles
    i = (j - g * n_m_tiles + rot) % n_m_tiles
    return h_kv * kv_group + g, lo + (i + down * (n_m_tiles - 1 - 2 * i)) * BLOCK_M


@gluon.jit
def _copy_pairs(LseDelta, pair_box, bar, b, n_heads, n_q, h, start_m, BLOCK_M: gl.constexpr):
    """The (-L * log2 e, D) pairs of the query tile of head h starting at row start_m (zeros past n_q) into
    `pair_box`, 2 * BLOCK_M float32s: the rows' -L * log2 e, then their D (`_pair_rows`). By cp.async, 4 bytes a
    copy (the global pairs are interleaved), from the (one-warp) caller, counted on `bar`: its phase then completes
    only once they have landed. The consumers read each half in the columns of Sᵀ they hold, where loaded from
    global memory one row per thread and converted, each tile took three warpgroup barriers (a shared-memory round
    trip per conversion; kernel_experiments.md, stop 45)."""
    i = gl.arange(0, 2 * BLOCK_M, layout=gl.BlockedLayout([1], [32], [1], [0]))
    second = (i >= BLOCK_M).to(gl.int32)  # D's half
    rows = start_m + i - second * BLOCK_M
    pairs = LseDelta + (b * n_heads + h).to(gl.int64) * n_q * 2
    _cp_async(pair_box, pairs + rows * 2 + second, mask=rows < n_q)
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
    _tma_load(k_desc, [b, h_kv, start_n, 0], kv_bar, k_box)
    _tma_load(v_desc, [b, h_kv, start_n, 0], kv_bar, v_box)
    for j in range(n_iter):
        slot = j % NBUF
        mbarrier.wait(empty_bar.index(slot), ((j // NBUF) - 1) & 1, pred=j >= NBUF)
        h, start_m = _one_pass_tile(j, n_m_tiles, lo, rot, down, h_kv, kv_group, BLOCK_M)
        # The pairs first: their count on Q's barrier must be in before the TMA's arrival can complete its phase.
        _copy_pairs(LseDelta, pair_smem.index(slot), q_bar.index(slot), b, n_heads, n_q, h, start_m, BLOCK_M)
        _load_pair(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b, h, start_m, slot, True)


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
            _tma_store(dq_desc, coord, dq_stage.index(first + half))
        else:
            _tma_add(dq_desc, coord, dq_stage.index(first + half))


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
            turn = _one_pass_turn(m, pid_n, n_k_tiles, stride, right_offset, down, BLOCK_M, BLOCK_N, BOUND_RIGHT,
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
            # Before the staging boxes go back: counting the turn after that delayed each hop of the full masks'
            # ring (22% slower at D 64, N 4096; kernel_experiments.md, stop 40).
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
    """dQ's share (ROWS, COLS) with its rows in the float32 sum's order (`flash_gluon.dq_sum_row`): row 4h + i of
    each 8 (h < 2, i < 4) to 2i + h, the same registers relabelled, no data moved, and the staging store free of bank
    conflicts. The shape and order are literals: Triton 3.6's permute refuses them as constexpr values."""
    return gl.reshape(gl.permute(gl.reshape(dq, [ROWS // 8, 2, 4, COLS]), (0, 2, 1, 3)), [ROWS, COLS])


@gluon.jit
def _sum_row(r):
    """`flash_gluon.dq_sum_row` in a Gluon kernel."""
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
    _tile(dq_stage.index(box), DQ_ROWS, DQ_COLS).store(_in_sum_order(dq, DQ_ROWS, DQ_COLS))
    fence_async_shared()
    _barrier()
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
    took the ring's last turn (`_ring_last_tiles`, each query head of the group), each once its semaphore counts
    all n_k_tiles turns (every turn is counted once its adds have completed): what the epilogue kernel does for the
    whole sum, without its launch and beside the compute-bound programs instead of after them (kernel_experiments.md,
    stop 53). DQ is dense (B, H, Nq, D), DqAcc (B, H, Nq rounded up to 8, D) in `flash_gluon.dq_sum_row`'s order; the
    two consumers take every other tile (warpgroup HALF from tile HALF)."""
    layout: gl.constexpr = _fold_layout(HEAD_DIM)
    wait_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    m_lo, m_hi = _ring_last_tiles(pid_n, n_k_tiles, n_m_tiles, stride)
    per_head = m_hi - m_lo
    b = bh_kv // n_kv_heads
    n_heads = n_kv_heads * kv_group
    n_sum = (n_q + 7) // 8 * 8  # the sum's rows a head (`flash_gluon.dq_sum_rows`)
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
    s_layout: gl.constexpr = _mma_layout(BLOCK_M)
    acc_layout: gl.constexpr = _mma_layout(HEAD_DIM)
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    col_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    dq_layout: gl.constexpr = _mma_layout(DQ_COLS)
    dtype: gl.constexpr = q_smem.dtype
    my_n = start_n + HALF * HALF_N
    k_all = _tile(k_box, 2 * HALF_N, HEAD_DIM)
    v_all = _tile(v_box, 2 * HALF_N, HEAD_DIM)
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
    for j in range(n_iter):
        slot = j % NBUF
        phase = (j // NBUF) & 1
        h, start_m = _one_pass_tile(j, n_m_tiles, lo, rot, down, h_kv, kv_group, BLOCK_M)
        q_tile = _tile(q_smem.index(slot), BLOCK_M, HEAD_DIM)
        do_tile = _tile(do_smem.index(slot), BLOCK_M, HEAD_DIM)
        neg_lse2, delta = _pair_rows(pair_smem.index(slot), BLOCK_M)
        mbarrier.wait(q_bar.index(slot), phase)  # Q's tile and the pairs
        p, dp_tok = _transposed_probabilities(k_tile, v_tile, q_tile, do_tile, do_bar.index(slot), phase, s_zero,
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
        _barrier()
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
        out = _reinterpret(dq_stage.index(HALF), dtype, [2, 1, 1, HALF_N, HEAD_DIM], dk_desc.layout).index(0)
    else:
        mbarrier.wait(stage_empty.index((last % NSTAGE) * 2 + HALF), (last // NSTAGE) & 1, pred=n_iter > 0)
        out = _reinterpret(dq_stage.index(HALF), dtype, [1, 1, HALF_N, HEAD_DIM], dk_desc.layout)
    _tile(out, HALF_N, HEAD_DIM).store((dk * softmax_scale).to(dtype))
    fence_async_shared()
    _barrier()
    _tma_store(dk_desc, [b, h_kv, my_n, 0], out)
    tma.store_wait(0)
    _barrier()
    _tile(out, HALF_N, HEAD_DIM).store(dv.to(dtype))
    fence_async_shared()
    _barrier()
    _tma_store(dv_desc, [b, h_kv, my_n, 0], out)
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
    `flash_gluon.dq_sum_row`'s order, zeroed first; unscaled), half of its rows or columns per consumer. LseDelta holds
    the (-L * log2 e, rowsum(dO * O)) pairs, written before; the producer copies each query tile's into shared memory
    beside its Q (`_copy_pairs`). k_desc and v_desc copy BLOCK_N-row boxes; dk_desc and dv_desc BLOCK_N // 2-row boxes;
    dq_desc a consumer's share, (BLOCK_M, D / 2) or (BLOCK_M / 2, D) boxes (`_one_pass_consumer`). NSTAGE sets of dQ
    staging boxes (two is 16 KB more shared memory at D 64 with 64-row query tiles; at D 128 two fit only with two Q/dO
    buffers, 230,944-230,976 bytes, and ran 5-7% faster deterministic under full masks, 1-2% slower causal,
    kernel_experiments.md, stop 45; with 128-row tiles at D 64 likewise, 231,968-232,000 bytes, where they ran 0-5%
    faster, stop 44).

    DETERMINISTIC: dQ's sums are added in a fixed order, ordered by Sem, (B, H, cdiv(Nq, BLOCK_M)) int32 zeroed
    first (see the section's comment); ROTATE (full masks, Nq / BLOCK_M >= Nk / BLOCK_N, and at most one head's
    cdiv(Nk, BLOCK_N) programs per SM) rotates each program's first query tile; PAIRED (a right bound and no left
    one, either kind) launches in `flash_triton._paired_key_program`'s order, group_heads heads a group, every other
    group's programs visiting their query tiles downward; PASS_LATE (only where each program's
    predecessor at a tile is two or more tiles ahead of it: `_one_pass_dq_writer`) counts a tile's turn after the
    next tile's adds are issued. Without DETERMINISTIC (Sem unread) dQ's sums run in no fixed order, so their last
    bits vary from run to run.

    DQ_ALTERNATE (with NSTAGE 2): the consumers take turns at each query tile's whole dQ product instead of each
    computing half of it (`_one_pass_consumer`); dq_desc's boxes are then the whole tile. With 128-row query tiles at
    D 64 that ran 1-4% faster in all 12 cells measured, deterministic or not; at D 128 (64-row tiles) 9-18% slower,
    where the turn's product (m64n128k128) is twice any other, the likeliest reason (kernel_experiments.md, stop 46).

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
    # (interleaving all the heads made the deterministic causal backward 1.5-1.8x slower: kernel_experiments.md);
    # with DETERMINISTIC and not ROTATE each head's key tiles from the last down, so that the tiles whose adds go
    # first start first. PAIRED (a right bound and no left one): groups of group_heads heads instead
    # (`flash_triton._paired_key_program`), each group's programs about filling the SMs.
    if PAIRED:
        pid_n, bh_kv, b, h_kv, down = _paired_program_tile(n_bh, n_kv_heads, n_k_tiles, group_heads)
    elif FOLD_DQ:
        pid_n, bh_kv, b, h_kv, _ = _program_tile(n_bh + fold_lag, n_kv_heads, 1, False)
        down = 0
    else:
        pid_n, bh_kv, b, h_kv, _ = _program_tile(n_bh, n_kv_heads, 1, DETERMINISTIC and not ROTATE)
        down = 0
    bh_kv = bh_kv.to(gl.int32)
    start_n = pid_n * BLOCK_N
    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo, full_lo, full_hi, hi = _query_tile_range(start_n, n_q, right_offset, left_offset, BLOCK_M, BLOCK_N,
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
    q_smem, do_smem, q_bar, do_bar = _stream_buffers(q_desc, do_desc, BLOCK_M, HEAD_DIM, NBUF)
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
