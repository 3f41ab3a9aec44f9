"""Repeated eager calls of the Triton op, replayed from a plan: a call costs its allocations and launches, no more.

Everything an eager call does besides allocating its outputs and launching its kernels follows from its signature:
the shapes, strides, dtypes, devices and pointer alignment (Triton specialises on it) of its tensors, and the causal
flag, scale and window. The first calls of a signature take the full path (validation, geometry, autotuning,
Triton's launcher). Once that path has launched compiled kernels, the launches are recorded as a plan under the
signature; a later call with the same signature allocates its outputs and replays the launches with its own tensors.

Why: at the sizes of a layer in a small model an attention call costs more host time than GPU time, so in an
eager model its host time is the step's time (docs/host-cost.md). What a plan skips ran, and passed, for this exact
signature. Plans exist for plain tensors outside torch.compile: CUDA tensors, and CPU tensors under
Triton's interpreter (except bf16, which the interpreter computes in fp32), so CPU CI runs the same replays.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from ..layout import empty_output

_PLAIN = (Tensor, torch.nn.Parameter)
MAX_PLANS = 1024  # per table; a full table is emptied (a model uses a handful of signatures)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # what Triton's launcher asks for itself
_current_device = getattr(torch._C, "_cuda_getDevice", None)


class Recorded(NamedTuple):
    """One launch as the full path made it: the compiled kernel's launcher for its grid, the tensors that lead
    its arguments, and every argument after them (strides, sizes, scale, constexprs) in signature order; on a GPU
    also the compiled kernel and its grid (what `native` needs to launch it without Triton's launcher)."""

    run: Callable
    tensors: tuple[Tensor, ...]
    tail: tuple
    kernel: object = None  # triton CompiledKernel; None under the interpreter
    grid: tuple[int, int, int] | None = None


class Replay(NamedTuple):
    run: Callable
    slots: tuple[int, ...]  # which of the call's tensors go first, by their position among the call's tensors
    tail: tuple
    kernel: object
    grid: tuple[int, int, int] | None


def replays(recorded: list[Recorded | None], call_tensors: tuple[Tensor, ...]) -> tuple[Replay, ...] | None:
    """The recorded launches in terms of the call's tensors (found by identity), or None when a launch was not
    recorded (the autotuner ran it) or used a tensor the call does not name."""
    out = []
    for launch in recorded:
        if launch is None:
            return None
        slots = []
        for t in launch.tensors:
            slot = next((i for i, c in enumerate(call_tensors) if c is t), None)
            if slot is None:
                return None
            slots.append(slot)
        out.append(Replay(launch.run, tuple(slots), launch.tail, launch.kernel, launch.grid))
    return tuple(out)


def _launch_all(plan_replays: tuple[Replay, ...], tensors: tuple[Tensor, ...], device_index: int) -> None:
    stream = _raw_stream(device_index) if _raw_stream is not None and device_index >= 0 else None
    for run, slots, tail, _, _ in plan_replays:
        run(*[tensors[i] for i in slots], *tail, stream=stream)


def on_current_device(t: Tensor) -> bool:
    """Whether t is on the current CUDA device, where Triton launches (or on the CPU, under the interpreter).
    Cheaper than torch.cuda.current_device()."""
    index = t.get_device()
    if index < 0:
        return True
    return index == (_current_device() if _current_device is not None else torch.cuda.current_device())


class ForwardPlan:
    """The forward of one signature: output shapes, the forward kernels' launches, the (left, right) window and
    scale the full path derived (the backward needs them), and the (shape, dtype) of each scratch tensor the launches
    use after the call's own (the decode kernels' partial results). `native`: whether the native launcher holds it
    too (None: not offered yet; False: it refused it)."""

    __slots__ = ("window", "scale", "lse_shape", "replays", "scratch", "native")

    def __init__(self, window: tuple[int, int], scale: float, lse_shape: tuple[int, ...],
                 plan_replays: tuple[Replay, ...], scratch: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()):
        self.window, self.scale, self.lse_shape, self.replays = window, scale, lse_shape, plan_replays
        self.scratch = scratch
        self.native: bool | None = None

    def launch(self, q: Tensor, k: Tensor, v: Tensor, *inputs: Tensor) -> tuple[Tensor, Tensor]:
        """(O, L) of q, k, v; `inputs`: a call's further tensors, recorded after O and L (a decode call's cache
        starts)."""
        o = empty_output(q)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device)
        scratch = [torch.empty(shape, dtype=dtype, device=q.device) for shape, dtype in self.scratch]
        _launch_all(self.replays, (q, k, v, o, lse, *inputs, *scratch), q.get_device())
        return o, lse


class BackwardPlan:
    """The backward of one signature: its kernels' launches, the (L, D) pairs' shape, and the (shape, dtype) of
    each scratch tensor the launches use after the call's own (the one pass's dQ sum and semaphores: the launches
    that use them also initialise them); `native` as in ForwardPlan."""

    __slots__ = ("delta_shape", "replays", "scratch", "native")

    def __init__(self, delta_shape: tuple[int, ...], plan_replays: tuple[Replay, ...],
                 scratch: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()):
        self.delta_shape, self.replays, self.scratch = delta_shape, plan_replays, scratch
        self.native: bool | None = None

    def launch(self, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = empty_output(q), empty_output(k), empty_output(v)
        lse_delta = torch.empty(self.delta_shape, dtype=torch.float32, device=q.device)
        scratch = [torch.empty(shape, dtype=dtype, device=q.device) for shape, dtype in self.scratch]
        _launch_all(self.replays, (q, k, v, o, lse, do, dq, dk, dv, lse_delta, *scratch), q.get_device())
        return dq, dk, dv


def _tensor_signature(t: Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() & 15


def plannable(q, k, v, is_causal, softmax_scale, window_size) -> bool:
    """Whether a forward call can have a plan: plain tensors outside torch.compile, and flags of the types a plan
    keys on (a (left, right) window of ints)."""
    if (type(q) not in _PLAIN or type(k) not in _PLAIN or type(v) not in _PLAIN or type(is_causal) is not bool
            or torch.compiler.is_compiling()):
        return False
    if softmax_scale is not None and type(softmax_scale) not in (float, int):
        return False
    # Bounds beyond 32 bits take the full path, which validates them and reads a bound that wide as no bound.
    return window_size is None or (type(window_size) is tuple and len(window_size) == 2
                                   and type(window_size[0]) is int and type(window_size[1]) is int
                                   and -1 <= window_size[0] < 1 << 31 and -1 <= window_size[1] < 1 << 31)


def forward_key(q, k, v, is_causal, softmax_scale, window_size) -> tuple | None:
    """The forward's signature, or None where no plan applies (see `plannable`)."""
    if not plannable(q, k, v, is_causal, softmax_scale, window_size):
        return None
    return (_tensor_signature(q), _tensor_signature(k), _tensor_signature(v), is_causal, softmax_scale, window_size)


def signature_key(window: tuple[int, int], scale: float, *tensors: Tensor) -> tuple | None:
    """The signature of a call whose window and scale the checks already derived, or None where no plan applies
    (inside torch.compile's tracing, or a tensor subclass). A backward's tensors: q, k, v, O, L as unpacked
    (saved-tensor hooks may hand back other strides) and dO; an opaque forward op's: q, k, v."""
    if torch.compiler.is_compiling() or not all(type(t) in _PLAIN for t in tensors):
        return None
    return (window, scale, *[_tensor_signature(t) for t in tensors])


def backward_key(window: tuple[int, int], scale: float, *tensors: Tensor) -> tuple | None:
    """A backward's signature (q, k, v, O, L as unpacked, the dense dO): `signature_key`'s behind the determinism
    setting. Which one pass a plan replays depends on it; flashsys's own switch drops every plan when it changes,
    torch.use_deterministic_algorithms does not, so it is in the key (the native launcher's too)."""
    key = signature_key(window, scale, *tensors)
    return None if key is None else (torch.are_deterministic_algorithms_enabled(), *key)


class PlanTable:
    """A bounded {signature: plan} table."""

    def __init__(self):
        self._plans: dict = {}

    def get(self, key):
        return None if key is None else self._plans.get(key)

    def remember(self, key, plan) -> None:
        if key is None or plan is None:
            return
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()

    def values(self) -> list:
        """The plans held, oldest first."""
        return list(self._plans.values())

    def __len__(self) -> int:
        return len(self._plans)


forward_plans = PlanTable()  # eager forwards, keyed by `forward_key` (the user's arguments, before any check)
backward_plans = PlanTable()  # backwards, eager or in a compiled graph's opaque op, keyed by `backward_key`
# The opaque forward ops a compiled graph calls (the Gluon forward on Hopper, the interpreter on a CPU), keyed by
# `signature_key`: Inductor launches the `tl` kernels itself, but cannot see into these, so without a plan each
# call would take the full path (checks, TMA descriptors, Triton's dispatch).
op_forward_plans = PlanTable()
# `flash_attention_decode` calls, keyed by `signature_key` (q, k, v and the cache starts, if any).
decode_plans = PlanTable()

