"""ZeRO2Optimizer: gradient and optimizer-state sharding (ZeRO stage 2) on top of BucketedDDP's buckets.

BucketedDDP reduce-scatters each bucket during backward, so a rank ends backward holding the averaged gradients
of its 1/world slice of every bucket only; it steps that slice's parameters with the inner optimizer and the
updated slices are all-gathered back, in place. Per step that is a reduce-scatter plus an all-gather: the bytes
of one all-reduce (ZeRO-1 adds a broadcast of every parameter on top of DDP's all-reduce). The step runs bucket
by bucket (one inner optimizer per bucket), each bucket's all-gather launched as soon as its slice is stepped,
so the gathers overlap the optimizer's own work on the next buckets; `step()` returns with the parameters whole.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..dist import Bucket, BucketedDDP
from ..dist.base import dropped_wrapper, wrapper_of
from ..dist.sharded_guards import STEPS_SHARDS
from ..dist.side_channel import Arrivals
from .state_dicts import ConsolidatedStateDict, StatePart, hyperparameters

# Optimizers whose update of an element reads only that element's gradient and state: they step a slice of a
# parameter exactly as they would step the whole one. Exactly these classes: a subclass may change the update
# (LARS subclasses SGD and scales by whole-parameter norms), so it needs elementwise=True.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
    torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD, torch.optim.Rprop,
)


@dataclass
class _Piece:
    """This rank's slice of one parameter: `tensor` aliases `param[start:end]` (flattened) inside the bucket's
    flat parameter buffer; its gradient is `bucket.grad_shard[grad_start:grad_start + end - start]`."""

    tensor: nn.Parameter
    param: nn.Parameter
    bucket: Bucket
    index: int  # the parameter's index in its bucket
    start: int
    end: int
    grad_start: int


class ZeRO2Optimizer(ConsolidatedStateDict, torch.optim.Optimizer):
    """Wrap `optimizer_cls(**kwargs)` so that each rank holds gradients and optimizer state only for its slice of
    every bucket of the `BucketedDDP` that wraps `params`.

    Usage: `ddp = BucketedDDP(model)`, then `opt = ZeRO2Optimizer(model.parameters(), torch.optim.AdamW, lr=...)`
    (the wrapper is found from the parameters). The training loop is unchanged: backward reduce-scatters as the
    buckets fill, `step()` steps the local slices and all-gathers the parameters (a collective: every rank).

    - `.grad` stays None on the model's parameters: the averaged gradients are in the shards. Clip with
      `clip_grad_norm_()` here: `torch.nn.utils.clip_grad_norm_` would see no gradients, so it raises on these
      parameters, as does any other optimizer's `step()` over them.
    - Gradients accumulate from one `step()` to the next (several backwards, or `no_sync()` micro-batches) and
      `step()` consumes them; `zero_grad()` here, on the wrapper or on the model drops what was not stepped.
    - The parameters live in the buckets: move or convert the model before wrapping it. A parameter moved out
      (`model.to(torch.float64)` afterwards) makes `step()` raise instead of updating a bucket nothing reads.
    - Results equal the unsharded optimizer's on the averaged gradients, bit for bit, for optimizers that update
      each element from its own gradient and state alone (`ELEMENTWISE_OPTIMIZERS`): a slice of a parameter is
      stepped as the whole would be. Others (Adafactor, LBFGS, Muon) need whole parameters: use
      `ShardedOptimizer` (ZeRO-1), or pass `elementwise=True` for one you know to be elementwise.
    - `consolidate_state_dict(to)` then `state_dict()` on rank `to` gives the unsharded optimizer's layout;
      `load_state_dict()` on every rank takes it (or an unsharded optimizer's) and keeps each slice.

    Args:
        params: the wrapped model's parameters or param-group dicts (a one-shot generator is fine).
        optimizer_cls: the optimizer to shard, e.g. `torch.optim.AdamW`.
        elementwise: override the `ELEMENTWISE_OPTIMIZERS` check (None: check).
        cross_rank_checks: every rank meets before each `step()` and `consolidate_state_dict()` (through the
            rendezvous store, bounded by the group's timeout), so a rank that does not call one is named in an
            error on the others instead of a hang. A few small round trips per step; False turns it off.
        overlap_all_gather: return from `step()` with the all-gathers still running; each module of the model
            waits for its bucket's just before its forward (as FSDP prefetches) or its `state_dict()`, and the next
            `step()` waits for all. Reading parameters any other way in between (an EMA update, `p.data`)
            needs `wait_for_parameters()` first. Off by default: with it, a module hook waits inside forward,
            which `torch.compile` cannot trace (a graph break per hooked module).
        **kwargs: the inner optimizer's arguments (lr, betas, fused, ...).

    Raises:
        TypeError: for an `optimizer_cls` that is not an Optimizer subclass, or not known to be elementwise (a
            subclass of a known one included).
        ValueError: when the parameters are not all held by one live BucketedDDP.
    """

    _steps_sharded_gradients = True  # `flashsys.dist.sharded_guards.STEPS_SHARDS`: it steps the shards itself

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict], optimizer_cls: type[torch.optim.Optimizer],
                 elementwise: bool | None = None, overlap_all_gather: bool = False, cross_rank_checks: bool = True,
                 **kwargs: Any) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"ZeRO2Optimizer: optimizer_cls must be a torch.optim.Optimizer subclass, got "
                            f"{optimizer_cls!r}")
        if elementwise is None:
            elementwise = optimizer_cls in ELEMENTWISE_OPTIMIZERS
        if not elementwise:
            raise TypeError(
                f"ZeRO2Optimizer: {optimizer_cls.__name__} is not known to update each element on its own; ZeRO-2 "
                "steps slices of parameters. Use ShardedOptimizer (ZeRO-1, whole parameters), or elementwise=True if it is."
            )
        self._optimizer_cls, self._inner_kwargs = optimizer_cls, kwargs
        self._ddp: BucketedDDP | None = None
        self._pieces: list[list[_Piece]] = []  # this rank's pieces, per param group
        self._inners: list[torch.optim.Optimizer] = []  # one per bucket, each with every param group
        self._consolidated: dict[str, Any] | None = None
        self.overlap_all_gather = overlap_all_gather
        self._cross_rank_checks = cross_rank_checks
        self._pending: dict[int, dist.Work] = {}  # bucket index -> its all-gather still in flight
        super().__init__(params, defaults=kwargs)
        if overlap_all_gather:
            self._hook_modules()

    def _hook_modules(self) -> None:
        """A forward pre-hook and a state-dict pre-hook on every module that owns parameters directly, waiting
        for their buckets' all-gathers: whichever module's forward or state_dict() runs (a parent's reaches its
        children's hooks), it sees whole parameters. The hooks hold the optimizer weakly."""
        ddp, ref = self.ddp, weakref.ref(self)
        index = {id(b): i for i, b in enumerate(ddp.buckets)}

        def waiter(buckets):
            def hook(*_args):
                opt = ref()
                if opt is not None and opt._pending:
                    opt._wait(buckets)
            return hook

        for module in ddp.module.modules():
            buckets = sorted({index[id(where[0])] for p in module.parameters(recurse=False)
                              if (where := ddp.bucket_of(p)) is not None})
            if buckets:
                module.register_forward_pre_hook(waiter(buckets))
                module.register_state_dict_pre_hook(waiter(buckets))

    def _wait(self, buckets) -> None:
        for b in buckets:
            handle = self._pending.pop(b, None)
            if handle is not None:
                handle.wait()

    def wait_for_parameters(self) -> None:
        """Wait for the all-gathers `step()` left running (`overlap_all_gather=True`); a no-op otherwise."""
        self._wait(list(self._pending))

    # ------------------------------------------------------------------ partition
    def _wrapper_for(self, params: list[nn.Parameter]) -> BucketedDDP:
        wrappers = {id(w): w for w in map(wrapper_of, params)}
        if len(wrappers) != 1 or not isinstance(next(iter(wrappers.values())), BucketedDDP):
            if any(map(dropped_wrapper, params)):
                raise ValueError("ZeRO2Optimizer: the BucketedDDP that wrapped these parameters was garbage-collected; "
                                 "keep a reference to it (ddp = BucketedDDP(model)) before creating the optimizer")
            names = sorted({type(w).__name__ if w is not None else "no wrapper" for w in wrappers.values()})
            raise ValueError(f"ZeRO2Optimizer: every parameter must belong to one live BucketedDDP (found: {names}); "
                             "wrap the model with BucketedDDP before creating the optimizer")
        ddp = next(iter(wrappers.values()))
        if self._ddp is not None and ddp is not self._ddp:
            raise ValueError("ZeRO2Optimizer: a param group belongs to another BucketedDDP than the first one")
        return ddp

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (on every rank); each of its parameters contributes the slice this rank owns."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        trainable = [p for p in group["params"] if p.requires_grad]  # frozen ones never get a gradient: no slice
        ddp = self._wrapper_for(trainable) if trainable or self._ddp is None else self._ddp
        if self._ddp is None:
            self._ddp = ddp
            ddp.shard_gradients()
            if self._cross_rank_checks:
                self._arrivals = Arrivals(type(self).__name__, ddp.process_group)
        pieces = []
        for p in trainable:
            bucket, i = ddp.bucket_of(p)
            lo, hi = ddp.shard_range(bucket)
            offset = bucket.layout.offsets[i]
            start, end = max(offset, lo), min(offset + p.numel(), hi)
            if start < end:
                piece = nn.Parameter(bucket.params_flat[start:end])  # aliases the parameter's storage
                pieces.append(_Piece(piece, p, bucket, i, start - offset, end - offset, start - lo))
        self._pieces.append(pieces)
        hyper = {k: v for k, v in group.items() if k != "params"}
        for b, bucket in enumerate(ddp.buckets):
            inner_group = {**hyper, "params": [x.tensor for x in pieces if x.bucket is bucket]}
            if len(self._inners) <= b:
                inner = self._optimizer_cls([inner_group], **self._inner_kwargs)
                setattr(inner, STEPS_SHARDS, True)  # it steps this rank's slices: the guards let it through
                self._inners.append(inner)
            else:
                self._inners[b].add_param_group(inner_group)
        if self._inners:
            self.defaults = dict(self._inners[0].defaults)
            for k, v in self._inners[0].param_groups[-1].items():
                if k != "params":
                    group.setdefault(k, v)

    @property
    def inner_state(self) -> dict[torch.Tensor, dict[str, Any]]:
        """The inner optimizers' state, keyed by this rank's slices (`nn.Parameter`s aliasing the parameters)."""
        return {piece: st for inner in self._inners for piece, st in inner.state.items()}

    @property
    def ddp(self) -> BucketedDDP:
        """The BucketedDDP whose buckets this optimizer shards."""
        assert self._ddp is not None
        return self._ddp

    def _all_pieces(self) -> list[_Piece]:
        return [x for pieces in self._pieces for x in pieces]

    # ------------------------------------------------------------------ step
    def _attach_gradients(self) -> None:
        used = dict(zip(map(id, self.ddp.buckets), self.ddp.gradients_used()))
        for x in self._all_pieces():
            live = used[id(x.bucket)][x.index]
            x.tensor.grad = x.bucket.grad_shard[x.grad_start : x.grad_start + x.end - x.start] if live else None

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Step this rank's slices, then all-gather every bucket's parameters in place (a collective: call it on
        every rank). Returns the closure's loss, if a closure was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._arrivals is not None:
            self._arrivals.check("step")
        self.wait_for_parameters()  # a step before the next forward: its slices must not change under a gather
        ddp = self.ddp
        moved = ddp.moved_parameters()
        if moved:
            raise RuntimeError(
                f"ZeRO2Optimizer.step: parameters {moved[:4]}{' ...' if len(moved) > 4 else ''} no longer live in "
                "their BucketedDDP bucket (model.to(), .half() or p.data = ... after the optimizer was built): the "
                "step would update the bucket and never them. Move or convert the model before wrapping it."
            )
        self._attach_gradients()
        # Last bucket first: it holds the first layers, which the next forward needs first.
        for b in reversed(range(len(self._inners))):
            inner, bucket = self._inners[b], ddp.buckets[b]
            for outer, group in zip(self.param_groups, inner.param_groups):
                group.update({k: v for k, v in outer.items() if k != "params"})
            inner.step(**kwargs)
            bucket.grad_live = False
            self._pending[b] = ddp.all_gather_parameters(bucket)  # runs while the next buckets are stepped
        for x in self._all_pieces():
            x.tensor.grad = None
        if not self.overlap_all_gather:
            self.wait_for_parameters()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients not yet stepped: the shards and any local `.grad` (no_sync accumulation)."""
        self.ddp.drop_gradients()
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the sharded gradients so their global 2-norm is at most `max_norm` (a collective); returns the
        norm before clipping, as `torch.nn.utils.clip_grad_norm_` does for unsharded gradients."""
        ddp = self.ddp
        shards = [b.grad_shard for b in ddp.buckets if b.grad_live]
        device = ddp.buckets[0].grad_shard.device if ddp.buckets else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for s in shards:
            sq += s.float().pow(2).sum()
        dist.all_reduce(sq, group=ddp.process_group)
        norm = sq.sqrt()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for s in shards:
            s.mul_(coef.to(s.dtype))
        return norm

    def grad_and_state_bytes(self) -> int:
        """Bytes this rank holds for gradients (its shards) and optimizer state (its slices')."""
        grads = sum(b.grad_shard.numel() * b.grad_shard.element_size() for b in self.ddp.buckets)
        state = sum(v.numel() * v.element_size() for s in self.inner_state.values() for v in s.values()
                    if torch.is_tensor(v))
        return grads + state

    # ------------------------------------------------------------------ state dicts
    def _global_index(self) -> dict[int, int]:
        return {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _state_group(self):
        return self.ddp.process_group

    def owned_ranges(self) -> list[tuple[int, int, int]]:
        """(index, start, end) of every range of flattened parameters this rank holds the state of: its slices of
        each bucket, and the frozen parameters (which have no slice) whole by index modulo the world size, so that
        every element of every parameter is on exactly one rank. Index: the parameter's position in the order of
        all groups' parameters, as state dicts number them."""
        index = self._global_index()
        rank, world = dist.get_rank(self.ddp.process_group), dist.get_world_size(self.ddp.process_group)
        ranges = [(index[id(x.param)], x.start, x.end) for x in self._all_pieces()]
        ranges += [(i, 0, p.numel()) for i, p in enumerate(p for g in self.param_groups for p in g["params"])
                   if not p.requires_grad and i % world == rank]
        return sorted(ranges)

    def state_parts(self) -> list[StatePart]:
        """This rank's parts of the optimizer state: the inner optimizers' state of each of its slices."""
        index = self._global_index()
        inner_state = self.inner_state
        return [StatePart(index[id(x.param)], x.start, x.end, inner_state[x.tensor]) for x in self._all_pieces()
                if inner_state.get(x.tensor)]

    def _load_state_parts(self, state: dict[int, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        """Each bucket's inner optimizer takes this rank's slices of the state."""
        index = self._global_index()
        for inner, bucket in zip(self._inners, self.ddp.buckets):
            inner_state, inner_groups, n = {}, [], 0
            for saved, pieces in zip(groups, self._pieces):
                ids = []
                for x in pieces:
                    if x.bucket is not bucket:
                        continue
                    values = state.get(index[id(x.param)])
                    if values is not None:
                        inner_state[n] = {k: (v.reshape(-1)[x.start : x.end].clone()
                                              if torch.is_tensor(v) and v.dim() > 0 else v) for k, v in values.items()}
                    ids.append(n)
                    n += 1
                inner_groups.append({**hyperparameters(saved), "params": ids})
            inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
