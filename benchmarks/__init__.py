"""Benchmark scripts; run each as `python -m benchmarks.<name>` from the repository root (see README)."""
