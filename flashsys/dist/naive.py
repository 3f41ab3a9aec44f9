"""NaiveDDP: after backward, one synchronous all-reduce per gradient. The simplest wrapper to trust, and the
baseline the others are measured against."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .base import ReduceAfterBackward


class NaiveDDP(ReduceAfterBackward):
    """After backward, all-reduce each gradient separately and synchronously (SUM, then divide by world size)."""

    def _reduce(self) -> None:
        for p, used in zip(self._grad_params, self._used_on_any_rank()):
            if not used:
                continue  # unused on every rank: the gradient stays None, as in a single process
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, group=self.process_group)
            p.grad.div_(self.world_size)
