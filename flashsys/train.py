"""`flashsys train`: a byte-level TransformerLM trained end to end with FlashAttention, BucketedDDP and
ShardedOptimizer, on whatever the machine has (gloo processes on a CPU, one NCCL process per GPU).

Determinism is what makes `--resume` bit-exact: the batch of step s is drawn from a generator seeded by
(seed, s), the learning rate is a function of s, and the checkpoint holds the weights and the full
(consolidated) optimizer state. Checkpoints are written to a temporary file and renamed, so a run killed
mid-write never leaves a half-written checkpoint where `--resume` would read it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

DEFAULT_DATA = Path(__file__).parent / "data" / "alice.txt"
CHECKPOINT = "checkpoint.pt"
VOCAB = 256  # bytes


class UsageError(Exception):
    """Bad input: printed as one clear line, exit code 2."""


@dataclass
class ModelConfig:
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 384
    context_length: int = 64


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: str = str(DEFAULT_DATA)
    out: str = "runs/latest"
    steps: int = 250
    batch_size: int = 16
    lr: float = 3e-3
    warmup: int = 20
    world_size: int = 2
    backend: str = "gloo"
    bucket_mb: float | str | None = 25.0
    shard: bool = True
    compile: bool = False
    dtype: str = "float32"
    checkpoint_every: int = 0
    stop_after: int | None = None
    resume: bool = False
    seed: int = 0
    sample_length: int = 200
    eval_batches: int = 8


# ---------------------------------------------------------------------------------------------- data


def load_corpus(path: str | Path, context_length: int) -> torch.Tensor:
    """UTF-8 text as a uint8 tensor of bytes; clear errors for missing, empty, non-UTF-8 or too-short files."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"data file not found: {p}")
    raw = p.read_bytes()
    if not raw:
        raise UsageError(f"data file is empty: {p}")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"data file is not UTF-8 text: {p} ({e.reason} at byte {e.start})") from None
    if len(raw) < 2 * (context_length + 1):
        raise UsageError(
            f"data file is too short: {len(raw)} bytes for context length {context_length} "
            f"(need at least {2 * (context_length + 1)}: one context for training and one held out)"
        )
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()


def split_corpus(data: torch.Tensor, context_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last 10% (at least one context) is held out."""
    n_val = max(len(data) // 10, context_length + 1)
    return data[:-n_val], data[-n_val:]


def batch_for_step(data: torch.Tensor, step: int, batch_size: int, context_length: int, seed: int):
    """The global batch of one step: the same on every rank and in every run (seeded by seed and step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - context_length - 1 + 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(context_length + 1)
    seq = data[idx].long()
    return seq[:, :-1], seq[:, 1:]


# ---------------------------------------------------------------------------------------------- model


def build_model(cfg: ModelConfig, device: torch.device, seed: int):
    from .nn import TransformerLM

    torch.manual_seed(seed)
    return TransformerLM(VOCAB, cfg.context_length, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.d_ff).to(device)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: TrainConfig, device, autocast) -> float:
    model.eval()
    losses = []
    for i in range(cfg.eval_batches):
        x, y = batch_for_step(data, 10_000_000 + i, min(cfg.batch_size, 16), cfg.model.context_length, cfg.seed)
        with autocast():
            logits = model(x.to(device))
        losses.append(F.cross_entropy(logits.float().reshape(-1, VOCAB), y.to(device).reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def generate(model, prompt: str, length: int, context_length: int, device, temperature: float = 0.8, seed: int = 0) -> str:
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt.encode("utf-8"))
    for _ in range(length):
        x = torch.tensor([ids[-context_length:]], device=device)
        logits = model(x)[0, -1].float().cpu() / temperature
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)))
    model.train()
    return bytes(ids).decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint_atomically(obj: dict, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one, never a half-written one


def read_checkpoint(path: Path, cfg: TrainConfig) -> dict:
    """Load and validate a checkpoint; corrupted or incompatible ones are a UsageError."""
    if not path.is_file():
        raise UsageError(f"--resume: no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or not a checkpoint at all
        raise UsageError(f"--resume: checkpoint {path} is corrupted or unreadable ({type(e).__name__})") from None
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "step", "config"} <= ckpt.keys():
        raise UsageError(f"--resume: {path} is not a flashsys checkpoint")
    if ckpt["config"]["model"] != asdict(cfg.model):
        raise UsageError(
            f"--resume: checkpoint model {ckpt['config']['model']} does not match the requested {asdict(cfg.model)}"
        )
    if ckpt["step"] > cfg.steps:
        raise UsageError(f"--resume: checkpoint is at step {ckpt['step']}, beyond --steps {cfg.steps}")
    return ckpt


# ---------------------------------------------------------------------------------------------- the worker


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def train_worker(rank: int, world: int, device: torch.device, cfg: TrainConfig) -> None:
    """One rank of the training job (called by spawn, or directly under torchrun)."""
    from contextlib import nullcontext

    from .dist import BucketedDDP
    from .optim import ShardedOptimizer

    if device.type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    out = Path(cfg.out)
    data = load_corpus(cfg.data, cfg.model.context_length)
    train_data, val_data = split_corpus(data, cfg.model.context_length)
    model = build_model(cfg.model, device, cfg.seed)
    if cfg.compile:
        model = torch.compile(model)
    ddp = BucketedDDP(model, bucket_size_mb=cfg.bucket_mb)
    if cfg.shard:
        opt = ShardedOptimizer(ddp.parameters(), torch.optim.AdamW, lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
    dtype = {"float32": None, "bfloat16": torch.bfloat16}[cfg.dtype]
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else nullcontext
    plain = model._orig_mod if cfg.compile else model

    start_step, history = 0, []
    if cfg.resume:
        ckpt = read_checkpoint(out / CHECKPOINT, cfg)
        plain.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        start_step, history = ckpt["step"], ckpt["history"]

    per_rank = cfg.batch_size // world
    bar = None
    if rank == 0:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                   file=sys.stdout, mininterval=0.5 if sys.stdout.isatty() else 10.0)
    t0, tokens = time.perf_counter(), 0
    end_step = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    for step in range(start_step, end_step):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = batch_for_step(train_data, step, cfg.batch_size, cfg.model.context_length, cfg.seed)
        x, y = x[rank * per_rank : (rank + 1) * per_rank].to(device), y[rank * per_rank : (rank + 1) * per_rank].to(device)
        opt.zero_grad(set_to_none=True)
        with autocast():
            logits = ddp(x)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        ddp.finish_gradient_synchronization()
        opt.step()
        tokens += cfg.batch_size * cfg.model.context_length
        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg)
        history.append((step + 1, loss_avg.item() / world))
        if bar is not None:
            elapsed = time.perf_counter() - t0
            bar.set_postfix(loss=f"{history[-1][1]:.3f}", tok_s=f"{tokens / elapsed:,.0f}")
            bar.update(1)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            if cfg.shard:
                opt.consolidate_state_dict(to=0)
            if rank == 0:
                save_checkpoint_atomically(
                    {"model": plain.state_dict(), "optimizer": opt.state_dict(), "step": step + 1,
                     "history": history, "config": asdict(cfg)},
                    out / CHECKPOINT,
                )
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.close()

    val_loss = evaluate(plain, val_data, cfg, device, autocast)
    peak = torch.tensor([_peak_memory_mb(device)], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    peaks = [torch.zeros_like(peak) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if rank == 0:
        torch.save(plain.state_dict(), out / "final_model.pt")
        sample = generate(plain, "Alice ", cfg.sample_length, cfg.model.context_length, device, seed=cfg.seed)
        summary = {
            "steps": cfg.steps,
            "world_size": world,
            "device": str(device),
            "first_train_loss": history[0][1] if history else None,
            "final_train_loss": history[-1][1] if history else None,
            "held_out_loss": val_loss,
            "tokens_per_s": tokens / elapsed if elapsed > 0 else None,
            "peak_memory_mb_per_rank": [round(p.item(), 1) for p in peaks],
            "sample": sample,
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        _plot_loss(history, val_loss, out / "loss.png")
        print_summary(summary, out)


def _plot_loss(history, val_loss, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([s for s, _ in history], [l for _, l in history], label="train (mean over ranks)")
    ax.axhline(val_loss, color="C1", linestyle="--", label=f"held-out at end: {val_loss:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title("flashsys train")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_summary(s: dict, out: Path) -> None:
    print()
    print(f"  steps              {s['steps']} on {s['world_size']} rank(s), {s['device']}")
    print(f"  train loss         {s['first_train_loss']:.3f} -> {s['final_train_loss']:.3f} nats/byte")
    print(f"  held-out loss      {s['held_out_loss']:.3f} nats/byte")
    print(f"  throughput         {s['tokens_per_s']:,.0f} tokens/s")
    print(f"  peak memory/rank   {', '.join(f'{m:.0f} MiB' for m in s['peak_memory_mb_per_rank'])}")
    print(f"  outputs            {out}/loss.png, summary.json, final_model.pt")
    print("  sample:")
    for line in s["sample"].splitlines() or [""]:
        print(f"    | {line}")


# ---------------------------------------------------------------------------------------------- entry


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    m = ModelConfig()
    p.add_argument("--preset", choices=["small", "medium", "large", "xl", "2.7B"], help="model size preset (overrides the four below)")
    p.add_argument("--d-model", type=int, default=m.d_model)
    p.add_argument("--layers", type=int, default=m.num_layers)
    p.add_argument("--heads", type=int, default=m.num_heads)
    p.add_argument("--d-ff", type=int, default=m.d_ff)
    p.add_argument("--context-length", type=int, default=m.context_length)
    p.add_argument("--world-size", type=int, default=None, help="processes (default: GPUs, or 2 on a CPU)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch, split over ranks")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--bucket-mb", default="25", help="BucketedDDP bucket size in MB, 'auto' or 'none'")
    p.add_argument("--no-shard", action="store_true", help="plain AdamW instead of ShardedOptimizer")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype)
    p.add_argument("--data", default=d.data, help="a UTF-8 text file (default: the bundled Alice text)")
    p.add_argument("--out", default=d.out)
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="K")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="end this invocation after STEP (as a time-limited job would); --resume continues the schedule")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--seed", type=int, default=d.seed)


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    from .dist import launched_by_torchrun
    from .nn.transformer import PRESETS

    if a.preset:
        pr = PRESETS[a.preset]
        model = ModelConfig(pr.d_model, pr.num_layers, pr.num_heads, pr.d_ff, a.context_length)
    else:
        model = ModelConfig(a.d_model, a.layers, a.heads, a.d_ff, a.context_length)
    for name in ("d_model", "num_layers", "num_heads", "d_ff", "context_length"):
        if getattr(model, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(model, name)}")
    if model.d_model % model.num_heads or (model.d_model // model.num_heads) % 2:
        raise UsageError(f"--d-model {model.d_model} must split into --heads {model.num_heads} heads of even size")
    cuda = torch.cuda.is_available()
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
    else:
        world = a.world_size if a.world_size is not None else (torch.cuda.device_count() if cuda else 2)
    if world < 1:
        raise UsageError(f"--world-size must be at least 1, got {world}")
    if a.steps < 1 or a.batch_size < 1 or a.lr <= 0:
        raise UsageError("--steps and --batch-size must be positive and --lr > 0")
    if world > a.batch_size:
        raise UsageError(f"--world-size {world} is larger than --batch-size {a.batch_size}: some ranks would get no data")
    if a.batch_size % world:
        raise UsageError(f"--batch-size {a.batch_size} must be divisible by the world size {world}")
    bucket: float | str | None
    if a.bucket_mb == "auto":
        bucket = "auto"
    elif a.bucket_mb.lower() == "none":
        bucket = None
    else:
        try:
            bucket = float(a.bucket_mb)
        except ValueError:
            raise UsageError(f"--bucket-mb must be a number, 'auto' or 'none', got {a.bucket_mb!r}") from None
        if bucket <= 0:
            raise UsageError(f"--bucket-mb must be positive, got {bucket}")
    backend = "nccl" if cuda and world <= torch.cuda.device_count() else "gloo"
    return TrainConfig(model=model, data=a.data, out=a.out, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                       warmup=min(20, max(1, a.steps // 10)), world_size=world, backend=backend, bucket_mb=bucket,
                       shard=not a.no_shard, compile=a.compile, dtype=a.dtype, checkpoint_every=a.checkpoint_every,
                       stop_after=a.stop_after, resume=a.resume, seed=a.seed)


def run_training(cfg: TrainConfig) -> None:
    """Validate everything that can be validated before processes start, then train."""
    from .dist import init_from_env, launched_by_torchrun, shutdown, spawn

    load_corpus(cfg.data, cfg.model.context_length)
    out = Path(cfg.out)
    if cfg.resume:
        read_checkpoint(out / CHECKPOINT, cfg)
    out.mkdir(parents=True, exist_ok=True)
    if launched_by_torchrun():
        rank, world, device = init_from_env(cfg.backend)
        try:
            train_worker(rank, world, device, cfg)
            dist.barrier()
        finally:
            shutdown()
    else:
        print(f"flashsys train: {cfg.world_size} process(es), {cfg.backend}, model {asdict(cfg.model)}, "
              f"{'ShardedOptimizer(AdamW)' if cfg.shard else 'AdamW'}, BucketedDDP(bucket_mb={cfg.bucket_mb})", flush=True)
        spawn(train_worker, cfg.world_size, cfg, backend=cfg.backend)
