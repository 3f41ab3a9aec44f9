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


def window_indices(n_tokens: int, step: int, batch_size: int, context_length: int, seed: int) -> torch.Tensor:
    """(batch_size, context_length + 1) corpus positions of one step's windows: the same on every rank and in every
    run (seeded by seed and step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, n_tokens - context_length - 1 + 1, (batch_size,), generator=g)
    return starts[:, None] + torch.arange(context_length + 1)


def batch_for_step(data: torch.Tensor, step: int, batch_size: int, context_length: int,
                   seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of one step's global batch, int64 (batch_size, context_length)."""
    seq = data[window_indices(len(data), step, batch_size, context_length, seed)].long()
    return seq[:, :-1], seq[:, 1:]


DOCUMENT_SEPARATOR = b"\n\n"  # with --pack-documents, a blank line ends a document (a paragraph of the text)


def document_ids(data: torch.Tensor, separator: bytes = DOCUMENT_SEPARATOR) -> torch.Tensor:
    """int64 document number of every byte: a new document starts right after each separator."""
    starts = torch.zeros(len(data), dtype=torch.int64)
    raw, at = bytes(data.tolist()), 0
    while (at := raw.find(separator, at)) >= 0:
        at += len(separator)
        if at < len(raw):
            starts[at] = 1
    return starts.cumsum(0)


def documents_for_step(doc_ids: torch.Tensor, step: int, batch_size: int, context_length: int,
                       seed: int) -> torch.Tensor:
    """(batch_size, context_length) document ids of the inputs of `batch_for_step`'s batch (same windows)."""
    return doc_ids[window_indices(len(doc_ids), step, batch_size, context_length, seed)][:, :-1]


def packed_offsets(doc_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """flash-attn's (cu_seqlens int32, max_seqlen) for a (batch, N) window of document ids, flattened row by row:
    each row is cut wherever its document changes, so no token attends across a document boundary."""
    rows, n = doc_ids.shape
    cut = torch.ones_like(doc_ids, dtype=torch.bool)
    cut[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]  # every row starts a segment; so does every new document
    starts = cut.flatten().nonzero().flatten()
    offsets = torch.cat([starts, torch.tensor([rows * n])]).to(torch.int32)
    return offsets, int((offsets[1:] - offsets[:-1]).max())
