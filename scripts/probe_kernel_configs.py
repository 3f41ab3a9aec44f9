"""Every candidate tile config of each Triton kernel, timed alone at one shape, beside cuDNN (kernel_experiments.md).

The autotuner keeps only its pick, and its pick is noisy (~5% between runs); this prints each candidate's time, so the
tables' order can be judged from one run. (Commit adb2f37 also timed a single-pass backward here: see
kernel_experiments.md.) GPU only:

    python scripts/probe_kernel_configs.py --head-dims 64 128 --seq-len 16384 --batch 1 --heads 16
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from flashsys.ops.attention import FlashAttention2Triton
from flashsys.ops.attention import flash_triton as ft


REP_MS = 150  # --rep


def _ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=REP_MS)


def _time_config(kernel, handles, g, window, named, grid, config):
    """One kernel launched alone with `config` (BLOCK_M, BLOCK_N, warps, stages), as Triton's autotuner times a
    candidate; `grid` is the launcher's `_tile_grid`."""
    handle, args, constexprs, _ = ft._prepare(kernel, handles, g, window, named)
    m, n, w, s = config
    meta = dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
    grid_xyz = (*grid(meta), 1)
    try:
        def launch():
            handle.fn[grid_xyz](*args, **constexprs, **meta)
        launch()
        torch.cuda.synchronize()
        return _ms(launch)
    except Exception as e:  # out of shared memory or registers: report, go on
        return f"{type(e).__name__}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    p.add_argument("--rep", type=int, default=150, help="do_bench rep per timing, ms (500: the sustained regime)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds; a row prints its median")
    p.add_argument("--kernels", nargs="+", default=["fwd", "dq", "dkdv"], choices=["fwd", "dq", "dkdv"])
    args = p.parse_args()
    global REP_MS
    REP_MS = args.rep
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"shape: batch {args.batch} x heads {args.heads} x N {args.seq_len}, bf16; times in ms (do_bench, rep "
          f"{args.rep} ms; median of {args.rounds} interleaved round(s), range in brackets)\n")
    causals = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
    for d in args.head_dims:
        for causal in causals:
            b, h, n = args.batch, args.heads, args.seq_len
            q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            o = FlashAttention2Triton.apply(*leaves, causal)
            lse = o.grad_fn.saved_tensors[4]
            o.backward(do)
            o = o.detach()
            chosen = {key.kernel: cfg for key, cfg in ft.chosen_configs().items()
                      if key.head_dim == d and key.bound_right == causal and key.bucket == triton.next_power_of_2(n)}
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                cudnn_fwd = _ms(lambda: F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal))
                out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
                cudnn_bwd = _ms(lambda: out.backward(do, retain_graph=True))
            print(f"## D={d} causal={causal}: cuDNN forward {cudnn_fwd:.3f}, backward {cudnn_bwd:.3f}")
            print(f"autotuner's picks: {chosen}")
            scale = d ** -0.5
            window = (-1, 0) if causal else (-1, -1)
            g = ft._geometry_of(q.shape, k.shape, q.dtype)
            cls = g.head_dim_class
            lse_delta = torch.empty((b, h, n, 2), dtype=torch.float32, device="cuda")
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
            fwd_named = ft.forward_arguments(g, q, k, v, torch.empty_like(q), torch.empty_like(lse), q, k, window, scale)
            dq_named, dkdv_named = ft.backward_arguments(g, q, k, v, o, lse, do, dq, dk, dv, lse_delta, q, k, window,
                                                         scale)
            query_tiles = ft._tile_grid(n, "BLOCK_M", g.n_bh)
            key_tiles = ft._tile_grid(n, "BLOCK_N", g.n_bh_kv)
            runs = (("fwd", ft._fwd_kernels, fwd_named, query_tiles, ft._FWD_TILES, ft._FWD_TILES_LONG),
                    ("dq", ft._bwd_dq_kernels, dq_named, query_tiles, ft._BWD_DQ_TILES, ft._BWD_DQ_TILES_LONG),
                    ("dkdv", ft._bwd_dkdv_kernels, dkdv_named, key_tiles, ft._BWD_DKDV_TILES, ft._BWD_DKDV_TILES_LONG))
            cells = [(kernel, handles, named, grid, cfg) for kernel, handles, named, grid, table, long_table in runs
                     if kernel in args.kernels for cfg in dict.fromkeys(table[cls] + long_table.get(cls, []))]
            times = {}
            for _ in range(args.rounds):
                for kernel, handles, named, grid, cfg in cells:
                    times.setdefault((kernel, cfg), []).append(_time_config(kernel, handles, g, window, named, grid,
                                                                            cfg))
            rows = []
            for (kernel, cfg), ts in times.items():
                ok = sorted(t for t in ts if not isinstance(t, str))
                rows.append((kernel, cfg, ok[len(ok) // 2] if ok else ts[0], f" [{ok[0]:.3f}-{ok[-1]:.3f}]"
                             if len(ok) > 1 else ""))
            print("| kernel | (BLOCK_M, BLOCK_N, warps, stages) | ms |")
            print("|---|---|---:|")
            best = {}
            for kernel, cfg, t, spread in rows:
                print(f"| {kernel} | {cfg} | {t if isinstance(t, str) else f'{t:.3f}'}{spread} |")
                if not isinstance(t, str) and (kernel not in best or t < best[kernel][1]):
                    best[kernel] = (cfg, t)
            print("best:", {k: (c, round(t, 3)) for k, (c, t) in best.items()})
            if "dq" in best and "dkdv" in best:
                print(f"backward: two-pass {best['dq'][1] + best['dkdv'][1]:.3f}, cuDNN {cudnn_bwd:.3f}")
            if "fwd" in best:
                print(f"forward: best {best['fwd'][1]:.3f}, cuDNN {cudnn_fwd:.3f}")
            print(flush=True)


if __name__ == "__main__":
    main()
