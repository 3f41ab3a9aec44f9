"""The all-reduce cost model behind BucketedDDP's bucket size: t(bytes) = o + bytes / w, measured on the real
process group, and the bucket size that minimises the communication it predicts is left exposed.

`plan_buckets` is the bucket layout itself (which gradients share a bucket), shared by BucketedDDP and the DDP
benchmark's model curve so both count the same all-reduces.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..timing import repeat

MB = 1024 * 1024


def measure_allreduce_cost(device: torch.device, dtype: torch.dtype, group=None, repeats: int = 10) -> tuple[float, float]:
    """Fit t(bytes) = o + bytes / w from all-reduces of 4 KiB and 16 MiB. Returns (o seconds, w bytes/second).

    Both sizes are warmed up before either is timed, and each size's fastest call is kept: a new communicator's
    first collectives (and a neighbour's burst on a shared host) are slow for reasons the model does not describe,
    and can make a 4 KiB all-reduce look slower than a 16 MiB one, which fits an infinite bandwidth and puts every
    gradient in one bucket. Every rank gets the same numbers (the max over ranks), so every rank builds the same
    buckets.
    """
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = (4096, 16 * MB)
    buffers = [torch.randn(nbytes // elem, device=device).to(dtype) for nbytes in sizes]
    for buf in buffers:  # warm-up of both sizes first
        repeat(lambda: dist.all_reduce(buf, group=group), warmup=0, iters=2, device=device, barrier=True, group=group)
    times = [min(repeat(lambda: dist.all_reduce(buf, group=group), warmup=0, iters=repeats, device=device,
                        barrier=True, group=group)) / 1e3 for buf in buffers]
    stats = torch.tensor(times, dtype=torch.float64, device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    return fit_allreduce_cost(*stats.tolist(), sizes)


def fit_allreduce_cost(t_small: float, t_big: float, sizes: tuple[int, int]) -> tuple[float, float]:
    """(o, w) of t(bytes) = o + bytes / w through two timings (seconds) of all-reduces of `sizes` bytes. When the
    larger one did not take longer (noise), the bandwidth is bounded by the larger call alone instead of being
    fitted as infinite."""
    if t_big > t_small:
        w = (sizes[1] - sizes[0]) / (t_big - t_small)
    else:
        w = sizes[1] / max(t_big, 1e-9)
    o = max(t_small - sizes[0] / w, 1e-7)
    return o, w


def plan_buckets(items: list[tuple[object, int]], cap_bytes: float) -> list[list[int]]:
    """Group (key, nbytes) items, taken in the order given, into buckets of one key each.

    A bucket closes once it holds at least `cap_bytes`; an item larger than the cap gets a bucket of its own
    (tensors are never split). Returns the buckets as lists of item indices, in the order they close, then
    the still-open ones. The benchmarks use it to count the all-reduces a cap gives.
    """
    open_: dict[object, list[int]] = {}
    filled: dict[object, int] = {}
    closed: list[list[int]] = []
    for i, (key, nbytes) in enumerate(items):
        current = open_.setdefault(key, [])
        if nbytes > cap_bytes:
            if current:
                closed.append(current)
                open_[key], filled[key] = [], 0
            closed.append([i])
            continue
        current.append(i)
        filled[key] = filled.get(key, 0) + nbytes
        if filled[key] >= cap_bytes:
            closed.append(current)
            open_[key], filled[key] = [], 0
    return closed + [group for group in open_.values() if group]


def optimal_bucket_bytes(total_bytes: int, overhead_s: float, bandwidth_bps: float) -> int:
    """Bucket size that minimises the exposed communication of the overhead model.

    With S gradient bytes in buckets of b bytes there are S/b all-reduces, each costing o + b/w. Communication
    of all buckets but the last can hide behind backward, but their per-call overheads queue up and surface
    at the end when backward is short; the last bucket starts only when backward ends and is always exposed:

        exposed(b) ~= (S / b) * o + b / w        minimised at        b* = sqrt(S * o * w)

    clamped to [1 MiB, S / 4]: at least four buckets, so that a measured overhead inflated by noise cannot put all
    S bytes in one bucket whose whole all-reduce waits for the end of backward.
    """
    b = math.sqrt(total_bytes * overhead_s * bandwidth_bps)
    return int(min(max(b, MB), max(total_bytes / 4, MB)))
