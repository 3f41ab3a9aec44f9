"""Whether the attention backward must be bit-deterministic: the process-wide switch behind the one-pass backward.

The default backward is deterministic: each sum runs in a fixed order, in two passes (dQ, then dK/dV) or, on Hopper
GPUs where a timed choice finds it faster, in one pass whose dQ adds wait for their turns (five tensor-core products
a tile where the two passes do seven; docs/attention-kernels.md has the measurements). Without the turns the one
pass is a little faster again: its dQ is a float32 sum that the key tiles' programs add into as they finish, in no
fixed order, so dQ's last bits vary from run to run (PyTorch's SDPA documents the same of its fused CUDA kernels'
backwards). That one runs only where asked for:

    import flashsys.ops.attention as fa
    fa.set_deterministic_backward(False)

A switch, not a per-call argument, as `torch.backends.cudnn.deterministic` is one: it reaches backwards that run
inside compiled graphs and the native launcher without changing any signature. `torch.use_deterministic_algorithms
(True)` overrides it: the backward is then deterministic whatever this switch says.
"""

from __future__ import annotations

import torch

_state = {"deterministic": True}


def set_deterministic_backward(deterministic: bool) -> None:
    """Allow (False) or forbid (True, the default) the non-deterministic one-pass backward, from the next backward
    on. A change drops the process's launch plans, so that no plan made under the other setting replays."""
    if not isinstance(deterministic, bool):
        raise TypeError("set_deterministic_backward: deterministic must be a bool, got "
                        f"{type(deterministic).__name__}")
    if deterministic == _state["deterministic"]:
        return
    _state["deterministic"] = deterministic
    from . import replay

    replay.clear()  # the native launcher's too


def deterministic_backward() -> bool:
    """Whether backwards must be bit-deterministic now: the switch's value, or True where
    `torch.use_deterministic_algorithms(True)` is on."""
    return _state["deterministic"] or torch.are_deterministic_algorithms_enabled()
