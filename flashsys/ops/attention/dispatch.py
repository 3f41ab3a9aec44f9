"""Which kernels run a Triton attention call: the one place that decides.

A dense forward with at most 16 queries per sequence against at least 512 keys (decoding from a cache) takes the
split-key decode kernels (`takes_decode`, `triton.decode`) on any device. Otherwise the chain, forward and backward
alike (`forward_problem`, `backward_problem`; each branch says why):

    CPU tensors (the interpreter)              -> `tl` kernels: the interpreter runs no Gluon
    not fp16/bf16, head dim not 64/128         -> `tl`: the Gluon kernels' TMA tiles take 16-bit 64/128-wide rows
    FLASHSYS_GLUON=0                           -> `tl`: the switch, for A/B timings
    not sm_90, or Gluon does not import        -> `tl`: the Gluon kernels use Hopper's wgmma and TMA
    symbolic shapes (dynamic torch.compile)    -> `tl`: Inductor re-emits the `tl` kernels; a Gluon launch needs ints
    B*H*D*(pairs visited) < the size bar       -> `tl`: below it the `tl` kernels run as fast (`min_work`)
    strides TMA cannot address                 -> `tl`: TMA needs 16-byte strides, the last one 1
    otherwise                                  -> Gluon, the variant timed fastest for the shape class

Varlen calls always take the `tl` kernels (packed sequences need per-sequence offsets, which the TMA descriptors
do not take). Within the Gluon path every kernel picks its variant by timing its candidates on the first call of
a shape class (`ChoiceKey`: head dim, dtype, mask bounds, length bucket), as Triton's autotuner does for the `tl`
kernels; the candidate tables below list what is timed, best single choice first (the choice where timing is off:
FLASHSYS_TRITON_AUTOTUNE=0, or inside a CUDA graph capture). `TL_KERNEL` in a table stands for the `tl` kernel of
that stage (in the one-pass tables: the two passes), so the timing decides between Gluon and `tl` there too.
The backward runs in one pass or in two (dQ, then dK/dV): the one-pass tables decide that first.

docs/attention-kernels.md has what each variant is and the measurements that put it in its table.
"""

from __future__ import annotations

import os
import warnings
from typing import NamedTuple

import torch
from torch import Tensor

from .gluon import import_error, kernels
from .gluon.launch import TL_KERNEL, Variant, rank4
from .triton import decode
from .triton_env import autotune_enabled, env_switch

Window = tuple[int, int]
HEAD_DIMS = (64, 128)
_DTYPES = (torch.float16, torch.bfloat16)
# The size bars: the work (`call_work`) below which a call keeps the `tl` kernels, by head dim and mask ("full": no
# bound; "bounded": a causal mask or a window). A replayed Gluon call costs the host what a `tl` one does (the native
# launcher encodes its TMA descriptors), so the bars follow the kernels' speed: at D 64 under a causal mask or a window
# the `tl` kernels keep up below 2^34; under a full mask at D 64 the Gluon kernels lead from 2^33 (forward + backward
# 12-13% faster; at 2^32 two runs had them 6-7% ahead, a third 23% behind); at D 128 they lead from 2^31 under any mask
# (15-31%). Compiled graphs take the same bars: a compiled causal D 64 step was slower with the Gluon kernels below
# 2^34, or level with the Gluon forward alone, a D 128 one faster with them from 2^31 (docs/attention-kernels.md §2 has
# the measurements).
SIZE_BARS: dict[tuple[int, str], int] = {
    (64, "bounded"): 1 << 34, (64, "full"): 1 << 33,
    (128, "bounded"): 1 << 31, (128, "full"): 1 << 31,
}
# No bar exceeds this: tests and A/B timings set it to 0 to send every call the Gluon kernels can take to them.
MIN_WORK = max(SIZE_BARS.values())
ENV = "FLASHSYS_GLUON"

# The forward's candidates per head dim. At D 64 FlashAttention-3's and -4's tile, 192 query rows over three consumer
# warpgroups of 160 registers in the ping-pong kernel, leads at N 16384 and under full masks from N 2048; the
# persistent 128x128 kernel wins the causal cells below N 16384 and the full ones at N 1024. At D 128 the 128x128
# two-buffer kernels lead since K and V go back to the producer apart.
FORWARD_VARIANTS: dict[int, tuple[Variant, ...]] = {
    64: (Variant("pingpong", 192, 128, 2, 160, warpgroups=3), Variant("pingpong", 192, 128, 3, 160, warpgroups=3),
         Variant("persistent", 128, 128, 3, 240)),
    128: (Variant("persistent", 128, 128, 2, 240), Variant("pingpong", 128, 128, 2, 240),
          Variant("pingpong", 128, 64, 4, 240), Variant("plain", 64, 64, 3), Variant("persistent", 128, 64, 4, 240)),
}
# Forward variants on trial: compiled and checked for sm_90 by every CI run (tests/ops/kernel_compile.py), tested
# against reference math and timed beside the candidates by scripts/forward_variants.py on a GPU, never chosen. One
# joins FORWARD_VARIANTS once a GPU run shows it correct and fastest in some cell (docs/attention-kernels.md §4).
# D 64: the 192-row tile in the persistent kernel, behind its 128-row sibling or the ping-pong kernel in every cell
# timed so far.
FORWARD_TRIALS: dict[int, tuple[Variant, ...]] = {
    64: (Variant("persistent", 192, 128, 2, 160, warpgroups=3), Variant("persistent", 192, 128, 3, 160, warpgroups=3)),
}
# dK/dV ("dkdv": block_m query rows streamed through nbuf buffers, block_n key rows held by block_n // 16 warps).
# D 128 only: at D 64 the `tl` dK/dV kernel is faster, so the head dim has no table and runs it.
DKDV_VARIANTS: dict[int, tuple[Variant, ...]] = {
    128: (Variant("dkdv", 64, 64, 2), Variant("dkdv", 64, 128, 2)),
}
# dQ ("dq": block_m query rows held by block_m // 16 warps, block_n key rows streamed): neither it nor the `tl` dQ
# kernel wins every cell, so the `tl` kernel is timed beside the Gluon variants and is the untimed choice.
DQ_VARIANTS: dict[int, tuple[Variant, ...]] = {
    64: (TL_KERNEL, Variant("dq", 64, 128, 2), Variant("dq", 64, 64, 2), Variant("dq", 128, 64, 2)),
    128: (TL_KERNEL, Variant("dq", 64, 64, 2), Variant("dq", 128, 128, 2)),
}
# The one-pass backward with determinism off ("one_pass": a producer warp streams block_m query rows through nbuf
# buffers to two consumer warpgroups of block_n // 2 key rows at `regs` registers, `stages` sets of dQ staging boxes;
# `alternate`: the consumers take turns at each tile's whole dQ). TL_KERNEL stands for the two passes, still faster in
# some cells. At D 64 128-row query tiles with dQ split by rows win; at D 128 their accumulators do not fit.
ONE_PASS_VARIANTS: dict[int, tuple[Variant, ...]] = {
    64: (TL_KERNEL, Variant("one_pass", 64, 128, 3, 240, 2), Variant("one_pass", 128, 128, 2, 240, 2, 1)),
    128: (TL_KERNEL, Variant("one_pass", 64, 128, 2, 240), Variant("one_pass", 64, 128, 2, 240, 2),
          Variant("one_pass", 64, 128, 3, 240)),
}
# The deterministic one pass (the default): the same kernels with dQ's adds into each query tile in a fixed order.
DETERMINISTIC_ONE_PASS_VARIANTS: dict[int, tuple[Variant, ...]] = {
    64: (TL_KERNEL, Variant("one_pass_det", 64, 128, 3, 240, 2), Variant("one_pass_det", 128, 128, 2, 240, 2, 1)),
    128: (TL_KERNEL, Variant("one_pass_det", 64, 128, 2, 240), Variant("one_pass_det", 64, 128, 2, 240, 2),
          Variant("one_pass_det", 64, 128, 3, 240)),
}
# Under full masks the deterministic D 128 one pass's two-staging-set kernel beats its siblings in every cell, but a
# first-call timing among them picked a slower one at times: it is the only one-pass candidate there.
DETERMINISTIC_ONE_PASS_FULL_MASK_VARIANTS: dict[int, tuple[Variant, ...]] = {
    128: (TL_KERNEL, Variant("one_pass_det", 64, 128, 2, 240, 2)),
}
_TABLES = {"forward": FORWARD_VARIANTS, "dkdv": DKDV_VARIANTS, "dq": DQ_VARIANTS, "one_pass": ONE_PASS_VARIANTS,
           "one_pass_det": DETERMINISTIC_ONE_PASS_VARIANTS}
# The choice times every candidate's GPU work (`timed_choice.gpu_ms`) in interleaved rounds and takes each one's
# median, each timing spanning about 100 ms as Triton's autotuner's do: one GPU's timings of the same kernel drift
# within a process by more than the variants differ, and single or shorter timings picked variants measurably slower
# than the best. The cost: one to a few seconds on a key's first call.
CHOICE_ROUNDS = 3
CHOICE_REP_MS = 100


def gluon_variants(head_dim: int) -> tuple[Variant, ...]:
    """Every Gluon kernel variant at this head dim: the forward's (those on trial too), dK/dV's, dQ's and the one
    pass's (the `tl` candidates left out)."""
    tables = (FORWARD_VARIANTS, FORWARD_TRIALS, DKDV_VARIANTS, DQ_VARIANTS, ONE_PASS_VARIANTS,
              DETERMINISTIC_ONE_PASS_VARIANTS)
    return tuple(v for table in tables for v in table.get(head_dim, ()) if v.kind != "tl")


def enabled() -> bool:
    """FLASHSYS_GLUON, an on/off switch (triton_env.env_switch: a value other than on or off raises)."""
    return env_switch(ENV)


# Why the Gluon path is off in this process, once a choice found that no variant runs on this GPU.
_disabled: list[str] = []
# The checks below run under torch.compile too (Dynamo traces `forward_problem` to pick the op), so they cache in
# plain module state: Dynamo warns about every functools cache it traces through.
_is_hopper: dict[int, bool] = {}  # device index -> sm_90


def _hopper(device_index: int) -> bool:
    if device_index not in _is_hopper:
        _is_hopper[device_index] = torch.cuda.get_device_capability(device_index) == (9, 0)
    return _is_hopper[device_index]


def unavailable_reason() -> str | None:
    """Why the Gluon kernels cannot run in this process (they do not import, or none ran), or None."""
    if kernels() is None:
        return import_error()
    return _disabled[0] if _disabled else None


def tma_addressable(t: Tensor) -> bool:
    """Every stride TMA reads is a positive multiple of 16 bytes (and known: not symbolic), the last is 1 (dims of size
    1 are never strided)."""
    if t.stride(-1) != 1:
        return False
    return all(size == 1 or (type(stride) is int and stride > 0 and stride % 8 == 0)
               for size, stride in zip(t.shape[:-1], t.stride()[:-1]))


def _ramp_sum(x: int) -> int:
    """The sum of max(t, 0) over the integers t < x."""
    return x * (x - 1) // 2 if x > 0 else 0


def _keys_below(n_q: int, first: int, n_k: int) -> int:
    """The sum over rows i < n_q of clamp(first + i, 0, n_k): the keys below a bound that moves down the rows."""
    return _ramp_sum(first + n_q) - _ramp_sum(first) - _ramp_sum(first + n_q - n_k) + _ramp_sum(first - n_k)


def visible_pairs(n_q: int, n_k: int, window: Window) -> int:
    """How many (query, key) pairs a (left, right) window leaves visible (-1: unbounded; bottom-right aligned, query i
    sees key j iff i + Nk - Nq - left <= j <= i + Nk - Nq + right), in constant time: row i sees the keys below its
    right bound but not below its left one. The window is one `validation.normalize_window` returned."""
    left, right = window
    offset = n_k - n_q
    below_right = n_q * n_k if right < 0 else _keys_below(n_q, offset + right + 1, n_k)
    below_left = 0 if left < 0 else _keys_below(n_q, offset - left, n_k)
    return below_right - below_left


def min_work(head_dim: int, window: Window = (-1, -1)) -> int:
    """The size bar at this head dim (one of HEAD_DIMS) and mask (`window`: (left, right), -1 unbounded), eager and
    compiled calls alike: SIZE_BARS's, or MIN_WORK where that is lower."""
    mask = "full" if window[0] < 0 and window[1] < 0 else "bounded"
    return min(MIN_WORK, SIZE_BARS[head_dim, mask])


def call_work(q_shape: tuple[int, ...], k_shape: tuple[int, ...], window: Window) -> int:
    """B * H * D * the query-key pairs the kernels visit, what `min_work` bars: the visible pairs under a full or
    causal mask (right bound only), all Nq * Nk under a window with a left bound (windowed calls gain from the Gluon
    kernels well below the bar's visible work)."""
    heads = q_shape[0] * (q_shape[1] if len(q_shape) == 4 else 1)
    n_q, n_k = q_shape[-2], k_shape[-2]
    pairs = n_q * n_k if window[0] >= 0 else visible_pairs(n_q, n_k, window)
    return heads * q_shape[-1] * pairs


def forward_problem(q: Tensor, k: Tensor, v: Tensor, window: Window) -> str | None:
    """None when the Gluon forward takes these (validated, dense-batch) inputs, else why not: the chain in this
    module's docstring (the size bar: `min_work`). Cheapest checks first: an eager call on the Python path asks this
    every time, and most small calls stop at the size bar before any stride is read."""
    if q.device.type != "cuda":
        return "not a CUDA tensor"
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} (takes float16, bfloat16)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} (takes {HEAD_DIMS})"
    if not enabled():
        return f"{ENV}={os.environ[ENV]}"
    if not _hopper(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return "not an sm_90 (Hopper) GPU"
    if (reason := unavailable_reason()) is not None:
        return reason
    if any(type(n) is not int for n in (*q.shape, *k.shape)):  # v is shaped like k (validated)
        return "symbolic shapes (torch.compile with dynamic shapes)"
    work, bar = call_work(q.shape, k.shape, window), min_work(q.shape[-1], window)
    if work < bar:
        return f"B*H*D*(query-key pairs) = {work} < {bar}, the size bar (the `tl` kernels run as fast there)"
    if not all(tma_addressable(t) for t in (q, k, v)):
        return "strides TMA cannot address (each must be a multiple of 16 bytes, the last 1)"
    return None


def takes_decode(q: Tensor, k: Tensor) -> bool:
    """Whether the split-key decode kernels (`triton.decode`) run this dense forward: a few queries per sequence
    against a long cache, on any device the `tl` kernels run on. Checked before the Gluon forward."""
    kv_group = q.shape[1] // k.shape[1] if q.dim() == 4 and k.shape[1] else 1
    return decode.takes(q.shape[-2], k.shape[-2], kv_group, varlen=False)


def takes_forward(q: Tensor, k: Tensor, v: Tensor, window: Window) -> bool:
    """Whether the Gluon forward runs this call (real tensors: their addresses must be 16-byte aligned too)."""
    return forward_problem(q, k, v, window) is None and all(t.data_ptr() % 16 == 0 for t in (q, k, v))


def backward_problem(q: Tensor, k: Tensor, v: Tensor, window: Window) -> str | None:
    """As `forward_problem`, for the Gluon backward kernels: the forward's conditions and a head dim one of them has
    variants for (dQ at D 64 and 128, dK/dV at D 128)."""
    if q.shape[-1] not in DKDV_VARIANTS and q.shape[-1] not in DQ_VARIANTS:
        return f"head dim {q.shape[-1]} (the Gluon backward kernels take {tuple(DQ_VARIANTS)})"
    return forward_problem(q, k, v, window)


def takes_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, do: Tensor, window: Window) -> bool:
    """Whether the Gluon backward kernels may run this backward: where `backward_problem` finds nothing, with
    16-byte-aligned tensors and an O and a dO that TMA can read."""
    return (backward_problem(q, k, v, window) is None and tma_addressable(do) and tma_addressable(o)
            and all(t.data_ptr() % 16 == 0 for t in (q, k, v, o, do)))


class ChoiceKey(NamedTuple):
    """A shape class whose kernel variant is chosen once: one stage ("forward", "dkdv", "dq", "one_pass" or
    "one_pass_det") at one head dim, dtype and mask kind, for lengths up to `bucket`."""

    head_dim: int
    dtype: torch.dtype
    bound_right: bool
    bound_left: bool
    bucket: int  # max(Nq, Nk) rounded up to a power of two
    kernel: str = "forward"

    @classmethod
    def of(cls, q: Tensor, k: Tensor, window: Window, kernel: str) -> ChoiceKey:
        q4, k4 = rank4(q), rank4(k)
        bucket = 1 << (max(q4.shape[2], k4.shape[2]) - 1).bit_length()
        return cls(q4.shape[3], q4.dtype, window[1] >= 0, window[0] >= 0, bucket, kernel)

    def candidates(self) -> tuple[Variant, ...]:
        """The variants timed for this key, best single choice first; () where the stage has none at this head dim
        (its `tl` kernel runs)."""
        if self.kernel == "one_pass_det" and not (self.bound_right or self.bound_left):
            full = DETERMINISTIC_ONE_PASS_FULL_MASK_VARIANTS.get(self.head_dim)
            if full is not None:
                return full
        return _TABLES[self.kernel].get(self.head_dim, ())

    def label(self, variant: Variant) -> str:
        """`variant`'s label in this choice: in the one-pass choice TL_KERNEL stands for the two passes."""
        return "two passes" if self.kernel.startswith("one_pass") and variant.kind == "tl" else variant.label()


def one_pass_key(q: Tensor, k: Tensor, window: Window, deterministic: bool) -> ChoiceKey:
    """The one-pass choice's key: the deterministic kind's candidates where `deterministic` (the backward must give
    the same bits from run to run), the unordered kind's otherwise."""
    return ChoiceKey.of(q, k, window, "one_pass_det" if deterministic else "one_pass")


_chosen: dict[ChoiceKey, Variant] = {}


def chosen(key: ChoiceKey) -> Variant | None:
    """The variant this key runs without timing anything: the one chosen (or pinned) before; else the first
    candidate where nothing is to be timed (FLASHSYS_TRITON_AUTOTUNE=0 remembers it; inside a CUDA graph capture it
    is not remembered, so that a later call may still time); else None, and the caller times `key.candidates()`
    (`timed_choice.fastest`) and `remember`s the result."""
    variant = _chosen.get(key)
    if variant is not None:
        return variant
    first = key.candidates()[0]
    if torch.cuda.is_current_stream_capturing():
        return first
    if not autotune_enabled():
        _chosen[key] = first
        return first
    return None


_KINDS = {"forward": ("plain", "pingpong", "persistent"), "dkdv": ("dkdv",), "dq": ("tl", "dq"),
          "one_pass": ("tl", "one_pass"), "one_pass_det": ("tl", "one_pass_det")}


def remember(key: ChoiceKey, variant: Variant) -> Variant:
    """Make `variant` this key's choice for the rest of the process (the timing's winner, or a pin: any variant of a
    kind the key's stage runs, in its table or not); returns it.

    Raises:
        ValueError: for a variant of a kind the stage does not run (a forward variant for dQ, say).
    """
    if variant.kind not in _KINDS[key.kernel]:
        raise ValueError(f"{variant.label()} cannot run the {key.kernel!r} stage (it takes kinds "
                         f"{_KINDS[key.kernel]})")
    _chosen[key] = variant
    return variant


def forget_choices() -> None:
    """Forget every choice made so far (each key is timed again on its next call), and any earlier finding that no
    variant runs here. Plans replay the old choices until `replay.clear()`."""
    _chosen.clear()
    _disabled.clear()


def disable(reason: str) -> None:
    """Turn the Gluon path off for this process (no variant of a choice ran on this GPU), with a RuntimeWarning."""
    if not _disabled:
        _disabled.append(reason)
        warnings.warn(f"flashsys: the Gluon kernels are off in this process, the `tl` kernels run ({reason})",
                      RuntimeWarning, stacklevel=3)


def chosen_variants() -> dict[ChoiceKey, Variant]:
    """{key: variant} chosen so far in this process."""
    return dict(_chosen)


def size_bars() -> str:
    """The size bars (`min_work`) in words, per head dim: "2^34 (D 64; full masks 2^33), 2^31 (D 128)"."""
    def power(b: int) -> str:
        return f"2^{b.bit_length() - 1}" if b else "0"

    def at(d: int) -> str:
        bounded, full = min_work(d, (-1, 0)), min_work(d)
        return f"{power(bounded)} (D {d})" if full == bounded else f"{power(bounded)} (D {d}; full masks {power(full)})"

    return ", ".join(at(d) for d in HEAD_DIMS)


def status() -> str:
    """One line for benchmark headers: whether the Gluon path runs on the current GPU, and the variants chosen so far
    ("causal" stands for any right bound without a left one, "window" for a left bound)."""
    if not enabled():
        return f"off ({ENV}={os.environ[ENV]})"
    if not torch.cuda.is_available() or not _hopper(torch.cuda.current_device()):
        return "off (not an sm_90 GPU)"
    if (reason := unavailable_reason()) is not None:
        return f"off ({reason})"
    masks = {(True, False): "causal", (False, False): "full", (True, True): "window", (False, True): "window"}
    choices = "; ".join(f"{k.kernel} D {k.head_dim} {str(k.dtype)[6:]} {masks[k.bound_right, k.bound_left]} "
                        f"N<={k.bucket}: {k.label(v)}" for k, v in sorted(_chosen.items(), key=str))
    bar = f"on where B*H*D*(query-key pairs, call_work) >= {size_bars()}, eager and compiled"
    return bar + (f"; chose {choices}" if choices else "")
