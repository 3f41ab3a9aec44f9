"""BucketedDDP: gradients grouped into flat buckets, each all-reduced asynchronously as soon as it is full.

Fewer, larger all-reduces than OverlapDDP (less per-call overhead), still overlapped with backward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .base import DataParallelBase
from .consistency import gather_digests
from .cost_model import MB, measure_allreduce_cost, optimal_bucket_bytes, plan_buckets
from .flat_layout import FlatLayout


@dataclass
class _Bucket:
    """Parameters that share one flat buffer. The buffer holds their gradients, then one "used" flag per
    parameter: after the SUM a flag > 0 means some rank had that gradient, so unused parameters need no
    extra collective and stay None when no rank used them."""

    params: list[nn.Parameter]
    layout: FlatLayout  # where each parameter's gradient sits in `buffer`
    buffer: torch.Tensor  # layout.numel gradient elements, then len(params) flags
    ready: set[int] = field(default_factory=set)  # indices of params whose gradient is in the buffer
    handle: dist.Work | None = None


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

    Args:
        module: the model, already on this rank's device.
        bucket_size_mb: bucket cap in MiB, `None` (one bucket per dtype and device) or `"auto"` (measured).
        process_group: the group to average over (default: the world).
        cross_rank_checks: see DataParallelBase.

    Raises:
        ValueError: for a bucket size that is not a positive number, None or "auto"; or a model that differs
            between ranks.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | str | None = 25.0, process_group=None,
                 cross_rank_checks: bool = True) -> None:
        super().__init__(module, process_group, cross_rank_checks)
        total_bytes = sum(p.numel() * p.element_size() for p in self._grad_params)
        if bucket_size_mb == "auto":
            if self._grad_params:
                p0 = self._grad_params[0]
                self.overhead_s, self.bandwidth_bps = measure_allreduce_cost(p0.device, p0.dtype, process_group)
                cap_bytes: float = optimal_bucket_bytes(total_bytes, self.overhead_s, self.bandwidth_bps)
            else:  # nothing to reduce: no buckets, nothing to measure
                self.overhead_s, self.bandwidth_bps, cap_bytes = 0.0, float("inf"), math.inf
        elif bucket_size_mb is None:
            cap_bytes = math.inf
        elif isinstance(bucket_size_mb, (int, float)) and bucket_size_mb > 0:
            cap_bytes = bucket_size_mb * MB
        else:
            raise ValueError(f"bucket_size_mb must be a positive number, None or 'auto', got {bucket_size_mb!r}")
        self.bucket_bytes = cap_bytes
        self._buckets = self._build_buckets(cap_bytes)
        layout = [(len(b.params), b.layout.numel, str(b.buffer.dtype)) for b in self._buckets]
        gathered = gather_digests(repr(layout), (len(layout), bucket_size_mb), process_group)
        if len({digest for digest, _ in gathered}) != 1:
            detail = ", ".join(f"rank {r}: {n} buckets (bucket_size_mb={mb!r})" for r, (_, (n, mb)) in enumerate(gathered))
            raise ValueError(f"BucketedDDP: the bucket layout differs between ranks ({detail}); every rank must use "
                             "the same bucket_size_mb")
        self._where = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._next_to_launch = 0
        self._register_grad_hooks(self._on_grad_ready)

    def _build_buckets(self, cap_bytes: float) -> list[_Bucket]:
        order = list(reversed(self._grad_params))  # roughly the order backward produces gradients
        groups = plan_buckets([((p.dtype, p.device), p.numel() * p.element_size()) for p in order], cap_bytes)
        buckets = []
        for group in groups:
            ps = [order[i] for i in group]
            layout = FlatLayout(ps)
            buffer = torch.zeros(layout.numel + len(ps), dtype=ps[0].dtype, device=ps[0].device)
            buckets.append(_Bucket(ps, layout, buffer))
        return buckets

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        """Gradient bytes of each bucket, in launch order."""
        return [b.layout.numel * b.buffer.element_size() for b in self._buckets]

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync_enabled:
            return
        bucket, i = self._where[id(p)]
        if i in bucket.ready or bucket.handle is not None:
            raise RuntimeError("BucketedDDP: a second backward ran before finish_gradient_synchronization()")
        bucket.layout.view(bucket.buffer, i).copy_(p.grad)
        bucket.ready.add(i)
        self._launch_full_buckets()

    def _launch(self, bucket: _Bucket) -> None:
        flags = bucket.buffer[bucket.layout.numel :]
        if len(bucket.ready) == len(bucket.params):
            flags.fill_(1)
        else:  # at finish: parameters without a gradient this step contribute zeros
            for i in range(len(bucket.params)):
                if i not in bucket.ready:
                    bucket.layout.view(bucket.buffer, i).zero_()
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
        """Launch the buckets still waiting, wait for all, average and copy back. A no-op after no backward.

        Raises:
            RuntimeError: when backward ran on some ranks but not on others (checked before waiting on anything).
        """
        ran_backward = self._next_to_launch > 0 or any(b.ready for b in self._buckets)
        self._check_ranks_agree(ran_backward)
        if not ran_backward:
            return
        for bucket in self._buckets[self._next_to_launch :]:
            self._launch(bucket)
        for bucket in self._buckets:
            bucket.handle.wait()
            n = bucket.layout.numel
            bucket.buffer[:n].div_(self.world_size)
            complete = len(bucket.ready) == len(bucket.params)
            used = [True] * len(bucket.params) if complete else (bucket.buffer[n:] > 0).tolist()
            for i, (p, chunk) in enumerate(zip(bucket.params, bucket.layout.views(bucket.buffer))):
                if i in bucket.ready:
                    p.grad.copy_(chunk)
                elif used[i]:
                    p.grad = chunk.clone()  # used on another rank only
            bucket.ready.clear()
            bucket.handle = None
        self._next_to_launch = 0
