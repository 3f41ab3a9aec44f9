"""What every flashsys data-parallel wrapper shares: rank-0 broadcast, a model-signature check, no_sync, forward;
and the base of the two wrappers that reduce only after backward has finished."""

from __future__ import annotations

import abc
import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .consistency import check_same_model_on_all_ranks


class DataParallelBase(nn.Module, metaclass=abc.ABCMeta):
    """Base of the wrappers. Subclasses implement the gradient reduction.

    At construction: the model signature is checked across ranks, then every parameter and buffer (frozen ones
    too) is broadcast from rank 0. The wrapper registers no parameters of its own; the model is `.module`.

    Args:
        module: the model, already on this rank's device.
        process_group: the group to average over (default: the world).

    Raises:
        RuntimeError: without an initialised process group.
        ValueError: when the model differs between ranks.
    """

    def __init__(self, module: nn.Module, process_group=None) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialised torch.distributed process group")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self._sync_enabled = True
        check_same_model_on_all_ranks(module, process_group)
        src = dist.get_global_rank(process_group, 0) if process_group is not None else 0
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t.data, src=src, group=process_group)
        # Unique parameters that receive gradients, in registration order (tied parameters appear once).
        self._grad_params = [p for p in module.parameters() if p.requires_grad]
        self._hook_handles: list = []

    def _register_grad_hooks(self, method: Callable[[torch.Tensor], None]) -> None:
        """A post-accumulate-grad hook on every parameter that gets a gradient (frozen ones get none).

        The hook holds only a weak reference to the wrapper: a wrapper that is dropped, or whose hooks were
        removed, no longer acts when the same model is wrapped again.
        """
        ref = weakref.WeakMethod(method)

        def hook(p: torch.Tensor) -> None:
            bound = ref()
            if bound is not None:
                bound(p)

        self._hook_handles += [p.register_post_accumulate_grad_hook(hook) for p in self._grad_params]

    def remove_hooks(self) -> None:
        """Detach this wrapper from the model's parameters (to wrap the same model again, say)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()

    def forward(self, *args, **kwargs):
        """The wrapped module's forward, unchanged (gradients are synchronised in backward hooks)."""
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next synchronised backward reduces the sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @abc.abstractmethod
    def finish_gradient_synchronization(self) -> None:
        """Make every rank's `.grad` the average over ranks; call between `loss.backward()` and `optimizer.step()`."""


class ReduceAfterBackward(DataParallelBase):
    """Base of the wrappers that reduce only once backward has finished: tracks whether a synchronised backward
    has produced gradients since the last reduction."""

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

    @abc.abstractmethod
    def _reduce(self) -> None:
        """All-reduce and average the gradients of `self._grad_params`."""
