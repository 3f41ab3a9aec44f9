"""Training checkpoints: written atomically, validated before a run resumes from one."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import UsageError

CHECKPOINT = "checkpoint.pt"
# ModelConfig fields that change how the model computes, not what its weights are: a run may resume with others.
_NOT_SHAPE = ("attention_backend", "checkpoint_blocks")


def _shape(model_config: dict) -> dict:
    return {k: v for k, v in model_config.items() if k not in _NOT_SHAPE}


def save_checkpoint_atomically(obj: dict, path: Path) -> None:
    """torch.save to a temporary file, then rename: readers see the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic on POSIX


def read_checkpoint(path: Path, model_config: dict, steps: int) -> dict:
    """Load a checkpoint and check that it can continue a run of `model_config` (a dict) to `steps`: the model's
    shape must match (its attention backend may differ).

    Raises:
        UsageError: when it is missing, corrupted, not a flashsys checkpoint, of another model or past `steps`.
    """
    if not path.is_file():
        raise UsageError(f"--resume: no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # truncated or not a checkpoint at all
        raise UsageError(f"--resume: checkpoint {path} is corrupted or unreadable ({type(e).__name__})") from None
    if not isinstance(ckpt, dict) or not {"model", "optimizer", "step", "config"} <= ckpt.keys():
        raise UsageError(f"--resume: {path} is not a flashsys checkpoint")
    if _shape(ckpt["config"]["model"]) != _shape(model_config):
        raise UsageError(f"--resume: checkpoint model {ckpt['config']['model']} does not match the requested {model_config}")
    if ckpt["step"] > steps:
        raise UsageError(f"--resume: checkpoint is at step {ckpt['step']}, beyond --steps {steps}")
    return ckpt
