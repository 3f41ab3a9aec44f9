"""Wrappers that reduce every gradient after backward has finished: no overlap, the simplest to trust.

NaiveDDP all-reduces each gradient on its own; FlatDDP packs all gradients of a (dtype, device) into one buffer
and all-reduces that once. Both are the baselines the overlapping wrappers are measured against.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .base import DataParallelBase


class _ReduceAfterBackward(DataParallelBase):
    """Tracks whether a synchronised backward has produced gradients since the last reduction."""

    def __init__(self, module: nn.Module, process_group=None) -> None:
        super().__init__(module, process_group)
        self._pending = False
        self._register_grad_hooks(self._mark_pending)

    def _mark_pending(self, _param: torch.Tensor) -> None:
        if self._sync_enabled:
            self._pending = True

    def finish_gradient_synchronization(self) -> None:
        """Average gradients across ranks. A no-op when no synchronised backward ran since the last call."""
        if not self._pending:
            return
        self._pending = False
        self._reduce()

    def _used_on_any_rank(self) -> list[bool]:
        """Which parameters have a gradient on at least one rank (one small all-reduce)."""
        device = self._grad_params[0].device
        used = torch.tensor([p.grad is not None for p in self._grad_params], dtype=torch.float32, device=device)
        dist.all_reduce(used, group=self.process_group)
        return (used > 0).tolist()

    def _reduce(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class NaiveDDP(_ReduceAfterBackward):
    """After backward, all-reduce each gradient separately and synchronously (SUM, then divide by world size)."""

    def _reduce(self) -> None:
        for p, used in zip(self._grad_params, self._used_on_any_rank()):
            if not used:
                continue  # unused on every rank: the gradient stays None, as in a single process
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.process_group)
            p.grad.div_(self.world_size)


class FlatDDP(_ReduceAfterBackward):
    """After backward, one all-reduce per (dtype, device) of all gradients flattened into a single buffer."""

    def _reduce(self) -> None:
        used = self._used_on_any_rank()
        groups: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p, u in zip(self._grad_params, used):
            if u:
                groups.setdefault((p.dtype, p.device), []).append(p)
        for params in groups.values():
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.process_group)
            flat.div_(self.world_size)
            offset = 0
            for p in params:
                chunk = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
                offset += p.numel()
