"""Optimizers for data-parallel training."""

from .sharded import ShardedOptimizer

__all__ = ["ShardedOptimizer"]
