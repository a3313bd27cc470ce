"""The benchmark runner behind ``fastembed-bench`` (see docs/benchmarks.md)."""
