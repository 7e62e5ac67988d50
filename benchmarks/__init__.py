"""Benchmark scripts: run them as ``python benchmarks/<script>.py``; see each script's docstring."""
