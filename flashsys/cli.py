"""The command line: `flashsys train` (the main job) and `flashsys info` (what works on this machine).

All argument parsing lives here; it turns flags into a `TrainConfig` and hands that to `flashsys.train`.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys

import torch

from .errors import UsageError
from .nn import PRESETS, ModelConfig, preset
from .ops.attention import ATTENTION_BACKENDS, FLASH_SHORT_NAMES
from .train import TrainConfig

DEMO = PRESETS["demo"]


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `flashsys train`; defaults come from `TrainConfig` and the "demo" preset."""
    d = TrainConfig()
    p.add_argument("--preset", choices=list(PRESETS), help="model size preset (overrides the four below)")
    p.add_argument("--d-model", type=int, default=DEMO.d_model, help="model width (default %(default)s)")
    p.add_argument("--layers", type=int, default=DEMO.num_layers, help="transformer blocks (default %(default)s)")
    p.add_argument("--heads", type=int, default=DEMO.num_heads, help="query heads (default %(default)s)")
    p.add_argument("--d-ff", type=int, default=DEMO.d_ff, help="SwiGLU hidden width (default %(default)s)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads (grouped-query attention; default --heads)")
    p.add_argument("--attention-window", type=int, default=None, metavar="W",
                   help="sliding-window attention: each token sees itself and the W tokens before it")
    p.add_argument("--pack-documents", action="store_true",
                   help="documents end at blank lines; attention never crosses one (flash_attention_varlen)")
    p.add_argument("--context-length", type=int, default=DEMO.context_length,
                   help="tokens (bytes) per sequence (default %(default)s)")
    p.add_argument("--attention", choices=list(ATTENTION_BACKENDS), default=DEMO.attention_backend,
                   help="attention implementation inside the model (default %(default)s; see `flashsys info`)")
    p.add_argument("--world-size", type=int, default=None, help="processes (default: GPUs, or 2 on a CPU)")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="global batch in sequences, split over ranks (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr,
                   help="peak learning rate of AdamW's warm-up and cosine schedule (default %(default)s)")
    p.add_argument("--bucket-mb", default="auto",
                   help="BucketedDDP bucket size in MB, 'auto' (measured, the default) or 'none'")
    p.add_argument("--no-shard", action="store_true", help="plain AdamW instead of a sharded optimizer")
    p.add_argument("--zero-stage", type=int, choices=[1, 2], default=None,
                   help="2: gradients and optimizer state sharded (ZeRO2Optimizer, default); 1: optimizer state only "
                        "(ShardedOptimizer)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the model (default: on a GPU, where it pays; --no-compile for eager)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype,
                   help="float32, or bfloat16 autocast (default %(default)s)")
    p.add_argument("--data", default=d.data, help="a UTF-8 text file (default: the bundled Alice text)")
    p.add_argument("--out", default=d.out,
                   help="output directory: checkpoint, summary.json, loss.png, final_model.pt (default %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="K",
                   help="write a checkpoint every K steps; 0: never (default %(default)s)")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="end this invocation after STEP (as a time-limited job would); --resume continues the schedule")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the weights and batches (default %(default)s)")
    p.add_argument("--timeout", type=float, default=d.timeout_s, metavar="SECONDS",
                   help="a rank that waits longer than this for the others fails (default %(default)s)")
    p.add_argument("--force", action="store_true",
                   help="--resume even when the checkpoint was trained with another seed, batch size, lr or data")


def _bucket_mb(text: str) -> float | str | None:
    if text == "auto":
        return "auto"
    if text.lower() == "none":
        return None
    try:
        bucket = float(text)
    except ValueError:
        raise UsageError(f"--bucket-mb must be a number, 'auto' or 'none', got {text!r}") from None
    if bucket <= 0:
        raise UsageError(f"--bucket-mb must be positive, got {bucket}")
    return bucket


def training_bytes_estimate(model: ModelConfig, batch_per_rank: int) -> int:
    """A lower bound on one rank's memory for a training step: fp32 weights, gradients and AdamW's two moments,
    plus the activations backward keeps (about 16 floats per token per layer in the blocks, and the logits with
    their float copy and gradient). Real use is higher; this is only to refuse what cannot possibly fit."""
    c = model
    params = 2 * c.vocab_size * c.d_model + c.num_layers * (4 * c.d_model**2 + 3 * c.d_model * c.d_ff)
    tokens = batch_per_rank * c.context_length
    activations = tokens * (c.num_layers * 16 * c.d_model + 3 * c.vocab_size)
    return 4 * (4 * params + activations)


def _available_bytes(on_gpu: bool) -> int | None:
    if on_gpu:
        return torch.cuda.get_device_properties(0).total_memory
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(model: ModelConfig, batch_per_rank: int, world: int, on_gpu: bool) -> None:
    """Refuse a run whose lower-bound memory estimate exceeds what the machine has, before any process starts
    (a CPU worker that runs out is killed by the kernel with no message).

    Raises:
        UsageError: saying how much the step needs at least and how much there is.
    """
    available = _available_bytes(on_gpu)
    if available is None:
        return
    need = training_bytes_estimate(model, batch_per_rank) * (1 if on_gpu else world)
    if need > available:
        where = "GPU memory per rank" if on_gpu else f"available memory for {world} rank(s)"
        raise UsageError(f"--batch-size {batch_per_rank * world} needs at least {need / 2**30:.1f} GiB, but there is "
                         f"{available / 2**30:.1f} GiB of {where}; lower --batch-size or --context-length")


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    """A validated `TrainConfig` from parsed flags.

    Raises:
        UsageError: naming the flag that is wrong.
    """
    from .corpus import VOCAB
    from .dist import launched_by_torchrun

    if a.preset:
        model = preset(a.preset, vocab_size=VOCAB, context_length=a.context_length, attention_backend=a.attention)
    else:
        model = DEMO.replace(d_model=a.d_model, num_layers=a.layers, num_heads=a.heads, d_ff=a.d_ff,
                             context_length=a.context_length, attention_backend=a.attention)
    model = model.replace(num_kv_heads=a.kv_heads, attention_window=a.attention_window)
    for name, flag in (("d_model", "--d-model"), ("num_layers", "--layers"), ("num_heads", "--heads"),
                       ("d_ff", "--d-ff"), ("context_length", "--context-length")):
        if getattr(model, name) <= 0:
            raise UsageError(f"{flag} must be positive, got {getattr(model, name)}")
    if a.kv_heads is not None and (a.kv_heads <= 0 or model.num_heads % a.kv_heads):
        raise UsageError(f"--kv-heads must divide --heads {model.num_heads}, got {a.kv_heads}")
    if a.attention_window is not None and a.attention_window < 0:
        raise UsageError(f"--attention-window must be 0 or more, got {a.attention_window}")
    if a.pack_documents and a.attention not in FLASH_SHORT_NAMES:
        raise UsageError(f"--pack-documents needs a flash attention backend (flash, flash-triton, flash-torch), "
                         f"not --attention {a.attention}")
    if model.d_model % model.num_heads or model.head_dim % 2:
        raise UsageError(f"--d-model {model.d_model} must split into --heads {model.num_heads} heads of even size")
    cuda = torch.cuda.is_available()
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
    else:
        world = a.world_size if a.world_size is not None else (torch.cuda.device_count() if cuda else 2)
    if world < 1:
        raise UsageError(f"--world-size must be at least 1, got {world}")
    if a.steps < 1 or a.batch_size < 1:
        raise UsageError(f"--steps and --batch-size must be positive, got {a.steps} and {a.batch_size}")
    if not math.isfinite(a.lr) or a.lr <= 0:
        raise UsageError(f"--lr must be a positive finite number, got {a.lr}")
    if a.checkpoint_every < 0:
        raise UsageError(f"--checkpoint-every must be 0 (never) or positive, got {a.checkpoint_every}")
    if a.no_shard and a.zero_stage is not None:
        raise UsageError(f"--zero-stage {a.zero_stage} shards the optimizer and --no-shard asks for none; give one")
    if a.stop_after is not None and a.stop_after < 1:
        raise UsageError(f"--stop-after must be at least 1, got {a.stop_after}")
    if not a.out.strip():
        raise UsageError("--out must name a directory, got an empty string")
    if not math.isfinite(a.timeout) or a.timeout <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {a.timeout}")
    if world > a.batch_size:
        raise UsageError(f"--world-size {world} is larger than --batch-size {a.batch_size}: some ranks would get "
                         "no data")
    if a.batch_size % world:
        raise UsageError(f"--batch-size {a.batch_size} must be divisible by the world size {world}")
    backend = "nccl" if cuda and world <= torch.cuda.device_count() else "gloo"
    check_memory(model, a.batch_size // world, world, backend == "nccl")
    return TrainConfig(model=model, data=a.data, out=a.out, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                       warmup=min(20, max(1, a.steps // 10)), world_size=world, backend=backend,
                       bucket_mb=_bucket_mb(a.bucket_mb), shard=not a.no_shard,
                       zero_stage=a.zero_stage if a.zero_stage is not None else TrainConfig.zero_stage,
                       compile=cuda if a.compile is None else a.compile, dtype=a.dtype,
                       checkpoint_every=a.checkpoint_every, stop_after=a.stop_after, resume=a.resume, seed=a.seed,
                       timeout_s=a.timeout, force=a.force, pack_documents=a.pack_documents)


def cmd_info() -> int:
    """Print versions, devices and which attention backends work here."""
    from . import __version__
    from .ops.attention import backend_report

    print(f"flashsys    {__version__}")
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
    for name, ok, why in backend_report():
        print(f"  {name:15s} {'works' if ok else 'unavailable'}{': ' + why if why else ''}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv) and run the command; returns the exit code (2 for a usage error)."""
    from .dist import SpawnError
    from .errors import TrainingDiverged
    from .train import run_training

    parser = argparse.ArgumentParser(prog="flashsys", description="FlashAttention, data-parallel and ZeRO-2 training of "
                                                                  "a language model on one or many GPUs (or CPU "
                                                                  "processes).")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a byte-level language model end to end (the main job)",
                           description="Train a TransformerLM on a text file with FlashAttention, BucketedDDP and "
                                       "ZeRO2Optimizer(AdamW) (--zero-stage 1: ShardedOptimizer; --no-shard: AdamW; "
                                       "one rank trains the model unwrapped with AdamW): gloo processes on a CPU, one "
                                       "NCCL process per GPU, ranks from the environment under torchrun.")
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
    except (SpawnError, TrainingDiverged) as e:
        print(f"flashsys train: failed: {e}", file=sys.stderr)
        return 1
    return 0
