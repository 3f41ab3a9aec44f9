"""Training checkpoints: checksummed, written atomically, validated before a run resumes from one.

File format: one header line `FLASHSYS-CHECKPOINT 1 <sha256 of the payload>`, then the payload, a `torch.save`
of plain containers and tensors. Both directions stream: memory stays at one checkpoint, as with plain torch.save.
A flipped byte anywhere fails the checksum (or the header) and the run refuses
to resume instead of training on garbage; the payload is loaded with `weights_only=True`, so a checkpoint can
hold only data, never code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import torch

from .errors import UsageError

CHECKPOINT = "checkpoint.pt"
MAGIC = b"FLASHSYS-CHECKPOINT 1 "
# ModelConfig fields that change how the model computes, not what its weights are: a run may resume with others.
_NOT_SHAPE = ("attention_backend", "checkpoint_blocks")
# TrainConfig fields that decide the trajectory: resuming with other values is not a continuation of the run.
# data_sha256 is the data file's contents: the same path may hold other text.
TRAJECTORY_FIELDS = ("seed", "batch_size", "lr", "warmup", "data", "data_sha256", "dtype", "pack_documents")
# The value a checkpoint written before a trajectory field existed had in effect.
_TRAJECTORY_DEFAULTS = {"pack_documents": False}
# Fields a checkpoint may lack with no known value: it cannot be compared on them.
_UNRECORDED = ("data_sha256",)
# How a difference is named where the field is not a flag of its own.
_LABELS = {"warmup": "warm-up steps (set by --steps)", "data_sha256": "the data file's contents (sha256)"}


def _shape(model_config: dict) -> dict:
    """The fields that define the model's function and weights. A checkpoint saved before a ModelConfig field
    existed gets that field's default (num_kv_heads and attention_window came later), so it still resumes."""
    from .nn.config import ModelConfig

    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
    return {k: v for k, v in {**defaults, **model_config}.items() if k not in _NOT_SHAPE}


def sha256_of_file(path: Path) -> str:
    """SHA-256 of a whole file, read in chunks."""
    with open(path, "rb") as f:
        return _sha256_from(f, 0)


def _sha256_from(f, offset: int) -> str:
    """SHA-256 of the file's bytes from `offset` to the end, read in chunks (checkpoints can be many GB)."""
    f.seek(offset)
    digest = hashlib.sha256()
    while chunk := f.read(1 << 24):
        digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint_atomically(obj: dict, path: Path) -> None:
    """Write `obj` with a checksum to a temporary file, then rename: readers see the old file or the new one,
    never half of one. The payload streams to disk; the header is filled in once it is hashed."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    header_len = len(MAGIC) + 64 + 1
    with open(tmp, "w+b") as f:
        f.write(b"\0" * header_len)
        torch.save(obj, f)
        f.flush()
        digest = _sha256_from(f, header_len)
        f.seek(0)
        f.write(MAGIC + digest.encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic on POSIX


def load_checkpoint(path: Path) -> dict:
    """The verified contents of a checkpoint file.

    Raises:
        UsageError: when it is missing, not a flashsys checkpoint, or corrupted (checksum mismatch).
    """
    if not path.is_file():
        raise UsageError(f"no checkpoint at {path}")
    with open(path, "rb") as f:
        header = f.readline(len(MAGIC) + 64 + 1)
        if not header.startswith(MAGIC) or not header.endswith(b"\n"):
            raise UsageError(f"{path} is corrupted or not a flashsys checkpoint (no checkpoint header)")
        if _sha256_from(f, len(header)).encode() != header[len(MAGIC):-1]:
            raise UsageError(f"checkpoint {path} is corrupted (checksum mismatch); it was damaged after "
                             "it was written. Use another copy, or start again.")
        f.seek(len(header))
        try:
            ckpt = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # a valid checksum over a payload torch cannot read: written by something else
            raise UsageError(f"checkpoint {path} is corrupted or unreadable ({type(e).__name__})") from None
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "step", "config", "history"} <= ckpt.keys():
        raise UsageError(f"{path} is not a flashsys checkpoint")
    problem = _contents_problem(ckpt)
    if problem:
        raise UsageError(f"checkpoint {path} is inconsistent ({problem}); it was not written by a "
                         "flashsys run as it stands. Use another copy, or start again.")
    return ckpt


def _contents_problem(ckpt: dict) -> str | None:
    """What makes a checksummed checkpoint's contents unusable, or None: a valid checksum only proves the bytes
    are the ones written, not that a run wrote them (a re-signed file with a negative step or without optimizer
    state would resume with negative learning rates or fresh moments)."""
    step, history, opt, config = ckpt["step"], ckpt["history"], ckpt["optimizer"], ckpt["config"]
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        return "no run configuration"
    if not isinstance(ckpt["model"], dict) or not all(isinstance(t, torch.Tensor) for t in ckpt["model"].values()):
        return "the model weights are not tensors"
    if not (isinstance(history, list) and all(isinstance(h, (list, tuple)) and len(h) == 2 for h in history)):
        return "the loss history is not a list of (step, loss)"
    if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list)):
        return "no optimizer state"
    n_params = sum(len(g.get("params", ())) for g in opt["param_groups"])
    steps_taken = {float(s["step"]) for s in opt["state"].values() if isinstance(s, dict) and "step" in s}
    return progress_problem(step, history, len(opt["state"]), n_params, steps_taken)


def progress_problem(step, history: list, with_state: int, n_params: int, steps_taken: set[float]) -> str | None:
    """What makes a checkpoint's progress inconsistent, or None, in either format: `step` a count of steps, the loss
    history ending at it, and after any step optimizer state for every parameter (`with_state` of `n_params`) whose
    step counts (`steps_taken`) are the checkpoint's."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step {step!r} is not a count of steps"
    if history and history[-1][0] != step:
        return f"the loss history does not end at step {step}"
    if step > 0:
        if with_state != n_params:
            return f"optimizer state for {with_state} of {n_params} parameters after {step} steps"
        if steps_taken != {float(step)}:
            return f"the optimizer state counts {sorted(steps_taken)} steps, the checkpoint {step}"
    return None


def read_checkpoint(path: Path, config: dict, force: bool = False) -> dict:
    """Load a checkpoint and check that it can continue a run of `config` (`check_continuation`).

    Raises:
        UsageError: naming what is wrong or what differs.
    """
    ckpt = load_checkpoint(path)
    check_continuation(ckpt["config"], ckpt["step"], config, force)
    return ckpt


def check_continuation(saved: dict, step: int, config: dict, force: bool = False) -> None:
    """Whether a checkpoint of a run with configuration `saved` (a TrainConfig as a dict, with the data's digest),
    at `step`, can continue a run of `config`: the model's shape must match (its attention backend may differ), the
    step must not be past `steps`, and the settings that decide the trajectory (seed, batch size, lr, warm-up, the
    data file and its contents, dtype, document packing) must be the same unless `force`. One check for both
    checkpoint formats.

    Raises:
        UsageError: naming what differs.
    """
    if _shape(saved["model"]) != _shape(config["model"]):
        raise UsageError(f"--resume: checkpoint model {saved['model']} does not match the requested {config['model']}")
    if step > config["steps"]:
        raise UsageError(f"--resume: checkpoint is at step {step}, beyond --steps {config['steps']}")
    saved = {**_TRAJECTORY_DEFAULTS, **saved}
    differs = [f"{_LABELS.get(k, k)} {_shown(saved.get(k))} -> {_shown(config.get(k))}" for k in TRAJECTORY_FIELDS
               if (k in saved or k not in _UNRECORDED) and saved.get(k) != config.get(k)]
    if differs and not force:
        raise UsageError(f"--resume: the checkpoint was trained with other settings ({', '.join(differs)}); the "
                         "resumed run would not continue it. Use the same flags, or add --force to resume anyway.")


def _shown(value) -> str:
    """A setting's value in a message; digests shortened."""
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12] + "…"
    return repr(value)
