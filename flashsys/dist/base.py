"""What every flashsys data-parallel wrapper shares: rank-0 broadcast, a model-signature check, no_sync, forward."""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Callable, Iterator

import torch
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
    """Compare a cheap signature across ranks; mismatched models raise here instead of hanging in a collective."""
    gathered = gather_digests(model_signature(module), sum(1 for _ in module.parameters()), group)
    if len({digest for digest, _ in gathered}) != 1:
        detail = ", ".join(f"rank {r}: {n} parameters, signature {digest[:12]}" for r, (digest, n) in enumerate(gathered))
        raise ValueError(
            "data parallel: the model differs between ranks (parameter count, order, shapes, dtypes or "
            f"requires_grad): {detail}"
        )


class DataParallelBase(nn.Module):
    """Base of the wrappers. Subclasses implement the gradient reduction.

    At construction: the model signature is checked across ranks, then every parameter and buffer (frozen ones
    too) is broadcast from rank 0. The wrapper registers no parameters of its own; the model is `.module`.
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
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next synchronised backward reduces the sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_gradient_synchronization(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError
