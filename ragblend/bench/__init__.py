"""Benchmark harness: datasets, fidelity metrics, the interleaved runner and plots."""
