"""The instruction mix of flashsys's three Triton kernels, compiled for sm_90 on any machine (no GPU, no launch).

Why: a timing on a lent GPU moves by 2-4% between runs of the same code, so whether a source change altered the
machine code at all is best answered by the machine code. This compiles the forward, dQ and dK/dV kernels at the
leaderboard's shape class (bf16, D 64, causal; --head-dim 128 for the other class) with one fixed tile each, prints
counts of the instructions that matter for attention (FP32 pipe, MUFU, tensor-core HGMMA), and with --dump DIR writes
each kernel's SASS (Triton's disassembly: control bits and instruction, no addresses) so two versions can be diffed.
Needs compiled Triton with its bundled ptxas and cuobjdump, not the interpreter.

    python scripts/sass_mix.py                                  # Triton's default FP fusion
    TRITON_DEFAULT_FP_FUSION=0 python scripts/sass_mix.py       # the default Triton 3.10 announces
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TILES = {"fwd": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
         "dq": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
         "dkdv": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)}
COUNTED = ("FFMA", "FMUL", "FADD", "MUFU", "HGMMA", "FMNMX", "FSEL")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dump", help="directory to write <kernel>.sass into")
    p.add_argument("--head-dim", type=int, default=64, choices=[64, 128])
    args = p.parse_args()
    if os.environ.get("TRITON_INTERPRET"):
        p.error("needs compiled Triton: unset TRITON_INTERPRET")
    from tests.ops.inductor_writes import _fake_cuda_driver, recorded_launches

    if not torch.cuda.is_available():
        _fake_cuda_driver()
    import triton

    from flashsys.ops.attention import flash_triton as ft

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(16, 1024, args.head_dim, dtype=torch.bfloat16, device=device)
    k, do = torch.randn_like(q), torch.randn_like(q)

    def run():
        o, lse = ft.flash_forward_triton(q, k, k, (-1, 0), 0.125, traced=True)
        ft.flash_backward_triton(q, k, k, o, lse, do, (-1, 0), 0.125, traced=True)

    launches = recorded_launches(run)
    print(f"triton {triton.__version__}, sm_90, bf16 D {args.head_dim} causal; TRITON_DEFAULT_FP_FUSION="
          f"{os.environ.get('TRITON_DEFAULT_FP_FUSION', 'unset')}")
    for kernel, (handle, kargs, constexprs, _) in launches:
        name = next(t for t in TILES if t in kernel.lower())
        fn = handle.fn
        while type(fn).__name__ != "JITFunction":  # under the autotuner / heuristics wrappers
            fn = fn.fn
        sass = fn.warmup(*kargs, **constexprs, **TILES[name], grid=(1,)).asm["sass"]  # Triton's cuobjdump, lazily
        ops = collections.Counter(m.group(1).split(".")[0] for m in  # lines: "<control bits>\t[@pred ]OPCODE ..."
                                  re.finditer(r"^\S+\t(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", sass, re.M))
        print(f"{name:5} {TILES[name]}: {sum(ops.values())} instructions; "
              + ", ".join(f"{op} {ops[op]}" for op in COUNTED))
        if args.dump:
            os.makedirs(args.dump, exist_ok=True)
            with open(os.path.join(args.dump, f"{name}.sass"), "w") as f:
                f.write(sass)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
