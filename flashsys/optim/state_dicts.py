"""The unsharded optimizer's state-dict layout, which both sharded optimizers save and load through one
implementation (`ConsolidatedStateDict`): checkpoints move between AdamW, ShardedOptimizer (ZeRO-1) and
ZeRO2Optimizer (ZeRO-2)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..dist.side_channel import Arrivals


def indexed_param_groups(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups as `torch.optim.Optimizer.state_dict()` writes them: hyper-parameters, and each parameter as its
    index in the order of all groups' parameters."""
    groups, n = [], 0
    for g in param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(n, n + len(g["params"])))})
        n += len(g["params"])
    return groups


def checked_full_state(owner: str, state_dict: Any, param_groups: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each parameter's state, by its global index, from a full state dict checked against `param_groups`.

    Raises:
        ValueError: naming `owner`, when `state_dict` is not an optimizer state dict, its groups hold other
            numbers of parameters, or a state belongs to no parameter or has another shape than its parameter.
    """
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        keys = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"{owner}.load_state_dict: expected a dict with 'state' and 'param_groups' (what "
                         f"state_dict() returns after consolidate_state_dict()), got {keys}")
    sizes, expected = [len(g["params"]) for g in state_dict["param_groups"]], [len(g["params"]) for g in param_groups]
    if sizes != expected:
        raise ValueError(f"{owner}.load_state_dict: param groups do not match this optimizer's ({sizes} parameters per "
                         f"group in the state dict, {expected} here)")
    params = [p for g in param_groups for p in g["params"]]
    state = {int(k): v for k, v in state_dict["state"].items()}
    for g, values in state.items():
        if not 0 <= g < len(params):
            raise ValueError(f"{owner}.load_state_dict: state for parameter {g}, but there are {len(params)}")
        for name, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != params[g].shape:
                raise ValueError(f"{owner}.load_state_dict: state {name!r} of parameter {g} has shape "
                                 f"{tuple(value.shape)}, but the parameter has {tuple(params[g].shape)}")
    return state


class StatePart(NamedTuple):
    """This rank's part of one parameter's optimizer state: elements [start, end) of the flattened parameter (all of
    it for ZeRO-1, a slice for ZeRO-2). Each per-element state tensor holds end - start elements; anything else
    (Adam's step, a scalar) is the whole parameter's and the same on every part."""

    index: int  # the parameter's index in the order of all groups' parameters
    start: int
    end: int
    values: dict[str, Any]


class ConsolidatedStateDict:
    """`consolidate_state_dict`, `state_dict` and `load_state_dict` in the unsharded optimizer's layout, for an
    optimizer whose state is sharded across the ranks of `_state_group()`. A subclass (a `torch.optim.Optimizer`)
    says what this rank holds (`state_parts`) and how it takes back its own parts of a full state
    (`_load_state_parts`)."""

    param_groups: list[dict[str, Any]]
    _consolidated: dict[str, Any] | None = None
    _arrivals: Arrivals | None = None  # set by a subclass that checks that every rank reaches its collectives

    def _state_group(self):
        """The process group the state is sharded over (None: the world)."""
        raise NotImplementedError

    def state_parts(self) -> list[StatePart]:
        """This rank's parts of the state."""
        raise NotImplementedError

    def _load_state_parts(self, state: dict[int, dict[str, Any]], groups: list[dict[str, Any]]) -> None:
        """Take this rank's parts of a checked full state (by global index) with the saved groups' hyper-parameters."""
        raise NotImplementedError

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's parts of the state on rank `to` (a collective: call it on every rank), reassembled per
        parameter; `state_dict()` on that rank then returns it. States are moved to the CPU on the way.

        Raises:
            RuntimeError: naming the ranks that did not call it within the group's timeout (with cross-rank checks).
        """
        if self._arrivals is not None:
            self._arrivals.check("consolidate_state_dict")
        group = self._state_group()
        mine = [part._replace(values={k: (v.detach().cpu() if torch.is_tensor(v) else v)
                                      for k, v in part.values.items()})
                for part in self.state_parts()]
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        gathered: list | None = [None] * world if rank == to else None
        dst = dist.get_global_rank(group, to) if group is not None else to
        dist.gather_object(mine, gathered, dst=dst, group=group)
        self._consolidated = None
        if rank != to:
            return
        params = [p for g in self.param_groups for p in g["params"]]
        state: dict[int, dict[str, Any]] = {}
        for parts in gathered:  # type: ignore[union-attr]
            for index, start, end, values in parts:
                full = state.setdefault(index, {})
                shape = params[index].shape
                for k, v in values.items():
                    if not (torch.is_tensor(v) and v.dim() > 0 and v.numel() == end - start):
                        full[k] = v  # a per-parameter value (Adam's step): the same on every part
                    elif end - start == shape.numel():
                        full[k] = v.reshape(shape)  # the whole parameter's state
                    else:
                        if k not in full:
                            full[k] = torch.zeros(shape, dtype=v.dtype)
                        full[k].view(-1)[start:end] = v.reshape(-1)
        self._consolidated = {"state": dict(sorted(state.items()))}

    def state_dict(self) -> dict[str, Any]:
        """The full state in the unsharded optimizer's layout; only on the rank that consolidated it.

        Raises:
            RuntimeError: on a rank that did not receive the consolidated state.
        """
        if self._consolidated is None:
            raise RuntimeError(f"{type(self).__name__}.state_dict(): call consolidate_state_dict(to=rank) on every "
                               "rank first, then state_dict() on that rank")
        return {"state": self._consolidated["state"], "param_groups": indexed_param_groups(self.param_groups)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (consolidated, or an unsharded optimizer's) state dict on every rank; each keeps its own parts.

        Raises:
            ValueError: when the dict is not an optimizer state dict or does not match these parameters.
        """
        state = checked_full_state(type(self).__name__, state_dict, self.param_groups)
        groups = state_dict["param_groups"]
        for outer, saved in zip(self.param_groups, groups):
            outer.update({k: v for k, v in saved.items() if k != "params"})
        self._load_state_parts(state, groups)


def hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's settings without its parameters."""
    return {k: v for k, v in group.items() if k != "params"}
