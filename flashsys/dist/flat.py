"""FlatDDP: after backward, all gradients of a (dtype, device) packed into one buffer and all-reduced once:
one call instead of one per parameter, still without overlap."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .base import ReduceAfterBackward
from .flat_layout import FlatLayout


class FlatDDP(ReduceAfterBackward):
    """After backward, one all-reduce per (dtype, device) of all gradients flattened into a single buffer."""

    def _reduce(self) -> None:
        used = self._used_on_any_rank()
        groups: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p, u in zip(self._grad_params, used):
            if u:
                groups.setdefault((p.dtype, p.device), []).append(p)
        for params in groups.values():
            layout = FlatLayout(params)
            flat = layout.pack([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
            dist.all_reduce(flat, group=self.process_group)
            flat.div_(self.world_size)
            for p, chunk in zip(params, layout.views(flat)):
                if p.grad is None:
                    p.grad = chunk.clone()
                else:
                    p.grad.copy_(chunk)
