"""Data-parallel training over torch.distributed (NCCL on GPUs, gloo on CPUs), launched by torchrun or mp.spawn."""

from .base import DataParallelBase, ReduceAfterBackward
from .bucketed import Bucket, BucketedDDP
from .consistency import check_same_model_on_all_ranks, gather_digests, model_signature
from .cost_model import measure_allreduce_cost, optimal_bucket_bytes, plan_buckets
from .flat import FlatDDP
from .flat_layout import FlatLayout
from .naive import NaiveDDP
from .overlap import OverlapDDP
from .process_group import (
    SpawnError,
    default_backend,
    find_free_port,
    init_for_spawn,
    init_from_env,
    launched_by_torchrun,
    shutdown,
    spawn,
)

__all__ = [
    "Bucket",
    "BucketedDDP",
    "DataParallelBase",
    "FlatDDP",
    "FlatLayout",
    "NaiveDDP",
    "OverlapDDP",
    "ReduceAfterBackward",
    "SpawnError",
    "check_same_model_on_all_ranks",
    "default_backend",
    "find_free_port",
    "gather_digests",
    "init_for_spawn",
    "init_from_env",
    "launched_by_torchrun",
    "measure_allreduce_cost",
    "model_signature",
    "optimal_bucket_bytes",
    "plan_buckets",
    "shutdown",
    "spawn",
]
