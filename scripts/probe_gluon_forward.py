"""An attention forward written in Gluon, Triton's lower-level language, timed beside SDPA's cuDNN and flashsys's
forward (GPU probe for #16; prints). H 16, 16k tokens per cell (B = 16384 // N; --seqs), bf16, dense (B, H, N, D).

Why Gluon: the #16 probes found that a `tl` kernel on Hopper runs the softmax and the tensor-core matmuls one
after the other (Triton 3.6 waits for each `wgmma` before its result is used, and its warp specialization does
not split producers and consumers on this GPU). Gluon exposes the pieces directly: asynchronous `wgmma` with an
explicit wait depth, TMA copies into a ring of shared-memory buffers with mbarriers, layouts. Both kernels do
FlashAttention-3's intra-warpgroup overlap by hand:

    S_j = Q K_jᵀ (async); O += P_{j-1} V_{j-1} (async); wait for S_j only; softmax(S_j) -> P_j runs while the
    P V product is still on the tensor cores; wait for it; rescale O; refill the freed K/V buffer (TMA).

Two kernels: "plain" (one partition; 4 warps = one warpgroup per program, several programs per SM) and "pingpong"
(warp-specialised: a producer warp issues the TMA copies, two consumer warpgroups of BLOCK_M // 2 query rows share
the key tiles and take turns at issuing their products, FlashAttention-3's inter-warpgroup ping-pong).

--compile-only compiles every variant for sm_90 without a GPU (Triton's bundled ptxas) and prints registers,
spills and shared memory: the loop to get it compiling, before device time is spent.

    python scripts/probe_gluon_forward.py --head-dims 64 128 --seqs 1024 4096 16384
    python scripts/probe_gluon_forward.py --compile-only
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError as exc:  # a Triton without Gluon's Hopper API
    print(f"no Gluon Hopper API in Triton {triton.__version__}: {exc}")
    sys.exit(0)

LOG2E = 1.4426950408889634
# TMA copies: Triton 3.6 (the GPUs) names them async_copy_*; later Tritons (CI's 3.9) renamed them.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@gluon.jit
def _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, row, slot, pred):
    """TMA copies of one key tile's K and V into buffer `slot`; each signals its own barrier."""
    mbarrier.expect(k_bar.index(slot), k_desc.block_type.nbytes, pred=pred)
    _tma_load(k_desc, [row, 0], k_bar.index(slot), k_smem.index(slot), pred=pred)
    mbarrier.expect(v_bar.index(slot), v_desc.block_type.nbytes, pred=pred)
    _tma_load(v_desc, [row, 0], v_bar.index(slot), v_smem.index(slot), pred=pred)


@gluon.jit
def _causal_mask(s, offs_m, j, first_masked, BLOCK_N: gl.constexpr):
    """S of key tile j with each query's later keys at -inf, from the first tile that straddles the diagonal on."""
    if j >= first_masked:
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    return s


@gluon.jit
def _first_softmax(s, qk_scale):
    """(P, row max, row sum) of the first key tile (scores in log2 units after qk_scale)."""
    m_i = gl.max(s, 1) * qk_scale
    p = gl.exp2(s * qk_scale - m_i[:, None])
    return p, m_i, gl.sum(p, 1)


@gluon.jit
def _online_softmax(s, m_i, l_i, qk_scale):
    """(P, new row max, alpha, new row sum) of a later key tile; O is rescaled by alpha once its last P·V is done."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, alpha, l_i * alpha + gl.sum(p, 1)


@gluon.jit
def _store_out(acc, m_i, l_i, offs_m, L, row0, o_desc, o_row, staging):
    """L (natural log) and O = acc / l; O goes through `staging` (the Q buffer, no longer read) by a TMA store."""
    gl.store(L + row0 + offs_m, m_i * 0.6931471805599453 + gl.log(l_i))
    acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, acc.type.layout))[:, None]
    staging.store(acc.to(o_desc.dtype))
    fence_async_shared()
    _tma_store(o_desc, [o_row, 0], staging)
    tma.store_wait(0)


@gluon.jit
def _gluon_fwd(q_desc, k_desc, v_desc, o_desc, L, n_ctx, qk_scale,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
               NBUF: gl.constexpr, NUM_WARPS: gl.constexpr):
    """One program = one query tile of one (batch, head); O and L (natural log) as flashsys's forward writes them.
    Causal: the tiles left of the diagonal run unmasked, the diagonal ones (BLOCK_M // BLOCK_N) masked."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_desc.dtype

    if CAUSAL:  # heaviest tiles first
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    row0 = gl.program_id(1) * n_ctx
    start_m = pid_m * BLOCK_M
    if CAUSAL:  # key tile j is masked where its last key lies right of the tile's first query
        n_tiles = gl.cdiv(start_m + BLOCK_M, BLOCK_N)
        first_masked = (start_m + 1) // BLOCK_N
    else:
        n_tiles = n_ctx // BLOCK_N
        first_masked = n_tiles

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(NBUF):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)
    fence_async_shared()

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    _tma_load(q_desc, [row0 + start_m, 0], q_bar, q_smem)
    for i in gl.static_range(NBUF):
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, row0 + i * BLOCK_N, i, i < n_tiles)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=row_s)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

    # Tile 0: S, its softmax; nothing to overlap yet.
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    p, m_i, l_i = _first_softmax(_causal_mask(s, offs_m, 0, first_masked, BLOCK_N), qk_scale)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)

    for j in range(1, n_tiles):
        slot = j % NBUF
        prev = (j - 1) % NBUF
        mbarrier.wait(k_bar.index(slot), (j // NBUF) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(prev), ((j - 1) // NBUF) & 1)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        acc_tok = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])  # S_j is done; P_{j-1} V_{j-1} may still run
        p, m_i, alpha, l_i = _online_softmax(_causal_mask(s, offs_m, j, first_masked, BLOCK_N), m_i, l_i, qk_scale)
        acc = warpgroup_mma_wait(0, deps=[acc_tok])
        # Buffer `prev` is free once every warp's products that read it are done: refill it NBUF tiles ahead.
        # One warpgroup: its wait above covers them all (a wgmma is issued by the whole warpgroup); two: the
        # other one may still be reading.
        if NUM_WARPS > 4:
            gl.thread_barrier()
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, row0 + (j - 1 + NBUF) * BLOCK_N, prev,
                 j - 1 + NBUF < n_tiles)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]

    last = (n_tiles - 1) % NBUF
    mbarrier.wait(v_bar.index(last), ((n_tiles - 1) // NBUF) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=[acc])

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(NBUF):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))
    _store_out(acc, m_i, l_i, offs_m, L, row0, o_desc, row0 + start_m, q_smem)


@gluon.jit
def _pp_producer(q_desc, k_desc, v_desc, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, empty_bar, row0, start_m,
                 n_tiles, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
    """One warp: both halves' Q, then K/V tile j into buffer j % NBUF once both consumers released tile j - NBUF."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    for h in gl.static_range(2):
        mbarrier.expect(q_bar.index(h), q_desc.block_type.nbytes)
        _tma_load(q_desc, [row0 + start_m + h * HALF_M, 0], q_bar.index(h), q_smem.index(h))
    for j in range(n_tiles):
        slot = j % NBUF
        mbarrier.wait(empty_bar.index(slot), ((j // NBUF) - 1) & 1, pred=j >= NBUF)
        _load_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, row0 + j * BLOCK_N, slot, True)


@gluon.jit
def _pp_consumer(o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar, row0, start_m, n_ctx,
                 qk_scale, HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 CAUSAL: gl.constexpr, NBUF: gl.constexpr):
    """One warpgroup, rows start_m + HALF * HALF_M onward, FlashAttention-3's ping-pong: the two warpgroups take
    turns at issuing their products (turn_bar), so one's softmax runs while the other's products run."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = o_desc.dtype
    my_m = start_m + HALF * HALF_M
    other_m = start_m + (1 - HALF) * HALF_M
    if CAUSAL:
        n_tiles = gl.cdiv(my_m + HALF_M, BLOCK_N)
        n_other = gl.cdiv(other_m + HALF_M, BLOCK_N)
        first_masked = (my_m + 1) // BLOCK_N
    else:
        n_tiles = n_ctx // BLOCK_N
        n_other = n_tiles
        first_masked = n_tiles
    q = q_smem.index(HALF)
    offs_m = my_m + gl.arange(0, HALF_M, layout=row_s)
    s_zero = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    mbarrier.wait(q_bar.index(HALF), 0)

    mbarrier.wait(turn_bar.index(HALF), 0)  # turn t waits for parity t & 1
    mbarrier.wait(k_bar.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    mbarrier.arrive(turn_bar.index(1 - HALF))
    s = warpgroup_mma_wait(0, deps=[s])
    p, m_i, l_i = _first_softmax(_causal_mask(s, offs_m, 0, first_masked, BLOCK_N), qk_scale)
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
    for j in range(1, n_tiles):
        slot = j % NBUF
        prev = (j - 1) % NBUF
        mbarrier.wait(turn_bar.index(HALF), j & 1)
        mbarrier.wait(k_bar.index(slot), (j // NBUF) & 1)
        s_tok = warpgroup_mma(q, k_smem.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_bar.index(prev), ((j - 1) // NBUF) & 1)
        acc_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(prev), acc, is_async=True)
        mbarrier.arrive(turn_bar.index(1 - HALF))
        s = warpgroup_mma_wait(1, deps=[s_tok])
        p, m_i, alpha, l_i = _online_softmax(_causal_mask(s, offs_m, j, first_masked, BLOCK_N), m_i, l_i, qk_scale)
        acc = warpgroup_mma_wait(0, deps=[acc_tok])
        mbarrier.arrive(empty_bar.index(prev))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    last = (n_tiles - 1) % NBUF
    mbarrier.wait(turn_bar.index(HALF), n_tiles & 1)
    mbarrier.wait(v_bar.index(last), ((n_tiles - 1) // NBUF) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_smem.index(last), acc, is_async=True)
    mbarrier.arrive(turn_bar.index(1 - HALF))
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(empty_bar.index(last))
    for t in range(n_tiles + 1, n_other + 1):  # the turns the other warpgroup still takes (causal: its extra tiles)
        mbarrier.wait(turn_bar.index(HALF), t & 1)
        mbarrier.arrive(turn_bar.index(1 - HALF))
    _store_out(acc, m_i, l_i, offs_m, L, row0, o_desc, row0 + my_m, q)


@gluon.jit
def _gluon_fwd_pingpong(q_desc, k_desc, v_desc, o_desc, L, n_ctx, qk_scale,
                        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
                        NBUF: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    """Warp-specialised: a producer warp (TMA) and two consumer warpgroups of BLOCK_M // 2 rows each that share the
    key tiles and ping-pong (see _pp_consumer). q_desc and o_desc have BLOCK_M // 2-row blocks."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_desc.dtype
    if CAUSAL:
        pid_m = gl.num_programs(0) - 1 - gl.program_id(0)
    else:
        pid_m = gl.program_id(0)
    row0 = gl.program_id(1) * n_ctx
    start_m = pid_m * BLOCK_M
    if CAUSAL:
        n_tiles = gl.cdiv(start_m + BLOCK_M, BLOCK_N)
    else:
        n_tiles = n_ctx // BLOCK_N
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD_DIM], v_desc.layout)
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
    gl.warp_specialize([(_pp_consumer, (o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar,
                                        row0, start_m, n_ctx, qk_scale, 0, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, NBUF)),
                        (_pp_consumer, (o_desc, L, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, empty_bar, turn_bar,
                                        row0, start_m, n_ctx, qk_scale, 1, HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, NBUF)),
                        (_pp_producer, (q_desc, k_desc, v_desc, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                                        empty_bar, row0, start_m, n_tiles, BLOCK_M, BLOCK_N, NBUF))],
                       [4, 1], [CONSUMER_REGS, 24])


def _kernel_args(q, k, v, bm, q_rows, bn):
    """(O, L, the kernel's runtime arguments) for dense contiguous (B, H, N, D) q, k, v: TMA descriptors over the
    flat (B·H·N, D) views with q_rows-row blocks for Q and O and bn-row blocks for K and V."""
    b, h, n, d = q.shape
    assert n % bm == 0 and n % bn == 0, "the probe takes whole tiles only"
    o = torch.empty_like(q)
    lse = torch.empty(b * h * n, device=q.device, dtype=torch.float32)
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[q.dtype]

    def desc(t, rows):
        layout = gl.NVMMASharedLayout.get_default_for([rows, d], gdt)
        return TensorDescriptor.from_tensor(t.view(b * h * n, d), [rows, d], layout)

    return o, lse, (desc(q, q_rows), desc(k, bn), desc(v, bn), desc(o, q_rows), lse, n, 1.0 / math.sqrt(d) * LOG2E)


def _launchers(kernel, grid, args, consts, num_warps):
    """(run: launch on the grid, compile_kernel: compile for a one-program grid without launching)."""
    def run():
        kernel[grid](*args, **consts, num_warps=num_warps)

    def compile_kernel():
        return kernel.warmup(*args, **consts, num_warps=num_warps, grid=(1,))
    return run, compile_kernel


def gluon_forward(q, k, v, causal, bm, bn, warps, nbuf):
    """(launch, compile, O, L) of the plain kernel."""
    b, h, n, d = q.shape
    o, lse, args = _kernel_args(q, k, v, bm, bm, bn)
    consts = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, NBUF=nbuf, NUM_WARPS=warps)
    return (*_launchers(_gluon_fwd, (n // bm, b * h), args, consts, warps), o, lse)


def gluon_forward_pingpong(q, k, v, causal, bm, bn, regs, nbuf):
    """(launch, compile, O, L) of the ping-pong kernel (Q and O in blocks of bm // 2 rows)."""
    b, h, n, d = q.shape
    o, lse, args = _kernel_args(q, k, v, bm, bm // 2, bn)
    consts = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, NBUF=nbuf, CONSUMER_REGS=regs)
    return (*_launchers(_gluon_fwd_pingpong, (n // bm, b * h), args, consts, 4), o, lse)


# ("plain", (BLOCK_M, BLOCK_N, warps, buffers)): 4 warps = one warpgroup, 8 = two sharing the key tiles;
# ("pingpong", (BLOCK_M, BLOCK_N, consumer registers, buffers)): two consumer warpgroups of BLOCK_M // 2 rows.
VARIANTS = {64: [("plain", t) for t in ((64, 128, 4, 3), (128, 64, 4, 3))]
            + [("pingpong", t) for t in ((128, 128, 240, 2), (128, 128, 240, 3), (256, 64, 240, 3))],
            128: [("plain", t) for t in ((64, 64, 4, 3),)]
            + [("pingpong", t) for t in ((128, 64, 240, 3), (128, 64, 240, 4), (128, 128, 240, 2),
                                         (128, 128, 224, 2))]}


def build(kind, q, k, v, causal, params):
    return (gluon_forward if kind == "plain" else gluon_forward_pingpong)(q, k, v, causal, *params)


def variant_label(kind, params) -> str:
    bm, bn, x, nbuf = params
    return f"gluon {kind} {bm}x{bn} " + (f"{x}w" if kind == "plain" else f"{x} regs") + f" {nbuf}buf"


def _resource_usage(kern) -> str:
    """Registers and spill bytes of a compiled kernel, from cuobjdump (bundled with Triton): n_regs and n_spills
    are only filled in when a kernel is loaded onto a GPU."""
    import re
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kern.asm["cubin"])
        f.flush()
        out = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                             text=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+).*?LOCAL:(\d+)", out)
    return f"{found[1]} registers, stack {found[2]} B, local {found[3]} B" if found else out.strip()[-200:]


def compile_only(head_dims) -> int:
    from tests.ops.inductor_writes import _fake_cuda_driver

    _fake_cuda_driver()
    print(f"triton {triton.__version__}, compile only (sm_90)")
    for d in head_dims:
        q = torch.randn(1, 2, 1024, d, dtype=torch.bfloat16)
        for causal in (True, False):
            for kind, params in VARIANTS[d]:
                _, compile_kernel, _, _ = build(kind, q, q, q, causal, params)
                label = f"D {d} causal {causal} {variant_label(kind, params)}"
                try:
                    kern = compile_kernel()
                    print(f"{label}: {_resource_usage(kern)}, {kern.metadata.shared} B shared")
                except Exception as exc:  # noqa: BLE001  the point is to see what fails
                    print(f"{label}: FAILED {type(exc).__name__}: {str(exc)[-1500:]}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=sorted(VARIANTS))
    ap.add_argument("--seqs", type=int, nargs="+", default=[16384],
                    help="N per cell, a multiple of 256 that divides 16384; B = 16384 // N")
    ap.add_argument("--compile-only", action="store_true")
    args = ap.parse_args()
    bad = [n for n in args.seqs if n <= 0 or n % 256 or 16384 % n]
    if bad:  # the kernels take whole tiles (up to 256 rows), and every cell holds 16k tokens
        ap.error(f"--seqs: {bad} is not a multiple of 256 that divides 16384")
    if args.compile_only:
        return compile_only(args.head_dims)
    if not torch.cuda.is_available():
        print("probe_gluon_forward times CUDA kernels; use --compile-only on a CPU")
        return 0
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from flashsys.ops.attention import flash_attention, native_launch
    from flashsys.ops.attention.flash_triton import flash_forward_triton

    native_launch.wait()  # eager flashsys calls take the native launcher, as benchmarks do
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "H 16, B = 16384 // N, bf16, forward only, median ms of triton.testing.do_bench")
    for d, n in ((d, n) for d in args.head_dims for n in args.seqs):
        for causal in (True, False):
            torch.manual_seed(0)
            b = 16384 // n
            q, k, v = (torch.randn(b, 16, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            flops = 4 * b * 16 * n ** 2 * d / (2 if causal else 1)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                rows = [("SDPA cuDNN", triton.testing.do_bench(
                    lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)))]
            with torch.no_grad():
                _, lse_fs = flash_forward_triton(q, k, v, (-1, 0) if causal else (-1, -1), 1.0 / math.sqrt(d))
                rows.append(("flashsys forward", triton.testing.do_bench(
                    lambda: flash_attention(q, k, v, causal=causal))))
            for kind, params in VARIANTS[d]:
                label = variant_label(kind, params)
                try:
                    run, _, o, lse = build(kind, q, k, v, causal, params)
                    run()
                    torch.cuda.synchronize()
                    err = (o.float() - ref.float()).abs().max().item()
                    lse_err = (lse.view_as(lse_fs) - lse_fs).abs().max().item()
                    if not (err < 2e-2 and lse_err < 1e-3):
                        rows.append((label + f" WRONG (max err O {err:.3g}, L {lse_err:.3g})", float("nan")))
                        continue
                    rows.append((label + f" (max err O {err:.1e}, L {lse_err:.1e})", triton.testing.do_bench(run)))
                except Exception as exc:  # noqa: BLE001
                    rows.append((label + f" FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:150]}",
                                 float("nan")))
            print(f"\nD={d} N={n} B={b} causal={causal}")
            for label, ms in rows:
                print(f"  {label:<70} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
