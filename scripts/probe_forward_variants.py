"""Variants of a minimal attention forward, timed beside SDPA's cuDNN and flash forwards and flashsys's forward
(GPU probe for #16; prints). The kernel uses TMA tensor descriptors; B 1, H 16, N 16384, bf16.

--question ws: does Triton's warp specialization help on this GPU? The key loop is a
  `tl.range(..., warp_specialize=WS)`, timed off and on for a few tiles (D 128). Whatever fails to compile is
  printed and skipped: the question is what Triton here does with the flag, not only how fast.
--question exp: how much of the forward is the exponentials (the MUFU unit), and does computing some of them with
  a cubic polynomial on the FMA units (as FlashAttention-4 does) pay? Modes: mufu (tl.math.exp2), none (no
  exponential at all: wrong results, the time bound), poly (every exponential by the polynomial), half (half of
  each tile's columns each way).
--question pipeline: does issuing the next key tile's S = Q Kᵀ before this tile's softmax (FlashAttention-3's
  intra-warpgroup overlap, written by hand: S is carried across iterations) let the tensor cores work under the
  exponentials? Timed against the same kernel in the plain order.
--question rescale: does skipping the rescale of the accumulator pay (FlashAttention-4's conditional rescaling)?
  A row's running maximum is only raised when some row of the tile grew by more than 8 (log2 units): until then
  the tile keeps its stale maxima (p <= 2^8, exact enough in fp32 and bf16) and neither multiplies acc and l by
  alpha nor waits for the last P·V product before the next one. The branch is tile-wide (one max over the rows).

Each output but mode "none" is checked against SDPA first.

    python scripts/probe_forward_variants.py --question ws
    python scripts/probe_forward_variants.py --question exp --head-dims 64 128
    python scripts/probe_forward_variants.py --question rescale --head-dims 64 128
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashsys.ops.attention import flash_attention

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host descriptors
    print("no triton.tools.tensor_descriptor in Triton", triton.__version__)
    sys.exit(0)

LN2 = math.log(2.0)


EXP_MODES = {"mufu": 0, "none": 1, "poly": 2, "half": 3}


@triton.jit
def _exp2_poly(x):
    """2^x for x <= 0 on the FMA units: 2^floor(x) by the exponent bits, 2^frac(x) by a cubic (max relative
    error 1.2e-4, below bf16's and fp16's rounding). x below -126 gives ~1e-38 or less: 0 for a softmax."""
    x = tl.maximum(x, -127.0)
    n = tl.floor(x)
    f = x - n
    p = 1.0 + f * (0.69556407 + f * (0.22616929 + f * 0.07814116))
    bits = p.to(tl.int32, bitcast=True) + (n.to(tl.int32) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp2(x, EXP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    if EXP == 0:
        p = tl.math.exp2(x)
    elif EXP == 1:
        p = x
    elif EXP == 2:
        p = _exp2_poly(x)
    else:  # odd columns by the polynomial, even ones on the MUFU
        a, b = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_N // 2, 2)))
        p = tl.reshape(tl.join(tl.math.exp2(a), _exp2_poly(b)), (BLOCK_M, BLOCK_N))
    return p


@triton.jit
def _online_softmax_step(acc, l_i, m_i, qk, v, qk_scale, EXP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """One key tile's online-softmax update of (acc, l, m) from its raw scores qk and values v."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = _exp2(qk * qk_scale - m_new[:, None], EXP, BLOCK_M, BLOCK_N)
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new


@triton.jit
def _lazy_softmax_step(acc, l_i, m_i, qk, v, qk_scale):
    """_online_softmax_step that keeps stale row maxima until one grows by more than 8 (log2 units)."""
    m_cand = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if tl.max(m_cand - m_i, 0) > 8.0:  # also the first tile: m_i is -inf
        alpha = tl.math.exp2(m_i - m_cand)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_cand
    p = tl.math.exp2(qk * qk_scale - m_i[:, None])
    l_i = l_i + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_i


@triton.jit
def _ws_inner(acc, l_i, m_i, q, desc_k, desc_v, row0, lo, hi, offs_m, offs_n, qk_scale,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr, WS: tl.constexpr,
              EXP: tl.constexpr, LAZY: tl.constexpr = False):
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([row0 + start_n, 0])
        qk = tl.dot(q, k.T)
        if MASK:
            qk = tl.where(offs_m[:, None] >= start_n + offs_n[None, :], qk, float("-inf"))
        if LAZY:
            acc, l_i, m_i = _lazy_softmax_step(acc, l_i, m_i, qk, desc_v.load([row0 + start_n, 0]), qk_scale)
        else:
            acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, qk, desc_v.load([row0 + start_n, 0]), qk_scale,
                                                 EXP, BLOCK_M, BLOCK_N)
    return acc, l_i, m_i


@triton.jit
def _pipelined_inner(acc, l_i, m_i, q, desc_k, desc_v, row0, lo, hi, qk_scale, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """Unmasked key tiles, S of tile j + 1 issued before tile j's softmax. The last iteration computes one S it
    does not use (its rows past the end read zeros or the next head: harmless, and not used)."""
    qk = tl.dot(q, desc_k.load([row0 + lo, 0]).T)
    for start_n in tl.range(lo, hi, BLOCK_N):
        qk_next = tl.dot(q, desc_k.load([row0 + start_n + BLOCK_N, 0]).T)
        acc, l_i, m_i = _online_softmax_step(acc, l_i, m_i, qk, desc_v.load([row0 + start_n, 0]), qk_scale, 0,
                                             BLOCK_M, BLOCK_N)
        qk = qk_next
    return acc, l_i, m_i


@triton.jit
def _ws_fwd(desc_q, desc_k, desc_v, desc_o, L, n_ctx, qk_scale,
            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
            WS: tl.constexpr, EXP: tl.constexpr, PIPE: tl.constexpr = False, LAZY: tl.constexpr = False):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)  # heaviest tiles first
    bh = tl.program_id(1)
    row0 = bh * n_ctx
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([row0 + start_m, 0])
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    unmasked_hi = start_m if CAUSAL else n_ctx  # causal: the tiles left of the diagonal one
    if PIPE:
        acc, l_i, m_i = _pipelined_inner(acc, l_i, m_i, q, desc_k, desc_v, row0, 0, unmasked_hi, qk_scale, BLOCK_M,
                                         BLOCK_N)
    else:
        acc, l_i, m_i = _ws_inner(acc, l_i, m_i, q, desc_k, desc_v, row0, 0, unmasked_hi, offs_m, offs_n, qk_scale,
                                  BLOCK_M, BLOCK_N, False, WS, EXP, LAZY)
    if CAUSAL:
        acc, l_i, m_i = _ws_inner(acc, l_i, m_i, q, desc_k, desc_v, row0, start_m, start_m + BLOCK_M, offs_m,
                                  offs_n, qk_scale, BLOCK_M, BLOCK_N, True, WS, EXP, LAZY)
    tl.store(L + bh * n_ctx + offs_m, m_i * 0.6931471805599453 + tl.log(l_i))
    desc_o.store([row0 + start_m, 0], (acc / l_i[:, None]).to(desc_o.dtype))


def probe_forward(q, k, v, causal, bm, bn, warps, stages, ws, exp="mufu", order="plain"):
    """(launch, O). order: "plain", "S-ahead" (S of the next tile before this tile's softmax) or "lazy" (the
    conditional rescale)."""
    b, h, n, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(b * h * n, device=q.device, dtype=torch.float32)
    flat = lambda t, rows: TensorDescriptor.from_tensor(t.view(b * h * n, d), [rows, d])  # noqa: E731
    args = (flat(q, bm), flat(k, bn), flat(v, bn), flat(o, bm), lse, n, 1.0 / math.sqrt(d) / LN2)
    grid = (n // bm, b * h)

    def run():
        _ws_fwd[grid](*args, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, WS=ws, EXP=EXP_MODES[exp],
                      PIPE=order == "S-ahead", LAZY=order == "lazy", num_warps=warps, num_stages=stages)
    return run, o


WS_TILES = ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 128, 4, 2), (128, 128, 8, 3), (64, 128, 4, 3))
PIPE_TILES = {64: ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 2), (256, 64, 8, 2),
                   (256, 128, 8, 2)),
              128: ((128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (256, 64, 8, 2))}
EXP_TILES = {64: ((128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3)), 128: ((128, 64, 8, 3), (128, 128, 8, 3))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--question", choices=["ws", "exp", "pipeline", "rescale"], default="ws")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128])
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"question {args.question}; B 1 H 16 N 16384 bf16, forward only, median ms of triton.testing.do_bench")
    for d in args.head_dims:
        for causal in (True, False):
            if args.question == "ws":
                variants = [(tile, ws, "mufu", "plain") for tile in WS_TILES for ws in (False, True)]
            elif args.question == "exp":
                variants = [(tile, False, exp, "plain") for tile in EXP_TILES.get(d, EXP_TILES[128])
                            for exp in EXP_MODES]
            else:  # pipeline, rescale: the plain order beside the question's
                other = "S-ahead" if args.question == "pipeline" else "lazy"
                variants = [(tile, False, "mufu", order) for tile in PIPE_TILES.get(d, PIPE_TILES[128])
                            for order in ("plain", other)]
            report(d, causal, variants)
    return 0


def report(d: int, causal: bool, variants) -> None:
    torch.manual_seed(0)
    b, h, n = 1, 16, 16384
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    ref = None
    rows = []
    for name, backend in (("SDPA cuDNN", SDPBackend.CUDNN_ATTENTION), ("SDPA flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel(backend):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            ref = out if ref is None else ref
            ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        rows.append((name, ms))
    with torch.no_grad():
        ms = triton.testing.do_bench(lambda: flash_attention(q, k, v, causal=causal))
    rows.append(("flashsys forward", ms))
    for (bm, bn, warps, stages), ws, exp, order in variants:
        label = f"probe {bm}x{bn} {warps}w {stages}s ws={ws} exp={exp}" + ("" if order == "plain" else f" {order}")
        if causal and bm % bn:  # the unmasked causal loop ends at start_m: BLOCK_N must divide BLOCK_M
            rows.append((label + " skipped: causal needs BLOCK_N | BLOCK_M", float("nan")))
            continue
        try:
            run, o = probe_forward(q, k, v, causal, bm, bn, warps, stages, ws, exp, order)
            run()
            torch.cuda.synchronize()
            err = (o.float() - ref.float()).abs().max().item()
            if exp != "none" and not err < 2e-2:
                rows.append((label + f" WRONG (max err {err:.3g})", float("nan")))
                continue
            rows.append((label + ("" if exp == "none" else f" (max err {err:.1e})"), triton.testing.do_bench(run)))
        except Exception as e:  # noqa: BLE001  the point is to see what this Triton refuses
            rows.append((label + f" FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]}", float("nan")))
    print(f"\nD={d} causal={causal}")
    for label, ms in rows:
        print(f"  {label:<75} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")


if __name__ == "__main__":
    raise SystemExit(main())
