"""Cross-rank checks: every rank must hold the same model (and the same optimizer groups) before the first
collective, or ranks disagree on what to reduce and hang. A cheap digest per rank turns that into an error."""

from __future__ import annotations

import hashlib

import torch.distributed as dist
from torch import nn


def model_signature(module: nn.Module) -> str:
    """Names, shapes, dtypes and requires_grad of every parameter and buffer, in order: equal models, equal strings."""
    parts = [f"P {n} {tuple(p.shape)} {p.dtype} {p.requires_grad}" for n, p in module.named_parameters()]
    parts += [f"B {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]
    return "\n".join(parts)


def gather_digests(text: str, note: object = None, group=None) -> list[tuple[str, object]]:
    """(sha256 of `text`, `note`) from every rank, in rank order (a collective): a cheap check that every
    rank holds the same thing, with a small note per rank for the error message."""
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (hashlib.sha256(text.encode()).hexdigest(), note), group=group)
    return gathered


def check_same_model_on_all_ranks(module: nn.Module, group=None) -> None:
    """Compare a cheap signature across ranks; mismatched models raise here instead of hanging in a collective.

    Raises:
        ValueError: listing each rank's parameter count and signature digest.
    """
    gathered = gather_digests(model_signature(module), sum(1 for _ in module.parameters()), group)
    if len({digest for digest, _ in gathered}) != 1:
        detail = ", ".join(f"rank {r}: {n} parameters, signature {digest[:12]}" for r, (digest, n) in enumerate(gathered))
        raise ValueError(
            "data parallel: the model differs between ranks (parameter count, order, shapes, dtypes or "
            f"requires_grad): {detail}"
        )
