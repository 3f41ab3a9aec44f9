"""Data-parallel training over torch.distributed (NCCL on GPUs, gloo on CPUs), launched by torchrun or mp.spawn."""

from .after_backward import FlatDDP, NaiveDDP
from .base import DataParallelBase, check_same_model_on_all_ranks, gather_digests, model_signature
from .bucketed import BucketedDDP, measure_allreduce_cost, optimal_bucket_bytes
from .overlap import OverlapDDP
from .process_group import (
    default_backend,
    find_free_port,
    init_for_spawn,
    init_from_env,
    launched_by_torchrun,
    shutdown,
    spawn,
)

WRAPPERS = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP, "bucketed": BucketedDDP}

__all__ = [
    "BucketedDDP",
    "DataParallelBase",
    "FlatDDP",
    "NaiveDDP",
    "OverlapDDP",
    "WRAPPERS",
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
    "shutdown",
    "spawn",
]
