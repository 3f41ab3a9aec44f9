"""Forward times of every Gluon variant as the library launches it (flash_gluon._launch), beside the `tl` forward and
SDPA's cuDNN forward, and the variant the library's own choice picks (GPU probe for #16; prints). H 16, 16k tokens
per cell, bf16; a variant that fails prints its error. With --rounds the candidates are timed in interleaved rounds
(the pool's clocks drift), and --choice-settings makes the library's choice afresh under other timing settings, to
compare its picks with the long timings here.

    python scripts/probe_gluon_variants.py --head-dims 64 128 --seqs 4096 16384
    python scripts/probe_gluon_variants.py --head-dims 128 --seqs 4096 --rounds 2 --rep 500 --choice-settings 10:5 100:3
    python scripts/probe_gluon_variants.py --against /tmp/old_gluon_kernels.py --rounds 3   # A/B against other kernels
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import traceback

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.harness import at_least_one  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=[64, 128])
    ap.add_argument("--seqs", type=int, nargs="+", default=[16384])
    ap.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    ap.add_argument("--rounds", type=at_least_one, default=1,
                    help="interleaved rounds; each row prints its median (min-max)")
    ap.add_argument("--choices", type=int, default=1, help="how many times the library's choice is made afresh")
    ap.add_argument("--choice-settings", nargs="+", default=["100:3"],
                    help="the choice's settings to try, each rep_ms:rounds (flash_gluon._CHOICE_REP_MS, _ROUNDS)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms) per timing")
    ap.add_argument("--against", metavar="FILE", type=kernels_file,
                    help="another version of gluon_kernels.py: its variants are timed too, interleaved with these")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_gluon_variants times CUDA kernels")
        return 0
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashsys.ops.attention import flash_gluon, native_launch
    from flashsys.ops.attention.flash_triton import flash_forward_triton

    native_launch.wait()
    against = _load_kernels(args.against) if args.against else None
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; H 16, "
          f"B = 16384 // N, bf16, forward only, median ms of triton.testing.do_bench(rep={args.rep}), "
          f"{args.rounds} interleaved round(s)")
    for d in args.head_dims:
        for n in args.seqs:
            for causal in {"yes": (True,), "no": (False,), "both": (True, False)}[args.causal]:
                b = 16384 // n
                q, k, v = (torch.randn(b, 16, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                window = (-1, 0) if causal else (-1, -1)
                scale = d ** -0.5
                flops = 4 * b * 16 * n * n * d / (2 if causal else 1)
                o = torch.empty_like(q)
                lse = torch.empty(q.shape[:-1], device="cuda", dtype=torch.float32)

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                def tl_forward():
                    saved = flash_gluon.MIN_WORK
                    flash_gluon.MIN_WORK = 1 << 62
                    try:
                        flash_forward_triton(q, k, v, window, scale)
                    finally:
                        flash_gluon.MIN_WORK = saved

                candidates = [("SDPA cuDNN", cudnn), ("flashsys tl forward", tl_forward)]
                for var in flash_gluon.VARIANTS[d]:
                    launch = functools.partial(flash_gluon._launch, var, q, k, v, o, lse, window, scale)
                    candidates.append((f"gluon {var.label()}", launch))
                    if against is not None:
                        candidates.append((f"gluon {var.label()} (--against)", functools.partial(
                            _with_kernels, against, launch)))
                times: dict[str, list[float]] = {}
                for _ in range(args.rounds):
                    for label, fn in candidates:
                        if label in times and not times[label]:
                            continue  # failed before
                        try:
                            times.setdefault(label, []).append(triton.testing.do_bench(fn, rep=args.rep))
                        except Exception:  # noqa: BLE001
                            print(f"  {label} FAILED: {traceback.format_exc()[-600:]}")
                            times[label] = []
                rows = [(label, statistics.median(ts), min(ts), max(ts)) for label, ts in times.items() if ts]
                print(f"\nD={d} N={n} B={b} causal={causal}")
                for rep_ms, rounds in (tuple(int(x) for x in c.split(":")) for c in args.choice_settings):
                    flash_gluon._CHOICE_REP_MS, flash_gluon._CHOICE_ROUNDS = rep_ms, rounds
                    picks = []
                    for _ in range(args.choices):
                        flash_gluon._chosen.clear()
                        flash_gluon.forward(q, k, v, o, lse, window, scale)
                        picks.append(next(iter(flash_gluon.chosen_variants().values())).label())
                    print(f"  the library's choice (rep {rep_ms} ms, {rounds} rounds): "
                          + ", ".join(picks))
                for label, ms, lo, hi in rows:
                    print(f"  {label:<45} {ms:8.3f} ms ({lo:.3f}-{hi:.3f})  {flops / ms / 1e9:7.1f} TFLOP/s",
                          flush=True)
    return 0


def kernels_file(path: str) -> str:
    """argparse type of --against: an existing Python file (another version of gluon_kernels.py)."""
    if not path.endswith(".py") or not os.path.isfile(path):
        raise argparse.ArgumentTypeError(f"{path!r}: want an existing .py file, another version of gluon_kernels.py")
    return path


def _load_kernels(path: str):
    """`path` (a gluon_kernels.py) imported as a module of flashsys.ops.attention, beside the library's own. Exits,
    naming --against, where a kernel the library launches is missing there or takes other parameters: the host
    passes the library's kernels' parameters, by name, and a difference would otherwise stop the timings midway
    with a KeyError from deep in the launch."""
    from flashsys.ops.attention import flash_gluon

    own = flash_gluon._kernels()
    if own is None:
        raise SystemExit(f"--against {path}: the library's own Gluon kernels do not import here "
                         f"({flash_gluon._broken})")
    spec = importlib.util.spec_from_file_location("flashsys.ops.attention._gluon_kernels_against", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, kernel in vars(own).items():
        if not name.startswith("attention_") or not hasattr(kernel, "arg_names"):
            continue
        theirs = getattr(getattr(module, name, None), "arg_names", None)
        if theirs is None:
            raise SystemExit(f"--against {path}: it has no kernel {name}, which the library launches")
        if theirs != kernel.arg_names:
            extra = [a for a in theirs if a not in kernel.arg_names]
            missing = [a for a in kernel.arg_names if a not in theirs]
            what = "; ".join(part for part in (f"takes {', '.join(extra)}, which the library does not pass" if extra
                                               else "", f"lacks {', '.join(missing)}" if missing else "") if part)
            raise SystemExit(f"--against {path}: its {name} {what or 'takes its parameters in another order'}")
    return module


def _with_kernels(module, launch):
    """Run `launch` with flash_gluon launching `module`'s kernels in place of its own."""
    from flashsys.ops.attention import flash_gluon

    own = flash_gluon._kernels()  # imported before the swap, so that the swap is undone to it
    flash_gluon._imported[0] = module
    try:
        return launch()
    finally:
        flash_gluon._imported[0] = own


if __name__ == "__main__":
    raise SystemExit(main())
