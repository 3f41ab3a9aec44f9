"""BucketedDDP: gradients grouped into flat buckets, each all-reduced asynchronously as soon as it is full.

Fewer, larger all-reduces than OverlapDDP (less per-call overhead), still overlapped with backward.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .base import DataParallelBase

MB = 1024 * 1024


@dataclass
class _Bucket:
    """Parameters that share one flat buffer. The buffer holds their gradients, then one "used" flag per
    parameter: after the SUM a flag > 0 means some rank had that gradient, so unused parameters need no
    extra collective and stay None when no rank used them."""

    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    buffer: torch.Tensor
    ready: set[int] = field(default_factory=set)  # indices of params whose gradient is in the buffer
    handle: dist.Work | None = None


def measure_allreduce_cost(device: torch.device, dtype: torch.dtype, group=None, repeats: int = 5) -> tuple[float, float]:
    """Fit t(bytes) = o + bytes / w from all-reduces of 4 KiB and 16 MiB. Returns (o seconds, w bytes/second).

    Every rank gets the same numbers (the max over ranks), so every rank builds the same buckets.
    """
    elem = torch.tensor([], dtype=dtype).element_size()
    sizes = (4096, 16 * MB)
    times = []
    for nbytes in sizes:
        buf = torch.randn(nbytes // elem, device=device).to(dtype)
        samples = []
        for i in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(buf, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first call is warm-up
                samples.append(time.perf_counter() - start)
        times.append(statistics.median(samples))
    stats = torch.tensor(times, dtype=torch.float64, device=device if dist.get_backend(group) == "nccl" else "cpu")
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=group)
    t_small, t_big = stats.tolist()
    w = (sizes[1] - sizes[0]) / max(t_big - t_small, 1e-9)
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

    clamped to [1 MiB, S].
    """
    b = math.sqrt(total_bytes * overhead_s * bandwidth_bps)
    return int(min(max(b, MB), max(total_bytes, MB)))


class BucketedDDP(DataParallelBase):
    """Data parallel with bucketed, overlapped gradient all-reduce (the PyTorch DDP scheme, in one file).

    - Buckets are filled in reverse registration order (roughly the order backward produces gradients), one
      set per (dtype, device); a bucket closes when it reaches `bucket_size_mb`; a larger tensor gets its own.
      `None` puts each (dtype, device) in one bucket. `"auto"` measures the all-reduce overhead o and bandwidth
      w at construction and uses `optimal_bucket_bytes`.
    - Flat bucket buffers are allocated once and reused every step; gradients are copied in by a
      post-accumulate-grad hook and copied back after the reduction, so `zero_grad(set_to_none=True)` is safe.
    - Buckets are launched strictly in order, on every rank, as soon as they and all before them are full;
      `finish_gradient_synchronization()` launches what is left (parameters without a gradient contribute
      zeros and a used-flag of 0), waits, and averages.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | str | None = 25.0, process_group=None) -> None:
        super().__init__(module, process_group)
        total_bytes = sum(p.numel() * p.element_size() for p in self._grad_params)
        if bucket_size_mb == "auto":
            if self._grad_params:
                p0 = self._grad_params[0]
                self.overhead_s, self.bandwidth_bps = measure_allreduce_cost(p0.device, p0.dtype, process_group)
            else:
                self.overhead_s, self.bandwidth_bps = 0.0, float("inf")
            cap_bytes: float = optimal_bucket_bytes(total_bytes, self.overhead_s, self.bandwidth_bps)
        elif bucket_size_mb is None:
            cap_bytes = math.inf
        elif isinstance(bucket_size_mb, (int, float)) and bucket_size_mb > 0:
            cap_bytes = bucket_size_mb * MB
        else:
            raise ValueError(f"bucket_size_mb must be a positive number, None or 'auto', got {bucket_size_mb!r}")
        self.bucket_bytes = cap_bytes
        self._buckets = self._build_buckets(cap_bytes)
        self._where = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._next_to_launch = 0
        self._register_grad_hooks(self._on_grad_ready)

    def _build_buckets(self, cap_bytes: float) -> list[_Bucket]:
        order = list(reversed(self._grad_params))  # roughly the order backward produces gradients
        groups = plan_buckets([((p.dtype, p.device), p.numel() * p.element_size()) for p in order], cap_bytes)
        buckets = []
        for group in groups:
            ps = [order[i] for i in group]
            offsets, n = [], 0
            for p in ps:
                offsets.append(n)
                n += p.numel()
            buffer = torch.zeros(n + len(ps), dtype=ps[0].dtype, device=ps[0].device)
            buckets.append(_Bucket(ps, offsets, n, buffer))
        return buckets

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        return [b.numel * b.buffer.element_size() for b in self._buckets]

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync_enabled:
            return
        bucket, i = self._where[id(p)]
        if i in bucket.ready or bucket.handle is not None:
            raise RuntimeError("BucketedDDP: a second backward ran before finish_gradient_synchronization()")
        off = bucket.offsets[i]
        bucket.buffer[off : off + p.numel()].copy_(p.grad.reshape(-1))
        bucket.ready.add(i)
        self._launch_full_buckets()

    def _launch(self, bucket: _Bucket) -> None:
        flags = bucket.buffer[bucket.numel :]
        if len(bucket.ready) == len(bucket.params):
            flags.fill_(1)
        else:  # at finish: parameters without a gradient this step contribute zeros
            for i, p in enumerate(bucket.params):
                if i not in bucket.ready:
                    bucket.buffer[bucket.offsets[i] : bucket.offsets[i] + p.numel()].zero_()
                flags[i] = 1 if i in bucket.ready else 0
        bucket.handle = dist.all_reduce(bucket.buffer, group=self.process_group, async_op=True)

    def _launch_full_buckets(self) -> None:
        while self._next_to_launch < len(self._buckets):
            bucket = self._buckets[self._next_to_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_to_launch += 1

    def finish_gradient_synchronization(self) -> None:
        """Launch the buckets still waiting, wait for all, average and copy back. A no-op after no backward."""
        if self._next_to_launch == 0 and not any(b.ready for b in self._buckets):
            return
        for bucket in self._buckets[self._next_to_launch :]:
            self._launch(bucket)
        for bucket in self._buckets:
            bucket.handle.wait()
            grads = bucket.buffer[: bucket.numel]
            grads.div_(self.world_size)
            complete = len(bucket.ready) == len(bucket.params)
            used = [True] * len(bucket.params) if complete else (bucket.buffer[bucket.numel :] > 0).tolist()
            for i, p in enumerate(bucket.params):
                chunk = grads[bucket.offsets[i] : bucket.offsets[i] + p.numel()].view_as(p)
                if i in bucket.ready:
                    p.grad.copy_(chunk)
                elif used[i]:
                    p.grad = chunk.clone()  # used on another rank only
            bucket.ready.clear()
            bucket.handle = None
        self._next_to_launch = 0
