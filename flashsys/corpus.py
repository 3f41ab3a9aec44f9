"""The training text as bytes, its held-out split, and the batch of every step.

Batches are a pure function of (seed, step): every rank draws the same global batch and takes its slice, and a
resumed run draws exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import UsageError

DEFAULT_DATA = Path(__file__).parent / "data" / "alice.txt"
VOCAB = 256  # byte-level: every byte value is a token
# Held-out batches use step numbers from here on: far past any training run, so no evaluation batch is ever
# seeded like a training batch.
EVAL_STEP_BASE = 10_000_000


def load_corpus(path: str | Path, context_length: int) -> torch.Tensor:
    """UTF-8 text as a uint8 tensor of bytes.

    Raises:
        UsageError: for a missing, empty, non-UTF-8 or too-short file.
    """
    p = Path(path)
    if not p.exists():
        raise UsageError(f"data file not found: {p}")
    if p.is_dir():
        raise UsageError(f"--data {p} is a directory; give a UTF-8 text file")
    if not p.is_file():  # a device such as /dev/null, a FIFO or a socket: reading it could block or never end
        raise UsageError(f"--data {p} is not a regular file (a device, FIFO or socket); give a UTF-8 text file")
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
    """(train, held out): the last 10% (at least one context) is held out."""
    n_val = max(len(data) // 10, context_length + 1)
    return data[:-n_val], data[-n_val:]


def batch_for_step(data: torch.Tensor, step: int, batch_size: int, context_length: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one step's global batch, int64 (batch_size, context_length): the same on every rank
    and in every run (seeded by seed and step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - context_length - 1 + 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(context_length + 1)
    seq = data[idx].long()
    return seq[:, :-1], seq[:, 1:]


def eval_batch(data: torch.Tensor, i: int, batch_size: int, context_length: int,
               seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The i-th held-out batch (see EVAL_STEP_BASE)."""
    return batch_for_step(data, EVAL_STEP_BASE + i, batch_size, context_length, seed)
