"""Optimizers for data-parallel training: ZeRO-1 (`ShardedOptimizer`, around any optimizer) and ZeRO-2
(`ZeRO2Optimizer`, on BucketedDDP's buckets, for elementwise optimizers)."""

from .sharded import ShardedOptimizer
from .zero2 import ELEMENTWISE_OPTIMIZERS, ZeRO2Optimizer

__all__ = ["ELEMENTWISE_OPTIMIZERS", "ShardedOptimizer", "ZeRO2Optimizer"]
