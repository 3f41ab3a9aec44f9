"""Training checkpoints: written atomically, validated before a run resumes from one."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .errors import UsageError

CHECKPOINT = "checkpoint.pt"


def save_checkpoint_atomically(obj: dict, path: Path) -> None:
    """torch.save to a temporary file, then rename: readers see the old file or the new one, never half of one."""
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)  # atomic on POSIX


def read_checkpoint(path: Path, model_config: dict, steps: int) -> dict:
    """Load a checkpoint and check that it can continue a run of `model_config` (a dict) to `steps`.

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
    if ckpt["config"]["model"] != model_config:
        raise UsageError(f"--resume: checkpoint model {ckpt['config']['model']} does not match the requested {model_config}")
    if ckpt["step"] > steps:
        raise UsageError(f"--resume: checkpoint is at step {ckpt['step']}, beyond --steps {steps}")
    return ckpt
