"""Does Triton's warp specialization speed up an attention forward on this GPU? (GPU probe for #16; prints.)

A minimal causal/full forward with TMA tensor descriptors, its key loop a `tl.range(..., warp_specialize=WS)`,
timed with WS off and on for a few tiles, beside SDPA's cuDNN and flash forwards and flashsys's forward, at
B 1, H 16, N 16384, D 128, bf16. Each probe output is checked against SDPA first. Whatever fails to compile is
printed and skipped: the question is what Triton on this machine does with the flag, not only how fast.

    python scripts/probe_warp_specialize.py
"""

from __future__ import annotations

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


@triton.jit
def _ws_inner(acc, l_i, m_i, q, desc_k, desc_v, row0, lo, hi, offs_m, offs_n, qk_scale,
              BLOCK_N: tl.constexpr, MASK: tl.constexpr, WS: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):
        k = desc_k.load([row0 + start_n, 0])
        qk = tl.dot(q, k.T)
        if MASK:
            qk = tl.where(offs_m[:, None] >= start_n + offs_n[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([row0 + start_n, 0])
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _ws_fwd(desc_q, desc_k, desc_v, desc_o, L, n_ctx, qk_scale,
            HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
            WS: tl.constexpr):
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
    if CAUSAL:
        acc, l_i, m_i = _ws_inner(acc, l_i, m_i, q, desc_k, desc_v, row0, 0, start_m, offs_m, offs_n, qk_scale,
                                  BLOCK_N, False, WS)
        acc, l_i, m_i = _ws_inner(acc, l_i, m_i, q, desc_k, desc_v, row0, start_m, start_m + BLOCK_M, offs_m,
                                  offs_n, qk_scale, BLOCK_N, True, WS)
    else:
        acc, l_i, m_i = _ws_inner(acc, l_i, m_i, q, desc_k, desc_v, row0, 0, n_ctx, offs_m, offs_n, qk_scale,
                                  BLOCK_N, False, WS)
    tl.store(L + bh * n_ctx + offs_m, m_i * 0.6931471805599453 + tl.log(l_i))
    desc_o.store([row0 + start_m, 0], (acc / l_i[:, None]).to(desc_o.dtype))


def probe_forward(q, k, v, causal, bm, bn, warps, stages, ws):
    b, h, n, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty(b * h * n, device=q.device, dtype=torch.float32)
    flat = lambda t, rows: TensorDescriptor.from_tensor(t.view(b * h * n, d), [rows, d])  # noqa: E731
    args = (flat(q, bm), flat(k, bn), flat(v, bn), flat(o, bm), lse, n, 1.0 / math.sqrt(d) / LN2)
    grid = (n // bm, b * h)

    def run():
        _ws_fwd[grid](*args, HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=causal, WS=ws,
                      num_warps=warps, num_stages=stages)
    return run, o


def main() -> int:
    torch.manual_seed(0)
    b, h, n, d = 1, 16, 16384, 128
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"B {b} H {h} N {n} D {d} bf16, forward only, median ms of triton.testing.do_bench")
    for causal in (True, False):
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
        for bm, bn, warps, stages in ((128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 128, 4, 2),
                                      (128, 128, 8, 3), (64, 128, 4, 3)):
            for ws in (False, True):
                label = f"probe {bm}x{bn} {warps}w {stages}s ws={ws}"
                if causal and bm % bn:  # the unmasked causal loop ends at start_m: BLOCK_N must divide BLOCK_M
                    rows.append((label + " skipped: causal needs BLOCK_N | BLOCK_M", float("nan")))
                    continue
                try:
                    run, o = probe_forward(q, k, v, causal, bm, bn, warps, stages, ws)
                    run()
                    torch.cuda.synchronize()
                    err = (o.float() - ref.float()).abs().max().item()
                    if not err < 2e-2:
                        rows.append((label + f" WRONG (max err {err:.3g})", float("nan")))
                        continue
                    rows.append((label, triton.testing.do_bench(run)))
                except Exception as e:  # noqa: BLE001  the point is to see what this Triton refuses
                    rows.append((label + f" FAILED: {type(e).__name__}: {str(e).splitlines()[0][:150]}", float("nan")))
        print(f"\ncausal={causal}")
        for label, ms in rows:
            print(f"  {label:<60} {ms:8.3f} ms  {flops / ms / 1e9:7.1f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
