"""Benchmarks: `python -m bench.linear` (the linear op vs torch)."""
