"""The command line: `flashsys train` (the main job), `flashsys info` (what works on this machine), `flashsys plan`
(will it fit) and `flashsys convert` (between checkpoint formats).

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
# The `flashsys train` flags of each strategy `flashsys.plan` accounts for.
TRAIN_FLAGS = {"ddp": "--no-shard", "zero1": "--zero-stage 1", "zero2": "--zero-stage 2", "zero3": "--zero-stage 3"}


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
    p.add_argument("--zero-stage", type=int, choices=[1, 2, 3], default=None,
                   help="2: gradients and optimizer state sharded (ZeRO2Optimizer, default); 1: optimizer state only "
                        "(ShardedOptimizer); 3: parameters too (torch's FSDP2, fully_shard per block)")
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
    p.add_argument("--checkpoint-format", choices=["file", "sharded"], default=d.checkpoint_format,
                   help="file: OUT/checkpoint.pt, gathered and written by rank 0; sharded: OUT/checkpoint/, each rank "
                        "writing its own part in parallel (torch.distributed.checkpoint), resumable on any world size "
                        "(default %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the checkpoint in OUT (either format; that of --checkpoint-format first)")
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


def check_memory(model: ModelConfig, batch_per_rank: int, world: int, on_gpu: bool, strategy: str,
                 dtype: str) -> None:
    """Refuse a run that the plan (`flashsys.plan`) says cannot fit, before any process starts (a CPU worker that
    runs out is killed by the kernel with no message): its state and the activations backward certainly keeps
    exceed a rank's memory (a GPU's, or on a CPU the available memory shared by the ranks). Estimates above what
    is there, short of that floor, only warn: the estimate is the plan's, not a measurement.

    Raises:
        UsageError: saying how much the step needs at least, how much there is, and what would fit.
    """
    from .plan import PREFERENCE, TRAINER_STRATEGIES, Device, plan, recommend

    available = _available_bytes(on_gpu)
    if available is None:
        return
    per_rank = available if on_gpu else available / world
    device = Device("this machine", per_rank, {"bfloat16": 1.0, "float32": 1.0})
    chosen = plan(model, world, batch_per_rank, strategy, device, dtype, model.checkpoint_blocks)
    if chosen.floor <= per_rank:
        if not chosen.fits:
            print(f"flashsys train: warning: the plan estimates {chosen.memory.total / 2**30:.1f} GiB per rank, "
                  f"{per_rank / 2**30:.1f} GiB is there; it may run out of memory", file=sys.stderr)
        return
    where = "GPU memory per rank" if on_gpu else f"available memory per rank ({world} ranks share it)"
    others = [p for p in (plan(model, world, batch_per_rank, s, device, dtype, model.checkpoint_blocks)
                          for s in TRAINER_STRATEGIES if s != strategy and world > 1) if p.floor <= per_rank]
    best = (recommend(others) or min(others, key=lambda p: PREFERENCE.index(p.strategy))) if others else None
    hint = f"{TRAIN_FLAGS[best.strategy]} would fit; or " if best else ""
    raise UsageError(f"--batch-size {batch_per_rank * world} needs at least {chosen.floor / 2**30:.1f} GiB per rank "
                     f"({strategy}; `flashsys plan` shows the breakdown), but there is {per_rank / 2**30:.1f} GiB of "
                     f"{where}; {hint}lower --batch-size or --context-length")


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
    if a.zero_stage == 3 and world == 1:
        raise UsageError("--zero-stage 3 shards the parameters over ranks; with --world-size 1 there is nothing to "
                         "shard (one rank trains the whole model with AdamW): drop --zero-stage 3, or use more ranks")
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
    strategy = "ddp" if a.no_shard or world == 1 else f"zero{a.zero_stage or TrainConfig.zero_stage}"
    check_memory(model, a.batch_size // world, world, backend == "nccl", strategy, a.dtype)
    return TrainConfig(model=model, data=a.data, out=a.out, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                       warmup=min(20, max(1, a.steps // 10)), world_size=world, backend=backend,
                       bucket_mb=_bucket_mb(a.bucket_mb), shard=not a.no_shard,
                       zero_stage=a.zero_stage if a.zero_stage is not None else TrainConfig.zero_stage,
                       compile=cuda if a.compile is None else a.compile, dtype=a.dtype,
                       checkpoint_every=a.checkpoint_every,
                       checkpoint_format=a.checkpoint_format, stop_after=a.stop_after, resume=a.resume, seed=a.seed,
                       timeout_s=a.timeout, force=a.force, pack_documents=a.pack_documents)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `flashsys plan`."""
    from .plan import DEFAULT_EFFICIENCY, DEVICES, STRATEGIES

    p.add_argument("--preset", choices=list(PRESETS), default="xl", help="model size preset (default %(default)s)")
    p.add_argument("--d-model", type=int, help="override the preset's width")
    p.add_argument("--layers", type=int, help="override the preset's blocks")
    p.add_argument("--heads", type=int, help="override the preset's query heads")
    p.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    p.add_argument("--d-ff", type=int, help="override the preset's SwiGLU width")
    p.add_argument("--vocab-size", type=int, help="override the preset's vocabulary")
    p.add_argument("--context-length", type=int, default=512, help="tokens per sequence (default %(default)s)")
    p.add_argument("--world-size", type=int, default=2, help="ranks, one per device (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=32, help="global batch in sequences (default %(default)s)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="default %(default)s")
    p.add_argument("--strategy", choices=["all", *STRATEGIES], default="all")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--device", choices=list(DEVICES), default="h100", help="default %(default)s")
    p.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY,
                   help="fraction of the peak FLOP/s a step reaches (default %(default)s, measured: xl on an H200)")
    p.add_argument("--bandwidth-gbps", type=float, default=None,
                   help="link bus bandwidth in GB/s (default: the measured all-reduce table's)")


def cmd_plan(a: argparse.Namespace) -> int:
    """Print the plan of every strategy (or one) and the recommendation, or the smallest world that would fit."""
    from .plan import DEVICES, STRATEGIES, plan, recommend, smallest_world, table

    changes = {name: value for name, value in (("d_model", a.d_model), ("num_layers", a.layers),
                                               ("num_heads", a.heads), ("d_ff", a.d_ff), ("vocab_size", a.vocab_size),
                                               ("num_kv_heads", a.kv_heads)) if value is not None}
    model = preset(a.preset, context_length=a.context_length, **changes)
    if a.world_size < 1 or a.batch_size < 1 or a.batch_size % a.world_size:
        raise UsageError(f"--batch-size {a.batch_size} must be a positive multiple of --world-size {a.world_size}")
    if not 0 < a.efficiency <= 1:
        raise UsageError(f"--efficiency must be in (0, 1], got {a.efficiency}")
    device = DEVICES[a.device]
    per_rank = a.batch_size // a.world_size
    strategies = (STRATEGIES if a.world_size > 1 else ("ddp",)) if a.strategy == "all" else (a.strategy,)
    if a.world_size == 1 and a.strategy in ("zero1", "zero2", "zero3"):
        raise UsageError(f"--strategy {a.strategy} shards over ranks; with --world-size 1 there is nothing to shard "
                         "(one rank runs plain AdamW: --strategy ddp)")
    bandwidth = a.bandwidth_gbps * 1e9 if a.bandwidth_gbps else None
    plans = [plan(model, a.world_size, per_rank, s, device, a.dtype, a.checkpointing, a.efficiency, bandwidth)
             for s in strategies]
    print(f"{a.preset} ({model.num_layers} blocks, d_model {model.d_model}, d_ff {model.d_ff}, vocab "
          f"{model.vocab_size}), context {a.context_length}, batch {a.batch_size} over {a.world_size} x "
          f"{device.name} ({device.memory / 2**30:.0f} GiB), {a.dtype}"
          f"{', activation checkpointing' if a.checkpointing else ''}:\n")
    print(table(plans))
    for p in plans:
        for note in p.notes:
            print(f"note ({p.strategy}): {note}")
    best = recommend(plans)
    if best is not None:
        flags = TRAIN_FLAGS[best.strategy]
        bound = "compute" if best.compute_s >= best.comm_s else "communication"
        print(f"\nrecommended: {best.strategy} (flashsys train {flags}): {best.memory.total / 2**30:.1f} GiB per rank, "
              f"about {best.step_s * 1e3:.0f} ms per step ({bound}-bound)")
        return 0
    found = smallest_world(model, per_rank, device, a.dtype, a.checkpointing)
    where = (f"the smallest world that holds it at {per_rank} sequences per rank is {found[0]} x {device.name} "
             f"({found[1]})" if found else "no world holds it: one rank's activations alone exceed the device")
    hint = "" if a.checkpointing else "; --checkpointing cuts the activations"
    print(f"\nnothing fits on {a.world_size} x {device.name}: {where}{hint}")
    return 1


def cmd_train(a: argparse.Namespace) -> int:
    """`flashsys train`: the flags checked into a TrainConfig, then the run."""
    from .train import run_training

    run_training(config_from_args(a))
    return 0


def cmd_convert(a: argparse.Namespace) -> int:
    """`flashsys convert SOURCE TARGET`: between the one-file and the sharded checkpoint formats."""
    from pathlib import Path

    from . import sharded_checkpoint

    source, target = Path(a.source), Path(a.target)
    if target.exists():
        raise UsageError(f"{target} exists; convert writes a new file or directory and replaces nothing")
    if source.is_dir():
        sharded_checkpoint.to_single_file(source, target)
    elif source.is_file():
        sharded_checkpoint.from_single_file(source, target)
    else:
        raise UsageError(f"{source} does not exist")
    print(f"flashsys convert: wrote {target}")
    return 0


def cmd_info() -> int:
    """Print versions, devices, which attention backends work here and whether the Hopper kernels run."""
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
    print(f"hopper kernels {hopper_kernels_status()}")
    return 0


def hopper_kernels_status() -> str:
    """Whether the Gluon kernels (Hopper) take flashsys's Triton calls here, and from which size: the dispatch's own
    words (`dispatch.status`), or why not."""
    try:
        from .ops.attention import dispatch

        return dispatch.status()
    except ImportError:  # the dispatch is part of the Triton op
        return "off (Triton is not installed)"
    except ValueError as e:  # a switch set to neither 0 nor 1 (read on import, or here): the Triton op raises the same
        return f"misconfigured: {e}"


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: sys.argv) and run the command; returns the exit code (2 for a usage error)."""
    from .dist import SpawnError
    from .errors import TrainingDiverged

    parser = argparse.ArgumentParser(prog="flashsys", description="FlashAttention, data-parallel and ZeRO-2 training "
                                     "of a language model on one or many GPUs (or CPU processes).")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a byte-level language model end to end (the main job)",
                           description="Train a TransformerLM on a text file with FlashAttention, BucketedDDP and "
                                       "ZeRO2Optimizer(AdamW) (--zero-stage 1: ShardedOptimizer; --zero-stage 3: "
                                       "torch's FSDP2; --no-shard: AdamW; one rank trains the model unwrapped with "
                                       "AdamW): gloo processes on a CPU, one NCCL process per GPU, ranks from the "
                                       "environment under torchrun.")
    add_train_arguments(train)
    sub.add_parser("info", help="torch/Triton versions, devices, which attention backends work here, and whether "
                                "the Hopper kernels run")
    planner = sub.add_parser("plan", help="memory per rank, communication and step time of each strategy, before "
                                          "launching", description="Will it fit, and what will it cost? Per-rank "
                             "memory (parameters, gradients, optimizer state, activations, buffers), bytes sent per "
                             "step and a predicted step time, for DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (flashsys.plan).")
    add_plan_arguments(planner)
    convert = sub.add_parser("convert", help="a training checkpoint from one format to the other",
                             description="Convert a sharded checkpoint directory (OUT/checkpoint/, "
                             "--checkpoint-format sharded) into the one-file format (checkpoint.pt), or the other "
                             "way round; the source is checked (manifest, SHA-256 of every file) first.")
    convert.add_argument("source", help="a sharded checkpoint directory, or a checkpoint.pt file")
    convert.add_argument("target", help="the file (from a directory) or directory (from a file) to write")
    args = parser.parse_args(argv)
    commands = {"convert": cmd_convert, "info": lambda _: cmd_info(), "plan": cmd_plan, "train": cmd_train}
    try:
        code = commands[args.command](args)
        sys.stdout.flush()  # a reader that left early shows here, not at the interpreter's exit
        return code
    except UsageError as e:
        print(f"flashsys {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (SpawnError, TrainingDiverged) as e:
        print(f"flashsys {args.command}: failed: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader closed the pipe (`flashsys info | head -3`): what is left has nowhere to go. Point stdout at
        # the null device so the interpreter's last flush does not raise again, and exit as a shell reports a
        # process SIGPIPE ended.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
