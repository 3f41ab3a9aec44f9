"""Decoding from a KV cache: one new query per sequence against the cache, grouped-query heads, forward only.
flashsys (its split-key decode kernels) against SDPA pinned to each of its kernels and compiled FlexAttention, in
one run. SDPA's fused kernels take no grouped K/V in this call, so it runs as transformers' sdpa path runs one
query: each K/V head's group of query heads folded into query rows, (B, Hkv, Hq/Hkv, D). `vs_best` is flashsys'
time over the fastest baseline that ran in the cell.

Two times per implementation on a GPU: `_ms`, the eager call (its launches' host time shows where it exceeds the
kernels' time), and `_graph_ms`, the call captured in a CUDA graph and replayed (the kernels alone, as a serving loop
or a compiled decode step with CUDA graphs runs them); `vs_best` and `vs_best_graph` compare each.

With --left-pad, row b of a batch starts with b / batch of half its cache as padding (a left-padded batch, as
transformers' generate() holds one): flashsys' `flash_attention_decode` skips each row's padding (`cache_start`)
against the padding's mask in SDPA's kernels that take one and a FlexAttention block mask (built outside the timing),
and against flashsys' varlen kernels over each row's real keys gathered (how a padded batch ran before the decode op
took one; the gather is timed, as it runs at every step).

    python -m benchmarks.decode --batches 1 4 16 64 --cache-lens 1024 4096 16384 32768
    python -m benchmarks.decode --left-pad --batches 4 16 64 --cache-lens 1024 8192 32768 \
        --sdpa sdpa-cudnn sdpa-efficient
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.harness import (
    DEVICE,
    ON_GPU,
    add_common_args,
    bench_ms,
    environment,
    graph_ms,
    progress,
    run_cell,
    write_table,
)
from flashsys.ops.attention import flash_attention, flash_attention_decode, flash_attention_varlen

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _flex(starts: torch.Tensor | None):
    """Compiled FlexAttention with GQA (no mask: one query sees the whole cache; with `starts`, a block mask of each
    row's keys from its start on, built at the first call); None where it is missing."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    compiled = torch.compile(flex_attention, dynamic=False)
    if starts is None:
        return lambda q, k, v: compiled(q, k, v, enable_gqa=True)
    masks = {}

    def run(q, k, v):
        if k.shape not in masks:
            masks[k.shape] = create_block_mask(lambda b, h, qi, kv: kv >= starts[b], q.shape[0], None, q.shape[2],
                                               k.shape[2], device=q.device)
        return compiled(q, k, v, block_mask=masks[k.shape], enable_gqa=True)

    return run


def _sdpa_grouped(kernel: str | None, starts: torch.Tensor | None):
    """SDPA with the query heads of each K/V head folded into query rows (one query per sequence sees every key,
    so the rows are independent); `kernel` pins one SDPA backend (None: PyTorch chooses). With `starts`, a boolean
    mask of each row's keys from its start on (made once per cache length, outside the timing)."""
    import contextlib

    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    masks = {}

    def run(q, k, v):
        b, hq, n_q, d = q.shape
        folded = q.reshape(b, k.shape[1], hq // k.shape[1] * n_q, d)
        mask = None
        if starts is not None:
            if k.shape not in masks:
                masks[k.shape] = (torch.arange(k.shape[2], device=q.device) >= starts[:, None])[:, None, None, :]
            mask = masks[k.shape]
        with sdpa_kernel(getattr(SDPBackend, kernel)) if kernel else contextlib.nullcontext():
            return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask).reshape(b, hq, n_q, d)

    return run


def _gathered_varlen(starts: torch.Tensor):
    """flashsys' varlen kernels over each row's real keys, gathered into a packed copy first (timed with it)."""

    def run(q, k, v):
        b, hq, n_q, d = q.shape
        n_k = k.shape[2]
        real = (torch.arange(n_k, device=q.device) >= starts[:, None]).reshape(-1).nonzero().view(-1)
        lengths = (n_k - starts).to(torch.int32)
        cu_k = torch.cat([lengths.new_zeros(1), lengths.cumsum(0, dtype=torch.int32)])
        cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device) * n_q
        kp, vp = (t.transpose(1, 2).reshape(b * n_k, -1, d)[real] for t in (k, v))
        out = flash_attention_varlen(q.transpose(1, 2).reshape(b * n_q, hq, d), kp, vp, cu_q, cu_k, n_q,
                                     int(lengths.max()), causal=True)
        return out.view(b, n_q, hq, d).transpose(1, 2)

    return run


SDPA_KERNELS = {"sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
                "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-math": "MATH", "sdpa": None}


UNCAPTURABLE = ("flashsys-varlen",)  # reads its offsets back at every call: no CUDA graph captures it


def impls(sdpa: list[str], with_flex: bool, starts: torch.Tensor | None = None) -> dict:
    """The implementations by name, flashsys first; with `starts` (a left-padded batch), each skipping or masking
    every row's keys before its start, and flashsys' varlen path beside its decode op."""
    if starts is None:
        out = {"flashsys": lambda q, k, v: flash_attention(q, k, v, causal=True)}
    else:
        out = {"flashsys": lambda q, k, v: flash_attention_decode(q, k, v, cache_start=starts, causal=True),
               "flashsys-varlen": _gathered_varlen(starts)}
    for name in sdpa:
        out[name] = _sdpa_grouped(SDPA_KERNELS[name], starts)
    if with_flex and (flex := _flex(starts)) is not None:
        out["flex_attention"] = flex
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "decode")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16" if ON_GPU else "fp32")
    p.add_argument("--q-heads", type=int, default=32 if ON_GPU else 4)
    p.add_argument("--kv-heads", type=int, default=8 if ON_GPU else 2)
    p.add_argument("--head-dim", type=int, default=128 if ON_GPU else 16)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64] if ON_GPU else [1])
    p.add_argument("--cache-lens", nargs="+", type=int, default=[1024, 4096, 16384, 32768] if ON_GPU else [512])
    p.add_argument("--sdpa", nargs="+", choices=list(SDPA_KERNELS),
                   default=["sdpa-flash", "sdpa-cudnn", "sdpa-efficient"] if ON_GPU else ["sdpa-math"])
    p.add_argument("--no-flex", action="store_true", help="leave compiled FlexAttention out")
    p.add_argument("--no-graphs", action="store_true", help="time the eager calls only (no CUDA-graph replays)")
    p.add_argument("--left-pad", action="store_true",
                   help="row b of each batch starts with b / batch of half its cache as padding")
    args = p.parse_args(argv)
    dtype = DTYPES[args.dtype]
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    graphs = ON_GPU and not args.no_graphs
    rows = []
    cells = [(b, n) for b in args.batches for n in args.cache_lens]
    for batch, n in progress(cells, "decode", args.no_progress):
        g = torch.Generator(device="cpu").manual_seed(batch * 100003 + n)
        q = torch.randn(batch, args.q_heads, 1, args.head_dim, generator=g).to(DEVICE, dtype)
        k, v = (torch.randn(batch, args.kv_heads, n, args.head_dim, generator=g).to(DEVICE, dtype) for _ in range(2))
        starts = (torch.arange(batch, device=DEVICE) * n // (2 * batch)) if args.left_pad else None
        fns = impls(args.sdpa, with_flex=ON_GPU and not args.no_flex, starts=starts)
        times = {}
        for name, fn in fns.items():
            def cell(fn=fn, name=name, q=q, k=k, v=v):
                with torch.no_grad():
                    fn(q, k, v)  # compile and autotune outside the timing
                    out = {"ms": bench_ms(lambda: fn(q, k, v))}
                    if graphs and name not in UNCAPTURABLE:
                        out["graph_ms"] = graph_ms(lambda: fn(q, k, v))
                    return out
            times[name] = run_cell(cell)
        row = {"batch": batch, "cache": n}
        for name, t in times.items():
            row[f"{name}_ms"] = t.get("ms", t.get("error"))
            if graphs:
                row[f"{name}_graph_ms"] = t.get("graph_ms", t.get("error"))
        for column, suffix in (("vs_best", "ms"), ("vs_best_graph", "graph_ms")):
            baselines = [t[suffix] for name, t in times.items() if not name.startswith("flashsys") and suffix in t]
            ours = times["flashsys"].get(suffix)
            if ours is not None and baselines:
                row[column] = ours / min(baselines)
        rows.append(row)
    name = f"decode_{'gpu' if ON_GPU else 'cpu'}{'_left_pad' if args.left_pad else ''}"
    padding = ("; left-padded: row b's first b * cache / (2 * batch) keys are padding. flashsys-varlen: the varlen "
               "kernels over the real keys gathered at each call" if args.left_pad else "")
    path = write_table(rows, args.out, name, "Decoding: queries against a KV cache, forward only",
                       [f"{args.dtype}, one query per sequence{padding}, Hq {args.q_heads}, Hkv {args.kv_heads}, "
                        f"head_dim {args.head_dim}; median ms per call: `_ms` the eager call, `_graph_ms` the call "
                        "replayed from a CUDA graph (the kernels alone). vs_best, vs_best_graph: flashsys / the "
                        "fastest baseline (< 1 is faster)."], environment())
    print(path.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
