"""The decode forward: a few queries (Nq <= 16) against a long K/V cache, split across the keys (flash-decoding).

A forward kernel program covers a tile of up to 128 query rows of one head; with one query per sequence it fills one
row of the tile and the grid has only batch * heads programs, too few to read the cache at the memory's speed. The
decode kernel instead gives each program all the query rows of one K/V head's group (the query heads that share
the K/V head, times Nq: grouped-query attention reads each cached key once for all of them) and one slice of the
keys. Where the (batch, K/V head) programs leave most of the GPU idle, the keys are split so that all the programs
still run in one wave, and a second kernel combines the slices' partial results by their logsumexps; where they
fill it, the one slice writes O and L itself (one launch, no partials). Both are `tl` kernels: they run wherever
the forward kernel runs, the interpreter included.

The masks are the forward's (bottom-right aligned windows, `tiles.visible`); the output and the saved logsumexp are
the forward's too, so the backward kernels take them unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from .. import device_limits
from ..replay.plans import Recorded
from .launch import positional, run_fixed
from ..validation import decode_fits
from .tiles import LN2_C, as_fp32, visible

MIN_KEYS = 512  # below this the forward kernel's grid has enough programs (or the cache is read in no time)
SPLIT_MIN_KEYS = 256  # the fewest keys a split is given: fewer cost more in partials than they save
TILE_BYTES = 32768  # one K (or V) tile: 128 keys x 128 bf16 dims; three stages buffer two of each, 136 KB on sm_90
SHORT_TILE_BYTES = TILE_BYTES // 2  # where short programs outnumber SMs: smaller tiles, more programs an SM (`tiling`)
SHORT_PROGRAM_KEYS = 4096  # a program of more keys keeps its SM busy by itself
CPU_PROGRAMS = 4  # the interpreter's stand-in for a GPU's SM count: small test shapes take both paths


@triton.jit
def flash_decode_split_kernel(
    Q, K, V, O, L, PartO, PartL, KeyStart, KeyMask,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_on, stride_od, mask_row_stride,
    n_heads, kv_group, n_q, n_k, n_splits, split_len, window_left, window_right, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BOUND_RIGHT: tl.constexpr, BOUND_LEFT: tl.constexpr, FP32_IEEE: tl.constexpr, DIRECT: tl.constexpr,
    HAS_KEY_START: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
):
    """One program = one (batch, K/V head) and one split of the keys: rows r < kv_group * n_q are query head
    kv_head * kv_group + r // n_q, query r % n_q. Writes, per row and split, the split's normalised output and its
    logsumexp (natural log; -inf where the split holds no visible key) to PartO (rows, splits, HEAD_DIM) and
    PartL (rows, splits) float32, rows in (batch, query head, query) order. DIRECT (one split): writes O (in its
    dtype, as the combine kernel would) and L instead, and PartO, PartL are not read. HAS_KEY_START: batch row b
    sees no key before KeyStart[b] (int32; a left-padded cache), which is not read otherwise. HAS_KEY_MASK: batch row
    b sees key j only where KeyMask[b * mask_row_stride + j] is nonzero (uint8; a padding mask over the cache)."""
    qk_scale = as_fp32(qk_scale)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n_kv_heads = n_heads // kv_group
    b = (pid // n_kv_heads).to(tl.int64)
    kv_head = (pid % n_kv_heads).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_r < kv_group * n_q
    head = kv_head * kv_group + offs_r // n_q
    query = offs_r % n_q
    q_ptrs = Q + b * stride_qb + head[:, None] * stride_qh + query[:, None] * stride_qn + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    K += b * stride_kb + kv_head * stride_kh
    V += b * stride_vb + kv_head * stride_vh

    # This split's keys, narrowed to those some query of the group sees.
    right_offset = n_k - n_q + window_right
    left_offset = n_k - n_q - window_left
    lo = split * split_len
    hi = tl.minimum(lo + split_len, n_k)
    if BOUND_RIGHT:
        hi = tl.minimum(hi, n_q - 1 + right_offset + 1)
    if BOUND_LEFT:
        lo = tl.maximum(lo, left_offset // BLOCK_N * BLOCK_N)
    if HAS_KEY_START:
        first = tl.load(KeyStart + b)
        lo = tl.maximum(lo, first // BLOCK_N * BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_mask = (cols[:, None] < hi) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + cols[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        if FP32_IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        seen = visible(query[:, None], cols[None, :], cols[None, :], hi, right_offset, left_offset,
                       BOUND_RIGHT, BOUND_LEFT)
        if HAS_KEY_START:
            seen = seen & (cols[None, :] >= first)
        if HAS_KEY_MASK:
            real = tl.load(KeyMask + b * mask_row_stride + cols, mask=cols < hi, other=0)
            seen = seen & (real[None, :] != 0)
        qk = tl.where(seen, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP32_IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    seen_any = l_i > 0.0
    l_safe = tl.where(seen_any, l_i, 1.0)
    lse = tl.where(seen_any, m_i * LN2_C + tl.log(l_safe), float("-inf"))
    rows = (b * n_heads + head) * n_q + query
    out_ok = row_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
    if DIRECT:
        tl.store(L + rows, lse, mask=row_ok)
        o_ptrs = (O + b * stride_ob + head[:, None] * stride_oh + query[:, None] * stride_on
                  + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=out_ok)
    else:
        tl.store(PartL + rows * n_splits + split, lse, mask=row_ok)
        out_ptrs = PartO + (rows[:, None] * n_splits + split) * HEAD_DIM + offs_d[None, :]
        tl.store(out_ptrs, acc / l_safe[:, None], mask=out_ok)


@triton.jit
def flash_decode_combine_kernel(
    PartO, PartL, O, L,
    stride_ob, stride_oh, stride_on, stride_od,
    n_heads, n_q, n_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program = one query row (batch, head, query): the splits' outputs weighted by exp(their logsumexp - the
    row's), written to O (in its dtype) and the row's logsumexp to L (the forward's (B, H, Nq) layout). A row no
    split saw outputs 0 with logsumexp -inf, as the forward kernel's."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse_s = tl.load(PartL + row * n_splits + offs_s, mask=offs_s < n_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m_sub = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_sub)
    total = tl.sum(w, 0)
    parts = tl.load(PartO + (row * n_splits + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                    mask=(offs_s[:, None] < n_splits) & (offs_d[None, :] < HEAD_DIM), other=0.0)
    seen = total > 0.0
    total_safe = tl.where(seen, total, 1.0)
    out = tl.sum(parts * w[:, None], 0) / total_safe
    tl.store(L + row, tl.where(seen, m_sub + tl.log(total_safe), float("-inf")))
    query = row % n_q
    bh = row // n_q
    b = bh // n_heads
    h = bh % n_heads
    o_ptrs = O + b * stride_ob + h * stride_oh + query * stride_on + offs_d * stride_od
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_d < HEAD_DIM)


def takes(n_q: int, n_k: int, kv_group: int, varlen: bool) -> bool:
    """Whether a call goes to the decode kernels: a dense batch whose queries and group rows fit a decode program
    (`validation.decode_fits`), and a cache of at least MIN_KEYS keys."""
    return not varlen and type(n_q) is int and type(n_k) is int and decode_fits(n_q, kv_group) and n_k >= MIN_KEYS


def program_target(device: torch.device) -> int:
    """How many decode programs a wave of whole-SM programs holds (`tiling`): one per SM (at D 128 bf16 a program's
    three stages of 128-key K and V tiles take 136 KB of shared memory; where the keys are split to fill the wave,
    timed against two per SM, one was as fast or faster; MPS's share counted); CPU_PROGRAMS stand in on a CPU."""
    return device_limits.usable_sms(device, stand_in=CPU_PROGRAMS)


def splits(n_k: int, programs: int, target: int, block_n: int) -> tuple[int, int]:
    """(number of splits, keys per split, a multiple of block_n) for `programs` (batch, K/V head) programs: the
    most splits that keep every program in one wave of `target`, each split at least SPLIT_MIN_KEYS keys. One
    split where the programs alone fill more than half the wave: more would add a second wave, or the partials'
    traffic and the combine's launch, and save less (H200, one query, 32/8 heads, D 128: 128 programs took 28.9 us
    in one split against 31.0 in two)."""
    n_splits = max(1, min(target // programs, triton.cdiv(n_k, SPLIT_MIN_KEYS)))
    split_len = triton.cdiv(triton.cdiv(n_k, n_splits), block_n) * block_n
    return triton.cdiv(n_k, split_len), split_len


def key_tile(block_d: int, element_size: int, tile_bytes: int = TILE_BYTES) -> int:
    """Keys per tile: tile_bytes of K (TILE_BYTES, bf16 D 128: 128 keys; fp32 or D 256: 64), between 16 and 128."""
    return max(16, min(128, tile_bytes // (block_d * element_size)))


def shared_bytes(block_n: int, block_d: int, element_size: int, stages: int) -> int:
    """The shared memory the split kernel takes, as Triton compiles it for sm_90 (launch-specialised, D 128 bf16:
    139,264 bytes at 128 keys and three stages, 71,680 at 64 and three, 38,912 at 64 and two): it buffers stages - 1
    K and V tiles, plus up to 8 KB for its layout conversions."""
    return (stages - 1) * 2 * block_n * block_d * element_size + 8192


def shared_limit(device: torch.device) -> int | None:
    """The most shared memory a program may take on `device` (`device_limits.max_shared_memory`; sm_90: 227 KB,
    sm_86/89: 99 KB), or None (a CPU)."""
    return device_limits.max_shared_memory(device) if device.type == "cuda" else None


def tiling(programs: int, target: int, n_k: int, block_d: int, element_size: int, limit: int | None = None
           ) -> tuple[int, int]:
    """(keys per tile, pipeline stages) of the split kernel for `programs` programs of up to n_k keys on `target` SMs,
    within `limit` bytes of shared memory a program (`shared_limit`; None: any).

    Whole-SM programs (TILE_BYTES tiles, three stages) where they fit one wave, or read long caches. Where short
    programs (at most SHORT_PROGRAM_KEYS keys) outnumber the SMs (one split, several waves), a program's start and its
    last tiles leave its SM idle unless other programs are resident beside it: SHORT_TILE_BYTES tiles, three stages
    up to twice the SMs, two stages beyond (at D 128 bf16 on sm_90: 70 KB of shared memory, three programs an SM;
    38 KB and ~108 registers a thread, four an SM; whole-SM tiles: 136 KB, one). H200, one query, 32/8 heads, D 128,
    kernels alone (cuDNN; whole-SM; shared): batch 64 x 1k keys 64.9; 68.0; 63.9 us, 64 x 2k 122.3; 124.6; 121.6,
    32 x 1k 34.4; 36.4; 34.3; at 64 x 8k 470; 467; 469, and left-padded rows of 4k-8k keys 0.376 ms whole-SM against
    0.396 shared."""
    if programs <= target or n_k > SHORT_PROGRAM_KEYS:
        block_n, stages = key_tile(block_d, element_size), 3
    else:
        block_n, stages = key_tile(block_d, element_size, SHORT_TILE_BYTES), 3 if programs <= 2 * target else 2
    # A GPU with less shared memory than these take (sm_86/89: 99 KB against the whole-SM tiling's 136 KB) gets
    # fewer stages, then smaller tiles, instead of a launch that fails.
    while limit is not None and shared_bytes(block_n, block_d, element_size, stages) > limit:
        if stages > 2:
            stages -= 1
        elif block_n > 16:
            block_n //= 2
        else:
            break
    return block_n, stages


def forward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, window: tuple[int, int], scale: float,
            traced: bool, key_start: Tensor | None = None, key_mask: Tensor | None = None
            ) -> tuple[list[Recorded | None], tuple[Tensor, Tensor]]:
    """Write O and L of rank-3/4 q over k, v (the forward's contract) with the decode kernels: the split kernel alone
    where one split suffices (`splits`), else the split and the combine kernels. Returns the launches as a plan
    records them, and the scratch tensors they use (the partial outputs and logsumexps; none for one split), which a
    replay allocates anew. `key_start` (int32, one per batch row): the first key each row sees (`cache_start` of
    `flash_attention_decode`). `key_mask` (uint8 (batch, n_k), unit stride along the keys): the keys each row sees
    (`key_mask` of `flash_attention_decode`)."""
    rank4 = q.dim() == 4
    batch, n_heads = q.shape[0], q.shape[1] if rank4 else 1
    kv_heads = k.shape[1] if rank4 else 1
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    kv_group = n_heads // kv_heads
    block_d = max(16, triton.next_power_of_2(d))
    block_m = max(16, triton.next_power_of_2(kv_group * n_q))
    target = program_target(q.device)
    block_n, num_stages = tiling(batch * kv_heads, target, n_k, block_d, q.element_size(), shared_limit(q.device))
    n_splits, split_len = splits(n_k, batch * kv_heads, target, block_n)
    direct = n_splits == 1
    rows = batch * n_heads * n_q
    # The one-split kernel reads no partials: it is handed O and L in their place, and the plan has no scratch.
    part_o = o if direct else torch.empty((rows, n_splits, d), dtype=torch.float32, device=q.device)
    part_l = lse if direct else torch.empty((rows, n_splits), dtype=torch.float32, device=q.device)
    fp32 = q.dtype == torch.float32
    split_named = dict(Q=q, K=k, V=v, O=o, L=lse, PartO=part_o, PartL=part_l,
                       KeyStart=lse if key_start is None else key_start,
                       KeyMask=lse if key_mask is None else key_mask,
                       mask_row_stride=0 if key_mask is None else key_mask.stride(0), n_heads=n_heads,
                       kv_group=kv_group, n_q=n_q, n_k=n_k, n_splits=n_splits, split_len=split_len,
                       window_left=window[0], window_right=window[1], qk_scale=scale * 1.4426950408889634)
    split_constexprs = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
                            BOUND_RIGHT=window[1] >= 0, BOUND_LEFT=window[0] >= 0, FP32_IEEE=fp32, DIRECT=direct,
                            HAS_KEY_START=key_start is not None, HAS_KEY_MASK=key_mask is not None, num_warps=4,
                            num_stages=num_stages)
    combine_named = dict(PartO=part_o, PartL=part_l, O=o, L=lse, n_heads=n_heads, n_q=n_q, n_splits=n_splits)
    combine_constexprs = dict(HEAD_DIM=d, BLOCK_D=block_d, BLOCK_S=max(2, triton.next_power_of_2(n_splits)),
                              num_warps=4)
    split_grid, combine_grid = (batch * kv_heads, n_splits, 1), (rows, 1, 1)
    scratch = () if direct else (part_o, part_l)
    if traced:
        wrap_triton(flash_decode_split_kernel)[split_grid](*positional(flash_decode_split_kernel, split_named),
                                                           **split_constexprs)
        if not direct:
            wrap_triton(flash_decode_combine_kernel)[combine_grid](
                *positional(flash_decode_combine_kernel, combine_named), **combine_constexprs)
        return [None], scratch
    recorded = [run_fixed(flash_decode_split_kernel, split_grid, split_named, split_constexprs)]
    if not direct:
        recorded.append(run_fixed(flash_decode_combine_kernel, combine_grid, combine_named, combine_constexprs))
    return recorded, scratch
