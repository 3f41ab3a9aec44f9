"""OverlapDDP: each gradient is all-reduced asynchronously the moment autograd has accumulated it."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .base import DataParallelBase


class OverlapDDP(DataParallelBase):
    """Per-parameter asynchronous all-reduce from `register_post_accumulate_grad_hook`, overlapping backward.

    Communication starts while backward is still computing earlier layers; `finish_gradient_synchronization()`
    waits on the handles and divides by the world size. A parameter must be used on every rank or on none
    (collectives are issued in hook order, which must be the same on every rank); one unused everywhere keeps
    a None gradient.
    """

    def __init__(self, module: nn.Module, process_group=None, cross_rank_checks: bool = True,
                 broadcast_buffers: bool = True) -> None:
        super().__init__(module, process_group, cross_rank_checks, broadcast_buffers)
        self._handles: list[tuple[nn.Parameter, dist.Work]] = []
        self._launched: set[int] = set()
        self._index = {id(p): i for i, p in enumerate(self._grad_params)}
        self._register_grad_hooks(self._launch)

    def _launch(self, p: nn.Parameter) -> None:
        if not self._sync_enabled:
            return
        if id(p) in self._launched:  # the same backward cannot accumulate a leaf twice
            raise RuntimeError("OverlapDDP: a gradient was launched twice in one synchronisation")
        self._launched.add(id(p))
        self._handles.append((p, dist.all_reduce(p.grad, group=self.process_group, async_op=True)))

    def _synchronize(self) -> None:
        """Wait for every launched all-reduce and average. A no-op when nothing was launched. The ranks must have
        launched the same gradients (a parameter used on some ranks only is an error, before any wait)."""
        self._check_ranks_agree(bool(self._handles), [self._index[id(p)] for p, _ in self._handles])
        for p, handle in self._handles:
            handle.wait()
            p.grad.div_(self.world_size)
        self._handles.clear()
        self._launched.clear()
