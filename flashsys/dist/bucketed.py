"""BucketedDDP: gradients grouped into flat buckets, each reduced asynchronously as soon as it is full.

Fewer, larger collectives than OverlapDDP (less per-call overhead), still overlapped with backward. The same
buckets serve ZeRO-2 (`flashsys.optim.ZeRO2Optimizer`): each bucket is then reduce-scattered, so every rank
ends with the averaged gradients of its own slice only.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from . import sharded_guards
from .base import DataParallelBase
from .consistency import gather_digests
from .cost_model import MB, measure_allreduce_cost, optimal_bucket_bytes, plan_buckets
from .flat_layout import FlatLayout

COMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# torch >= 2.12 names the flat collectives *_single; older releases only have the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Bucket:
    """Parameters that share one flat buffer: BucketedDDP's unit of communication.

    What a sharded optimizer reads (`ZeRO2Optimizer`, after `BucketedDDP.shard_gradients()`): `params` (in bucket
    order), `layout` (where each lies in the flat buffers), `params_flat` (the parameters' storage, padded to a
    multiple of the world size), `grad_shard` (this rank's slice of the averaged gradients, `shard_range`) and
    `grad_live` (whether that slice holds gradients no step has consumed). The other fields are the wrapper's.

    Replicated (all-reduce) mode: `buffer` holds their gradients, then one "used" flag per parameter: after the
    SUM a flag > 0 means some rank had that gradient, so unused parameters need no extra collective and stay None
    when no rank used them.

    Sharded (reduce-scatter, ZeRO-2) mode: the parameters themselves live in `params_flat` (padded to a multiple of
    the world size); a full-size gradient buffer exists only from the bucket's first gradient to the end of its
    reduce-scatter, and each rank keeps `grad_shard`, its slice of the averaged gradients.
    """

    params: list[nn.Parameter]
    layout: FlatLayout  # where each parameter (and its gradient) sits in the flat buffers
    buffer: torch.Tensor | None  # replicated mode: layout.numel gradient elements, then len(params) flags
    comm: torch.Tensor | None = None  # replicated mode with comm_dtype: what is reduced
    ready: set[int] = field(default_factory=set)  # indices of params whose gradient is in the buffer
    handle: dist.Work | None = None
    # sharded mode
    params_flat: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    transient: torch.Tensor | None = None  # the full gradient buffer while it is filled
    reduced: tuple[torch.Tensor, ...] = ()  # (full buffer, output) while the reduce-scatter runs
    flags: torch.Tensor | None = None  # which parameters had a gradient on this rank, all-reduced with the bucket
    flags_handle: dist.Work | None = None
    used: torch.Tensor | None = None  # > 0 where some rank had the parameter's gradient since the last step
    grad_live: bool = False  # grad_shard holds gradients the optimizer has not consumed yet


class BucketedDDP(DataParallelBase):
    """Data parallel with bucketed, overlapped gradient reduction (the PyTorch DDP scheme, in one file).

    - Buckets are filled in reverse registration order (roughly the order backward produces gradients), one
      set per (dtype, device); a bucket closes when it reaches `bucket_size_mb`; a larger tensor gets its own.
      `None` puts each (dtype, device) in one bucket. `"auto"` measures the all-reduce overhead o and bandwidth
      w at construction and uses `optimal_bucket_bytes`.
    - Flat bucket buffers are allocated once and reused every step. By default gradients are copied in by a
      post-accumulate-grad hook and copied back after the reduction; with `gradient_as_bucket_view=True` each
      `.grad` is a view into its bucket, so neither copy happens (see `zero_grad`).
    - Buckets are launched strictly in order, on every rank, as soon as they and all before them are full; the
      end of backward launches what is left (a parameter without a gradient this step contributes what its
      `.grad` holds, or zeros and a used-flag of 0), waits, and averages.

    Args:
        module: the model, already on this rank's device.
        bucket_size_mb: bucket cap in MiB, `None` (one bucket per dtype and device) or `"auto"` (measured at
            construction, the default: a few hundred MB at the xl preset; docs/data-parallel.md has its measurements
            against torch DDP's `bucket_cap_mb`).
        process_group: the group to average over (default: the world).
        cross_rank_checks: see DataParallelBase.
        broadcast_buffers: see DataParallelBase.
        gradient_as_bucket_view: make every `.grad` a view into its bucket (as torch DDP's option): no copy in or
            out, and no second copy of the gradients in memory. `.grad` set to None (`zero_grad(set_to_none=True)`
            on the optimizer) still works, at the cost of one copy per gradient on the next backward; this
            wrapper's `zero_grad()` zeroes the buckets instead and keeps the views.
        comm_dtype: reduce in this floating dtype (e.g. `torch.bfloat16`: half the bytes of fp32), then
            accumulate back into the gradients' dtype. The gradients are divided by the world size before the
            cast, so fp16 cannot overflow in the sum. None: reduce in the gradients' dtype.

    Raises:
        ValueError: for a bucket size that is not a positive number, None or "auto"; a `comm_dtype` that is not a
            floating dtype; or a model that differs between ranks.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float | str | None = "auto", process_group=None,
                 cross_rank_checks: bool = True, broadcast_buffers: bool = True, gradient_as_bucket_view: bool = False,
                 comm_dtype: torch.dtype | None = None) -> None:
        if comm_dtype is not None and comm_dtype not in COMM_DTYPES:  # gloo and NCCL reduce no float8
            raise ValueError(f"BucketedDDP: comm_dtype must be one of {', '.join(map(str, COMM_DTYPES))} or None, "
                             f"got {comm_dtype!r}")
        if not (bucket_size_mb in ("auto", None) or (isinstance(bucket_size_mb, (int, float))
                                                     and not isinstance(bucket_size_mb, bool) and bucket_size_mb > 0)):
            raise ValueError(f"bucket_size_mb must be a positive number, None or 'auto', got {bucket_size_mb!r}")
        super().__init__(module, process_group, cross_rank_checks, broadcast_buffers)
        self.comm_dtype = comm_dtype
        self.gradient_as_bucket_view = gradient_as_bucket_view
        # NCCL averages inside the collective (ncclAvg): no separate pass over the gradients after it, which would
        # sit exposed at the end of backward. gloo has no AVG: sum, then divide. With comm_dtype the gradients are
        # divided before the cast instead (fp16 must not overflow in the sum).
        self._average_in_collective = comm_dtype is None and dist.get_backend(process_group) == "nccl"
        self._reduce_op = dist.ReduceOp.AVG if self._average_in_collective else dist.ReduceOp.SUM
        self.sharded = False  # set by shard_gradients(): ZeRO-2
        self._homes: list[tuple[nn.Parameter, int, torch.dtype]] = []  # sharded: where each parameter must live
        self._zero_grad_routed: list[nn.Module] = []
        total_bytes = sum(p.numel() * p.element_size() for p in self._grad_params)
        if bucket_size_mb == "auto":
            if self._grad_params:
                p0 = self._grad_params[0]
                self.overhead_s, self.bandwidth_bps = measure_allreduce_cost(p0.device, p0.dtype, process_group)
                cap_bytes: float = optimal_bucket_bytes(total_bytes, self.overhead_s, self.bandwidth_bps)
            else:  # nothing to reduce: no buckets, nothing to measure
                self.overhead_s, self.bandwidth_bps, cap_bytes = 0.0, float("inf"), math.inf
        else:
            cap_bytes = math.inf if bucket_size_mb is None else bucket_size_mb * MB
        self.bucket_bytes = cap_bytes
        self._buckets = self._build_buckets(cap_bytes)
        layout = [(len(b.params), b.layout.numel, str(b.buffer.dtype)) for b in self._buckets]
        gathered = gather_digests(repr(layout), (len(layout), bucket_size_mb), process_group)
        if len({digest for digest, _ in gathered}) != 1:
            detail = ", ".join(f"rank {r}: {n} buckets (bucket_size_mb={mb!r})"
                               for r, (_, (n, mb)) in enumerate(gathered))
            raise ValueError(f"BucketedDDP: the bucket layout differs between ranks ({detail}); every rank must use "
                             "the same bucket_size_mb")
        self._where = {id(p): (b, i) for b in self._buckets for i, p in enumerate(b.params)}
        self._next_to_launch = 0
        self._register_grad_hooks(self._on_grad_ready)

    def _build_buckets(self, cap_bytes: float) -> list[Bucket]:
        order = list(reversed(self._grad_params))  # roughly the order backward produces gradients
        groups = plan_buckets([((p.dtype, p.device), p.numel() * p.element_size()) for p in order], cap_bytes)
        buckets = []
        for group in groups:
            ps = [order[i] for i in group]
            layout = FlatLayout(ps)
            buffer = torch.zeros(layout.numel + len(ps), dtype=ps[0].dtype, device=ps[0].device)
            comm = None
            if self.comm_dtype is not None and self.comm_dtype != buffer.dtype:
                comm = torch.empty(buffer.numel(), dtype=self.comm_dtype, device=buffer.device)
            bucket = Bucket(ps, layout, buffer, comm)
            if self.gradient_as_bucket_view:  # gradients that exist already move in; the others on first use
                for p, view in zip(ps, layout.views(buffer)):
                    if p.grad is not None:
                        view.copy_(p.grad)
                        p.grad = view
            buckets.append(bucket)
        return buckets

    @property
    def bucket_sizes_bytes(self) -> list[int]:
        """Gradient bytes of each bucket, in launch order."""
        return [b.layout.numel * b.params[0].element_size() for b in self._buckets]

    # ------------------------------------------------------------------ ZeRO-2
    def shard_gradients(self) -> None:
        """Switch to ZeRO-2: reduce-scatter each bucket so every rank keeps only its slice of the averaged
        gradients, in `grad_shard`, and hold the parameters in flat per-bucket buffers (`params_flat`) so the
        updated slices can be all-gathered in place. Called by `ZeRO2Optimizer`; `.grad` stays None on every
        parameter from then on (the gradients are in the shards).

        What would silently do nothing from then on is made to work or refused: the model's own `zero_grad()` drops
        the shards too; another optimizer's `step()` over these parameters, and `torch.nn.utils.clip_grad_norm_`
        on them, raise (`flashsys.dist.sharded_guards`); a parameter moved out of its bucket (`model.to(...)`) is
        reported by `moved_parameters()`, which the optimizer checks at each step.

        Raises:
            RuntimeError: when called twice, or with `gradient_as_bucket_view` (the full buckets no longer persist).
        """
        if self.sharded:
            raise RuntimeError("BucketedDDP: the gradients are already sharded (one ZeRO2Optimizer per wrapper)")
        if self.gradient_as_bucket_view:
            raise RuntimeError("BucketedDDP: ZeRO-2 frees each bucket after its reduce-scatter; "
                               "gradient_as_bucket_view=True has no bucket to view")
        world = self.world_size
        for b in self._buckets:
            padded = -(-b.layout.numel // world) * world
            dtype, device = b.params[0].dtype, b.params[0].device
            b.params_flat = torch.zeros(padded, dtype=dtype, device=device)
            with torch.no_grad():
                for p, view in zip(b.params, b.layout.views(b.params_flat)):
                    view.copy_(p.data)
                    p.data = view  # the parameter now lives in the flat buffer
                    p.grad = None
            b.grad_shard = torch.zeros(padded // world, dtype=dtype, device=device)
            b.flags = torch.zeros(len(b.params), dtype=torch.float32, device=device)
            b.buffer = b.comm = None  # the replicated buffers are no longer needed
        self._homes = [(p, p.data_ptr(), p.dtype) for b in self._buckets for p in b.params]
        self.sharded = True
        self._route_module_zero_grad()
        sharded_guards.install()

    def _route_module_zero_grad(self) -> None:
        """Make the model's own `zero_grad()` (and a compiled wrapper's) drop the shards as well: with the gradients
        out of `.grad`, nn.Module's version would leave the discarded batch to be stepped. The override is an
        instance attribute, held weakly, removed by `remove_hooks()`."""
        ref = weakref.ref(self)
        modules = (self.module, getattr(self.module, "_orig_mod", None))  # the model, and under torch.compile's
        for module in {id(m): m for m in modules if m is not None}.values():
            def zero_grad(set_to_none: bool = True, _module=module) -> None:
                ddp = ref()
                if ddp is not None and ddp.sharded:
                    ddp.drop_gradients()
                nn.Module.zero_grad(_module, set_to_none)

            module.zero_grad = zero_grad
            self._zero_grad_routed.append(module)

    def remove_hooks(self) -> None:
        """Detach this wrapper from the model's parameters (and the model's `zero_grad` from the shards)."""
        super().remove_hooks()
        for module in self._zero_grad_routed:
            module.__dict__.pop("zero_grad", None)
        self._zero_grad_routed.clear()

    def moved_parameters(self) -> list[str]:
        """Sharded mode: the names of the parameters that no longer live in their bucket's flat buffer (or changed
        dtype): `model.to(dtype or device)` or `p.data = ...` after sharding. A step would update the bucket, not
        them."""
        moved = [p for p, ptr, dtype in self._homes if p.data_ptr() != ptr or p.dtype != dtype]
        if not moved:
            return []
        names = {id(q): n for n, q in self.module.named_parameters()}
        return [names.get(id(p), str(tuple(p.shape))) for p in moved]

    def shard_range(self, bucket: Bucket) -> tuple[int, int]:
        """[start, end) of this rank's slice of `bucket`'s flat (padded) buffers."""
        assert bucket.params_flat is not None
        size = bucket.params_flat.numel() // self.world_size
        rank = dist.get_rank(self.process_group)
        return rank * size, (rank + 1) * size

    @property
    def buckets(self) -> list[Bucket]:
        """The buckets, in launch order (read-only use: ZeRO2Optimizer maps its shards onto them)."""
        return self._buckets

    def bucket_of(self, p: nn.Parameter) -> tuple[Bucket, int] | None:
        """(the bucket holding `p`, its index there), or None for a parameter whose gradient is not reduced (frozen
        when wrapped, or not the model's)."""
        return self._where.get(id(p))

    def all_gather_parameters(self, bucket: Bucket, async_op: bool = True) -> dist.Work | None:
        """Sharded mode: every rank's slice of `bucket`'s flat parameters (`shard_range`) gathered into every rank's
        `params_flat`, in place (a collective: every rank, bucket by bucket in the same order)."""
        lo, hi = self.shard_range(bucket)
        with torch.no_grad():
            return _all_gather_flat(bucket.params_flat, bucket.params_flat[lo:hi], group=self.process_group,
                                    async_op=async_op)

    def drop_gradients(self) -> None:
        """Sharded mode: forget the gradient slices no step has consumed (the next backward starts from zero)."""
        for bucket in self._buckets:
            bucket.grad_live = False

    # ------------------------------------------------------------------ backward
    def _grad_view(self, bucket: Bucket, i: int) -> torch.Tensor:
        if self.sharded:
            if bucket.transient is None:
                flat = bucket.params_flat
                bucket.transient = torch.empty(flat.numel(), dtype=self.comm_dtype or flat.dtype, device=flat.device)
                bucket.transient[bucket.layout.numel :].zero_()  # the padding
            return bucket.layout.view(bucket.transient, i)
        return bucket.layout.view(bucket.buffer, i)

    def _take_gradient(self, bucket: Bucket, i: int) -> bool:
        """Put parameter i's gradient (or zeros, when it has none) into the bucket; True when it had one."""
        p = bucket.params[i]
        view = self._grad_view(bucket, i)
        if p.grad is None:
            view.zero_()
            return False
        if self.gradient_as_bucket_view and p.grad.data_ptr() == view.data_ptr():
            return True  # accumulated in place already
        view.copy_(p.grad)
        if self.sharded:
            p.grad = None  # ZeRO-2: the full gradient lives only until its bucket is reduced
        elif self.gradient_as_bucket_view:
            p.grad = view
        return True

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if not self._sync_enabled:
            return
        bucket, i = self._where[id(p)]
        if i in bucket.ready or bucket.handle is not None:
            raise RuntimeError("BucketedDDP: a gradient arrived twice in one synchronisation")
        self._take_gradient(bucket, i)
        bucket.ready.add(i)
        self._launch_full_buckets()

    def _launch(self, bucket: Bucket) -> None:
        missing = [i for i in range(len(bucket.params)) if i not in bucket.ready]
        if self.sharded:
            # at the end of backward: whatever .grad holds (no_sync accumulation), or zeros
            absent = [i for i in missing if not self._take_gradient(bucket, i)]
            self._set_used_flags(bucket.flags, absent)
            buf = bucket.transient  # allocated by the first _take_gradient of this synchronisation
            if self.comm_dtype is not None:
                buf.div_(self.world_size)
            out = bucket.grad_shard if not bucket.grad_live and buf.dtype == bucket.grad_shard.dtype else \
                torch.empty(bucket.grad_shard.numel(), dtype=buf.dtype, device=buf.device)
            bucket.handle = _reduce_scatter_flat(out, buf, op=self._reduce_op, group=self.process_group, async_op=True)
            bucket.flags_handle = dist.all_reduce(bucket.flags, group=self.process_group, async_op=True)
            bucket.transient, bucket.reduced = None, (buf, out)
            return
        absent = [i for i in missing if not self._take_gradient(bucket, i)]
        self._set_used_flags(bucket.buffer[bucket.layout.numel :], absent)
        if bucket.comm is not None:
            torch.div(bucket.buffer, self.world_size, out=bucket.comm)
            bucket.handle = dist.all_reduce(bucket.comm, group=self.process_group, async_op=True)
        else:
            # The used-flags travel in the same buffer: averaged, a flag is still > 0 where some rank had it.
            bucket.handle = dist.all_reduce(bucket.buffer, op=self._reduce_op, group=self.process_group, async_op=True)

    @staticmethod
    def _set_used_flags(flags: torch.Tensor, absent: list[int]) -> None:
        """1 for each parameter of the bucket that had a gradient here, 0 for the `absent` ones: fills on the device.
        (An item assignment, `flags[i] = 1`, is a host-to-device copy of a scalar that waits: hundreds of them per
        backward of a large model, tens of milliseconds of host time.)"""
        flags.fill_(1)
        for i in absent:
            flags[i].fill_(0)

    def _launch_full_buckets(self) -> None:
        while self._next_to_launch < len(self._buckets):
            bucket = self._buckets[self._next_to_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            self._launch(bucket)
            self._next_to_launch += 1

    def _synchronize(self) -> None:
        """Launch the buckets still waiting, wait for all, average (and copy back). A no-op after no backward."""
        ran_backward = self._next_to_launch > 0 or any(b.ready for b in self._buckets)
        self._check_ranks_agree(ran_backward)
        if not ran_backward:
            return
        for bucket in self._buckets[self._next_to_launch :]:
            self._launch(bucket)
        for bucket in self._buckets:
            bucket.handle.wait()
            if self.sharded:
                self._finish_sharded(bucket)
            else:
                self._finish_replicated(bucket)
            bucket.ready.clear()
            bucket.handle = None
        self._next_to_launch = 0

    def _finish_replicated(self, bucket: Bucket) -> None:
        n = bucket.layout.numel
        if bucket.comm is not None:
            bucket.buffer.copy_(bucket.comm)  # already divided before the cast
        elif not self._average_in_collective:
            bucket.buffer[:n].div_(self.world_size)
        complete = len(bucket.ready) == len(bucket.params)
        used = [True] * len(bucket.params) if complete else (bucket.buffer[n:] > 0).tolist()
        targets, sources = [], []
        for i, (p, chunk) in enumerate(zip(bucket.params, bucket.layout.views(bucket.buffer))):
            if not used[i]:
                continue  # no rank had a gradient: it stays None, as in one process
            if self.gradient_as_bucket_view:
                p.grad = chunk
            elif p.grad is not None:
                targets.append(p.grad)
                sources.append(chunk)
            else:
                p.grad = chunk.clone()  # used on another rank only
        if targets:  # one multi-tensor copy per bucket instead of a launch per parameter (host time, exposed)
            torch._foreach_copy_(targets, sources)

    def _finish_sharded(self, bucket: Bucket) -> None:
        _, out = bucket.reduced
        bucket.reduced = ()  # frees the full-size gradient buffer
        bucket.flags_handle.wait()
        bucket.flags_handle = None
        if self.comm_dtype is None and not self._average_in_collective:
            out.div_(self.world_size)
        if out is not bucket.grad_shard:
            if bucket.grad_live:
                bucket.grad_shard.add_(out)  # a second backward before the optimizer step: gradients add up
            else:
                bucket.grad_shard.copy_(out)
        # Kept on the device: reading it would make the host wait for the reduction here, once per bucket.
        bucket.used = bucket.used + bucket.flags if bucket.grad_live else bucket.flags.clone()
        bucket.grad_live = True

    def gradients_used(self) -> list[list[bool]]:
        """ZeRO-2: per bucket, which parameters some rank had a gradient for since the last step (one read of
        the device for all buckets). A parameter no rank used is skipped by the optimizer, as in one process."""
        live = [b for b in self._buckets if b.grad_live]
        flat = torch.cat([b.used for b in live]).gt(0).tolist() if live else []
        used, start = [], 0
        for b in self._buckets:
            if b.grad_live:
                used.append(flat[start : start + len(b.params)])
                start += len(b.params)
            else:
                used.append([False] * len(b.params))
        return used

    # ------------------------------------------------------------------ zero_grad
    def zero_grad(self, set_to_none: bool = True) -> None:
        """With `gradient_as_bucket_view`, zero every bucket in one fill each and keep the views (`set_to_none` is
        ignored: a None `.grad` would cost a copy per gradient on the next backward). Sharded (ZeRO-2): drop the
        gradient shards no step has consumed, and any local `.grad`. Otherwise as nn.Module."""
        if self.sharded:
            self.drop_gradients()
        if not self.gradient_as_bucket_view or self.sharded:
            super().zero_grad(set_to_none)
            return
        for bucket in self._buckets:
            bucket.buffer.zero_()
            for p, view in zip(bucket.params, bucket.layout.views(bucket.buffer)):
                p.grad = view
        for p in self.module.parameters():
            if p.requires_grad and id(p) not in self._where:
                p.grad = None
