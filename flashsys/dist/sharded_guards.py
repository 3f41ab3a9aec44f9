"""Refusals for the torch calls that would silently do nothing on ZeRO-2 parameters.

Under ZeRO-2 (`BucketedDDP.shard_gradients`) a parameter's averaged gradient lives in its bucket's shard and
`.grad` stays None. Code written for replicated gradients then does nothing without a word: another optimizer
over those parameters never updates them, and `torch.nn.utils.clip_grad_norm_` returns 0 and clips nothing.
Once a wrapper shards, these guards make both an error that says what to call instead. Everything else passes
through untouched; the checks only look at which wrapper holds each parameter.
"""

from __future__ import annotations

import functools
import weakref

import torch

from .base import wrapper_of

# Optimizers that step sharded gradients themselves (ZeRO2Optimizer and its per-bucket inner optimizers) carry
# this attribute set to True.
STEPS_SHARDS = "_steps_sharded_gradients"

_installed = False
# The verdict for each optimizer: (parameter count it was computed for, names of the sharded parameters it holds).
_verdicts: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, list[str]]] = weakref.WeakKeyDictionary()


def is_sharded(p: torch.Tensor) -> bool:
    """Whether `p`'s gradient lives in a live ZeRO-2 wrapper's shards."""
    wrapper = wrapper_of(p)
    return wrapper is not None and getattr(wrapper, "sharded", False)


def _sharded_in(optimizer: torch.optim.Optimizer) -> list[str]:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    known = _verdicts.get(optimizer)
    if known is None or known[0] != len(params):
        held = [f"{tuple(p.shape)}" for p in params if is_sharded(p)]
        known = (len(params), held)
        _verdicts[optimizer] = known
    return known[1]


def _refuse_unsharded_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    if getattr(optimizer, STEPS_SHARDS, False):
        return
    held = _sharded_in(optimizer)
    if held:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step: {len(held)} of its parameters (shapes {held[:4]}"
            f"{', ...' if len(held) > 4 else ''}) have their gradients sharded by ZeRO-2, so .grad is None and this "
            "step would never update them. Step them with the ZeRO2Optimizer that shards them (one optimizer; use "
            "param groups for different settings)."
        )


def _refusing(clip, name: str):
    @functools.wraps(clip)
    def guarded(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(is_sharded(p) for p in params):
            raise RuntimeError(
                f"torch.nn.utils.{name}: the gradients of these parameters are sharded by ZeRO-2 (.grad is None), "
                "so it would see none and clip nothing. Clip with the ZeRO2Optimizer's clip_grad_norm_(max_norm)."
            )
        return clip(params, *args, **kwargs)

    guarded.__flashsys_guarded__ = True
    return guarded


def install() -> None:
    """Install the guards once per process (idempotent): a global optimizer step pre-hook, and clip_grad_norm_ /
    clip_grad_value_ that refuse sharded parameters."""
    global _installed
    if _installed:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_refuse_unsharded_step)
    from torch.nn.utils import clip_grad

    for name in ("clip_grad_norm_", "clip_grad_value_"):
        for namespace in (torch.nn.utils, clip_grad):
            original = getattr(namespace, name)
            if not getattr(original, "__flashsys_guarded__", False):
                setattr(namespace, name, _refusing(original, name))
    _installed = True
