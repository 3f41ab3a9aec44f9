"""Command line: `flashsys train` (the main job) and `flashsys info` (what works on this machine)."""

from __future__ import annotations

import argparse
import platform
import sys


def cmd_info() -> int:
    import torch

    print(f"flashsys    {__import__('flashsys').__version__}")
    print(f"python      {platform.python_version()}")
    print(f"torch       {torch.__version__}")
    try:
        import triton

        print(f"triton      {triton.__version__}")
    except ImportError as e:
        print(f"triton      not importable ({e})")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"device {i}    {torch.cuda.get_device_name(i)}")
    else:
        print("devices     CPU only (no CUDA device)")
    print("attention backends:")
    for name, ok, why in attention_backend_report():
        print(f"  {name:13s} {'works' if ok else 'unavailable'}{': ' + why if why else ''}")
    return 0


def attention_backend_report() -> list[tuple[str, bool, str]]:
    """Run each attention backend once on a tiny input and say which work here, and why not."""
    import torch

    from .nn import ATTENTION_BACKENDS, attend
    from .ops.attention import interpreter_active

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q = torch.randn(1, 2, 16, 16, device=device)
    report = []
    for name in ATTENTION_BACKENDS:
        if name == "flash-triton" and device == "cpu" and not interpreter_active():
            report.append((name, False, "needs CUDA, or TRITON_INTERPRET=1 set before import (slow, for tests)"))
            continue
        try:
            attend(q, q, q, causal=True, softmax_scale=None, backend=name)
            how = {"flash": "Triton on CUDA" if device == "cuda" else "tiled PyTorch (no CUDA)",
                   "flash-triton": "Triton interpreter (TRITON_INTERPRET=1)" if device == "cpu" else "",
                   }.get(name, "")
            report.append((name, True, how))
        except Exception as e:  # report, don't crash
            report.append((name, False, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"))
    return report


def main(argv: list[str] | None = None) -> int:
    from .train import UsageError, add_train_arguments, config_from_args, run_training

    parser = argparse.ArgumentParser(prog="flashsys", description="FlashAttention-2, data parallel and ZeRO-1 training.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a byte-level language model end to end (the main job)",
                           description="Train a TransformerLM on a text file with FlashAttention, BucketedDDP and "
                                       "ShardedOptimizer: gloo processes on a CPU, one NCCL process per GPU, "
                                       "ranks from the environment under torchrun.")
    add_train_arguments(train)
    sub.add_parser("info", help="torch/Triton versions, devices, and which attention backends work here")
    args = parser.parse_args(argv)
    if args.command == "info":
        return cmd_info()
    try:
        run_training(config_from_args(args))
    except UsageError as e:
        print(f"flashsys train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
