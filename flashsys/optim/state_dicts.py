"""The unsharded optimizer's state-dict layout, which both sharded optimizers save and load: checkpoints move
between AdamW, ShardedOptimizer (ZeRO-1) and ZeRO2Optimizer (ZeRO-2)."""

from __future__ import annotations

from typing import Any

import torch


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
