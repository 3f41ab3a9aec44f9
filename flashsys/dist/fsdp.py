"""ZeRO-3 through torch's own engine: FSDP2 (`fully_shard`) on every block and at the root of a `TransformerLM`,
and the full (unsharded) state dicts that flashsys checkpoints hold, so that a ZeRO-3 checkpoint resumes under
ZeRO-2, ZeRO-1 or plain AdamW and the other way round.

Recipe for a model of your own (what `flashsys train --zero-stage 3` does):

    shard_model(model, compute_dtype=torch.bfloat16)   # after init_process_group, model on this rank's device
    opt = torch.optim.AdamW(model.parameters(), lr=...)  # over the sharded (DTensor) parameters
    loss_fn(model(x), y).backward()                      # FSDP2 gathers and reduce-scatters per block
    opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def shard_model(model: nn.Module, compute_dtype: torch.dtype | None = None) -> None:
    """Shard `model` in place with FSDP2: each block of `model.layers` is one unit (its parameters gathered just
    before its forward and backward, the next one prefetched), the root holds the rest (embeddings, final norm,
    LM head). With `compute_dtype` the gathered parameters are cast to it for compute, and gradients reduced in
    float32; the sharded parameters and the optimizer stay float32.

    Raises:
        RuntimeError: without an initialised process group (FSDP2's own error), or for a model without `layers`.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not hasattr(model, "layers"):
        raise RuntimeError(f"shard_model: {type(model).__name__} has no `layers` to shard block by block")
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if compute_dtype \
        else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


def _options(**changes):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **changes)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state dict, unsharded, on the CPU of rank 0 (empty on the others). A collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(cpu_offload=True))


def load_full_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load an unsharded state dict (every rank passes the same one) into the sharded model. A collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_options())


def _names_in_order(model: nn.Module, opt: torch.optim.Optimizer) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for g in opt.param_groups for p in g["params"]]


def full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state unsharded, in `torch.optim.Optimizer.state_dict()`'s layout (parameters by index in
    the order of its groups, as AdamW, ShardedOptimizer and ZeRO2Optimizer save it), on rank 0 (empty on the
    others). A collective."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, opt, options=_options(cpu_offload=True))
    if not by_name:
        return {}
    index = {name: i for i, name in enumerate(_names_in_order(model, opt))}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[n] for n in g["params"]]}
              for g in by_name["param_groups"]]
    return {"state": {index[name]: values for name, values in by_name["state"].items()}, "param_groups": groups}


def load_full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an optimizer state in the index layout (`full_optimizer_state`'s, or any flashsys checkpoint's) into the
    optimizer over the sharded parameters. A collective.

    Raises:
        ValueError: when its groups hold other numbers of parameters than this optimizer's.
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    names = _names_in_order(model, opt)
    sizes = [len(g["params"]) for g in state["param_groups"]]
    if sizes != [len(g["params"]) for g in opt.param_groups]:
        raise ValueError(f"the optimizer state's groups hold {sizes} parameters, this optimizer's "
                         f"{[len(g['params']) for g in opt.param_groups]}")
    by_name = {"state": {names[int(i)]: values for i, values in state["state"].items()},
               "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                 "params": [names[int(i)] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, opt, optim_state_dict=by_name, options=_options())
