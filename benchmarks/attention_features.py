"""Grouped-query attention, sliding windows and packed variable-length sequences: flashsys against the strongest
PyTorch way to compute the same thing, forward + backward, in one run.

- gqa: q (1, Hq, N, D), k, v (1, Hkv, N, D), causal; flashsys vs SDPA with enable_gqa=True pinned to each of its
  kernels (flash, cuDNN, efficient). `vs_best_sdpa` is our time over the fastest SDPA kernel that ran.
- window: causal with window_size=(W, 0) against flashsys full causal at the same N: time should grow linearly in
  N with the window (`ms_per_1k_tokens` flat) and quadratically without.
- varlen: --total tokens packed from documents of random lengths in [--doc-min, --doc-max]: flashsys varlen
  against SDPA on the same documents padded to the longest (a boolean mask: causal within each document, padding
  hidden) and against a loop of flashsys calls, one per document.

    python -m benchmarks.attention_features --sections gqa window varlen
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import (
    DEVICE, ON_GPU, add_common_args, bench_ms, environment, peak_memory, progress, run_cell, write_table,
)
from flashsys.ops.attention import ATTENTION_BACKENDS, flash_attention, flash_attention_varlen

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _randn(*shape, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_()


def fwd_bwd(call, inputs, grad):
    """ms and peak MB of call() followed by backward with `grad`."""
    def step():
        for t in inputs:
            t.grad = None
        call().backward(grad)

    step()  # compile and autotune outside the timing
    with peak_memory() as mem:
        step()
    return bench_ms(step), mem["peak_mb"]


def gqa_rows(args, dtype) -> list[dict]:
    rows = []
    for n in progress(args.seq_lens, "gqa", args.no_progress):
        q = _randn(1, args.q_heads, n, args.head_dim, dtype=dtype, seed=n)
        k, v = (_randn(1, args.kv_heads, n, args.head_dim, dtype=dtype, seed=n + i) for i in (1, 2))
        do = torch.randn_like(q)
        cells = {}
        for name in ["flash", *args.sdpa]:
            backend = ATTENTION_BACKENDS[name]
            cells[name] = run_cell(lambda: dict(zip(("ms", "peak_MB"),
                                                    fwd_bwd(lambda: backend(q, k, v, True), (q, k, v), do))))
        best = min((c["ms"] for name, c in cells.items() if name != "flash" and "ms" in c), default=None)
        for name, cell in cells.items():
            row = {"section": "gqa", "N": n, "Hq": args.q_heads, "Hkv": args.kv_heads, "impl": name, **cell}
            if name == "flash" and best and "ms" in cell:
                row["vs_best_sdpa"] = cell["ms"] / best
            rows.append(row)
    return rows


def window_rows(args, dtype) -> list[dict]:
    rows = []
    for n in progress(args.window_seq_lens, "window", args.no_progress):
        q, k, v = (_randn(1, args.q_heads, n, args.head_dim, dtype=dtype, seed=n + i) for i in range(3))
        do = torch.randn_like(q)
        full = run_cell(lambda: dict(zip(("ms", "peak_MB"), fwd_bwd(lambda: flash_attention(q, k, v, causal=True),
                                                                    (q, k, v), do))))
        windowed = run_cell(lambda: dict(zip(("ms", "peak_MB"), fwd_bwd(
            lambda: flash_attention(q, k, v, causal=True, window_size=(args.window, 0)), (q, k, v), do))))
        for name, cell in (("causal", full), (f"window {args.window}", windowed)):
            row = {"section": "window", "N": n, "impl": name, **cell}
            if "ms" in cell:
                row["ms_per_1k_tokens"] = cell["ms"] / (n / 1024)
            if name != "causal" and "ms" in cell and "ms" in full:
                row["speedup_vs_causal"] = full["ms"] / cell["ms"]
            rows.append(row)
    return rows


def varlen_rows(args, dtype) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < args.total:
        lengths.append(min(int(torch.randint(args.doc_min, args.doc_max + 1, (1,), generator=g)),
                           args.total - sum(lengths)))
    lengths = [n for n in lengths if n > 0]
    total, longest, h, d = sum(lengths), max(lengths), args.q_heads, args.head_dim
    q, k, v = (_randn(total, h, d, dtype=dtype, seed=i) for i in range(3))
    do = torch.randn_like(q)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    bounds = list(zip(cu.tolist(), cu.tolist()[1:]))

    def packed():
        return flash_attention_varlen(q, k, v, cu, cu, longest, longest, causal=True)

    def per_document():
        return torch.cat([flash_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), causal=True)[0]
                          .transpose(0, 1) for a, b in bounds])

    # The padded batch is built once, outside the timing: a padded pipeline would hold its data that way.
    def pad(t):
        dense = torch.zeros(len(lengths), longest, h, d, dtype=dtype, device=DEVICE)
        for i, (a, b) in enumerate(bounds):
            dense[i, : b - a] = t.detach()[a:b]
        return dense.transpose(1, 2).contiguous().requires_grad_()

    qp, kp, vp = pad(q), pad(k), pad(v)
    dop = pad(do).detach()
    i = torch.arange(longest, device=DEVICE)
    valid = i[None, :] < torch.tensor(lengths, device=DEVICE)[:, None]  # (docs, N): real tokens
    mask = (i[None, :, None] >= i[None, None, :]) & valid[:, None, :]
    mask |= ~valid[:, :, None]  # padding queries see everything (their output is dropped): no all-masked rows

    def padded():
        return torch.nn.functional.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask[:, None])

    cases = (("flashsys varlen", packed, (q, k, v), do), ("SDPA padded + mask", padded, (qp, kp, vp), dop),
             ("flashsys, one call per document", per_document, (q, k, v), do))
    cells = {name: run_cell(lambda fn=fn, leaves=leaves, grad=grad: dict(zip(("ms", "peak_MB"),
                                                                              fwd_bwd(fn, leaves, grad))))
             for name, fn, leaves, grad in cases}
    ours = cells["flashsys varlen"].get("ms")
    rows = []
    for name, cell in cells.items():
        row = {"section": "varlen", "N": total, "documents": len(lengths), "longest": longest, "impl": name, **cell}
        if ours and "ms" in cell and name != "flashsys varlen":
            row["speedup_of_varlen"] = cell["ms"] / ours
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "attention_features")
    p.add_argument("--sections", nargs="+", choices=["gqa", "window", "varlen"], default=["gqa", "window", "varlen"])
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16" if ON_GPU else "fp32")
    p.add_argument("--q-heads", type=int, default=32 if ON_GPU else 4)
    p.add_argument("--kv-heads", type=int, default=8 if ON_GPU else 2)
    p.add_argument("--head-dim", type=int, default=128 if ON_GPU else 16)
    p.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384] if ON_GPU else [64])
    p.add_argument("--sdpa", nargs="+", default=["sdpa-flash", "sdpa-cudnn", "sdpa-efficient"] if ON_GPU
                   else ["sdpa-math"], help="SDPA variants of the registry to compare (GQA section)")
    p.add_argument("--window", type=int, default=1024 if ON_GPU else 16)
    p.add_argument("--window-seq-lens", nargs="+", type=int,
                   default=[4096, 8192, 16384, 32768, 65536] if ON_GPU else [64, 128])
    p.add_argument("--total", type=int, default=16384 if ON_GPU else 200, help="varlen: packed tokens")
    p.add_argument("--doc-min", type=int, default=64 if ON_GPU else 8)
    p.add_argument("--doc-max", type=int, default=4096 if ON_GPU else 64)
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    rows = []
    for section, build in (("gqa", gqa_rows), ("window", window_rows), ("varlen", varlen_rows)):
        if section in args.sections:
            rows += build(args, dtype)
    name = f"attention_features_{'gpu' if ON_GPU else 'cpu'}"
    path = write_table(rows, args.out, name, "GQA, sliding windows and packed sequences, forward + backward",
                       [f"{args.dtype}, causal, head_dim {args.head_dim}, Hq {args.q_heads}, Hkv {args.kv_heads} "
                        f"(varlen: Hq heads for q, k and v); median ms of forward + backward."], environment())
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
