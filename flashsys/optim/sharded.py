"""ShardedOptimizer: optimizer-state sharding (ZeRO stage 1) around any torch.optim.Optimizer.

Every rank keeps all parameters, but optimizer state (Adam's two moments: twice the model size in fp32) only
for the parameters it owns. After the owners step their shard, each parameter is broadcast from its owner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..dist import FlatLayout, gather_digests
from ..dist.side_channel import Arrivals
from .state_dicts import ConsolidatedStateDict, StatePart, hyperparameters


def _group_signature(group: dict[str, Any]) -> str:
    hyper = sorted((k, repr(v)) for k, v in group.items() if k != "params")
    shapes = [(tuple(p.shape), str(p.dtype)) for p in group["params"]]
    return repr((hyper, shapes))


class ShardedOptimizer(ConsolidatedStateDict, torch.optim.Optimizer):
    """Wrap `optimizer_cls(**kwargs)` so that each rank holds state only for the parameters it owns.

    - Ownership is by whole parameters, per param group, largest first to the least-loaded rank (ties to the
      lower rank): deterministic on every rank, never by id() or set order.
    - `step()` steps the local shard with the inner optimizer, then broadcasts every parameter from its owner,
      packed in flat chunks of at most 128 MB (`broadcast_chunk_bytes`) per (owner, dtype, device). Results
      equal the unsharded optimizer's bit for bit.
    - Hyper-parameters changed in `param_groups` (an LR scheduler) reach the inner optimizer at the next step.
    - `consolidate_state_dict(to)` then `state_dict()` on rank `to` gives the unsharded optimizer's layout;
      `load_state_dict()` on every rank restores each shard.
    - `add_param_group()` must be called on every rank (a signature check catches groups that differ).

    Args:
        params: parameters or param-group dicts, as for any optimizer (a one-shot generator is fine).
        optimizer_cls: the optimizer to shard, e.g. `torch.optim.AdamW`.
        process_group: the group to shard over (default: the world).
        cross_rank_checks: every rank meets before each `step()` and `consolidate_state_dict()` (through the
            rendezvous store, bounded by the group's timeout), so a rank that does not call one is named in an
            error on the others instead of a hang. A few small round trips per step; False turns it off.
        **kwargs: the inner optimizer's arguments (lr, betas, ...).

    Raises:
        TypeError: when `optimizer_cls` is not a `torch.optim.Optimizer` subclass.
        RuntimeError: without an initialised process group.
    """

    def __init__(self, params: Iterable[nn.Parameter] | Iterable[dict], optimizer_cls: type[torch.optim.Optimizer],
                 process_group=None, cross_rank_checks: bool = True, **kwargs: Any) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise TypeError(f"ShardedOptimizer: optimizer_cls must be a torch.optim.Optimizer subclass, got "
                            f"{optimizer_cls!r}")
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs an initialised torch.distributed process group")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self._optimizer_cls, self._inner_kwargs = optimizer_cls, kwargs
        self._owner: dict[nn.Parameter, int] = {}
        self._load = [0] * self.world_size
        self._local: list[list[nn.Parameter]] = []  # owned parameters of each param group
        self._inner: torch.optim.Optimizer | None = None
        self._consolidated: dict[str, Any] | None = None
        self.broadcast_chunk_bytes = 128 * 2**20
        self._plan: tuple | None = None
        self._arrivals = Arrivals(type(self).__name__, process_group) if cross_rank_checks else None
        super().__init__(params, defaults=kwargs)

    # ------------------------------------------------------------------ partition
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group on every rank (a collective); its parameters are assigned to owners, largest first.

        Raises:
            ValueError: when parameters span devices, or the group differs between ranks.
        """
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(f"ShardedOptimizer: all parameters must be on one device, got {sorted(map(str, devices))}")
        self._check_group_on_all_ranks(group)
        params = group["params"]
        for i in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
            owner = min(range(self.world_size), key=lambda r: (self._load[r], r))
            self._owner[params[i]] = owner
            self._load[owner] += params[i].numel() * params[i].element_size()
        owned = [p for p in params if self._owner[p] == self.rank]
        self._local.append(owned)
        inner_group = {**{k: v for k, v in group.items() if k != "params"}, "params": owned}
        if self._inner is None:
            self._inner = self._optimizer_cls([inner_group], **self._inner_kwargs)
            self.defaults = dict(self._inner.defaults)
        else:
            self._inner.add_param_group(inner_group)
        # The outer group carries every default of the inner optimizer, as the unsharded optimizer's would.
        for k, v in self._inner.param_groups[-1].items():
            if k != "params":
                group.setdefault(k, v)

    def _check_group_on_all_ranks(self, group: dict[str, Any]) -> None:
        gathered = gather_digests(_group_signature(group), group=self.process_group)
        if len({digest for digest, _ in gathered}) != 1:
            raise ValueError(
                f"ShardedOptimizer: param group {len(self.param_groups) - 1} differs between ranks "
                "(parameter shapes, dtypes or hyper-parameters); add_param_group must be called with the same group "
                "everywhere"
            )

    def owner_of(self, p: nn.Parameter) -> int:
        """The rank that holds `p`'s optimizer state and steps it."""
        return self._owner[p]

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The wrapped optimizer, holding only this rank's shard."""
        assert self._inner is not None
        return self._inner

    # ------------------------------------------------------------------ step
    def _sync_hyperparameters(self) -> None:
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for k, v in outer.items():
                if k != "params":
                    inner[k] = v

    def _broadcast_plan(self) -> list[tuple[int, int, list[nn.Parameter]]]:
        """(owner, source rank, chunk) for every broadcast of a step. Ownership changes only in
        add_param_group, so the plan is built once and reused until then."""
        key = (len(self._owner), self.broadcast_chunk_bytes)
        if self._plan is None or self._plan[0] != key:
            plan = []
            for owner in range(self.world_size):
                by_kind: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
                for g in self.param_groups:
                    for p in g["params"]:
                        if self._owner[p] == owner:
                            by_kind.setdefault((p.dtype, p.device), []).append(p)
                src = dist.get_global_rank(self.process_group, owner) if self.process_group is not None else owner
                plan += [(owner, src, chunk) for params in by_kind.values() for chunk in self._chunks(params)]
            self._plan = (key, plan)
        return self._plan[1]

    @torch.no_grad()
    def _broadcast_parameters(self) -> None:
        """Each owner sends its parameters packed in flat chunks of at most `broadcast_chunk_bytes` per
        (dtype, device): few large broadcasts, and at most one chunk of extra memory (not a copy of the shard)."""
        for owner, src, chunk in self._broadcast_plan():
            self._broadcast_chunk(chunk, owner, src)

    def _chunks(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        chunks: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if chunks[-1] and size + nbytes > self.broadcast_chunk_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(p)
            size += nbytes
        return chunks

    def _broadcast_chunk(self, params: list[nn.Parameter], owner: int, src: int) -> None:
        if len(params) == 1:
            dist.broadcast(params[0].data, src=src, group=self.process_group)
            return
        layout = FlatLayout(params)
        if owner == self.rank:
            flat = layout.pack([p.data for p in params])
        else:
            flat = torch.empty(layout.numel, dtype=params[0].dtype, device=params[0].device)
        dist.broadcast(flat, src=src, group=self.process_group)
        if owner != self.rank:
            layout.unpack(flat, [p.data for p in params])

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:  # type: ignore[override]
        """Step this rank's shard with the inner optimizer, then broadcast every parameter from its owner
        (a collective: call it on every rank). Returns the closure's loss, if a closure was given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._arrivals is not None:
            self._arrivals.check("step")
        self._sync_hyperparameters()
        self.inner.step(**kwargs)
        self._broadcast_parameters()
        return loss

    # ------------------------------------------------------------------ state dicts
    def _global_index(self) -> dict[nn.Parameter, int]:
        return {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}

    def _state_group(self):
        return self.process_group

    def owned_ranges(self) -> list[tuple[int, int, int]]:
        """(index, 0, numel) of every parameter this rank owns (steps and holds the state of); each parameter is
        owned by exactly one rank. Index: its position in the order of all groups' parameters."""
        return [(i, 0, p.numel()) for p, i in self._global_index().items() if self.owner_of(p) == self.rank]

    def state_parts(self) -> list[StatePart]:
        """This rank's parts of the optimizer state: the inner optimizer's state of each owned parameter, whole."""
        index = self._global_index()
        inner_params = [p for g in self._local for p in g]
        return [StatePart(index[inner_params[i]], 0, inner_params[i].numel(), values)
                for i, values in self.inner.state_dict()["state"].items()]

    def _load_state_parts(self, state: dict[int, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        """The inner optimizer takes the state of the parameters this rank owns."""
        index = self._global_index()
        inner_state, inner_groups, n = {}, [], 0
        for saved, owned in zip(groups, self._local):
            ids = []
            for p in owned:
                if index[p] in state:
                    inner_state[n] = state[index[p]]
                ids.append(n)
                n += 1
            inner_groups.append({**hyperparameters(saved), "params": ids})
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
