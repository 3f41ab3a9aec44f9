"""What every flashsys data-parallel wrapper shares: rank-0 broadcast, a model-signature check, one wrapper per
model, buffers broadcast each forward, no_sync, and synchronisation finished by backward itself (as torch DDP);
and the base of the two wrappers that reduce only after backward has finished."""

from __future__ import annotations

import abc
import contextlib
import hashlib
import weakref
from array import array
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .consistency import check_same_model_on_all_ranks
from .flat_layout import FlatLayout
from .side_channel import control_group, group_timeout

# The live wrapper of each parameter, by id: a second wrapper on the same parameters would reduce every gradient
# twice. A live wrapper holds its model, so the ids it registered cannot be reused while it is alive.
_WRAPPER_OF: weakref.WeakValueDictionary[int, DataParallelBase] = weakref.WeakValueDictionary()
# The gradient hook each parameter carries, by id: (the parameter, weakly; the hook's handle). A wrapper that is
# dropped leaves its hooks behind; they raise, and a new wrapper of the same model removes them.
_HOOK_OF: dict[int, tuple[weakref.ref, torch.utils.hooks.RemovableHandle]] = {}


def wrapper_of(p: torch.Tensor) -> DataParallelBase | None:
    """The live data-parallel wrapper whose hooks act on `p`'s gradient, or None."""
    wrapper = _WRAPPER_OF.get(id(p))
    return wrapper if wrapper is not None and wrapper._hook_handles else None


def dropped_wrapper(p: torch.Tensor) -> bool:
    """Whether `p` still carries the hook of a wrapper that was garbage-collected (wrapped, but not kept)."""
    entry = _HOOK_OF.get(id(p))
    return entry is not None and entry[0]() is p and _WRAPPER_OF.get(id(p)) is None


def _dropped_wrapper_error(name: str) -> RuntimeError:
    return RuntimeError(
        f"data parallel: the {name} that wrapped this model was garbage-collected, so gradients are no longer averaged "
        f"across ranks and the replicas would drift apart. Keep a reference to it (ddp = {name}(model)) for as long "
        "as the model trains, or wrap the model again."
    )


class DataParallelBase(nn.Module, metaclass=abc.ABCMeta):
    """Base of the wrappers. Subclasses implement the gradient reduction.

    At construction: the model signature is checked across ranks, then every parameter and buffer (frozen ones
    too) is broadcast from rank 0. The wrapper registers no parameters of its own; the model is `.module`.

    Gradients are averaged by the end of every synchronised `backward()`: the first gradient hook of a backward
    queues `finish_gradient_synchronization()` as an autograd engine callback, as torch DDP does, so a loop
    written for torch DDP needs no extra call. Calling it explicitly after backward (the CS336 loop) stays valid
    and is then a no-op.

    Args:
        module: the model, already on this rank's device.
        process_group: the group to average over (default: the world).
        cross_rank_checks: at each synchronisation, compare on a gloo side channel whether every rank ran backward
            and reduced the same gradients, so a skipped backward or a parameter used on some ranks only is a
            clear error instead of a hang or garbage. Costs one small CPU all-gather per step, at which the ranks'
            host threads meet; False turns it off.
        broadcast_buffers: broadcast every buffer from rank 0 at the start of each training forward (grad enabled,
            not under `no_sync()`), as torch DDP does by default, so running statistics cannot drift apart. Turn it
            off for models whose buffers are constants (RoPE tables): it is one broadcast per dtype per forward.

    Raises:
        RuntimeError: without an initialised process group, or when the model's parameters already belong to a
            live wrapper (their gradients would be reduced twice).
        ValueError: when the model differs between ranks.
    """

    def __init__(self, module: nn.Module, process_group=None, cross_rank_checks: bool = True,
                 broadcast_buffers: bool = True) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__} needs an initialised torch.distributed process group")
        for p in module.parameters():
            if dropped_wrapper(p):  # its wrapper is gone: this one takes over
                _HOOK_OF.pop(id(p))[1].remove()
            other = wrapper_of(p)
            if other is not None:
                raise RuntimeError(
                    f"{type(self).__name__}: the model is already wrapped by a live {type(other).__name__}; its hooks "
                    "would reduce every gradient a second time. Wrap it once (call remove_hooks() on the old wrapper "
                    "before wrapping again)."
                )
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self._finish_task = None  # the autograd graph task whose end finishes synchronisation
        self._finished_by_backward = False
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
        # Which parameters were trainable when wrapped: hooks exist for exactly those.
        self._all_params = list(module.parameters())
        self._trainable = [p.requires_grad for p in self._all_params]
        # A side channel for cross-rank checks at each synchronisation. On its own group, a check never pairs
        # with a gradient collective still pending on the main group, whatever went wrong there.
        checks = cross_rank_checks and self.world_size > 1
        self._control_group = control_group(process_group) if checks else None

    def _register_grad_hooks(self, method: Callable[[torch.Tensor], None]) -> None:
        """A post-accumulate-grad hook on every parameter that gets a gradient (frozen ones get none).

        The hook holds only a weak reference to the wrapper. A wrapper whose hooks were removed no longer acts; one
        that was dropped without that makes its hooks raise (training on would silently stop averaging), until the
        model is wrapped again, which removes them.
        """
        ref = weakref.WeakMethod(method)
        name = type(self).__name__

        def hook(p: torch.Tensor) -> None:
            bound = ref()
            if bound is None:
                raise _dropped_wrapper_error(name)
            bound(p)
            bound.__self__._finish_at_end_of_backward()

        for key in [key for key, (param, _) in _HOOK_OF.items() if param() is None]:
            del _HOOK_OF[key]  # parameters that are gone
        for p in self._grad_params:
            handle = p.register_post_accumulate_grad_hook(hook)
            self._hook_handles.append(handle)
            _WRAPPER_OF[id(p)] = self
            _HOOK_OF[id(p)] = (weakref.ref(p), handle)

    def remove_hooks(self) -> None:
        """Detach this wrapper from the model's parameters (to wrap the same model again, say)."""
        for h in self._hook_handles:
            h.remove()
        self._hook_handles.clear()
        for p in self._grad_params:
            _HOOK_OF.pop(id(p), None)

    def _finish_at_end_of_backward(self) -> None:
        """Queue synchronisation once per synchronised backward, to run when the autograd engine has finished it
        (the engine syncs the caller's streams with the gradients' first, so the callback may use them)."""
        if not self._sync_enabled:
            return
        task = torch._C._current_graph_task_id()
        if task == self._finish_task:
            return
        self._finish_task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_from_backward)

    def _finish_from_backward(self) -> None:
        self._finish_task = None
        self._synchronize()
        self._finished_by_backward = True

    def finish_gradient_synchronization(self) -> None:
        """Make every rank's `.grad` the average over ranks. Backward does it by itself; after a backward this
        call is a no-op, and calling it again (or without a backward) only takes part in the cross-rank check.

        Raises:
            RuntimeError: when backward ran on some ranks but not on others, or the ranks reduced different
                gradients (checked before waiting on anything).
        """
        if self._finished_by_backward:
            self._finished_by_backward = False
            return
        self._synchronize()

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers to every rank, one flat broadcast per (dtype, device)."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in self.module.buffers():
            groups.setdefault((b.dtype, b.device), []).append(b)
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        with torch.no_grad():
            for buffers in groups.values():
                layout = FlatLayout(buffers)
                flat = layout.pack(buffers)
                dist.broadcast(flat, src=src, group=self.process_group)
                layout.unpack(flat, buffers)

    def forward(self, *args, **kwargs):
        """The wrapped module's forward, unchanged (gradients are synchronised in backward hooks).

        Raises:
            RuntimeError: when a parameter was frozen or unfrozen, replaced, added or removed after wrapping (its
                gradient would not be synchronised, or would be waited for forever).
        """
        current = list(self.module.parameters())
        if len(current) != len(self._all_params) or any(a is not b for a, b in zip(current, self._all_params)):
            known = {id(p) for p in self._all_params}
            names = [n for n, p in self.module.named_parameters() if id(p) not in known]
            raise RuntimeError(
                f"{type(self).__name__}: the model's parameters changed after wrapping (new or replaced: {names}; "
                f"{len(self._all_params)} parameters when wrapped, {len(current)} now); their gradients would not be "
                "synchronised. Wrap the model again (call remove_hooks() on the old wrapper first)."
            )
        if any(p.requires_grad != t for p, t in zip(self._all_params, self._trainable)):
            changed = [n for (n, p), t in zip(self.module.named_parameters(), self._trainable) if p.requires_grad != t]
            raise RuntimeError(
                f"{type(self).__name__}: requires_grad changed after wrapping for {changed}; gradients are "
                "synchronised for the parameters that were trainable when the model was wrapped. Wrap the model "
                "again after freezing or unfreezing (call remove_hooks() on the old wrapper first)."
            )
        if self.broadcast_buffers and self.world_size > 1 and self._sync_enabled and torch.is_grad_enabled():
            self._broadcast_buffers()
        self._finished_by_backward = False  # an explicit finish after this forward's backward is what skips
        return self.module(*args, **kwargs)

    def _check_ranks_agree(self, ran_backward: bool, launched: Sequence[int] = ()) -> None:
        """Compare, across ranks, whether each ran a synchronised backward and which gradients it launched
        (indices, in order), before any rank waits on a gradient collective. A mismatch would pair collectives
        wrongly (garbage or a hang); here it becomes the same clear error on every rank."""
        if self._control_group is None:
            return
        digest = int.from_bytes(hashlib.blake2b(array("q", launched).tobytes(), digest_size=7).digest(), "little")
        mine = torch.tensor([int(ran_backward), digest], dtype=torch.int64)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        name = type(self).__name__
        try:
            dist.all_gather(gathered, mine, group=self._control_group)
        except RuntimeError as e:  # gloo's transport error says only that a recv timed out
            raise RuntimeError(
                f"{name}: not every rank reached the end of backward within the process group's timeout of "
                f"{group_timeout(self.process_group).total_seconds():g} s (a rank is stuck, died, or skipped the "
                f"step): {str(e).splitlines()[0][:200]}"
            ) from None
        ran = [bool(g[0]) for g in gathered]
        if len(set(ran)) > 1:
            raise RuntimeError(
                f"{name}: backward ran on ranks {[r for r, x in enumerate(ran) if x]} but not on ranks "
                f"{[r for r, x in enumerate(ran) if not x]} before finish_gradient_synchronization(); every rank "
                "must run a backward each step (or all of them under no_sync())."
            )
        if len({int(g[1]) for g in gathered}) > 1:
            raise RuntimeError(
                f"{name}: the ranks reduced different sets of gradients: a parameter was used on some ranks only. "
                f"{name} needs every parameter used on every rank or on none; BucketedDDP handles parameters "
                "unused on some ranks."
            )

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally; the next synchronised backward reduces the sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    @abc.abstractmethod
    def _synchronize(self) -> None:
        """Make every rank's `.grad` the average over ranks (the wrapper's own reduction)."""


class ReduceAfterBackward(DataParallelBase):
    """Base of the wrappers that reduce only once backward has finished: tracks whether a synchronised backward
    has produced gradients since the last reduction."""

    def __init__(self, module: nn.Module, process_group=None, cross_rank_checks: bool = True,
                 broadcast_buffers: bool = True) -> None:
        super().__init__(module, process_group, cross_rank_checks, broadcast_buffers)
        self._pending = False
        self._register_grad_hooks(self._mark_pending)

    def _mark_pending(self, _param: torch.Tensor) -> None:
        if self._sync_enabled:
            self._pending = True

    def _synchronize(self) -> None:
        """Average gradients across ranks. A no-op when no synchronised backward ran since the last call."""
        self._check_ranks_agree(self._pending)
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
