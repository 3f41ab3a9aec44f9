"""`flashsys train`: a byte-level TransformerLM trained end to end with FlashAttention, BucketedDDP and
ShardedOptimizer, on whatever the machine has (gloo processes on a CPU, one NCCL process per GPU).

A `Trainer` is one rank's job, in the torchtitan split: set-up in the constructor, then `train_step`, `checkpoint`
and `finish`. Determinism is what makes `--resume` bit-exact: the batch of step s is drawn from a generator
seeded by (seed, s), the learning rate is a function of s, and the checkpoint holds the weights and the full
(consolidated) optimizer state.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import sharded_checkpoint
from .checkpoint import CHECKPOINT, read_checkpoint, save_checkpoint_atomically
from .corpus import (
    DEFAULT_DATA,
    EVAL_STEP_BASE,
    VOCAB,
    batch_for_step,
    document_ids,
    documents_for_step,
    load_corpus,
    packed_offsets,
    split_corpus,
)
from .dist import fsdp
from .dist.process_group import launched_by_torchrun
from .errors import TrainingDiverged, UsageError
from .mfu import mfu, peak_flops
from .nn import PRESETS, ModelConfig, TransformerLM
from .timing import Stopwatch

__all__ = ["TrainConfig", "Trainer", "TrainingDiverged", "UsageError", "run_training", "train_worker"]


WARMUP_STEPS = 3  # steps left out of the throughput: the first compiles the model and autotunes the kernels


@dataclass
class TrainConfig:
    """Everything one training run depends on; saved in its checkpoints."""

    model: ModelConfig = field(default_factory=lambda: PRESETS["demo"])
    data: str = str(DEFAULT_DATA)
    out: str = "runs/latest"
    steps: int = 250
    batch_size: int = 16  # global, split over the ranks
    lr: float = 3e-3
    warmup: int = 20
    world_size: int = 2
    backend: str = "gloo"
    bucket_mb: float | str | None = "auto"
    shard: bool = True
    zero_stage: int = 2  # with shard: 2 = ZeRO2Optimizer, 1 = ShardedOptimizer, 3 = FSDP2 (parameters sharded too)
    compile: bool = False
    dtype: str = "float32"
    checkpoint_every: int = 0
    checkpoint_format: str = "file"  # "file": one checkpoint.pt written by rank 0; "sharded": DCP, every rank its part
    stop_after: int | None = None
    resume: bool = False
    seed: int = 0
    sample_length: int = 200
    eval_batches: int = 8
    timeout_s: float = 300.0  # a rank that waits longer than this in a collective fails instead of hanging
    force: bool = False  # resume even when the checkpoint's trajectory settings differ
    pack_documents: bool = False  # attention stops at document boundaries (blank lines) inside each context


def run_record(cfg: TrainConfig, data: torch.Tensor) -> dict:
    """What a checkpoint records of its run: the configuration and a digest of the data's contents (the same
    --data path may hold other text by the time a run resumes)."""
    return {**asdict(cfg), "data_sha256": hashlib.sha256(data.numpy().tobytes()).hexdigest()}


def resume_source(out: Path, preferred: str) -> tuple[str, Path]:
    """("file" or "sharded", path) of the checkpoint a resumed run in `out` reads: the format it writes
    (`preferred`) when that checkpoint exists, else the other one, so a run may change its format between
    invocations.

    Raises:
        UsageError: when there is neither.
    """
    found = {"file": out / CHECKPOINT if (out / CHECKPOINT).is_file() else None,
             "sharded": sharded_checkpoint.find_directory(out / sharded_checkpoint.SHARDED_CHECKPOINT)}
    for kind in (preferred, "sharded" if preferred == "file" else "file"):
        if found[kind] is not None:
            return kind, found[kind]
    raise UsageError(f"--resume: no checkpoint in {out} (neither {CHECKPOINT} nor "
                     f"{sharded_checkpoint.SHARDED_CHECKPOINT}/)")


def read_resume_point(out: Path, config: dict, preferred: str, force: bool, verify_files: bool = True) -> dict:
    """The checked checkpoint a run resumes from (`resume_source`), with its continuation checked against `config`:
    the one-file checkpoint's contents, or a sharded one's manifest (under the key "sharded", with "directory")."""
    kind, path = resume_source(out, preferred)
    if kind == "file":
        return read_checkpoint(path, config, force)
    body = sharded_checkpoint.read_for_resume(path, config, force, verify_files)
    return {"sharded": body, "directory": path, "step": body["step"],
            "history": [tuple(h) for h in body["history"]]}


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up, then cosine decay to 10% of the peak."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def packing(docs: torch.Tensor | None, step: int, batch_size: int, cfg: TrainConfig, device: torch.device,
            rows=slice(None)) -> tuple:
    """The extra model arguments of step's batch: (cu_seqlens on `device`, max_seqlen) of its document segments
    when documents are packed (`docs` given), else nothing."""
    if docs is None:
        return ()
    offsets, longest = packed_offsets(documents_for_step(docs, step, batch_size, cfg.model.context_length,
                                                         cfg.seed)[rows])
    return offsets.to(device), longest


@torch.no_grad()
def evaluate(model, data: torch.Tensor, cfg: TrainConfig, device, autocast, docs: torch.Tensor | None = None) -> float:
    """Mean cross-entropy (nats per byte) over `cfg.eval_batches` held-out batches (packed like training when
    `docs`, the held-out document ids, are given)."""
    model.eval()
    losses = []
    for i in range(cfg.eval_batches):
        batch = min(cfg.batch_size, 16)
        x, y = batch_for_step(data, EVAL_STEP_BASE + i, batch, cfg.model.context_length, cfg.seed)
        extra = packing(docs, EVAL_STEP_BASE + i, batch, cfg, device)
        with autocast():
            logits = model(x.to(device), *extra)
        losses.append(F.cross_entropy(logits.float().reshape(-1, VOCAB), y.to(device).reshape(-1)).item())
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def generate(model, prompt: str, length: int, context_length: int, device, temperature: float = 0.8,
             seed: int = 0) -> str:
    """Sample `length` bytes after `prompt`, one at a time, at `temperature`."""
    model.eval()
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(prompt.encode("utf-8"))
    for _ in range(length):
        x = torch.tensor([ids[-context_length:]], device=device)
        logits = model(x)[0, -1].float().cpu() / temperature
        ids.append(int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g)))
    model.train()
    return bytes(ids).decode("utf-8", errors="replace")


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class Trainer:
    """One rank of the training job. The constructor sets up data, model, wrapper and optimizer (and resumes
    from the checkpoint when asked); `fit()` runs the steps and finishes."""

    def __init__(self, rank: int, world: int, device: torch.device, cfg: TrainConfig) -> None:
        from .dist import BucketedDDP
        from .optim import ShardedOptimizer, ZeRO2Optimizer

        self.rank, self.world, self.device, self.cfg = rank, world, device, cfg
        if device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        self.out = Path(cfg.out)
        data = load_corpus(cfg.data, cfg.model.context_length)
        self.run_record = run_record(cfg, data)
        self.train_data, self.val_data = split_corpus(data, cfg.model.context_length)
        self.train_docs = self.val_docs = None
        if cfg.pack_documents:
            self.train_docs, self.val_docs = split_corpus(document_ids(data), cfg.model.context_length)
        torch.manual_seed(cfg.seed)
        self.model = TransformerLM.from_config(cfg.model).to(device)  # the plain module: what checkpoints hold
        dtype = {"float32": None, "bfloat16": torch.bfloat16}[cfg.dtype]
        # One rank has nothing to average or shard: the model and plain AdamW run unwrapped.
        self.strategy = "single" if world == 1 else "ddp" if not cfg.shard else f"zero{cfg.zero_stage}"
        if self.strategy == "zero3":  # torch's FSDP2 shards the model in place, block by block
            fsdp.shard_model(self.model, dtype)
        compiled = torch.compile(self.model) if cfg.compile else self.model
        # The model's buffers are RoPE tables, the same on every rank: nothing to broadcast each forward. Without
        # ZeRO-2 the gradients live in the buckets (no copies in and out, no second copy in memory).
        zero2 = self.strategy == "zero2"
        self.ddp = BucketedDDP(compiled, bucket_size_mb=cfg.bucket_mb, broadcast_buffers=False,
                               gradient_as_bucket_view=not zero2) if self.strategy in ("ddp", "zero1", "zero2") \
            else None
        self.net = self.ddp if self.ddp is not None else compiled
        adamw = dict(lr=cfg.lr, weight_decay=0.1, betas=(0.9, 0.95))
        if device.type == "cuda":
            adamw["fused"] = True  # one kernel for the whole step instead of a few per parameter
        self.sharded = self.strategy in ("zero1", "zero2")  # the optimizers whose state consolidates on rank 0
        if self.sharded:
            # ZeRO-2 moves the bytes of one all-reduce per step (ZeRO-1: 1.5x) and keeps 1/world of the gradients.
            if zero2:  # eager: each layer waits for its own parameters' all-gather (compiled graphs cannot wait)
                self.opt = ZeRO2Optimizer(self.net.parameters(), torch.optim.AdamW,
                                          overlap_all_gather=not cfg.compile, **adamw)
            else:
                self.opt = ShardedOptimizer(self.net.parameters(), torch.optim.AdamW, **adamw)
        else:  # one rank, DDP, or ZeRO-3's sharded parameters
            self.opt = torch.optim.AdamW(self.net.parameters(), **adamw)
        self.autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if dtype else nullcontext
        self.start_step, self.history = 0, []
        if cfg.resume:
            self._resume()

    def _resume(self) -> None:
        """Load the checkpoint in `out` (either format, written by any strategy; a sharded one on any world size)."""
        cfg = self.cfg
        # Spawned ranks: the launcher has checked every file of the checkpoint before starting them. Under torchrun
        # each rank checks its share of a sharded checkpoint's files, and all learn of any damage.
        verify = launched_by_torchrun()
        ckpt = read_resume_point(self.out, self.run_record, cfg.checkpoint_format, cfg.force, verify_files=False)
        if "sharded" in ckpt:
            if verify:
                damaged = sharded_checkpoint.verify_my_share(ckpt["directory"], ckpt["sharded"], self.rank, self.world)
                everyone: list = [None] * self.world
                dist.all_gather_object(everyone, damaged)
                damaged = sorted(n for names in everyone for n in names)
                if damaged:
                    raise UsageError(f"--resume: {', '.join(damaged)} in {ckpt['directory']} do not match the "
                                     "manifest (damaged, or from another checkpoint)")
            sharded_checkpoint.load_into_training(ckpt["directory"], ckpt["sharded"], self.model, self.opt,
                                                  self.strategy)
        elif self.strategy == "zero3":
            fsdp.load_full_model_state(self.model, ckpt["model"])
            fsdp.load_full_optimizer_state(self.model, self.opt, ckpt["optimizer"])
        else:
            self.model.load_state_dict(ckpt["model"])
            self.opt.load_state_dict(ckpt["optimizer"])
        self.start_step, self.history = ckpt["step"], list(ckpt["history"])

    def train_step(self, step: int) -> torch.Tensor:
        """One optimizer step on this rank's slice of the global batch; returns the loss averaged over ranks, as a
        tensor on the device: reading it waits for the GPU, so `fit` reads it one step later."""
        cfg = self.cfg
        for g in self.opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x, y = batch_for_step(self.train_data, step, cfg.batch_size, cfg.model.context_length, cfg.seed)
        per_rank = cfg.batch_size // self.world
        rows = slice(self.rank * per_rank, (self.rank + 1) * per_rank)
        x, y = self._to_device(x[rows]), self._to_device(y[rows])
        extra = packing(self.train_docs, step, cfg.batch_size, cfg, self.device, rows)
        if self.ddp is not None and self.ddp.gradient_as_bucket_view:
            self.ddp.zero_grad()  # zeroes the buckets and keeps .grad their views (every parameter is used)
        else:
            self.opt.zero_grad(set_to_none=True)
        with self.autocast():
            logits = self.net(x, *extra)
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        if self.ddp is not None:
            self.ddp.finish_gradient_synchronization()
        self.opt.step()
        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg)
        return loss_avg / self.world

    def _to_device(self, batch: torch.Tensor) -> torch.Tensor:
        # A copy from pageable memory makes the host wait for the GPU; from pinned memory it is queued.
        if self.device.type == "cuda":
            return batch.pin_memory().to(self.device, non_blocking=True)
        return batch.to(self.device)

    def record_loss(self, step: int, loss: torch.Tensor) -> None:
        """Append step's loss to the history.

        Raises:
            TrainingDiverged: when it is not finite (every rank reads the same all-reduced value, so all stop).
        """
        mean = loss.item()
        if not math.isfinite(mean):
            last = self.history[-1][0] if self.history else self.start_step
            kept = (f"the last checkpoint in {self.out / CHECKPOINT} is untouched"
                    if (self.out / CHECKPOINT).exists() else "no checkpoint was written (see --checkpoint-every)")
            raise TrainingDiverged(f"the training loss is {mean} at step {step + 1} (last finite loss at step {last}); "
                                   f"{kept}. Lower --lr, or try --dtype float32.")
        self.history.append((step + 1, mean))

    def checkpoint(self, step: int) -> None:
        """Save weights, optimizer state and history after `step` (a collective when there are several ranks).
        One format whatever the strategy: the unsharded model's and AdamW's state (`--checkpoint-format file`,
        consolidated on rank 0), or the same tensors in pieces, each rank writing its own (`sharded`)."""
        if self.cfg.checkpoint_format == "sharded":
            sharded_checkpoint.save_from_training(self.out / sharded_checkpoint.SHARDED_CHECKPOINT, self.model,
                                                  self.opt, self.strategy, step, self.history, self.run_record)
            return
        if self.strategy == "zero3":
            model_state, opt_state = fsdp.full_model_state(self.model), fsdp.full_optimizer_state(self.model, self.opt)
        else:
            if self.sharded:
                self.opt.consolidate_state_dict(to=0)
            model_state = self.model.state_dict() if self.rank == 0 else None
            opt_state = self.opt.state_dict() if self.rank == 0 else None
        if self.rank == 0:
            save_checkpoint_atomically(
                {"model": model_state, "optimizer": opt_state, "step": step, "history": self.history,
                 "config": self.run_record},
                self.out / CHECKPOINT,
            )

    def fit(self) -> None:
        """Train from `start_step` to the end (or to `stop_after`), checkpointing as configured, then finish.

        Each step's loss is read after the next step is queued, so the host never waits for the GPU mid-run.
        Throughput is measured after the first WARMUP_STEPS steps (compilation and autotuning), when there are more.
        """
        cfg = self.cfg
        bar = None
        if self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=cfg.steps, initial=self.start_step, desc="train", unit="step", dynamic_ncols=True,
                       file=sys.stdout, mininterval=0.5 if sys.stdout.isatty() else 10.0)
        end_step = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
        timed_from = self.start_step + (WARMUP_STEPS if end_step - self.start_step > 2 * WARMUP_STEPS else 0)
        watch = Stopwatch(self.device)
        pending = None  # (step, loss tensor) not read yet
        for step in range(self.start_step, end_step):
            if step == timed_from:
                watch.start()
            loss = self.train_step(step)
            if pending is not None:
                self.record_loss(*pending)
            pending = (step, loss)
            if bar is not None:
                if self.history:
                    bar.set_postfix(loss=f"{self.history[-1][1]:.3f}")
                bar.update(1)
            if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
                self.record_loss(*pending)  # never checkpoint weights from a step whose loss is not finite
                pending = None
                self.checkpoint(step + 1)
        if pending is not None:
            self.record_loss(*pending)
        elapsed_s = watch.elapsed() / 1e3 if end_step > timed_from else 0.0
        tokens = (end_step - timed_from) * cfg.batch_size * cfg.model.context_length
        if bar is not None:
            bar.close()
        self.finish(tokens / elapsed_s if elapsed_s > 0 else None)

    def finish(self, tokens_per_s: float | None) -> None:
        """Held-out loss, per-rank peak memory, and on rank 0 the final model, a sample, summary.json and loss.png."""
        cfg, device = self.cfg, self.device
        val_loss = evaluate(self.model, self.val_data, cfg, device, self.autocast, self.val_docs)
        peak = torch.tensor([_peak_memory_mb(device)], dtype=torch.float64,
                            device=device if dist.get_backend() == "nccl" else "cpu")
        peaks = [torch.zeros_like(peak) for _ in range(self.world)]
        dist.all_gather(peaks, peak)
        weights = fsdp.full_model_state(self.model) if self.strategy == "zero3" else None  # a collective
        if self.rank != 0:
            return
        sampler = self.model
        if weights is not None:  # sampling on rank 0 alone: an unsharded copy (the sharded one needs every rank)
            sampler = TransformerLM.from_config(cfg.model).to(device)
            sampler.load_state_dict(weights)
        save_or_rescue(sampler.state_dict(), self.out / "final_model.pt")
        device_peak = peak_flops(device, cfg.dtype)
        sample = generate(sampler, "Alice ", cfg.sample_length, cfg.model.context_length, device, seed=cfg.seed)
        summary = {
            "steps": cfg.steps,
            "world_size": self.world,
            "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
            "first_train_loss": self.history[0][1] if self.history else None,
            "final_train_loss": self.history[-1][1] if self.history else None,
            "held_out_loss": val_loss,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu(tokens_per_s, cfg.model, device_peak) if tokens_per_s else None,
            "peak_tflops": device_peak / 1e12 if device_peak else None,
            "peak_memory_mb_per_rank": [round(p.item(), 1) for p in peaks],
            "sample": sample,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        _plot_loss(self.history, val_loss, self.out / "loss.png")
        print_summary(summary, self.out)


def save_or_rescue(state: dict, path: Path) -> None:
    """torch.save to `path`; if that fails (disk full, directory gone), save to a new temporary directory instead
    and raise an error that says where the weights are, so finished training is never lost to a failed write."""
    try:
        torch.save(state, path)
    except (OSError, RuntimeError) as e:  # torch.save reports a missing directory as a RuntimeError
        rescue = Path(tempfile.mkdtemp(prefix="flashsys-rescue-")) / path.name
        torch.save(state, rescue)
        raise OSError(f"could not write {path} ({e}); the trained weights were saved to {rescue} instead") from e


def train_worker(rank: int, world: int, device: torch.device, cfg: TrainConfig) -> None:
    """One rank of the training job (called by spawn, or directly under torchrun)."""
    Trainer(rank, world, device, cfg).fit()


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
    """The end-of-run summary the README shows."""
    print()
    print(f"  steps              {s['steps']} on {s['world_size']} rank(s), {s['device']}")
    print(f"  train loss         {s['first_train_loss']:.3f} -> {s['final_train_loss']:.3f} nats/byte")
    print(f"  held-out loss      {s['held_out_loss']:.3f} nats/byte")
    if s["tokens_per_s"] is None:
        throughput = "not measured (no timed steps)"
    else:
        throughput = f"{s['tokens_per_s']:,.0f} tokens/s"
        if s["mfu"] is not None:
            throughput += f", MFU {s['mfu']:.1%} (of a {s['peak_tflops']:.0f} TFLOP/s peak)"
    print(f"  throughput         {throughput}")
    print(f"  peak memory/rank   {', '.join(f'{m:.0f} MiB' for m in s['peak_memory_mb_per_rank'])}")
    print(f"  outputs            {out}/loss.png, summary.json, final_model.pt")
    print("  sample:")
    for line in s["sample"].splitlines() or [""]:
        print(f"    | {line}")


def check_output_dir(out: Path) -> None:
    """Create `out` and prove it writable now, before any training that could be lost at save time.

    Raises:
        UsageError: when it cannot be created or written.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--out {out} is not a writable directory ({e.strerror or e})") from None


@contextlib.contextmanager
def run_directory_lock(out: Path) -> Iterator[None]:
    """Hold an exclusive lock on `out` for the whole run, so two runs never write one directory.

    Raises:
        UsageError: when another live process holds it (the lock dies with its process, so no stale locks).
    """
    import fcntl

    lock_path = out / ".flashsys.lock"
    f = open(lock_path, "a+")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise UsageError(f"--out {out} is in use by another flashsys run ({holder}); use another --out, or wait "
                             "for that run to end") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}")
        f.flush()
        yield
    finally:
        f.close()


def run_training(cfg: TrainConfig) -> None:
    """Validate everything that can be validated before processes start, then train (spawned ranks, or this
    process as one rank under torchrun). The launching process holds the run directory's lock throughout."""
    from .dist import init_from_env, shutdown, spawn

    data = load_corpus(cfg.data, cfg.model.context_length)
    out = Path(cfg.out)
    if cfg.resume:  # under torchrun every rank runs this: the ranks share the reading of the files later
        read_resume_point(out, run_record(cfg, data), cfg.checkpoint_format, cfg.force,
                          verify_files=not launched_by_torchrun())
    if launched_by_torchrun():
        rank, world, device = init_from_env(cfg.backend, timeout_s=cfg.timeout_s)
        try:
            with contextlib.ExitStack() as stack:
                # Rank 0 writes the outputs: it checks and locks the directory, and every rank learns the outcome,
                # so a bad --out is the same clear error on all ranks instead of a hang at the first collective.
                problem = [None]
                if rank == 0:
                    try:
                        check_output_dir(out)
                        stack.enter_context(run_directory_lock(out))
                    except UsageError as e:
                        problem = [str(e)]
                dist.broadcast_object_list(problem, src=0)
                if problem[0] is not None:
                    raise UsageError(problem[0])
                train_worker(rank, world, device, cfg)
                dist.barrier()
        finally:
            shutdown()
    else:
        check_output_dir(out)
        with run_directory_lock(out):
            if cfg.world_size > 1 and cfg.shard and cfg.zero_stage == 3:
                parallel = "FSDP2 (fully_shard per block) with AdamW"
            elif cfg.world_size > 1:
                optimizer = {1: "ShardedOptimizer(AdamW)", 2: "ZeRO2Optimizer(AdamW)"}[cfg.zero_stage]
                parallel = (f"{optimizer if cfg.shard else 'AdamW'}, "
                            f"BucketedDDP(bucket_mb={cfg.bucket_mb})")
            else:
                parallel = "AdamW, no data-parallel wrapper (one rank)"
            print(f"flashsys train: {cfg.world_size} process(es), {cfg.backend}, model {asdict(cfg.model)}, {parallel}"
                  f"{', torch.compile' if cfg.compile else ''}", flush=True)
            spawn(train_worker, cfg.world_size, cfg, backend=cfg.backend, timeout_s=cfg.timeout_s)
